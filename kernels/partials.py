"""In-kernel reduction of fp32 partial tiles, shared by the sm90 and sm100 kernels.

CTAs that share an output tile (the K slices of split-K, the units of
stream-K) each park their fp32 partial in a slot of an int32 scratch buffer
(laid out by `kernels.space.split_k_scratch_words`) and count themselves on
the tile's semaphore; the one that arrives last adds the others' partials
and stores the tile. Nobody waits on anybody, so no co-residency is assumed.
How a kernel parks and adds (registers, TMEM) is its own; the slots, the
semaphores and the arrival protocol are here.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
from cutlass import Boolean, Int32, Int64

from kernels.schedulers import TileGrid
from kernels.space import SPLIT_K_COUNTERS, split_k_partials_offset


class PartialScratch:
    """The views of the kernel's int32 scratch: tile semaphores, partial slots,
    and `arrivals`, one shared-memory int32 that hands the arrival's outcome
    from the thread that counted to the CTA's other threads."""

    def __init__(self, sems: cute.Tensor, partials: cute.Pointer, arrivals: cute.Tensor, tiles_n: Int32):
        self.sems = sems
        self.partials = partials
        self.arrivals = arrivals
        self.tiles_n = tiles_n

    @staticmethod
    def create(buf: cute.Tensor, arrivals: cute.Tensor, grid: TileGrid, cluster_mn: tuple[int, int]):
        tiles_n = grid.clusters_n * cluster_mn[1]
        tiles = grid.clusters_m * cluster_mn[0] * tiles_n
        sems = cute.make_tensor(buf.iterator + SPLIT_K_COUNTERS, cute.make_layout(tiles))
        partials = cute.recast_ptr(buf.iterator + split_k_partials_offset(tiles), dtype=cutlass.Float32)
        return PartialScratch(sems, partials, arrivals, tiles_n)

    # Carried through the consumers' tile loop like any DSL value.
    def __extract_mlir_values__(self) -> list:
        return cutlass.extract_mlir_values([self.sems, self.partials, self.arrivals, self.tiles_n])

    def __new_from_mlir_values__(self, values: list) -> "PartialScratch":
        return PartialScratch(
            *cutlass.new_from_mlir_values([self.sems, self.partials, self.arrivals, self.tiles_n], values)
        )

    def tile_id(self, m, n) -> Int32:
        return m * self.tiles_n + n

    def partial(self, slot, values: int, threads: int) -> cute.Tensor:
        """(value, thread) fp32 partial tile in slot `slot` (see `SliceSlots`,
        `UnitSlots`): thread-major, so that a warp's accesses coalesce."""
        start = Int64(slot) * (values * threads)
        return cute.make_tensor(self.partials + start, cute.make_layout((values, threads), stride=(threads, 1)))

    @cute.jit
    def arrive(self, tile_id, count, tidx, bar) -> Boolean:
        """Count this CTA on the semaphore of tile `tile_id`, which `count`
        contributors share; every thread of `bar` calls it once its share of
        the partial is parked. Whether this CTA arrived last: then every
        other partial is visible to all of its threads, and the semaphore is
        back at zero for the next launch."""
        # Stores through locals: a store through `self` inside a branch would
        # rebind this object's fields to the branch's results, which the
        # caller's later branches cannot see.
        sems, arrivals = self.sems, self.arrivals
        # The partial is visible device-wide before the arrival that counts it.
        cute.arch.fence_acq_rel_gpu()
        bar.arrive_and_wait()
        if tidx == 0:
            earlier = cute.arch.atomic_add(sems.iterator + tile_id, Int32(1), sem="acq_rel", scope="gpu")
            arrivals[0] = earlier
            if earlier == count - 1:
                sems[tile_id] = Int32(0)
        bar.arrive_and_wait()
        last = arrivals[0] == count - 1
        if last:
            # Thread 0's acquire, extended past the barrier to every thread's reads.
            cute.arch.fence_acq_rel_gpu()
        return last


class SliceSlots:
    """Split-K: K slice l of CTA tile `tile_id` parks in slot tile_id * S + l."""

    def __init__(self, tile_id, split_k: int):
        self.tile_id = tile_id
        self.split_k = split_k

    def __call__(self, l):
        return Int64(self.tile_id) * self.split_k + l


class UnitSlots:
    """Stream-K: contributor s of stream-K tile `unit_tile` parks in its
    unit's slot (`StreamKScheduler.slot`), one per CTA of the cluster."""

    def __init__(self, sched, unit_tile, cluster_mn: tuple[int, int]):
        self.sched = sched
        self.unit_tile = unit_tile
        self.cluster_size = cluster_mn[0] * cluster_mn[1]
        self.rank = sched.rank_mn[0] + sched.rank_mn[1] * cluster_mn[0]

    def __call__(self, s):
        return Int64(self.sched.slot(s, self.unit_tile)) * self.cluster_size + self.rank
