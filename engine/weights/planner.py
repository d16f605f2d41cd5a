"""The memory plan: how a budget is split between pinned trunk, read-ahead ring and experts.

Trunk first (spec 2.4): every token reads the whole unpinned trunk, so a pinned GB saves a
GB per token for sure, while an expert-cache GB saves a fraction of that. The plan pins a
prefix of layers (a cyclic 0..n-1 scan gives LRU a 0 % hit rate; a prefix gives exactly
npin/n), streams the rest through a ring of uniform slots (two when they fit, so the next
layer is read while the current one computes), and gives what is left to expert slots,
never fewer than top-k + 1. The plan is printed as a forecast before anything is
allocated, and refused, with the numbers, when it cannot fit.

Memory facts come from engine.weights.sysmem: MemAvailable and the smallest cgroup limit over the
process's cgroup and its ancestors, the same reader k3tui's probe uses.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.errors import PlanError
from engine.weights.sysmem import MemoryFacts, read_memory_facts
from k3vocab import AUTO_PRESET, DEFAULT_CONTEXT, GB, PRESET_CHOICES, PRESETS

HEAD_CHUNK_BYTES = 64_000_000  # a streamed head's read buffer (tables.py); two are resident
RUNTIME_BYTES = 250_000_000  # python + numpy + thread stacks, measured ~0.2 GB


def fmt_bytes(n: float) -> str:
    """Readable size with enough digits for tiny test checkpoints and the 1.5 TB one."""
    for unit, scale in (("GB", GB), ("MB", 1e6), ("KB", 1e3)):
        if abs(n) >= scale * 0.1 or unit == "KB":
            return f"{n / scale:.3g} {unit}" if n < scale * 100 else f"{n / scale:.0f} {unit}"
    return f"{n} B"


def gb_arg(n: float) -> str:
    """A --*-gb value that is at least `n` bytes (rounded up at 4 significant digits)."""
    x = n / GB
    if x <= 0:
        return "0"
    digits = max(0, 3 - int(math.floor(math.log10(x))))
    q = 10 ** digits
    return f"{math.ceil(x * q) / q:.{digits}f}"


@dataclass(frozen=True)
class Geometry:
    """What the planner needs to know about a checkpoint, in bytes."""

    n_layers: int
    layer_bytes: tuple[int, ...]  # buffer bytes to hold each layer's trunk (aligned)
    expert_slot_bytes: int  # buffer bytes for one routed expert (aligned windows)
    expert_bytes: int  # payload bytes of one routed expert
    n_experts: int
    top_k: int
    moe_layers: int
    model_bytes: int  # model-level tensors kept resident (embed, lm_head, norms)
    checkpoint_bytes: int
    kv_bytes_per_token: int  # MLA latent cache, all MLA layers
    state_bytes: int  # KDA recurrent state + conv history
    scratch_bytes: int  # compute temporaries (widened weights, activations)
    table_bytes: int = 0  # embedding + head: the part of model_bytes that can stream

    @property
    def trunk_bytes(self) -> int:
        return sum(self.layer_bytes)

    @property
    def all_experts_bytes(self) -> int:
        return self.n_experts * self.moe_layers * self.expert_slot_bytes

    @property
    def all_weights_bytes(self) -> int:
        """A budget holding every trunk layer and every expert (the `max` rung)."""
        return self.trunk_bytes + self.all_experts_bytes

    @property
    def min_expert_slots(self) -> int:
        return self.top_k + 1


@dataclass
class Plan:
    geometry: Geometry
    trunk_budget: int
    cache_budget: int
    pinned: tuple[int, ...]  # layers kept in RAM after their first read
    ring_slots: int
    ring_slot_bytes: int
    expert_slots: int
    threads: int
    context: int
    facts: MemoryFacts | None = None
    source: str = "budget"  # how the numbers were chosen: budget, preset NAME, trunk/cache
    notes: list[str] = field(default_factory=list)
    guess_experts: bool = False  # read the next layer's likely experts before its router
    snapshot_bytes: int = 0  # the server's kept conversation states (serve --snapshot-gb)
    stream_tables: bool = False  # embedding rows on demand, head streamed (see tables.py)

    @property
    def tables_bytes(self) -> int:
        """Resident model tables: all of them, or the small vectors + two head chunks."""
        g = self.geometry
        if not self.stream_tables:
            return g.model_bytes
        return g.model_bytes - g.table_bytes + 2 * HEAD_CHUNK_BYTES

    def terms(self) -> dict[str, int]:
        """Every part of the peak RSS forecast, named, in bytes."""
        g = self.geometry
        return {
            "pinned_weights": self.pinned_bytes,
            "ring": self.ring_bytes,
            "expert_slots": self.cache_bytes,
            "model_tables": self.tables_bytes,
            "kda_state": g.state_bytes,
            "kv_cache": g.kv_bytes_per_token * self.context,
            "scratch": g.scratch_bytes,
            "runtime": RUNTIME_BYTES,
            "snapshots": self.snapshot_bytes,
        }

    @property
    def forecast_rss_bytes(self) -> int:
        return sum(self.terms().values())

    @property
    def read_bytes_per_token(self) -> int:
        """Trunk + (streamed) head bytes every token reads, before any expert miss."""
        head = self.geometry.table_bytes // 2 if self.stream_tables else 0
        return self.streamed_trunk_bytes + head

    @property
    def pinned_bytes(self) -> int:
        return sum(self.geometry.layer_bytes[i] for i in self.pinned)

    @property
    def ring_bytes(self) -> int:
        return self.ring_slots * self.ring_slot_bytes

    @property
    def cache_bytes(self) -> int:
        return self.expert_slots * self.geometry.expert_slot_bytes

    @property
    def budget_bytes(self) -> int:
        """What the plan allocates for weights: pinned + ring + expert arena."""
        return self.pinned_bytes + self.ring_bytes + self.cache_bytes

    @property
    def overhead_bytes(self) -> int:
        """The fixed part outside the budget: tables, state, KV for the context, runtime."""
        return self.forecast_rss_bytes - self.budget_bytes

    @property
    def streamed_trunk_bytes(self) -> int:
        g = self.geometry
        return sum(b for i, b in enumerate(g.layer_bytes) if i not in set(self.pinned))

    def describe(self) -> str:
        g = self.geometry
        f = fmt_bytes
        ring = ""
        if self.ring_slots:
            ring = (f", ring {self.ring_slots} x {f(self.ring_slot_bytes)}"
                    + (" with read-ahead" if self.ring_slots >= 2 else " (no read-ahead)"))
        lines = [
            f"memory plan ({self.source}): weights {f(self.budget_bytes)} + fixed "
            f"{f(self.overhead_bytes)} = peak RSS forecast "
            f"{f(self.budget_bytes + self.overhead_bytes)}",
            f"  trunk: {len(self.pinned)} of {g.n_layers} layers pinned "
            f"({f(self.pinned_bytes)}{_layer_list(self.pinned, g.n_layers)}){ring}; streams "
            f"{f(self.streamed_trunk_bytes)} of trunk per token",
            f"  experts: {self.expert_slots} slots x {f(g.expert_slot_bytes)} = "
            f"{f(self.cache_bytes)} (top-{g.top_k} needs {g.min_expert_slots}; all "
            f"{g.n_experts * g.moe_layers} experts = {f(g.all_experts_bytes)})",
            "  fixed: " + ", ".join(f"{k.replace('_', ' ')} {f(v)}" for k, v in
                                    list(self.terms().items())[3:] if k != "snapshots"),
            f"  reader threads: {self.threads}",
            *([self.snapshot_line()] if self.snapshot_bytes else []),
            "  expert read-ahead: "
            + (
                "on (each layer's likely experts are read while its attention computes)"
                if self.guess_experts
                else "off"
            ),
        ]
        if self.facts is not None:
            lines.append(f"  available memory: {f(self.facts.available)}")
        lines += [f"  note: {x}" for x in self.notes]
        return "\n".join(lines)

    def snapshot_line(self) -> str:
        g = self.geometry
        one = g.state_bytes + g.kv_bytes_per_token * self.context
        n = self.snapshot_bytes // one
        return (f"  conversation snapshots: {fmt_bytes(self.snapshot_bytes)} (--snapshot-gb), "
                f"{n} of {fmt_bytes(one)} at {self.context} tokens"
                + ("" if n else "; too small for one at full context, so long conversations "
                   "are prefilled cold"))

    def as_dict(self) -> dict[str, Any]:
        return {
            "snapshot_gb": self.snapshot_bytes / GB,
            "budget_gb": self.budget_bytes / GB,
            "overhead_gb": self.overhead_bytes / GB,
            "pinned_layers": len(self.pinned),
            "ring_slots": self.ring_slots,
            "ring_slot_gb": self.ring_slot_bytes / GB,
            "expert_slots": self.expert_slots,
            "threads": self.threads,
            "guess_experts": self.guess_experts,
            "stream_tables": self.stream_tables,
            "forecast_rss_gb": self.forecast_rss_bytes / GB,
            "read_gb_per_token": self.read_bytes_per_token / GB,
            "terms_gb": {k: v / GB for k, v in self.terms().items()},
        }


def pin_set(sizes: Sequence[int], k: int) -> tuple[int, ...]:
    """Which `k` layers to keep in RAM.

    Oversized layers first (layer 0's dense FFN): each one pinned shrinks the ring slot.
    The rest are spread evenly through the layer order rather than taken as a prefix: while
    a pinned layer computes no ring slot is in use, so the reader runs one more layer ahead
    there; a prefix would leave the disk idle for its whole length once the ring is full.
    Any fixed set gives the same bytes per token (every unpinned layer is read once).
    """
    n = len(sizes)
    typical = sorted(sizes)[n // 2]
    chosen = sorted((i for i in range(n) if sizes[i] > typical), key=lambda i: -sizes[i])[:k]
    rest = [i for i in range(n) if i not in chosen]
    m = k - len(chosen)
    if m > 0:
        chosen += [rest[int((j + 0.5) * len(rest) / m)] for j in range(m)]
    return tuple(sorted(chosen))


def _layer_list(pinned: Sequence[int], n: int) -> str:
    if not pinned or len(pinned) == n:
        return ""
    shown = ",".join(str(i) for i in pinned[:12])
    return f": layers {shown}{',...' if len(pinned) > 12 else ''}"


def _split_trunk(g: Geometry, trunk_budget: int) -> tuple[tuple[int, ...], int, int, int]:
    """Pin layers and size the ring for `trunk_budget`; → (pinned, R, slot, leftover).

    The ring slot must hold the largest *unpinned* layer. Two slots (read-ahead) whenever
    two fit, as the peer does, then as many pinned layers as still fit beside them.
    """
    sizes = g.layer_bytes
    n = g.n_layers
    if trunk_budget >= g.trunk_bytes:
        return tuple(range(n)), 0, 0, trunk_budget - g.trunk_bytes
    options = []
    for k in range(n):
        pinned = pin_set(sizes, k)
        slot = max(sizes[i] for i in range(n) if i not in pinned)
        options.append((pinned, slot, sum(sizes[i] for i in pinned)))
    for ring in (2, 1):
        fits = [(p, slot, used) for p, slot, used in options if used + ring * slot <= trunk_budget]
        if fits:
            pinned, slot, used = max(fits, key=lambda o: len(o[0]))
            return pinned, ring, slot, trunk_budget - used - ring * slot
    return (), 1, max(sizes), trunk_budget - max(sizes)  # refused by the caller


def _budgets(g: Geometry, facts: MemoryFacts, context: int, budget_gb: float | None,
             preset: str | None, trunk_gb: float | None, cache_gb: float | None
             ) -> tuple[int, int, str]:
    """(trunk bytes, expert cache bytes, what they came from) from the memory flags: a
    preset, then explicit trunk/cache sizes, then a total budget filling what is left."""
    slot_e = g.expert_slot_bytes
    min_cache = g.min_expert_slots * slot_e
    min_total = max(g.layer_bytes) + min_cache
    source = "budget"
    trunk: int | None
    cache: int | None
    if preset == AUTO_PRESET:
        trunk, cache = _auto(g, facts, context)
        source = "preset auto"
    elif preset:
        if preset not in PRESETS:
            raise PlanError(
                f"unknown preset {preset!r}; choose one of {', '.join(PRESETS)} or auto."
            )
        t, c = PRESETS[preset]
        trunk, cache = int(t * GB), int(c * GB)
        source = f"preset {preset}"
    else:
        trunk = cache = None
    if trunk_gb is not None:
        trunk, source = int(trunk_gb * GB), "trunk/cache"
    if cache_gb is not None:
        cache, source = int(cache_gb * GB), "trunk/cache"
    if budget_gb is not None:
        budget = int(budget_gb * GB)
        if budget < min_total:
            raise PlanError(
                f"a {fmt_bytes(budget)} budget is below this checkpoint's minimum of "
                f"{fmt_bytes(min_total)} (one ring slot of {fmt_bytes(max(g.layer_bytes))} "
                f"for the largest layer + {g.min_expert_slots} expert slots of "
                f"{fmt_bytes(slot_e)}); give --budget-gb {gb_arg(min_total)} or more."
            )
        if trunk is None and cache is None:
            # Trunk first; the leftover after pinning flows to the expert arena below.
            trunk, cache = budget - min_cache, min_cache
        elif trunk is None and cache is not None:
            trunk = budget - cache
        elif cache is None and trunk is not None:
            cache = budget - trunk
        source = f"budget {budget_gb:g} GB" if source == "budget" else source
    if trunk is None or cache is None:
        raise PlanError(
            "no memory budget given; pass --budget-gb X, --preset NAME|auto, or both "
            "--trunk-gb and --cache-gb."
        )
    return trunk, cache, source


def make_plan(
    geometry: Geometry,
    *,
    budget_gb: float | None = None,
    preset: str | None = None,
    trunk_gb: float | None = None,
    cache_gb: float | None = None,
    threads: int = 0,
    context: int = DEFAULT_CONTEXT,
    facts: MemoryFacts | None = None,
    check_memory: bool = True,
    guess_experts: str = "auto",
    snapshot_gb: float = 0.0,
) -> Plan:
    """Split a budget (or preset, or trunk/cache pair) into pinned layers, ring and slots."""
    g = geometry
    facts = facts if facts is not None else read_memory_facts()
    slot_e = g.expert_slot_bytes
    min_cache = g.min_expert_slots * slot_e
    trunk, cache, source = _budgets(g, facts, context, budget_gb, preset, trunk_gb, cache_gb)
    pinned, ring, slot, leftover = _split_trunk(g, max(trunk, 0))
    if not pinned and ring and slot > trunk:
        raise PlanError(
            f"a trunk budget of {fmt_bytes(trunk)} cannot hold one ring slot for the largest "
            f"layer ({fmt_bytes(slot)}); give --trunk-gb {gb_arg(slot)} or more."
        )
    if budget_gb is not None or trunk_gb is None:
        cache += max(leftover, 0)  # unspent trunk budget becomes expert slots
    nslots = min(int(cache // slot_e), g.n_experts * g.moe_layers)
    if nslots < g.min_expert_slots:
        raise PlanError(
            f"an expert cache of {fmt_bytes(cache)} holds {nslots} slots of "
            f"{fmt_bytes(slot_e)} but top-{g.top_k} needs {g.min_expert_slots}; give "
            f"--cache-gb {gb_arg(min_cache)} or more."
        )
    plan = Plan(
        geometry=g,
        trunk_budget=trunk,
        cache_budget=cache,
        pinned=pinned,
        ring_slots=ring,
        ring_slot_bytes=slot,
        expert_slots=nslots,
        threads=threads if threads and threads > 0 else default_threads(g),
        context=context,
        facts=facts,
        source=source,
        snapshot_bytes=int(max(snapshot_gb, 0.0) * GB),
    )
    plan.guess_experts = _wants_guesses(plan, guess_experts)
    _decide_tables(plan)
    if guess_experts == "on" and not plan.guess_experts:
        plan.notes.append(
            f"expert read-ahead stays off: it needs {2 * g.top_k} expert slots (a layer's "
            f"top-{g.top_k} beside the next one's guesses) and the plan has {nslots}, or "
            "every expert is resident already."
        )
    if check_memory:
        check_fits(plan)
    return plan


def _decide_tables(plan: Plan) -> None:
    """Stream the embedding and head when keeping them would more than double the
    weights' RAM while the trunk streams anyway: a head GB read per token costs what a
    trunk GB does, so past that point the tables are the budget's worst use. At the real
    size this is what keeps the laptop preset (4.7 GB of tables, 4 GB of weights) under
    8 GB; the desktop preset and above keep them."""
    g = plan.geometry
    if g.table_bytes <= plan.budget_bytes or not plan.streamed_trunk_bytes:
        return
    plan.stream_tables = True
    plan.notes.append(
        f"embedding and head ({fmt_bytes(g.table_bytes)}) stay on disk: embedding rows are "
        f"read on demand and the head is streamed in chunks, {fmt_bytes(g.table_bytes // 2)}"
        f" more read per token; resident they would add {fmt_bytes(g.table_bytes)} to a "
        f"{fmt_bytes(plan.budget_bytes)} budget."
    )


def _wants_guesses(plan: Plan, mode: str) -> bool:
    """Expert read-ahead (a guess from the layer's attention input; a wrong guess costs its
    bytes, never a different token). `auto` turns it on only where the disk has idle time,
    i.e. no trunk streams, and only when the arena holds a second layer's worth of slots
    beside the demand reads."""
    if mode not in ("auto", "on", "off"):
        raise PlanError(f"unknown expert read-ahead mode {mode!r}; choose auto, on or off.")
    g = plan.geometry
    room = plan.expert_slots >= 2 * g.top_k
    everything = plan.expert_slots >= g.n_experts * g.moe_layers
    if mode == "off" or not room or everything:
        return False
    return mode == "on" or plan.streamed_trunk_bytes == 0


def default_threads(g: Geometry) -> int:
    """Enough reads in flight to keep an NVMe queue busy, without thrashing two cores."""
    return 8 if g.top_k >= 8 else 4


def check_fits(plan: Plan) -> None:
    """Refuse a plan above 95 % of available memory, or a KV cache above 90 % of it."""
    facts = plan.facts
    if facts is None or facts.available <= 0:
        return
    avail = facts.available
    g = plan.geometry
    kv = g.kv_bytes_per_token * plan.context
    if kv > 0.9 * avail:
        raise PlanError(
            f"the KV cache for {plan.context} tokens needs {fmt_bytes(kv)}, above 90% of the "
            f"{fmt_bytes(avail)} available; use a shorter context (a memory limit, not an "
            "engine ceiling)."
        )
    total = plan.budget_bytes + plan.overhead_bytes
    if total > 0.95 * avail:
        raise PlanError(
            f"the plan needs {fmt_bytes(total)} ({fmt_bytes(plan.budget_bytes)} of weights + "
            f"{fmt_bytes(plan.overhead_bytes)} fixed) but only {fmt_bytes(avail)} is "
            f"available (95% = {fmt_bytes(0.95 * avail)}); give a smaller --budget-gb or "
            "--preset auto."
        )


def _auto(g: Geometry, facts: MemoryFacts, context: int) -> tuple[int, int]:
    """Budget from what the machine has now, leaving headroom for the OS and the rest."""
    avail = facts.available
    fixed = (
        g.model_bytes
        + g.state_bytes
        + g.kv_bytes_per_token * context
        + g.scratch_bytes
        + RUNTIME_BYTES
    )
    # Leave 2 GB + 2 % for the OS and page tables, and stay under the 95 % refusal line.
    usable = int(min(avail - 2 * GB - 0.02 * avail, 0.94 * avail)) - fixed
    reserve = avail - usable
    min_cache = g.min_expert_slots * g.expert_slot_bytes
    if usable < max(g.layer_bytes) + min_cache:
        raise PlanError(
            f"only {fmt_bytes(avail)} is available and {fmt_bytes(reserve)} must stay free, "
            f"which leaves {fmt_bytes(max(usable, 0))}, below this checkpoint's minimum of "
            f"{fmt_bytes(max(g.layer_bytes) + min_cache)}; close other programs or use a "
            "machine with more memory."
        )
    if usable >= g.trunk_bytes + min_cache:
        return g.trunk_bytes, min(usable - g.trunk_bytes, g.all_experts_bytes)
    return usable - min_cache, min_cache


# ---- command-line flags shared by run, serve and bench ------------------------------


def add_memory_arguments(parser: argparse.ArgumentParser) -> None:
    """The memory flags every engine entry point honours."""
    grp = parser.add_argument_group("memory (stream the model under a budget)")
    grp.add_argument(
        "--budget-gb",
        type=float,
        default=None,
        metavar="X",
        help="total GB for trunk + expert cache (trunk gets memory first)",
    )
    grp.add_argument(
        "--preset",
        default=None,
        choices=PRESET_CHOICES,
        help="a named budget, or auto from available memory and the cgroup limit",
    )
    grp.add_argument(
        "--trunk-gb",
        type=float,
        default=None,
        metavar="X",
        help="GB for the trunk: pinned layers + read-ahead ring",
    )
    grp.add_argument(
        "--cache-gb", type=float, default=None, metavar="Y", help="GB for the routed-expert cache"
    )
    grp.add_argument(
        "--trunk",
        default=None,
        metavar="DIR",
        help="a packed trunk (trunk.bin + trunk.json from `pack`) to stream from",
    )
    grp.add_argument(
        "--threads",
        type=int,
        default=0,
        metavar="N",
        help="reader threads = disk queue depth (0 = automatic)",
    )
    grp.add_argument(
        "--guess-experts",
        choices=("auto", "on", "off"),
        default="auto",
        help="read each layer's likely experts while its attention computes "
        "(auto: when the trunk is resident and the disk has idle time)",
    )


@dataclass(frozen=True)
class MemorySettings:
    """The memory flags of `add_memory_arguments`, read once from the command line
    (`from_args`); the library takes these, never the argparse namespace."""

    budget_gb: float | None = None
    preset: str | None = None
    trunk_gb: float | None = None
    cache_gb: float | None = None
    trunk: str | None = None  # a packed trunk's folder
    threads: int = 0  # reader threads; 0 = automatic
    guess_experts: str = "auto"
    snapshot_gb: float = 0.0  # serve's kept conversation states, counted by the plan

    @classmethod
    def from_args(cls, args: argparse.Namespace, snapshot_gb: float = 0.0) -> MemorySettings:
        """From a namespace parsed by a parser that `add_memory_arguments` filled."""
        return cls(args.budget_gb, args.preset, args.trunk_gb, args.cache_gb, args.trunk,
                   args.threads or 0, args.guess_experts or "auto", snapshot_gb or 0.0)

    @property
    def streams(self) -> bool:
        """Any memory flag given: stream under a plan (else everything is resident)."""
        return any(v is not None for v in
                   (self.budget_gb, self.preset, self.trunk_gb, self.cache_gb, self.trunk))

    def plan(self, geometry: Geometry, context: int = DEFAULT_CONTEXT) -> Plan:
        preset = self.preset
        if self.trunk and preset is None and self.budget_gb is None \
                and self.trunk_gb is None and self.cache_gb is None:
            preset = "auto"  # --trunk alone: stream under what the machine can give
        return make_plan(
            geometry,
            budget_gb=self.budget_gb,
            preset=preset,
            trunk_gb=self.trunk_gb,
            cache_gb=self.cache_gb,
            threads=self.threads,
            context=context,
            guess_experts=self.guess_experts,
            snapshot_gb=self.snapshot_gb,
        )
