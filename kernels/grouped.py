"""Grouped GEMM work decode: a flat work index -> (group, cluster tile), on device.

Two forms share one decode. Each group g covers the half-open range
``[bounds[g], bounds[g + 1])`` of a *grouped extent*, where ``bounds[0] = 0``
and ``bounds[g + 1] = offs[g]`` (cumulative ends, as ``torch._grouped_mm``
takes them):

- ``"rows"`` (MoE): the extent is A's rows; group g owns
  ``ceil(rows_g / cluster rows) * clusters_n`` cluster tiles (none when empty).
- ``"k"`` (seed 000's mixed-K problems, packed along K): the extent is the
  packed K; every group owns the same ``clusters_m * clusters_n`` tiles.

Work order. In the rows form a group is *light* when its padded rows are at
most `LIGHT_ROWS`: each B tile it reads from DRAM then feeds so few MMAs
that the tile waits on memory (an H100 does about 300 bf16 FLOPs per DRAM
byte; a B byte feeds 2 FLOPs per row). Heavier groups reuse B from L2 and
wait on the tensor cores. Run one class after the other and a skewed MoE
launch alternates DRAM-bound and MMA-bound phases; so the heavy groups' tiles
(group by group) and the light groups' tiles (likewise) form two sequences
merged evenly, index i being heavy when ``floor((i + 1) H / T)`` exceeds
``floor(i H / T)`` (H heavy tiles of T). Both classes then run side by side
and finish together. With one class only (equal splits, the k form) this is
plain group order. A group's tiles follow the dense kernels' swizzled raster
order (`kernels.schedulers.decode_tile`).

At launch one warp turns ``offs`` into a shared-memory table (per group: its
bounds, its position in the heavy-then-light order, that position's first
index) with warp scans, so no host sync is needed and a CUDA graph replays
with whatever offsets the device holds; every role then finds its group by a
fixed-step binary search of that table (`kernels.group_table`, the device
side). `MAX_GROUPS` bounds the table. `work_order` is the host mirror used by
tests; this module stays free of cutlass so that the tuner can import its
limits.
"""

from __future__ import annotations

FORMS = ("rows", "k")
MAX_GROUPS = 256
# Padded rows up to which a rows-form group counts as light (see above).
LIGHT_ROWS = 256


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def work_order(offs: list[int], form: str, extent: int, clusters_m: int, clusters_n: int,
               cluster_rows: int) -> list[tuple[int, int]]:
    """(group, index within the group) of every work index, in order (host mirror of the table)."""
    heavy, light = [], []
    for g, hi in enumerate(offs):
        lo = min(offs[g - 1], extent) if g else 0
        rows_m = _cdiv(max(min(hi, extent) - lo, 0), cluster_rows) if form == "rows" else clusters_m
        is_light = form == "rows" and rows_m * cluster_rows <= LIGHT_ROWS
        (light if is_light else heavy).extend((g, t) for t in range(rows_m * clusters_n))
    total = len(heavy) + len(light)
    order = []
    for i in range(total):
        before = i * len(heavy) // total
        is_heavy = (i + 1) * len(heavy) // total > before
        order.append(heavy[before] if is_heavy else light[i - before])
    return order
