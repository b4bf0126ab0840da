"""Device side of `kernels.grouped`: the per-launch group table and a scheduler over it."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from kernels.grouped import LIGHT_ROWS, MAX_GROUPS
from kernels.schedulers import TileGrid, TileScheduler, WorkTile, decode_tile

# Groups each lane of the table-building warp covers.
_PER_LANE = MAX_GROUPS // 32
_SEARCH_STEPS = MAX_GROUPS.bit_length() - 1
# `GroupTable.order` holds one group index per byte.
assert MAX_GROUPS <= 256


def _scan(x):
    """Inclusive warp scan of `x` and the warp's total."""
    incl = x
    for s in range(5):
        up = cute.arch.shuffle_sync_up(incl, 1 << s)
        incl = incl + cutlass.select_(cute.arch.lane_idx() >= (1 << s), up, Int32(0))
    return incl, cute.arch.shuffle_sync(incl, 31)


class GroupTable:
    """The per-launch shared-memory table (see `kernels.grouped` for the order it encodes).

    Positions list the heavy groups, then the light ones, each in group
    order: `order[p]` is the group at position p and `starts[p]` its first
    index in the heavy-then-light concatenation; `bounds[g]` is group g's
    first row (or k); `heavy[0]` counts the heavy groups' tiles.
    """

    def __init__(self, form: str, storage, groups, clusters_m, clusters_n, cluster_rows: int, split: int = 1):
        entries = cute.make_layout(MAX_GROUPS + 1)
        self.form = form
        # K slices of a "k"-form group's tiles (split-K): each its own work.
        self.split = split
        self.bounds = storage.bounds.get_tensor(entries)
        self.starts = storage.starts.get_tensor(entries)
        # One byte per group (MAX_GROUPS = 256) keeps the table inside the
        # shared memory that `kernels.space` leaves over for it.
        self.order = storage.order.get_tensor(cute.make_layout(MAX_GROUPS))
        self.heavy = storage.heavy.get_tensor(cute.make_layout(1))
        self.groups = groups
        self.clusters_m = clusters_m
        self.clusters_n = clusters_n
        self.cluster_rows = cluster_rows

    @cute.jit
    def build(self, offs: cute.Tensor, extent, builder) -> None:
        """Every thread calls this, the lanes of the warp where `builder` holds fill the table.

        A CTA-wide barrier must follow.
        """
        if builder:
            self._fill(offs, extent)

    @cute.jit
    def _fill(self, offs: cute.Tensor, extent) -> None:
        lane = cute.arch.lane_idx()
        per_group = []
        heavy_groups, heavy_tiles, light_groups, light_tiles = Int32(0), Int32(0), Int32(0), Int32(0)
        for j in cutlass.range_constexpr(_PER_LANE):
            g = lane * _PER_LANE + j
            live = g < self.groups
            hi = cutlass.min(offs[cutlass.min(g, self.groups - 1)], extent)
            lo = cutlass.min(cutlass.select_(g == 0, Int32(0), offs[cutlass.max(g - 1, 0)]), extent)
            cm = self.clusters_m
            heavy = live
            if const_expr(self.form == "rows"):
                cm = (cutlass.max(hi - lo, 0) + (self.cluster_rows - 1)) // self.cluster_rows
                heavy = live & (cm * self.cluster_rows > LIGHT_ROWS)
            cnt = cutlass.select_(live, cm * self.clusters_n * self.split, Int32(0))
            per_group.append((g, live, heavy, lo, cnt))
            one_if_heavy = cutlass.select_(heavy, Int32(1), Int32(0))
            heavy_groups += one_if_heavy
            heavy_tiles += one_if_heavy * cnt
            light_groups += cutlass.select_(live, Int32(1), Int32(0)) - one_if_heavy
            light_tiles += (1 - one_if_heavy) * cnt
        # Exclusive prefixes of this lane's first group within each class.
        hg, hg_total = _scan(heavy_groups)
        ht, ht_total = _scan(heavy_tiles)
        lg, _ = _scan(light_groups)
        lt, lt_total = _scan(light_tiles)
        hg, ht = hg - heavy_groups, ht - heavy_tiles
        lg, lt = lg - light_groups + hg_total, lt - light_tiles + ht_total
        starts, bounds, order, groups, heavy_total = self.starts, self.bounds, self.order, self.groups, self.heavy
        for j in cutlass.range_constexpr(_PER_LANE):
            g, live, heavy, lo, cnt = per_group[j]
            if live:
                bounds[g] = lo
                if heavy:
                    starts[hg] = ht
                    order[hg] = cutlass.Uint8(g)
                    hg += 1
                    ht += cnt
                else:
                    starts[lg] = lt
                    order[lg] = cutlass.Uint8(g)
                    lg += 1
                    lt += cnt
        if lane == 31:
            starts[groups] = ht_total + lt_total
            bounds[groups] = cutlass.min(offs[groups - 1], extent)
            heavy_total[0] = ht_total

    @property
    def count(self):
        return self.starts[self.groups]

    def locate(self, idx):
        """(group, index within the group) of work index `idx`.

        The heavy and light sequences are merged evenly: of the first idx
        indices, floor(idx * heavy / count) are heavy ones.
        """
        heavy, total = Int64(self.heavy[0]), Int64(cutlass.max(self.count, 1))
        before = Int32(Int64(idx) * heavy // total)
        is_heavy = Int32((Int64(idx) + 1) * heavy // total) > before
        pos = cutlass.select_(is_heavy, before, self.heavy[0] + idx - before)
        p = Int32(0)
        for s in reversed(range(_SEARCH_STEPS)):
            cand = p + (1 << s)
            p = cutlass.select_((cand < self.groups) & (self.starts[cand] <= pos), cand, p)
        return Int32(self.order[p]), pos - self.starts[p]

    def clusters_m_of(self, g):
        if const_expr(self.form == "rows"):
            rows = self.bounds[g + 1] - self.bounds[g]
            return (cutlass.max(rows, 0) + (self.cluster_rows - 1)) // self.cluster_rows
        return self.clusters_m


class GroupedTileScheduler(TileScheduler):
    """`TileScheduler` over a `GroupTable`: tiles are (m within the group, n,
    group); with K slices, the third is group * slices + slice, the slices of
    a group following one another as batches do."""

    def __new_from_mlir_values__(self, values: list) -> "GroupedTileScheduler":
        base = super().__new_from_mlir_values__(values)
        return GroupedTileScheduler(
            self.spec, self.grid, self.num_clusters, self.rank_mn, base._idx, self._ring, base._state
        )

    @staticmethod
    def create(spec, table: GroupTable, ring=None) -> "GroupedTileScheduler":
        base = TileScheduler.create(spec, table, ring)
        return GroupedTileScheduler(
            spec, table, base.num_clusters, base.rank_mn, base._idx, ring, base._state
        )

    def _work(self) -> WorkTile:
        table = self.grid
        g, local = table.locate(self._idx)
        sub = TileGrid(table.clusters_m_of(g), table.clusters_n, Int32(table.split))
        cl_m, cl_n, s = decode_tile(local, sub, self.spec.swizzle, self.spec.raster_m)
        return WorkTile(self._cta_tile(cl_m, cl_n, g * table.split + s), self._idx < table.count)
