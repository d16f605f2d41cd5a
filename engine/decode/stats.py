"""One generated token's engine statistics, as one typed record.

generate() fills a `TokenStats` per token from the weight source's running totals;
`python -m engine run --json` prints `as_dict()` per token; the server's worker completes
the record (serve/worker.py) and its protocol writes it as the `k3` object of every chunk
(README's `k3` table). The field names are the wire names.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from engine.weights.source import WeightSource
from engine.weights.sysmem import current_rss, peak_rss
from k3vocab import GB

# The server's, set for an answer's last chunk only.
K3_FINAL = ("reasoning_tokens", "gb_read_prefill", "note", "demo")
# Present in `as_dict()` only when the source reports them.
OPTIONAL = ("budget_gb", "experts_guessed", "experts_guessed_used", "gb_read_unused")


@dataclass(frozen=True)
class TokenStats:
    s_per_token: float | None = None  # wall time of this token (GenToken.seconds)
    compute_s: float | None = None  # the token's time not spent waiting for reads
    wait_trunk_s: float | None = None
    wait_experts_s: float | None = None
    gb_read_trunk: float | None = None
    gb_read_experts: float | None = None
    mb_per_s: float | None = None
    true_hit_rate: float | None = None  # hits / (hits + misses); None without routed experts
    expert_hits: int = 0
    expert_misses: int = 0
    evictions: int = 0
    rss_gb: float | None = None
    peak_rss_gb: float | None = None
    budget_gb: float | None = None  # the memory plan's budget (streaming sources)
    # expert read-ahead (when the plan turns it on): guesses made, adopted, bytes wasted
    experts_guessed: int | None = None
    experts_guessed_used: int | None = None
    gb_read_unused: float | None = None
    # the server's, on an answer's last chunk
    reasoning_tokens: int | None = None
    gb_read_prefill: float | None = None  # GB the prompt's prefill read (after any reuse)
    note: str | None = None  # why an answer is empty (max_tokens ran out while reasoning)
    demo: str | None = None  # the demo model's notice

    @property
    def gb_read(self) -> float | None:
        """GB read from disk for this token (trunk + experts)."""
        if self.gb_read_trunk is None and self.gb_read_experts is None:
            return None
        return (self.gb_read_trunk or 0.0) + (self.gb_read_experts or 0.0)

    def as_dict(self) -> dict[str, Any]:
        """The engine's per-token figures (`run --json`'s `per_token` entries)."""
        out = asdict(self)
        for key in ("s_per_token",) + K3_FINAL:
            del out[key]
        return {k: v for k, v in out.items() if v is not None or k not in OPTIONAL}


class StatsMeter:
    """Per-token statistics from the source's running totals, plus each token's expert
    hits/misses (so a run's hit rate can be totalled) and the RSS now and at its peak,
    measured here when the source does not report them."""

    def __init__(self, source: WeightSource):
        self.source = source
        self.prev = self._read()

    def _read(self) -> dict[str, Any]:
        return dict(self.source.stats())

    def delta(self, seconds: float, compute_seconds: float) -> TokenStats:
        """`seconds`: the token's wall time; `compute_seconds`: its forward pass."""
        prev, cur = self.prev, self._read()
        self.prev = cur

        def d(key: str) -> float:
            return float(cur.get(key, 0) or 0) - float(prev.get(key, 0) or 0)

        gb = d("gb_read_trunk") + d("gb_read_experts")
        hits, misses = int(d("expert_hits")), int(d("expert_misses"))
        guesses = "experts_guessed" in cur
        return TokenStats(
            s_per_token=seconds,
            compute_s=max(0.0, compute_seconds - d("wait_trunk_s") - d("wait_experts_s")),
            wait_trunk_s=d("wait_trunk_s"),
            wait_experts_s=d("wait_experts_s"),
            gb_read_trunk=d("gb_read_trunk"),
            gb_read_experts=d("gb_read_experts"),
            mb_per_s=gb * 1000.0 / compute_seconds if compute_seconds > 0 else 0.0,
            true_hit_rate=hits / (hits + misses) if hits + misses else None,
            expert_hits=hits,
            expert_misses=misses,
            evictions=int(d("evictions")),
            rss_gb=cur.get("rss_gb", current_rss() / GB),
            peak_rss_gb=cur.get("peak_rss_gb", peak_rss() / GB),
            budget_gb=cur.get("budget_gb"),
            experts_guessed=int(d("experts_guessed")) if guesses else None,
            experts_guessed_used=int(d("experts_guessed_used")) if guesses else None,
            gb_read_unused=d("gb_read_unused") if guesses else None,
        )
