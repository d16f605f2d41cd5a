"""`StreamingSource`: the model's weights from disk under a memory budget.

* Trunk: a pinned prefix of layers (read once, kept) and a ring of uniform slots for the
  rest. While layer L computes in one slot, the reader threads fill the next slot(s) with
  the layers that come next in the cyclic 0..n-1 order; a slot whose layer is being
  computed on is never reused (with one slot there is no read-ahead: the next read
  starts when the layer is released).
* Experts: `experts(L, ids)` finds the ones already resident, claims victim slots for
  the rest and issues all their reads at once, sorted by file offset, ahead of any trunk
  read-ahead; `ex[e]` waits only for expert e, so compute starts on the first arrival.
  A prefill that asks for a chunk's union reads each distinct expert once.
* Expert read-ahead (when the plan turns it on): before a layer's attention the model
  passes a guess of the experts it will route to (`guess(L, ids)`); their reads start
  at once into free slots and `experts(L, ...)` adopts the ones the router really chose.
  The router still decides every token; a wrong guess costs its bytes (counted apart as
  `gb_read_unused`) and leaves a valid expert in the cache.
* Nothing reaches the model from a failed or short read: the error is raised from the
  `with` block that needed the bytes.
* Counters for per-token statistics: bytes are counted when the model consumes them
  (pinned layers once, streamed layers each pass, experts on a miss), waits as wall time
  the model spent blocked on reads.

`open_source(checkpoint_dir, memory)` is what run/serve/bench call: the resident source when
no memory flag was given, else a plan (printed to stderr as a forecast) and this source.
"""

from __future__ import annotations

import sys
import threading
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np

from engine.checkpoint.binding import new_digest
from engine.checkpoint.compact import CompactSpec
from engine.checkpoint.safetensors import SafetensorsIndex, TensorInfo
from engine.checkpoint.schema import open_checked
from engine.checkpoint.trunk import layer_mismatch, trunk_specs
from engine.core.config import ModelConfig
from engine.core.directio import (
    ALIGN,
    Batch,
    FileTable,
    Layout,
    ReadPool,
    TensorSpec,
    align_up,
    aligned_buffer,
)
from engine.kernels import FUSED
from engine.errors import CheckpointError, ReadError
from engine.weights.experts import EvictionPolicy, ExpertCache
from engine.weights.planner import Geometry, MemorySettings, Plan
from engine.weights.resident import ResidentSource
from engine.weights.source import ExpertSet, ExpertWeights, WeightSource, expert_from_arrays
from engine.weights.tables import RowTable, StreamedMatrix
from engine.weights.sysmem import current_rss, peak_rss
from k3vocab import DEFAULT_CONTEXT, GB

MODEL_TENSORS = ("embed_tokens.weight", "lm_head.weight", "norm.weight",
                 "output_attn_res_norm.weight", "output_attn_res_proj.weight")
EXPERT_PRIORITY = 0  # urgent: the compute is blocked on these
TRUNK_PRIORITY = 1  # read-ahead
EXPERT_CHUNK = 1 << 20  # experts split so the first one lands after a fraction of the set
FORMS_PER_SLOT = 8  # expert views kept per slot


def spec_of(t: TensorInfo) -> TensorSpec:
    # t.file is already a Path: building another re-parses it, and an expert's layout is
    # made the first time it is read, on the decode's critical path.
    file = t.file if isinstance(t.file, Path) else Path(t.file)
    return TensorSpec(t.name, file, t.offset, t.nbytes, t.np_dtype, tuple(t.shape))


