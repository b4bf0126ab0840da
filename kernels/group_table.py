"""Device side of `kernels.grouped`: the per-launch group table and a scheduler over it."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, const_expr

from kernels.grouped import MAX_GROUPS
from kernels.schedulers import TileGrid, TileScheduler, WorkTile, decode_tile

# Groups each lane of the table-building warp covers.
_PER_LANE = MAX_GROUPS // 32
_SEARCH_STEPS = MAX_GROUPS.bit_length() - 1


class GroupTable:
    """The per-launch shared-memory table: bounds and first tile index of every group.

    `bounds` and `starts` are smem Int32 tensors of MAX_GROUPS + 1 entries.
    """

    def __init__(self, form: str, bounds, starts, groups, clusters_m, clusters_n, cluster_rows: int):
        self.form = form
        self.bounds = bounds
        self.starts = starts
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
        counts = []
        ranges = []
        local = Int32(0)
        for j in cutlass.range_constexpr(_PER_LANE):
            g = lane * _PER_LANE + j
            live = g < self.groups
            hi = cutlass.min(offs[cutlass.min(g, self.groups - 1)], extent)
            lo = cutlass.min(cutlass.select_(g == 0, Int32(0), offs[cutlass.max(g - 1, 0)]), extent)
            cm = self.clusters_m
            if const_expr(self.form == "rows"):
                cm = (cutlass.max(hi - lo, 0) + (self.cluster_rows - 1)) // self.cluster_rows
            cnt = cutlass.select_(live, cm * self.clusters_n, Int32(0))
            counts.append(cnt)
            ranges.append((g, live, lo))
            local += cnt
        incl = local
        for s in cutlass.range_constexpr(5):
            up = cute.arch.shuffle_sync_up(incl, 1 << s)
            incl = incl + cutlass.select_(lane >= (1 << s), up, Int32(0))
        run = incl - local
        starts, bounds, groups = self.starts, self.bounds, self.groups
        for j in cutlass.range_constexpr(_PER_LANE):
            g, live, lo = ranges[j]
            if live:
                starts[g] = run
                bounds[g] = lo
            run += counts[j]
        if lane == 31:
            starts[groups] = incl
            bounds[groups] = cutlass.min(offs[groups - 1], extent)

    @property
    def count(self):
        return self.starts[self.groups]

    def locate(self, idx):
        """(group, index within the group): fixed-step binary search of `starts`."""
        g = Int32(0)
        for s in reversed(range(_SEARCH_STEPS)):
            cand = g + (1 << s)
            g = cutlass.select_((cand < self.groups) & (self.starts[cand] <= idx), cand, g)
        return g, idx - self.starts[g]

    def clusters_m_of(self, g):
        if const_expr(self.form == "rows"):
            rows = self.bounds[g + 1] - self.bounds[g]
            return (cutlass.max(rows, 0) + (self.cluster_rows - 1)) // self.cluster_rows
        return self.clusters_m


class GroupedTileScheduler(TileScheduler):
    """`TileScheduler` over a `GroupTable`: tiles are (m within the group, n, group)."""

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
        sub = TileGrid(table.clusters_m_of(g), table.clusters_n, Int32(1))
        cl_m, cl_n, _ = decode_tile(local, sub, self.spec.swizzle, self.spec.raster_m)
        cm, cn = self.spec.cluster_mn
        tile = (
            cute.arch.make_warp_uniform(cl_m * cm + self.rank_mn[0]),
            cute.arch.make_warp_uniform(cl_n * cn + self.rank_mn[1]),
            cute.arch.make_warp_uniform(g),
        )
        return WorkTile(tile, self._idx < table.count)
