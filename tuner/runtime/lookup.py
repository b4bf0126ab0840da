"""Which choice serves a key: the one rule `gemm`, `explain` and `/v1/best` share.

A family is a key without M (arch, device, dtypes, layout, N, K, groups).
`tuner tune` measures each family over a ladder of M and stores an M map:
intervals of M, each with a choice (a pool config or cuBLAS) and the
interleaved measurements behind it (`tuner.search.ladder`). For a key of M = m:

1. the map interval that covers m gives the choice: a kernel holds there
   because it was measured at least as fast as cuBLAS at both ends;
2. a family with no map (a database from before M maps) serves the winner
   tuned at m, else the winner of the nearest tuned M t, but only where m
   lies in t's own interval [t / sqrt 2, t * sqrt 2] (the span a ladder rung
   owns between neighbours twice as far);
3. otherwise there is no choice: cuBLAS runs (or, opted in, `tuner.runtime.online`
   measures this M).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

from db.store import FAMILY_FIELDS, RangeView, Store, WinnerView
from tuner.key import Key

BASELINE = "cublas"
# How far from its own M a winner of a family without a map may serve.
OWN_SPAN = math.sqrt(2)

RANGE = "range"
EXACT = "exact"
NEAREST = "nearest"


@dataclass(frozen=True)
class Decision:
    """A choice for one M and what backs it.

    `how` is RANGE (a map interval), EXACT (the winner tuned at this M) or
    NEAREST (a map-less family's winner of a nearby M). `tuned_m` is the M
    nearest to the call's where the choice was measured; `ms` and
    `baseline_ms` are its and cuBLAS's times there.
    """

    m: int
    how: str
    config_name: str
    scheduler: str
    config: dict | None
    tuned_m: int
    ms: float
    baseline_ms: float
    backend: str
    versions: dict[str, str]
    interval: tuple[int, int] | None = None
    evidence: tuple[dict, ...] = ()
    source: str | None = None
    winner: WinnerView | None = None

    @property
    def exact(self) -> bool:
        """Measured at this very M."""
        return self.tuned_m == self.m

    @property
    def speedup(self) -> float:
        return self.baseline_ms / self.ms

    def stale(self, versions: dict[str, str]) -> bool:
        return self.versions != versions

    def describe(self) -> str:
        """One line on why this choice serves the M: the interval and its evidence."""
        if self.how == EXACT:
            return f"winner tuned at M={self.tuned_m}"
        if self.how == NEAREST:
            return f"winner of the nearest tuned M={self.tuned_m} (no M map for this family)"
        lo, hi = self.interval
        span = f"M={lo}" if lo == hi else f"M {lo}..{hi}"
        points = ", ".join(f"{speedup_at(p, self.config_name):.2f}x at M={p['m']}" for p in self.evidence)
        return f"{span} ({self.source}): measured {points} over cuBLAS"


def speedup_at(point: dict, name: str) -> float:
    """cuBLAS time over `name`'s at one evidence point."""
    return point["ms"][BASELINE] / point["ms"][name]


def decide(m: int, ranges: list[RangeView], winners: list[WinnerView]) -> Decision | None:
    """The rule (module doc) over one device's map and winners of a family."""
    for r in ranges:
        if r.covers(m):
            point = r.nearest_point(m)
            return Decision(
                m, RANGE, r.config_name, r.scheduler, r.config, point["m"], point["ms"][r.config_name],
                point["ms"][BASELINE], r.backend, r.versions, (r.m_lo, r.m_hi), tuple(r.evidence), r.source,
            )
    if ranges:
        return None
    for w in winners:
        if w.key["m"] == m:
            return _from_winner(m, EXACT, w)
    near = [w for w in winners if w.key["m"] / OWN_SPAN <= m <= w.key["m"] * OWN_SPAN]
    if not near:
        return None
    best = min(near, key=lambda w: (abs(math.log(w.key["m"] / m)), -w.key["m"]))
    return _from_winner(m, NEAREST, best)


def _from_winner(m: int, how: str, w: WinnerView) -> Decision:
    return Decision(
        m, how, w.config_name, w.scheduler, w.config, w.key["m"], w.ms, w.baseline_ms, w.backend, w.versions,
        winner=w,
    )


def family_of(key: Key) -> dict:
    fields = key.to_dict()
    return {f: fields[f] for f in FAMILY_FIELDS}


def family_id(fields: dict) -> tuple:
    """A hashable id of the family of `fields` (a key's or a map range's)."""
    return tuple(str(fields[f]) for f in FAMILY_FIELDS)


class Span(NamedTuple):
    """An M interval where the rule may choose a kernel, and the least time
    that kernel saved against cuBLAS at any point measured for it (us)."""

    lo: int
    hi: int
    saving_us: float


def kernel_spans(store: Store, key: Key, versions: dict[str, str] | None = None) -> tuple[Span, ...] | None:
    """The M intervals of `key`'s family (its M aside) where `decide` may
    choose a kernel, sorted; at every other M it chooses cuBLAS or nothing.
    With `versions`, choices stale under them are left out (the caller runs
    cuBLAS for those). None when nothing of the family is stored."""
    family = family_of(key)
    ranges = store.ranges(**family)
    if ranges:
        return tuple(sorted(Span(r.m_lo, r.m_hi, _saving_us(r)) for r in ranges
                            if r.config is not None and not (versions and r.stale(versions))))
    winners = store.winners(limit=100_000, **family)
    if not winners:
        return None
    # A map-less family's winner serves M within its own span (the rule's step 2).
    return tuple(sorted(
        Span(math.ceil(w.key["m"] / OWN_SPAN), math.floor(w.key["m"] * OWN_SPAN), 1000 * (w.baseline_ms - w.ms))
        for w in winners if w.config is not None and not (versions and w.stale(versions))
    ))


def _saving_us(r: RangeView) -> float:
    """The least cuBLAS time minus the interval's kernel time over its evidence."""
    savings = [p["ms"][BASELINE] - p["ms"][r.config_name] for p in r.evidence
               if BASELINE in p["ms"] and r.config_name in p["ms"]]
    return 1000 * min(savings) if savings else 0.0


def lookup(store: Store, key: Key) -> Decision | None:
    """The decision for `key` from the store (module doc), or None: cuBLAS."""
    family = family_of(key)
    ranges = store.ranges(**family)
    winners = [] if ranges else store.winners(limit=100_000, **family)
    return decide(key.problem.m, ranges, winners)
