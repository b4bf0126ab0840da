"""What a measurement backend returns, and the interface every backend offers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kernels.space import GemmConfig
from tuner.key import Key


# Share of samples dropped at each end by `trimmed_mean`.
TRIM = 0.2


def trimmed_mean(samples: list[float], trim: float = TRIM) -> float:
    """The mean of the samples left after dropping `trim` of them at each end.

    Interleaved single calls come out bimodal: a call right after a heavy
    one runs at lower clocks than one after an idle gap. With positions
    rotated every candidate sees both modes equally, but a median then lands
    in either mode by chance; the trimmed mean weighs both and still drops
    the outliers.
    """
    ordered = sorted(samples)
    cut = int(len(ordered) * trim)
    kept = ordered[cut: len(ordered) - cut] or ordered
    return sum(kept) / len(kept)


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

    def versions(self) -> dict[str, str]:
        """Software (and model) versions a result is valid under."""

    def measure(self, key: Key, cfg: GemmConfig) -> Measurement:
        """Time `cfg` on `key`'s problem."""

    def baseline(self, key: Key) -> Measurement:
        """Time the cuBLAS (torch) path on `key`'s problem."""

    def remeasure(self, key: Key, cfgs: list[GemmConfig | None], *, cold: bool = False) -> list[Measurement]:
        """Time several candidates interleaved (None = the baseline), to pick a winner
        fairly; `cold`: each call alone after an L2 flush (latency, not throughput)."""
