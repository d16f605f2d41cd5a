"""No import cycles in product code. A cycle hides behind a function-level import (the
import graph counts those too) and makes the layers meaningless: which room is below?

grimp (import-linter's graph) sees every import statement, at module or function level,
so a cycle dodged with a deferred import is still found here.
"""

from __future__ import annotations

import grimp

# k3tui's known cycles, to be broken (issue 28) — this list may only shrink. Each is the
# set of modules that import each other round a loop.
KNOWN = {
    frozenset({"k3tui.tui.app", "k3tui.tui.handler"}),
}


def cycles(graph: grimp.ImportGraph) -> set[frozenset[str]]:
    """The strongly connected components of more than one module (Tarjan, iterative)."""
    edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: set[frozenset[str]] = set()
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, 0)]
        while work:
            v, i = work.pop()
            if i == 0:
                index[v] = low[v] = len(index)
                stack.append(v)
                on_stack.add(v)
            if i < len(edges[v]):
                work.append((v, i + 1))
                w = edges[v][i]
                if w not in index:
                    work.append((w, 0))
                elif w in on_stack:
                    low[v] = min(low[v], index[w])
                continue
            for w in edges[v]:  # children done: take their low-links
                if w in on_stack:
                    low[v] = min(low[v], low[w])
            if low[v] == index[v]:
                comp = set()
                while True:
                    w = stack.pop()
                    on_stack.discard(w)
                    comp.add(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    found.add(frozenset(comp))
    return found


def test_the_finder_sees_a_cycle_behind_a_function_level_import(tmp_path, monkeypatch):
    pkg = tmp_path / "cyc_pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "a.py").write_text("from cyc_pkg import b\n")
    (pkg / "b.py").write_text("def f():\n    from cyc_pkg import a\n")
    (pkg / "c.py").write_text("from cyc_pkg import a\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert cycles(grimp.build_graph("cyc_pkg", cache_dir=None)) == {
        frozenset({"cyc_pkg.a", "cyc_pkg.b"})}


def test_no_new_import_cycle_in_product_code():
    found = cycles(grimp.build_graph("engine", "k3tui", cache_dir=None))
    new = found - KNOWN
    assert not new, f"import cycles (break them; don't defer an import): {sorted(map(sorted, new))}"
    gone = KNOWN - found
    assert not gone, f"broken cycles still listed as known; delete them from KNOWN: {gone}"