class CheckpointMap:
    """Where every layer's trunk, every expert and the model tensors live on disk."""

    def __init__(self, checkpoint_dir: str | Path, trunk_dir: str | Path | None = None,
                 index: SafetensorsIndex | None = None):
        self.root = Path(checkpoint_dir)
        self.config, self.index, self.names = open_checked(self.root, index)
        n = self.config.num_hidden_layers
        per_layer: dict[int, list[TensorSpec]] = {i: [] for i in range(n)}
        lp = self.names.prefix + "layers."
        for name, t in self.index.tensors.items():
            if not name.startswith(lp) or self.names.is_expert(name):
                continue
            num = name[len(lp):].split(".", 1)[0]
            if num.isdigit() and int(num) < n:
                per_layer[int(num)].append(spec_of(t))
        empty = [i for i, specs in per_layer.items() if not specs]
        if empty:
            raise CheckpointError(
                f"layer {empty[0]} has no trunk tensors in {self.root}; the download is "
                "incomplete."
            )
        self.trunk_dir = None if trunk_dir is None else Path(trunk_dir)
        # layer -> the sha256 of its bytes in trunk.bin, checked on its first read
        self.trunk_digests: dict[int, str] = {}
        if self.trunk_dir is not None:
            packed = trunk_specs(self.trunk_dir, self.index, self.names, n, self.root)
            per_layer, self.trunk_digests = packed.layers, packed.digests
        self.trunk_kind = _trunk_kind(per_layer, trunk_dir, bool(self.trunk_digests))
        self.layers = [Layout(per_layer[i]) for i in range(n)]
        self._expert_layouts: dict[tuple[int, int], tuple[Layout, int]] = {}
        self._forms: dict[tuple, int] = {}

    def expert_layout(self, layer: int, expert: int) -> Layout:
        return self._expert(layer, expert)[0]

    def expert_form(self, layer: int, expert: int) -> int:
        """Which form the expert has: where each of its arrays sits in a slot (position,
        dtype, shape, in `TensorNames.expert` order). Experts of one form have the same views
        of a slot; a checkpoint has a few (one per page offset its experts start at)."""
        return self._expert(layer, expert)[1]

    def _expert(self, layer: int, expert: int) -> tuple[Layout, int]:
        key = (layer, expert)
        known = self._expert_layouts.get(key)
        if known is None:
            names = self.names.expert(layer, expert)
            lay = Layout([spec_of(self.index.info(n)) for n in names])
            shape = tuple((lay.tensors[n][0], lay.tensors[n][1].dtype.str,
                           lay.tensors[n][1].shape) for n in names)
            form = self._forms.setdefault(shape, len(self._forms))
            known = self._expert_layouts[key] = (lay, form)
        return known

    def model_spec(self, short: str) -> TensorSpec:
        return spec_of(self.index.info(self.names.model(short)))

    def geometry(self) -> Geometry:
        c = self.config
        moe = [i for i in range(c.num_hidden_layers) if c.is_moe(i)]
        slot = payload = 0
        for i in moe:  # experts are uniform; check one per layer
            lay = self.expert_layout(i, 0)
            # a slot must hold any expert's windows, whatever page offset it starts at
            worst = align_up(lay.payload) + ALIGN * len(lay.runs)
            slot, payload = max(slot, lay.nbytes, worst), max(payload, lay.payload)
        model = [self.model_spec(s) for s in MODEL_TENSORS]
        mats = [s for lay in self.layers for _, s in lay.tensors.values()] + model
        biggest = max((int(np.prod(s.shape)) for s in mats if len(s.shape) == 2), default=0)
        n_mla = len(c.mla_layers)
        n_kda = c.num_hidden_layers - n_mla
        kda_state = n_kda * c.kda_num_heads * c.kda_head_dim * c.kda_head_dim * 4
        conv = n_kda * 3 * c.kda_width * max(c.short_conv_kernel_size - 1, 0) * 4
        files = {t.file for t in self.index.tensors.values()}
        return Geometry(
            n_layers=c.num_hidden_layers,
            layer_bytes=tuple(lay.nbytes for lay in self.layers),
            expert_slot_bytes=slot,
            expert_bytes=payload,
            n_experts=c.num_experts,
            top_k=c.num_experts_per_token,
            moe_layers=len(moe),
            model_bytes=sum(s.nbytes for s in model),
            table_bytes=sum(s.nbytes for s in model[:2]),  # MODEL_TENSORS: embed, head first
            checkpoint_bytes=sum(Path(f).stat().st_size for f in files),
            kv_bytes_per_token=n_mla * (c.kv_lora_rank + c.qk_rope_head_dim) * 4,
            state_bytes=kda_state + conv,
            scratch_bytes=scratch_bytes(biggest, c),
        )


