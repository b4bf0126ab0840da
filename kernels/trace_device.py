"""Device side of tile traces (`kernels.trace` describes the records)."""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Int32, Int64, const_expr

from kernels.trace import FIELDS, RECORD_WORDS

_START = FIELDS.index("start_ns")
_CLAIM = FIELDS.index("claim_ns")


def now() -> Int64:
    """%globaltimer, in nanoseconds."""
    return cute.arch.globaltimer()


class TileTrace:
    """Device-side view of the trace buffer of one launch."""

    def __init__(self, buf: cute.Tensor, tiles_m: Int32, tiles_n: Int32):
        self.buf = buf
        self.tiles_m = tiles_m
        self.tiles_n = tiles_n

    @staticmethod
    def create(buf: cute.Tensor, grid, cluster_mn: tuple[int, int]) -> "TileTrace":
        """The view for a launch over `grid` (a `kernels.schedulers.TileGrid`)."""
        return TileTrace(buf, grid.clusters_m * cluster_mn[0], grid.clusters_n * cluster_mn[1])

    def __extract_mlir_values__(self) -> list:
        return cutlass.extract_mlir_values([self.buf, self.tiles_m, self.tiles_n])

    def __new_from_mlir_values__(self, values: list) -> "TileTrace":
        return TileTrace(*cutlass.new_from_mlir_values([self.buf, self.tiles_m, self.tiles_n], values))

    def _word(self, tile, field: int) -> Int64:
        m, n, l = tile
        slot = (Int64(l) * self.tiles_m + m) * self.tiles_n + n
        return slot * RECORD_WORDS + field

    @cute.jit
    def record(self, tile, start: Int64 | None, end: Int64) -> None:
        """Every field of `tile`'s record but the claim; one thread calls it.

        `start` None leaves the start word to `begin`: on sm100 the tile's
        mainloop runs in another warp (another CTA's, for a 2-CTA MMA) than
        its epilogue.
        """
        bidx, bidy, _ = cute.arch.block_idx()
        gdimx, _, _ = cute.arch.grid_dim()
        base = self._word(tile, 0)
        values = (Int64(cute.arch.smid()), Int64(bidx) + Int64(bidy) * Int64(gdimx),
                  Int64(tile[0]), Int64(tile[1]), Int64(tile[2]), start, end)
        for i in cutlass.range_constexpr(len(values)):
            if const_expr(values[i] is not None):
                self.buf[base + i] = values[i]

    @cute.jit
    def begin(self, tile, start: Int64) -> None:
        """The start word of `tile`'s record (see `record`); one thread calls it."""
        self.buf[self._word(tile, _START)] = start

    @cute.jit
    def claim(self, tile, latency: Int64) -> None:
        """The claim word of `tile`'s record; one thread calls it."""
        self.buf[self._word(tile, _CLAIM)] = latency
