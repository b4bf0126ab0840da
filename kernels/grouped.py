"""Grouped GEMM work decode: a flat work index -> (group, cluster tile), on device.

Two forms share one decode. Each group g covers the half-open range
``[bounds[g], bounds[g + 1])`` of a *grouped extent*, where ``bounds[0] = 0``
and ``bounds[g + 1] = offs[g]`` (cumulative ends, as ``torch._grouped_mm``
takes them):

- ``"rows"`` (MoE): the extent is A's rows; group g owns
  ``ceil(rows_g / cluster rows) * clusters_n`` cluster tiles (none when empty).
- ``"k"`` (seed 000's mixed-K problems, packed along K): the extent is the
  packed K; every group owns the same ``clusters_m * clusters_n`` tiles.

Work indices run group by group, tiles of a group in the dense kernels'
swizzled raster order (`kernels.schedulers.decode_tile`). At launch one warp
turns ``offs`` into a shared-memory table of (bounds, first tile index) per
group with a warp scan, so no host sync is needed and a CUDA graph replays
with whatever offsets the device holds; every role then finds its group by a
fixed-step binary search of that table (`kernels.group_table`, the device
side). `MAX_GROUPS` bounds the table. `tile_starts` and `locate` are the
host mirror used by tests; this module stays free of cutlass so that the
tuner can import its limits.
"""

from __future__ import annotations

import bisect

FORMS = ("rows", "k")
MAX_GROUPS = 256


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def tile_starts(offs: list[int], form: str, extent: int, clusters_m: int, clusters_n: int,
                cluster_rows: int) -> list[int]:
    """First work index of every group, then the total (host mirror of the table)."""
    starts = [0]
    for g, hi in enumerate(offs):
        lo = min(offs[g - 1], extent) if g else 0
        rows_m = _cdiv(max(min(hi, extent) - lo, 0), cluster_rows) if form == "rows" else clusters_m
        starts.append(starts[-1] + rows_m * clusters_n)
    return starts


def locate(idx: int, starts: list[int]) -> tuple[int, int]:
    """(group, index within the group) of work index `idx` < starts[-1]."""
    g = bisect.bisect_right(starts, idx, hi=len(starts) - 1) - 1
    return g, idx - starts[g]