def _trunk_kind(per_layer: dict[int, list[TensorSpec]], trunk_dir: str | Path | None,
                digests: bool) -> str:
    """What the trunk streams from, for the forecast line."""
    if trunk_dir is None:
        return "the checkpoint's shards (BF16)"
    checked = ("each layer checked against its digest on its first read" if digests else
               "not checked: packed without per-layer digests")
    specs = [s for layer in per_layer.values() for s in layer]
    if not any(isinstance(s, CompactSpec) for s in specs):
        return f"the packed BF16 trunk in {trunk_dir} ({checked})"
    bf16 = sum(int(np.prod(s.shape)) * s.dtype.itemsize for s in specs)
    return (f"the compact trunk in {trunk_dir} "
            f"({100 * sum(s.nbytes for s in specs) / max(bf16, 1):.1f}% of BF16, lossless; "
            f"{checked})")


def scratch_bytes(biggest: int, c: ModelConfig) -> int:
    """Compute temporaries: activations, plus a widened copy (u32 + f32) of the largest
    matrix when the numpy reference kernels run instead of the fused ones."""
    acts = 16 * 4 * max(c.vocab_size, c.intermediate_size, c.hidden_size * 4) + (32 << 20)
    return acts if FUSED else acts + 8 * biggest


@dataclass
class _RingSlot:
    buf: np.ndarray
    layer: int | None = None
    batch: Batch | None = None
    users: int = 0
    views: dict[str, np.ndarray] | None = None


@dataclass
class _Pinned:
    buf: np.ndarray
    batch: Batch
    counted: bool = False
    views: dict[str, np.ndarray] = field(default_factory=dict)


