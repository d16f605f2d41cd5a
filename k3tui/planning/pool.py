"""A pool of llama.cpp RPC workers: whether the machines given hold the model, how many
more it needs, and how the layers split among them. Pure functions; the arithmetic is the
rpc recipe's (`recipes.py`: the cache for the context, the reserve each machine keeps, the
split in proportion to free memory), applied to what the workers said about themselves.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from k3tui.planning.recipes import KIMI_K3_LAYERS, RESERVE_GIB, cache_gib, split_layers
from k3tui.units import GiB, gib

RESERVE_BYTES = int(RESERVE_GIB * GiB)


@dataclass(frozen=True)
class Member:
    """One machine of the pool: the head (when it has a GPU to hold layers) or a worker."""

    name: str
    free_bytes: int | None  # what its devices have free; None: it did not answer
    why_not: str = ""  # why it did not answer

    @property
    def usable_bytes(self) -> int:
        """Its free memory less the reserve for the system and compute buffers."""
        return max(0, (self.free_bytes or 0) - RESERVE_BYTES)


def need_bytes(model_bytes: int, ctx: int) -> int:
    """The weights plus the cache for `ctx` tokens: what the pool must keep resident."""
    return model_bytes + int(cache_gib(ctx) * GiB)


def need_text(model_bytes: int, ctx: int) -> str:
    return (f"{gib(need_bytes(model_bytes, ctx))} ({gib(model_bytes)} of weights + "
            f"{gib(cache_gib(ctx) * GiB)} of cache for {ctx} tokens)")


def shortfall(members: list[Member], model_bytes: int, ctx: int) -> str | None:
    """Why `members` cannot hold the model, with the numbers; None when they can."""
    need = need_bytes(model_bytes, ctx)
    have = sum(m.usable_bytes for m in members)
    if have >= need:
        return None
    each = ", ".join(f"{m.name} {gib(m.usable_bytes)}" for m in members) or "nothing"
    short = need - have
    usable = [m.usable_bytes for m in members if m.usable_bytes > 0]
    more = (f"; {math.ceil(short / max(usable))} more machine(s) like the largest of them "
            "would make up the difference" if usable else "")
    return (f"the pool cannot hold the model: it needs {need_text(model_bytes, ctx)}, and "
            f"it offers {gib(have)} (each machine's free memory less {RESERVE_GIB:g} GiB "
            f"for the system: {each}), {gib(short)} short{more}")


def layer_lines(members: list[Member], n_layers: int | None) -> list[str]:
    """How the layers will be split: by each machine's free memory, the way llama.cpp
    deals them when no --tensor-split is given (workers first, the head's GPU last)."""
    n = n_layers or KIMI_K3_LAYERS
    counts = split_layers(n, [m.free_bytes or 0 for m in members])
    return [f"{m.name}: {c} of {n} layers" + (f" ({gib(m.free_bytes)} free)"
                                               if m.free_bytes is not None else
                                               f" (no answer: {m.why_not})")
            for m, c in zip(members, counts)]


def workers_needed(model_bytes: int, node_bytes: int, ctx: int) -> int | None:
    """How many more machines like one of `node_bytes` a pool needs beside it (the rpc
    recipe's count less the head); None when such a machine keeps nothing after the
    reserve."""
    from k3tui.planning.recipes import rpc_sizing

    if node_bytes <= RESERVE_BYTES:
        return None
    sizing = rpc_sizing(gguf_gib=model_bytes / GiB, node_gib=node_bytes / GiB, ctx=ctx)
    return sizing.nodes - 1


def plan_lines(workers: list[Member], *, model_bytes: int, ctx: int, node_bytes: int,
               head: Member | None) -> list[str]:
    """`k3tui plan`'s pool section: with workers, whether they hold the model and how the
    layers split; without, how many workers like this machine it would take. `head`: this
    machine's GPU when it holds layers too."""
    need = need_text(model_bytes, ctx)
    if not workers:
        nodes = workers_needed(model_bytes, node_bytes, ctx)
        if nodes is None:
            return [f"Pool:    none configured; the GGUF needs {need}"]
        count = nodes if head is not None else nodes + 1  # a CPU-only head holds no layers
        return [f"Pool:    none configured; the GGUF needs {need}: {count} worker(s) with "
                f"this machine's {gib(node_bytes)} would hold it"
                + (" beside this machine's GPU" if head is not None else "")
                + " (`k3tui worker` on each, then [llama_server] rpc; "
                  "`k3tui plan --recipe rpc` explains)"]
    members = workers + ([head] if head is not None else [])
    short = shortfall(members, model_bytes, ctx)
    lines = [f"Pool:    {len(workers)} worker(s) for the GGUF's {need}; llama.cpp deals "
             "the layers by free memory:"]
    lines += [f"  {line}" for line in layer_lines(members, KIMI_K3_LAYERS)]
    if any(m.free_bytes is None for m in workers):
        lines.append("  `k3tui serve` refuses to start until every worker answers")
    lines.append(f"  {short}" if short else "  together they hold it")
    return lines
