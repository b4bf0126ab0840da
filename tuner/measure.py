"""What a measurement backend returns, and the interface every backend offers."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kernels.space import GemmConfig
from tuner.key import Key


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