class StreamingSource:
    """A `WeightSource` that reads trunk and experts from disk under `plan`."""

    def __init__(self, cmap: CheckpointMap, plan: Plan,
                 policy: str | EvictionPolicy = "cyclic"):
        self.map = cmap
        self.index = cmap.index  # load_model checks the tensors against it
        self.plan = plan
        self.config = cmap.config
        self.names = cmap.names
        g = plan.geometry
        self.n = g.n_layers
        self.files = FileTable()
        self.pool = ReadPool(plan.threads)
        self.cache = ExpertCache(plan.expert_slots, g.expert_slot_bytes, policy,
                                 n_layers=g.n_layers, working_set=g.top_k * g.moe_layers)
        self._ring = [_RingSlot(aligned_buffer(plan.ring_slot_bytes))
                      for _ in range(plan.ring_slots)]
        self._pinned_set = set(plan.pinned)
        self._streamed = [i for i in range(self.n) if i not in self._pinned_set]
        self._pass = 0  # forward passes seen, for read-ahead priorities across tokens
        self._last = -1
        self._expert_seq = 0
        self._c = dict(wait_trunk_s=0.0, wait_experts_s=0.0, trunk_bytes=0, expert_bytes=0,
                       expert_hits=0, expert_misses=0, guessed=0, guessed_used=0,
                       unused_bytes=0)
        # Guessed reads not yet adopted by `experts()`: (layer, expert) -> (slot, batch).
        # Once their layer has been asked for, the ones left over are `_unadopted`.
        self._guesses: dict[tuple[int, int], tuple[int, Batch]] = {}
        self._unadopted: set[tuple[int, int]] = set()
        # Wrong guesses cancelled before their read began, out of `_guesses` (never adopted,
        # guessed again as new reads): (slot, batch), freed once the pool has skipped them.
        self._cancelled: list[tuple[int, Batch]] = []
        self.wants_guesses = plan.guess_experts
        self._model: dict[str, np.ndarray] = {}
        # slot -> {expert form: ExpertWeights}: views of the slot's bytes, built once per form
        # (a checkpoint's experts have a few), so neither a cached expert nor a slot refilled
        # with another expert of that form builds views on the decode's critical path.
        self._weights: dict[int, dict[int, ExpertWeights]] = {}
        self._wait_lock = threading.Lock()
        self._waiters = 0
        self._wait_t0 = 0.0
        self._pinned: dict[int, _Pinned] = {}
        self._closed = False
        # Pinned layers stream in at once, in layer order, behind any urgent read.
        # Layers whose trunk bytes matched their digest (checked once, on the first read).
        self._verified: set[int] = set()
        self.verify_s = 0.0  # reader time spent on those checks
        for i in plan.pinned:
            buf = aligned_buffer(cmap.layers[i].nbytes)
            self._pinned[i] = _Pinned(buf, self._read_layer(i, buf, (TRUNK_PRIORITY, i)))
        self._schedule(0, in_use=False, first=True)
        # When the plan holds every expert, read them all once up front, each layer's in
        # file order right behind its trunk layer, instead of on the critical path after
        # each router decides. A layer's reads are adopted when it first asks for experts.
        self._preload: dict[int, list[tuple[int, int, Batch]]] = {}
        if plan.expert_slots >= g.n_experts * g.moe_layers:
            for L in (i for i in range(self.n) if self.config.is_moe(i)):
                ids = list(range(g.n_experts))
                got = self._read_experts(L, ids, self.cache.reserve(len(ids), L),
                                         priority=(TRUNK_PRIORITY, L, 1))
                self._preload[L] = [(e, slot, batch) for e, (slot, batch) in got.items()]

    # ---- trunk -------------------------------------------------------------------------

    @contextmanager
    def layer(self, index: int) -> Iterator[Mapping[str, np.ndarray]]:
        if not 0 <= index < self.n:
            raise CheckpointError(f"layer {index} does not exist (the model has {self.n}).")
        if index <= self._last:
            self._pass += 1
        self._last = index
        if index in self._pinned_set:
            self._schedule(index, in_use=False)
            yield self._pinned_views(index)
            return
        slot = self._slot_for(index)
        slot.users += 1
        try:
            self._schedule(index, in_use=True)
            self._await_slot(slot, index)
            yield slot.views  # type: ignore[misc]
        finally:
            slot.users -= 1
            if slot.users == 0:
                self._schedule(index, in_use=False)  # this slot now takes a later layer

    def _pinned_views(self, index: int) -> dict[str, np.ndarray]:
        p = self._pinned[index]
        lay = self.map.layers[index]
        if not p.counted:
            t0 = time.perf_counter()
            try:
                p.batch.wait()
            except ReadError:  # read it again next time rather than fail for ever
                p.batch = self._read_layer(index, p.buf, (TRUNK_PRIORITY, -1))
                raise
            finally:
                self._c["wait_trunk_s"] += time.perf_counter() - t0
            p.views = lay.views(p.buf, self.names.layer_prefix(index))
            p.counted = True
            self._c["trunk_bytes"] += lay.payload
        return p.views

    def resident_layer(self, index: int) -> Mapping[str, np.ndarray] | None:
        """A pinned layer's views once its read has landed (never waits), else None."""
        p = self._pinned.get(index)
        if p is None or not p.counted:
            return None  # its first use counts its bytes and checks its read
        return p.views

    def _await_slot(self, slot: _RingSlot, index: int) -> None:
        if slot.views is not None:
            return
        t0 = time.perf_counter()
        try:
            assert slot.batch is not None
            slot.batch.wait()
        except ReadError:
            slot.layer, slot.batch = None, None
            raise
        finally:
            self._c["wait_trunk_s"] += time.perf_counter() - t0
        lay = self.map.layers[index]
        slot.views = lay.views(slot.buf, self.names.layer_prefix(index))
        self._c["trunk_bytes"] += lay.payload

    def _slot_for(self, index: int) -> _RingSlot:
        for s in self._ring:
            if s.layer == index:
                return s
        # Not read ahead (first call, or the model left the cyclic order): read it now.
        free = [s for s in self._ring if s.users == 0]
        if not free:
            raise CheckpointError(
                "every trunk ring slot is in use; the model asked for more layers at once "
                "than the plan's ring holds."
            )
        slot = next((s for s in free if s.layer is None), free[0])
        self._fill(slot, index, (EXPERT_PRIORITY, -1))  # the compute waits for it now
        return slot

    def _fill(self, slot: _RingSlot, index: int, priority: tuple) -> None:
        if slot.batch is not None and not slot.batch.done():
            slot.batch.cancel()
            slot.batch.finished()  # no read may still be writing into this buffer
        slot.layer, slot.views = index, None
        slot.batch = self._read_layer(index, slot.buf, priority)

    def _read_layer(self, index: int, buf: np.ndarray, priority: tuple) -> Batch:
        """Queue layer `index`'s read into `buf`; until its bytes have once matched their
        digest, the reader that lands them checks them (off the compute's thread), and a
        mismatch fails the read: those bytes never reach the model."""
        lay = self.map.layers[index]
        want = self.map.trunk_digests.get(index)
        check = None
        if want is not None and index not in self._verified:
            check = partial(self._check_layer, index, buf, want)
        return self.pool.submit(lay.reads(self.files, buf), priority, then=check)

    def _check_layer(self, index: int, buf: np.ndarray, want: str) -> None:
        t0 = time.perf_counter()
        (run,) = self.map.layers[index].runs  # trunk_specs: a digest's layer is one run
        digest = new_digest()
        digest.update(buf[run.payload_pos:run.payload_pos + run.end - run.start])
        with self._wait_lock:
            self.verify_s += time.perf_counter() - t0
        if digest.hexdigest() != want:
            assert self.map.trunk_dir is not None
            raise ReadError(layer_mismatch(self.map.root, self.map.trunk_dir, index))
        self._verified.add(index)

    def _schedule(self, current: int, in_use: bool, first: bool = False) -> None:
        """Fill free slots with the streamed layers that come after `current`, in cyclic
        order; a slot in use (or holding `current` while in use) is never touched."""
        s = self._streamed
        if not self._ring or not s:
            return
        start = 0 if first else next((k for k, L in enumerate(s) if L > current), len(s))
        want = min(len(self._ring) - int(in_use), len(s) - int(in_use))
        upcoming = [s[(start + k) % len(s)] for k in range(want)]
        keep = set(upcoming) | ({current} if in_use else set())
        held = {r.layer for r in self._ring}
        for L in upcoming:
            if L in held:
                continue
            free = [r for r in self._ring if r.users == 0 and r.layer not in keep]
            if not free:
                break
            later_pass = not first and L <= current
            self._fill(free[0], L, (TRUNK_PRIORITY, (self._pass + later_pass) * self.n + L))
            held.add(L)

    # ---- experts -----------------------------------------------------------------------

    @property
    def max_experts_per_call(self) -> int:
        """How many distinct experts one `experts()` call can hold at once."""
        return self.cache.nslots

    @contextmanager
    def experts(self, layer: int, ids: Sequence[int]) -> Iterator[ExpertSet]:
        wanted = list(dict.fromkeys(int(e) for e in ids))
        bad = [e for e in wanted if not 0 <= e < self.config.num_experts]
        if bad:
            raise CheckpointError(f"expert {bad[0]} of layer {layer} does not exist.")
        self._adopt_preload(layer)
        self._retire_guesses(layer, wanted)
        cap = max(1, self.cache.free_for_reuse)
        view: _ExpertsAtOnce | _ExpertGroups
        if len(wanted) <= cap:
            view = _ExpertsAtOnce(_Group(self, layer, wanted), wanted)
        else:
            view = _ExpertGroups(self, layer, wanted, cap)
        try:
            yield view
        finally:
            view.release()

    def _wait_expert(self, batch: Batch) -> None:
        """Wait for one expert's read; the wall time some compute thread was blocked counts."""
        with self._wait_lock:
            if self._waiters == 0:
                self._wait_t0 = time.perf_counter()
            self._waiters += 1
        try:
            batch.wait()
        finally:
            with self._wait_lock:
                self._waiters -= 1
                if self._waiters == 0:
                    self._c["wait_experts_s"] += time.perf_counter() - self._wait_t0

    def _acquire(self, layer: int, group: list[int]) -> dict[int, tuple[int, Batch | None]]:
        """Pin resident experts, claim slots and issue sorted reads for the rest."""
        cache = self.cache
        got: dict[int, tuple[int, Batch | None]] = {}
        missing = []
        for e in group:
            guess = self._guesses.pop((layer, e), None)
            if guess is not None:  # its read started before the router: adopt it
                self._unadopted.discard((layer, e))
                got[e] = guess
                self._c["expert_misses"] += 1
                self._c["guessed_used"] += 1
                continue
            slot = cache.lookup((layer, e))
            if slot is not None:
                cache.pin(slot)
                got[e] = (slot, None)
                self._c["expert_hits"] += 1
            else:
                missing.append(e)
        try:
            slots = cache.reserve(len(missing), layer)
        except Exception:
            for e, (slot, batch) in got.items():
                if batch is None:
                    cache.unpin(slot)
                else:  # an adopted guess: hand it back, to be reaped when its read ends
                    self._guesses[(layer, e)] = (slot, batch)
                    self._unadopted.add((layer, e))
            raise
        got.update(self._read_experts(layer, missing, slots))
        self._c["expert_misses"] += len(missing)
        return got

    def _expert_weights(self, slot: int, key: tuple[int, int]) -> ExpertWeights:
        """The ExpertWeights of `key`, whose bytes are in `slot`."""
        form = self.map.expert_form(*key)
        known = self._weights.setdefault(slot, {})
        weights = known.get(form)
        if weights is None:
            if len(known) >= FORMS_PER_SLOT:  # a checkpoint of many forms: bounded memory
                known.clear()
            views = self.map.expert_layout(*key).views(self.cache.buffer(slot))
            weights = known[form] = expert_from_arrays([views[n] for n in self.names.expert(*key)])
        return weights

    def _adopt_preload(self, layer: int) -> None:
        """The up-front reads of `layer`'s experts become cached experts (a failed one is
        simply not cached: it is read on demand like any miss)."""
        for e, slot, batch in self._preload.pop(layer, ()):
            try:
                self._wait_expert(batch)
            except ReadError:
                self.cache.discard(slot)
            else:
                self.cache.publish(slot, (layer, e))
                self._c["expert_bytes"] += self.map.expert_layout(layer, e).payload
            self.cache.unpin(slot)

    def _read_experts(self, layer: int, ids: list[int], slots: list[int],
                      priority: tuple | None = None) -> dict[int, tuple[int, Batch]]:
        """Issue the reads of `ids` into their reserved `slots`, sorted by file offset;
        urgent unless a `priority` is given."""
        cache = self.cache
        layouts = [self.map.expert_layout(layer, e) for e in ids]
        order = sorted(range(len(ids)),
                       key=lambda k: (str(layouts[k].runs[0].file), layouts[k].runs[0].start))
        big = next((k for k in order if layouts[k].nbytes > cache.slot_bytes), None)
        if big is not None:
            for slot in slots:
                cache.discard(slot)
                cache.unpin(slot)
            raise CheckpointError(
                f"expert {ids[big]} of layer {layer} needs {layouts[big].nbytes} bytes, more "
                f"than a cache slot ({cache.slot_bytes}); the checkpoint's experts differ in "
                "size."
            )
        got = {}
        for k in order:
            lay, slot = layouts[k], slots[k]
            self._expert_seq += 1
            batch = self.pool.submit(lay.reads(self.files, cache.buffer(slot)),
                                     priority or (EXPERT_PRIORITY, self._expert_seq),
                                     chunk=EXPERT_CHUNK if priority is None else None)
            got[ids[k]] = (slot, batch)
        return got

    # ---- expert read-ahead from a guess ----------------------------------------------

    def guess(self, layer: int, ids: Sequence[int]) -> None:
        """Start reading the guessed experts of `layer` that are not resident, into slots
        the demand reads will not need (a layer's top-k always stays claimable)."""
        if not self.wants_guesses:
            return
        self._reap_guesses()
        cache = self.cache
        new = [e for e in dict.fromkeys(int(x) for x in ids)
               if 0 <= e < self.config.num_experts and cache.lookup((layer, e)) is None
               and (layer, e) not in self._guesses]
        new = new[:max(0, cache.free_for_reuse - self.plan.geometry.top_k)]
        if not new:
            return
        # Victims are chosen as if from the previous layer: this layer's cached experts are
        # about to be asked for, so they are the last to go, not the first.
        slots = cache.reserve(len(new), (layer - 1) % self.n)
        for e, (slot, batch) in self._read_experts(layer, new, slots).items():
            self._guesses[(layer, e)] = (slot, batch)
        self._c["guessed"] += len(new)

    def _retire_guesses(self, layer: int, wanted: list[int]) -> None:
        """`layer` is being asked for: its guesses outside `wanted` will not be adopted. Those
        whose read has not begun are cancelled: a wrong guess still queued would only take
        the disk (and, on few cores, the CPU) from the reads the layer waits for."""
        for k in [k for k in self._guesses if k[0] == layer and k[1] not in wanted]:
            slot, batch = self._guesses[k]
            if batch.started:
                self._unadopted.add(k)
            else:
                batch.cancel()
                del self._guesses[k]
                self._unadopted.discard(k)
                self._cancelled.append((slot, batch))
        self._reap_guesses()

    def _reap_guesses(self, block: bool = False) -> None:
        """Unadopted guesses whose read finished become ordinary cached experts; cancelled
        ones give their slot back once the pool has skipped their reads."""
        waiting = []
        for slot, batch in self._cancelled:
            if not batch.done() and not block:
                waiting.append((slot, batch))
                continue
            batch.finished()
            self.cache.discard(slot)  # even if a read began as it was cancelled
            self.cache.unpin(slot)
        self._cancelled = waiting
        for key in list(self._unadopted):
            slot, batch = self._guesses[key]
            if not batch.done():
                if not block:
                    continue
                batch.finished()
            del self._guesses[key]
            self._unadopted.discard(key)
            if batch.error is None and not batch.cancelled:
                self.cache.publish(slot, key)
                self._c["unused_bytes"] += self.map.expert_layout(*key).payload
            else:
                self.cache.discard(slot)
            self.cache.unpin(slot)

    # ---- model tensors, stats, lifetime ------------------------------------------------

    def warm(self) -> None:
        """Wait for what the plan keeps in RAM: the pinned layers, every expert where they all
        fit, the model tables unless they stream. A server calls this before it says ready,
        so its first request does not pay for the load."""
        for i in self.plan.pinned:
            self._pinned_views(i)
        for layer in list(self._preload):
            self._adopt_preload(layer)
        for name in MODEL_TENSORS:
            self.model_tensor(name)  # the streamed tables only open here; they read on use

    def model_tensor(self, name: str) -> np.ndarray:
        arr = self._model.get(name)
        if arr is None and self.plan.stream_tables and name in MODEL_TENSORS[:2]:
            kind = RowTable if name == "embed_tokens.weight" else StreamedMatrix
            # a streamed table stands in for the array: the model only takes rows or a matmul
            arr = self._model[name] = kind(self.map.model_spec(name), self.pool, self.files,  # type: ignore[assignment]
                                           (EXPERT_PRIORITY, -1))
        if arr is None:
            spec = self.map.model_spec(name)
            lay = Layout([spec])
            buf = aligned_buffer(lay.nbytes)
            self.pool.submit(lay.reads(self.files, buf), (EXPERT_PRIORITY, -1)).wait()
            arr = self._model[name] = lay.views(buf)[spec.name]
        return arr

    def stats(self) -> dict[str, Any]:
        c = self._c
        return {
            "wait_trunk_s": c["wait_trunk_s"],
            "wait_experts_s": c["wait_experts_s"],
            "gb_read_trunk": c["trunk_bytes"] / GB,
            "gb_read_experts": c["expert_bytes"] / GB,
            "gb_read_tables": sum(getattr(t, "bytes_read", 0) for t in self._model.values()) / GB,
            "expert_hits": c["expert_hits"],
            "expert_misses": c["expert_misses"],
            "evictions": self.cache.evictions,
            "gb_read_unused": c["unused_bytes"] / GB,
            "experts_guessed": c["guessed"],
            "experts_guessed_used": c["guessed_used"],
            "gb_read_device": self.pool.bytes_read / GB,
            "disk_busy_s": self.pool.busy_s,
            "rss_gb": current_rss() / GB,
            "peak_rss_gb": peak_rss() / GB,
            "budget_gb": self.plan.budget_bytes / GB,
        }

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for batches in self._preload.values():
            for _, _, batch in batches:
                batch.cancel()
                batch.finished()  # no read may still be writing into the arena
        self._preload.clear()
        self._unadopted.update(self._guesses)
        self._reap_guesses(block=True)
        self.pool.close()
        self.files.close()

    def __enter__(self) -> StreamingSource:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Group:
    """Experts of one `experts()` call held in slots; `get(e)` waits only for e's read.

    Thread-safe: the MoE may fetch experts from several compute threads at once.
    """

    def __init__(self, src: StreamingSource, layer: int, ids: list[int]):
        self.src = src
        self.layer = layer
        self.lock = threading.Lock()
        self.held = src._acquire(layer, ids)  # expert → (slot, read batch or None)
        self.ready: dict[int, ExpertWeights] = {}
        self.failed: dict[int, ReadError] = {}

    def get(self, e: int) -> ExpertWeights:
        with self.lock:
            if e in self.ready:
                return self.ready[e]
            if e in self.failed:
                raise self.failed[e]
            slot, batch = self.held[e]  # KeyError: not asked for
        if batch is not None:
            try:
                self.src._wait_expert(batch)
            except ReadError as exc:
                with self.lock:
                    if e in self.held and self.held[e][1] is batch:
                        self.src.cache.discard(slot)
                        self.src.cache.unpin(slot)
                        del self.held[e]
                        self.failed[e] = exc
                raise
        src = self.src
        with self.lock:
            if e in self.ready:
                return self.ready[e]
            slot, batch = self.held[e]
            if batch is not None:  # first reader of this expert publishes it
                src.cache.publish(slot, (self.layer, e))
                src._c["expert_bytes"] += src.map.expert_layout(self.layer, e).payload
                self.held[e] = (slot, None)
            self.ready[e] = weights = src._expert_weights(slot, (self.layer, e))
            return weights

    def arrival(self, e: int) -> int:
        """0 once e's bytes are in memory (or its read failed: `get` raises at once), else
        its read's queue position + 1."""
        held = self.held.get(e)
        batch = None if held is None else held[1]
        return 0 if batch is None or batch.done() else batch.seq + 1

    def release(self) -> None:
        """Unpin the slots; reads still in flight finish before their slot can be reused."""
        cache = self.src.cache
        with self.lock:
            for e, (slot, batch) in self.held.items():
                if batch is not None:
                    batch.finished()  # never free a slot a read is still writing into
                    if batch.error is None and not batch.cancelled:
                        cache.publish(slot, (self.layer, e))
                        self.src._c["expert_bytes"] += self.src.map.expert_layout(
                            self.layer, e).payload
                    else:
                        cache.discard(slot)
                cache.unpin(slot)
            self.held, self.ready = {}, {}


