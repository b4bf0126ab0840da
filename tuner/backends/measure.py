"""What a measurement backend returns, the interface every backend offers,
and the statistics that compare interleaved timings."""

from __future__ import annotations

import contextlib
import gc
import math
import statistics
from dataclasses import dataclass, field
from typing import Iterator, Protocol

from kernels.space import GemmConfig
from tuner.key import Key


# Share of samples dropped at each end by `trimmed_mean`.
TRIM = 0.2
# A cuBLAS call this many times slower than cuBLAS measured at a larger M of
# the same (N, K) was timed in a slow spell of the GPU (Phi-3-mini o at M =
# 19, H100: every candidate 8x its neighbours' times, and a kernel that runs
# 1.4x cuBLAS's time read 2 % ahead of it). With N and K fixed, a GEMM does
# not run that much faster on more rows.
SLOW_SPELL_RATIO = 1.25


def slow_spell(cublas_ms: float, cublas_ms_at_larger_m: float) -> bool:
    """Whether a measurement whose cuBLAS call took `cublas_ms` was taken in
    a slow spell (`SLOW_SPELL_RATIO`): its candidates' ratios say nothing."""
    return cublas_ms > SLOW_SPELL_RATIO * cublas_ms_at_larger_m


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's garbage collector off inside the block (after a collection),
    as it was after: a collection that falls inside one of a pair of timed
    forwards is host time the other does not pay (a model's forward makes
    enough objects to start several)."""
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def trimmed_mean(samples: list[float], trim: float = TRIM) -> float:
    """The mean of the samples left after dropping `trim` of them at each end.

    Interleaved single calls come out bimodal: a call right after a heavy
    one runs at lower clocks than one after an idle gap. With positions
    rotated every candidate sees both modes equally, but a median then lands
    in either mode by chance; the trimmed mean weighs both and still drops
    the outliers.
    """
    ordered, cut = _trimming(samples, trim)
    kept = ordered[cut: len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


def _trimming(samples: list[float], trim: float) -> tuple[list[float], int]:
    """The samples in order and how many `trim` drops at each end: one rule
    for the trimmed mean and its standard error."""
    ordered = sorted(samples)
    return ordered, int(len(ordered) * trim)


def trimmed_se(samples: list[float], trim: float = TRIM) -> float:
    """The standard error of `trimmed_mean(samples, trim)` (Tukey and
    McLaughlin): the winsorized samples' deviation over (kept share) x
    sqrt(n). The plain mean's standard error would count the very outliers
    the trimmed mean drops: host-timed forwards have a heavy tail (a
    scheduler tick, a clock ramp), and it made the estimate look several
    times noisier than it is."""
    ordered, cut = _trimming(samples, trim)
    n = len(ordered)
    if n < 2 or n - 2 * cut < 2:
        raise ValueError(f"trimmed_se needs at least two samples left after trimming, got {n}")
    lo, hi = ordered[cut], ordered[n - 1 - cut]
    winsorized = [min(max(v, lo), hi) for v in ordered]
    return math.sqrt(statistics.variance(winsorized) * n) / (n - 2 * cut)


def paired_speedup(pairs: list[tuple[float, float, bool]]) -> dict:
    """A candidate's speed over a baseline's from (baseline s, candidate s,
    candidate ran first) pairs: the log ratios of each order are averaged
    apart (trimmed means), then the two orders weigh alike. Whichever runs
    second in a pair tends to run at other clocks than the first, so the log
    ratios of the two orders form two modes; averaging each alone keeps that
    order effect out of the estimate and out of its standard error. Returns
    the speedup, its standard error (`trimmed_se` of each order, in log
    units: 0.002 is 0.2 %), the order effect (log of how much faster the
    second of a pair runs), the spread of all log ratios and the sample
    count."""
    logs = {first: [math.log(u / p) for u, p, f in pairs if f == first] for first in (True, False)}
    if not all(len(v) > 1 for v in logs.values()):
        raise ValueError("paired_speedup needs at least two pairs of each order")
    means = {first: trimmed_mean(v) for first, v in logs.items()}
    se = 0.5 * math.sqrt(sum(trimmed_se(v) ** 2 for v in logs.values()))
    return {"speedup": math.exp((means[True] + means[False]) / 2), "log_se": se,
            "order_effect": (means[False] - means[True]) / 2,
            "spread": statistics.pstdev(logs[True] + logs[False]), "samples": len(pairs)}


@dataclass(frozen=True)
class Measurement:
    """One timed (or predicted) run. `ok` is False for a config that failed to
    compile, faulted, or failed the correctness gate; such a trial can never win."""

    ms: float | None
    ok: bool
    error: str | None = None
    rel_err: float | None = None
    detail: dict = field(default_factory=dict)


class Backend(Protocol):
    name: str
    arch: str
    device_name: str
    # A measurement costs less than storing it (the model's arithmetic): a
    # key's search runs in memory and its trials are stored together once
    # the key is done; a key interrupted before that is searched again from
    # the start. A backend without it (the GPU) keeps an Optuna study per
    # key in the database and stores each trial as it is measured, so that
    # an interrupted key resumes where it stopped (`tuner.search.study`).
    bulk: bool

    def versions(self) -> dict[str, str]:
        """Software (and model) versions a result is valid under."""

    def measure(self, key: Key, cfg: GemmConfig) -> Measurement:
        """Time `cfg` on `key`'s problem."""

    def baseline(self, key: Key) -> Measurement:
        """Time the cuBLAS (torch) path on `key`'s problem."""

    def remeasure(self, key: Key, cfgs: list[GemmConfig | None], *, cold: bool = False) -> list[Measurement]:
        """Time several candidates interleaved (None = the baseline), to pick a winner
        fairly; `cold`: each call alone after an L2 flush (latency, not throughput)."""