class _ExpertsAtOnce(Mapping[int, ExpertWeights]):
    """The whole set fits the cache: every expert stays valid for the block, so the MoE may
    fetch them from several compute threads at once; each waits only for its own read."""

    concurrent = True

    def __init__(self, group: _Group, wanted: list[int]):
        self.group = group
        self.wanted = wanted
        self._asked = set(wanted)

    def __getitem__(self, e: int) -> ExpertWeights:
        if int(e) not in self._asked:
            raise KeyError(e)
        return self.group.get(int(e))

    def arrival(self, e: int) -> int:
        return self.group.arrival(int(e))

    def __iter__(self) -> Iterator[int]:
        return iter(self.wanted)

    def __len__(self) -> int:
        return len(self.wanted)

    def release(self) -> None:
        self.group.release()


class _ExpertGroups(Mapping[int, ExpertWeights]):
    """The set is larger than the cache can hold at once: served in groups in the order of
    `ids`; an expert stays valid only until one from a later group is asked for (iterate
    in order and use each at once, as the MoE's serial path does)."""

    concurrent = False

    def __init__(self, src: StreamingSource, layer: int, wanted: list[int], cap: int):
        self.src = src
        self.layer = layer
        self.wanted = wanted
        self.groups = [wanted[i:i + cap] for i in range(0, len(wanted), cap)]
        self.group_of = {e: g for g, grp in enumerate(self.groups) for e in grp}
        self.current = 0
        self.group: _Group | None = _Group(src, layer, self.groups[0])

    def __getitem__(self, e: int) -> ExpertWeights:
        e = int(e)
        if e not in self.group_of:
            raise KeyError(e)
        if self.group_of[e] != self.current or self.group is None:
            self.release()
            self.current = self.group_of[e]
            self.group = _Group(self.src, self.layer, self.groups[self.current])
        return self.group.get(e)

    def arrival(self, e: int) -> int:
        """Not concurrent: the MoE takes these in the order of `ids`, never by arrival."""
        return 0

    def __iter__(self) -> Iterator[int]:
        return iter(self.wanted)

    def __len__(self) -> int:
        return len(self.wanted)

    def __contains__(self, e: object) -> bool:
        return e in self.group_of

    def release(self) -> None:
        if self.group is not None:
            self.group.release()
            self.group = None


def open_source(checkpoint_dir: str | Path, memory: MemorySettings | None = None,
                *, context: int = DEFAULT_CONTEXT, quiet: bool = False) -> WeightSource:
    """The resident source when no memory flag was given, else a planned StreamingSource
    (its plan printed to stderr as a forecast unless `quiet`)."""
    if memory is None or not memory.streams:
        return ResidentSource(checkpoint_dir, index=open_checked(checkpoint_dir)[1])
    cmap = CheckpointMap(checkpoint_dir, memory.trunk)
    plan = memory.plan(cmap.geometry(), context=context)
    if not quiet:
        print(f"trunk: {cmap.trunk_kind}\n{plan.describe()}", file=sys.stderr, flush=True)
    return StreamingSource(cmap, plan)
