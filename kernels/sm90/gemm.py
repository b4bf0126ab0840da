"""Warp-specialized persistent GEMM for Hopper (sm_90a), scheduler pluggable.

out = a @ b (fp32 accumulation) with A (M, K) row-major and B either (N, K)
K-major ("tn", an nn.Linear weight: out = x @ W.T) or (K, N) N-major ("nn").

Warp roles of a CTA: warpgroup 0 holds the TMA producer warp (A and B
k-blocks into a `stages`-deep mbarrier ring, multicast across the cluster)
and the scheduler warp (dynamic and stream-K schedulers); one consumer
warpgroup (tile_m 64), two (tile_m 128: 64 rows each, 256: 128 rows each)
or three (tile_m 192: 64 rows each) run WGMMA and the epilogue, which goes
registers -> smem -> global by TMA stores in (tile_m x `epi_subtile_n`)
sub-tiles.
Every role walks the tiles given by `kernels.schedulers`.

With pingpong consumers (CUTLASS's KernelTmaWarpSpecializedPingpong) two
consumer warpgroups each compute whole tiles: the first takes the 1st, 3rd,
5th ... tile of the CTA's schedule, the second the others, and the load warp
fills the ring in that order. They take turns through an ordered barrier,
mainloop after mainloop and epilogue after epilogue, so that one
warpgroup's epilogue runs while the other's WGMMAs keep the tensor cores busy.

With swap_ab (B an nn.Linear weight) the kernel runs out.T = W @ x.T: its A
is the weight, its B the activations, 8 to 128 of their rows a tile on the
MMA's N side, and its output the (N, M) view of `out`, stored M-major
(transposed stmatrix, TMA). Callers pass a, b and out as for any config.

Split-K walks K slices as batches: with S = split_k the kernel sees A as
(M, K/S, S) and B as (N, K/S, S), and reduces in the kernel. Every slice
parks its fp32 accumulators in a scratch buffer and counts itself on its
tile's semaphore; the slice that arrives last adds the others' partials and
stores the tile, so no separate reduction runs and no slice ever waits on
another (no co-residency is assumed). M, N and K are symbolic: one compile
serves every problem size of a (config, dtypes, layout).
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.hopper_helpers as sm90_utils
from cutlass import Boolean, Int32, Int64, const_expr
from cutlass.memory import SmemAllocator
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum

from kernels.partials import PartialScratch, SliceSlots, UnitSlots
from kernels.schedulers import ClaimRing, SchedulerSpec, TileGrid, TileScheduler
from kernels.space import (
    GemmConfig,
    InvalidConfig,
    epi_buffers,
    epi_subtile_n,
    sm90_registers,
)
from kernels.trace_device import TileTrace
from kernels.trace_device import now as trace_now

_WARPS_PER_GROUP = 4
_THREADS_PER_GROUP = 128
_LOAD_WARP = 0
_SCHED_WARP = 1
_SMEM_ALIGN = 1024
# Pingpong warpgroups use this id and the next.
_EPILOGUE_BARRIER_ID = 1
# Pingpong turns: (mainloop, epilogue) sections of each of two warpgroups.
_TURN_SECTIONS = 2
_TURN_GROUPS = 2
# A TMA load's L2 cache policy for evict-first (CUTLASS's CacheHintSm90::EVICT_FIRST).
_L2_EVICT_FIRST = 0x12F0000000000000


class Sm90GemmKernel:
    """One kernel variant of the sm90 pool; `cfg` fixes everything but the sizes.

    ``__call__(a, b, out, sched_buf, max_clusters, stream)`` takes 2-D
    row-major A, B (layout per `layout`) and `out` (M, N); `sched_buf` is the
    int32[2] buffer of the dynamic scheduler (unused by the others) or, with
    split-K, the scratch laid out by `kernels.space.split_k_scratch_words`
    (those counters first), and `max_clusters` the clusters the device runs
    at once.
    """

    def __init__(self, cfg: GemmConfig, layout: str = "tn"):
        self.can_implement(cfg, layout)
        # Set only while `traced` builds the launch (kernels.trace).
        self._trace_buf = None
        self.cfg = cfg
        self.layout = layout
        self.sched = SchedulerSpec.from_config(cfg)
        self.tile_mn = (cfg.tile_m, cfg.tile_n)
        self.cluster_mn = (cfg.cluster_m, cfg.cluster_n)
        self.stages = cfg.stages
        self.split_k = cfg.split_k
        self.pingpong = cfg.pingpong
        self.swap_ab = cfg.swap_ab
        self.mma_groups = cfg.consumer_warpgroups
        # Warpgroups, and their threads, that share one tile's WGMMAs,
        # accumulators and epilogue: all consumers, or one with pingpong.
        self.tile_groups = cfg.tile_warpgroups
        self.mma_threads = self.tile_groups * _THREADS_PER_GROUP
        self.threads = (1 + self.mma_groups) * _THREADS_PER_GROUP
        # setmaxnreg budgets: the producer warpgroup gives registers to the
        # consumers, which hold the accumulators (`kernels.space` sizes them).
        self.producer_regs, self.consumer_regs = sm90_registers(cfg)
        # Ring consumers per CTA: the load warp and every consumer warp
        # (pingpong warpgroups too receive every index, to skip the other's).
        self.ring_consumer_warps = 1 + self.mma_groups * _WARPS_PER_GROUP
        self.ring_words = ClaimRing.storage_words(self.sched)
        self.epi_tile = (cfg.tile_m, epi_subtile_n(cfg))
        self.a_policy, self.b_policy = _load_policies(cfg)
        # The weight (the caller's b) is the kernel's A under swap_ab, else its B.
        self.weight_operand, self.activation_operand = ("a", "b") if cfg.swap_ab else ("b", "a")

    @staticmethod
    def can_implement(cfg: GemmConfig, layout: str) -> None:
        """Raise InvalidConfig unless this class builds `cfg` (space rules hold already)."""
        if cfg.arch != "sm90":
            raise InvalidConfig(f"{cfg.arch} config given to the sm90 kernel")
        if layout not in ("tn", "nn"):
            raise InvalidConfig(f"unknown layout {layout!r}")

    # ------------------------------------------------------------------ host side

    def _views(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor):
        """(m, k, l), (n, k, l) views, l the K slice, and the (m, n, 1) output.

        With swap_ab the kernel's A is the weight b and its B the
        activations a, and it writes out.T: the (n, m, 1) view of `c` whose
        first mode is contiguous (an M-major output)."""
        m, n = c.shape
        if const_expr(self.swap_ab):
            ct = cute.make_tensor(c.iterator, cute.make_layout((n, m, 1), stride=(1, c.stride[0], m * c.stride[0])))
            return self._operand_view(b, "tn"), self._operand_view(a, "tn"), ct
        c3 = cute.make_tensor(c.iterator, cute.make_layout((m, n, 1), stride=(c.stride[0], 1, m * c.stride[0])))
        return self._operand_view(a, "tn"), self._operand_view(b, self.layout), c3

    def _operand_view(self, t: cute.Tensor, layout: str):
        """The (rows, k, l) view of a K-major ("tn") or (k, rows) row-major
        ("nn") operand, l the K slice."""
        s = self.split_k
        if const_expr(layout == "tn"):
            rows, k = t.shape
        else:
            k, rows = t.shape
        k_slice = k
        if const_expr(s > 1):
            k_slice = cute.assume(k // s, divby=8)
        if const_expr(layout == "tn"):
            return cute.make_tensor(t.iterator, cute.make_layout((rows, k_slice, s), stride=(t.stride[0], 1, k_slice)))
        return cute.make_tensor(
            t.iterator, cute.make_layout((rows, k_slice, s), stride=(1, t.stride[0], t.stride[0] * k_slice))
        )

    def _setup(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor) -> None:
        self.a_dtype, self.b_dtype, self.c_dtype = a.element_type, b.element_type, c.element_type
        self.a_layout = LayoutEnum.from_tensor(a)
        self.b_layout = LayoutEnum.from_tensor(b)
        self.c_layout = LayoutEnum.from_tensor(c)
        self.tiled_mma = sm90_utils.make_trivial_tiled_mma(
            self.a_dtype,
            self.b_dtype,
            self.a_layout.sm90_mma_major_mode(),
            self.b_layout.sm90_mma_major_mode(),
            cutlass.Float32,
            (self.tile_groups, 1, 1),
            tiler_mn=(64, self.tile_mn[1]),
        )
        self.tile_mnk = (*self.tile_mn, self.cfg.tile_k)
        self.a_mcast = self.cluster_mn[1]
        self.b_mcast = self.cluster_mn[0]
        self.epi_stages = epi_buffers(self.c_dtype.width)
        self.a_smem, self.b_smem, self.c_smem = self._smem_layouts()

    def _smem_layouts(self):
        """Staged A, B and C smem layouts, and one stage of A and B (the TMA
        boxes). One stage is built on its own, not sliced from the staged
        layout: slicing a swizzled layout of an odd number of 8-row atoms
        (tile_n 72, 136, 168, ...) aborts in nvidia-cutlass-dsl 4.8.1."""
        def operand(shape_mk, dtype, layout, stages=None):
            k_major = layout.sm90_mma_major_mode() == cute.nvgpu.OperandMajorMode.K
            atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
                sm90_utils.get_smem_layout_atom(layout, dtype, shape_mk[1 if k_major else 0]), dtype
            )
            if stages is None:
                return cute.tile_to_shape(atom, shape_mk, order=(0, 1) if k_major else (1, 0))
            return cute.tile_to_shape(atom, (*shape_mk, stages), order=(0, 1, 2) if k_major else (1, 0, 2))

        tm, tn, tk = self.tile_mnk
        a_smem = operand((tm, tk), self.a_dtype, self.a_layout, self.stages)
        b_smem = operand((tn, tk), self.b_dtype, self.b_layout, self.stages)
        self.a_stage = operand((tm, tk), self.a_dtype, self.a_layout)
        self.b_stage = operand((tn, tk), self.b_dtype, self.b_layout)
        self.stage_bytes = cute.size_in_bytes(self.a_dtype, self.a_stage) + cute.size_in_bytes(
            self.b_dtype, self.b_stage
        )
        # A swap_ab output is M-major: its staging runs along the tile's rows.
        m_major = self.c_layout.is_m_major_c()
        c_atom = cute.nvgpu.warpgroup.make_smem_layout_atom(
            sm90_utils.get_smem_layout_atom(self.c_layout, self.c_dtype, self.epi_tile[0 if m_major else 1]),
            self.c_dtype,
        )
        order = (1, 0, 2) if m_major else (0, 1, 2)
        c_smem = cute.tile_to_shape(c_atom, (*self.epi_tile, self.epi_stages), order=order)
        return a_smem, b_smem, c_smem

    @staticmethod
    def _tma_load(tensor, smem_stage, tile, mcast):
        op = (
            cute.nvgpu.cpasync.CopyBulkTensorTileG2SOp()
            if mcast == 1
            else cute.nvgpu.cpasync.CopyBulkTensorTileG2SMulticastOp()
        )
        return cute.nvgpu.cpasync.make_tiled_tma_atom(op, tensor, smem_stage, tile, num_multicast=mcast)

    def _tma_atoms(self, a3: cute.Tensor, b3: cute.Tensor, c3: cute.Tensor) -> tuple:
        """Derive the layouts for these operands, then the TMA atoms and
        tensors of A and B (loads, multicast in a cluster) and C (stores)."""
        self._setup(a3, b3, c3)
        tm, tn, tk = self.tile_mnk
        tma_a, ta = self._tma_load(a3, self.a_stage, (tm, tk), self.a_mcast)
        tma_b, tb = self._tma_load(b3, self.b_stage, (tn, tk), self.b_mcast)
        tma_c, tc = cute.nvgpu.cpasync.make_tiled_tma_atom(
            cute.nvgpu.cpasync.CopyBulkTensorTileS2GOp(),
            c3,
            cute.slice_(self.c_smem, (None, None, 0)),
            self.epi_tile,
        )
        return tma_a, ta, tma_b, tb, tma_c, tc

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,
        b: cute.Tensor,
        c: cute.Tensor,
        sched_buf: cute.Tensor,
        max_clusters: Int32,
        stream,
    ):
        a3, b3, c3 = self._views(a, b, c)
        tma_a, ta, tma_b, tb, tma_c, tc = self._tma_atoms(a3, b3, c3)
        grid = TileGrid.of(self._work_shape(c3), self.tile_mn, self.cluster_mn)
        k_tiles = (a3.shape[1] + self.cfg.tile_k - 1) // self.cfg.tile_k

        @cute.struct
        class SharedStorage:
            load_bars: cute.struct.MemRange[Int64, 2 * self.stages]
            ring_bars: cute.struct.MemRange[Int64, self.ring_words[0]]
            ring_slots: cute.struct.Align[cute.struct.MemRange[Int32, self.ring_words[1]], 16]
            arrivals: cute.struct.MemRange[Int32, 1]
            turn_bars: cute.struct.MemRange[Int64, _TURN_SECTIONS * _TURN_GROUPS if self.pingpong else 0]
            sA: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem)], _SMEM_ALIGN]
            sB: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem)], _SMEM_ALIGN]
            sC: cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(self.c_smem)], _SMEM_ALIGN]

        self.shared_storage = SharedStorage
        self.kernel(
            tma_a, ta, tma_b, tb, tma_c, tc, self.tiled_mma, self.a_smem, self.b_smem, self.c_smem, sched_buf,
            self._trace_buf,
        ).launch(
            grid=self.sched.grid_shape(grid, max_clusters, k_tiles),
            block=[self.threads, 1, 1],
            cluster=(*self.cluster_mn, 1),
            min_blocks_per_mp=1,
            stream=stream,
            use_pdl=self.cfg.pdl,
        )

    @cute.jit
    def traced(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, sched_buf: cute.Tensor,
               max_clusters: Int32, trace_buf: cute.Tensor, stream):
        """The launch of `__call__` with every tile's record written to
        `trace_buf` (the trace build flag; `kernels.trace`)."""
        self._trace_buf = trace_buf
        self.__call__(a, b, c, sched_buf, max_clusters, stream)

    def _work_shape(self, c3: cute.Tensor) -> tuple:
        """(M, N, batches) the scheduler walks: K slices are batches of one output."""
        return (c3.shape[0], c3.shape[1], self.split_k)

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_c: cute.CopyAtom,
        mC: cute.Tensor,
        tiled_mma: cute.TiledMma,
        a_smem: cute.ComposedLayout,
        b_smem: cute.ComposedLayout,
        c_smem: cute.ComposedLayout,
        sched_buf: cute.Tensor,
        trace_buf: cute.Tensor | None,
    ):
        tidx, _, _ = cute.arch.thread_idx()
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        self._prefetch_descriptors(warp_idx, (tma_a, tma_b, tma_c))

        (cluster_layout, cluster_coord, a_mask, b_mask, storage, load_pipe, ring, turns,
         sA, sB, sC) = self._cta_start(a_smem, b_smem, c_smem)

        # (bM, bK, tiles_m, tiles_k, l) and friends
        gA = cute.local_tile(mA, cute.slice_(self.tile_mnk, (None, 0, None)), (None, None, None))
        gB = cute.local_tile(mB, cute.slice_(self.tile_mnk, (0, None, None)), (None, None, None))
        gC = cute.local_tile(mC, cute.slice_(self.tile_mnk, (None, None, 0)), (None, None, None))
        k_tiles = cute.size(gA, mode=[3])
        grid = TileGrid.of(self._work_shape(mC), self.tile_mn, self.cluster_mn)

        tAsA, tAgA = cute.nvgpu.cpasync.tma_partition(
            tma_a,
            cluster_coord[1],
            cute.make_layout(cute.slice_(cluster_layout, (0, None, 0)).shape),
            cute.group_modes(sA, 0, 2),
            cute.group_modes(gA, 0, 2),
        )
        tBsB, tBgB = cute.nvgpu.cpasync.tma_partition(
            tma_b,
            cluster_coord[0],
            cute.make_layout(cute.slice_(cluster_layout, (None, 0, 0)).shape),
            cute.group_modes(sB, 0, 2),
            cute.group_modes(gB, 0, 2),
        )

        group_idx = cute.arch.make_warp_uniform(tidx // _THREADS_PER_GROUP)
        pipeline_init_wait(cluster_shape_mn=self.cluster_mn)
        trace = None
        if const_expr(trace_buf is not None):
            trace = TileTrace.create(trace_buf, grid, self.cluster_mn)

        if group_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == _LOAD_WARP:
                sched = TileScheduler.create(self.sched, grid, ring, k_tiles)
                work = sched.initial_work()
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                # k-blocks of the first tile whose weight is already requested.
                head = Int32(0)
                if const_expr(self.cfg.pdl):
                    head = self._prefetch_weight(work, load_pipe, state, k_tiles, tma_a, tAgA, tAsA, a_mask,
                                                 tma_b, tBgB, tBsB, b_mask)
                while work.is_valid:
                    m, n, l = work.tile
                    k_start, k_count = work.k_range(k_tiles)
                    state = self._load_tile(
                        sched, load_pipe, state, k_start, k_count, tma_a, tAgA[(None, m, None, l)], tAsA, a_mask,
                        tma_b, tBgB[(None, n, None, l)], tBsB, b_mask, head,
                    )
                    head = Int32(0)
                    work = sched.advance()
                if const_expr(self.cfg.pdl):
                    # Every load is issued: a dependent grid may start its own prologue.
                    cute.arch.griddepcontrol_launch_dependents()
                load_pipe.producer_tail(state)
            if warp_idx == _SCHED_WARP:
                if const_expr(self.cfg.pdl):
                    # The claim counters are the previous kernel's until it is done.
                    cute.arch.griddepcontrol_wait()
                TileScheduler.create(self.sched, grid, ring, k_tiles).serve_claims(sched_buf, trace)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            if const_expr(self.cfg.pdl):
                # The output, the split-K scratch: both may still be the
                # previous kernel's to read or write.
                cute.arch.griddepcontrol_wait()
            if const_expr(self.pingpong):
                self._consume_pingpong(
                    tiled_mma, load_pipe, turns, sA, sB, sC, gC, tma_c, k_tiles, tidx, warp_idx, group_idx,
                    TileScheduler.create(self.sched, grid, ring), trace,
                )
            else:
                self._consume(
                    tiled_mma, load_pipe, sA, sB, sC, gC, tma_c, k_tiles, tidx, warp_idx, group_idx,
                    TileScheduler.create(self.sched, grid, ring, k_tiles),
                    sched_buf, storage.arrivals.get_tensor(cute.make_layout(1)), trace,
                )

    @cute.jit
    def _consume(
        self, tiled_mma, load_pipe, sA, sB, sC, gC, tma_c, k_tiles, tidx, warp_idx, group_idx, sched,
        sched_buf, arrivals, trace=None,
    ):
        """Consumer warpgroups: WGMMA over the ring, the split-K fixup, the TMA-store epilogue."""
        mma_tidx = tidx - _THREADS_PER_GROUP
        thr_mma = tiled_mma.get_slice(
            cute.make_layout(self.mma_groups, stride=_THREADS_PER_GROUP)(group_idx - 1)
        )
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gC).shape[:3], cutlass.Float32)

        epi = self._epilogue(tiled_mma, sC, acc, mma_tidx, warp_idx)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        subtiles_done = Int32(0)
        scratch = None
        if const_expr(self.cfg.reduces_partials):
            scratch = PartialScratch.create(sched_buf, arrivals, sched.grid, self.cluster_mn)

        work = sched.initial_work()
        while work.is_valid:
            m, n, l = work.tile
            if const_expr(trace is not None):
                start = trace_now()
            _, k_count = work.k_range(k_tiles)
            read, release = self._mma_tile(tiled_mma, load_pipe, tCrA, tCrB, acc, k_count, read, release)
            if const_expr(self.split_k > 1):
                slots = SliceSlots(scratch.tile_id(m, n), self.split_k)
                if self._reduce_partials(scratch, acc, scratch.tile_id(m, n), Int32(self.split_k), l,
                                         slots, mma_tidx, epi.bar):
                    subtiles_done = self._store_tile(epi, acc, tma_c, gC[(None, None, m, n, 0)], subtiles_done)
            elif const_expr(self.sched.stream_k):
                whole = work.k_tiles == k_tiles
                if not whole:
                    slots = UnitSlots(sched, work.unit_tile, self.cluster_mn)
                    whole = self._reduce_partials(scratch, acc, scratch.tile_id(m, n), work.count, work.slice,
                                                  slots, mma_tidx, epi.bar)
                if whole:
                    subtiles_done = self._store_tile(epi, acc, tma_c, gC[(None, None, m, n, l)], subtiles_done)
            else:
                subtiles_done = self._store_tile(epi, acc, tma_c, gC[(None, None, m, n, l)], subtiles_done)
            if const_expr(trace is not None):
                if mma_tidx == 0:
                    trace.record(work.tile, start, trace_now())
            work = sched.advance()
        epi.store_pipe.producer_tail()

    @cute.jit
    def _consume_pingpong(
        self, tiled_mma, load_pipe, turns, sA, sB, sC, gC, tma_c, k_tiles, tidx, warp_idx, group_idx, sched,
        trace=None,
    ):
        """One pingpong consumer warpgroup: every other tile of the CTA's schedule, whole.

        A warpgroup takes two turns per tile on `turns` (a `pipeline.PipelineOrder`,
        CUTLASS's ordered sequence barrier), each after the other warpgroup's
        same turn: its mainloop, so that it waits on ring stages only once the
        other has taken all of its own (a full barrier's parity tells apart
        only two passes of the ring), and its epilogue, since the two share
        the staging buffers. The mainloop turn passes on once its WGMMAs are
        issued, the epilogue turn once its TMA stores have read the buffers.
        """
        turn = group_idx - 1
        mma_tidx = tidx % _THREADS_PER_GROUP
        thr_mma = tiled_mma.get_slice(0)
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(gC).shape[:3], cutlass.Float32)

        epi = self._epilogue(tiled_mma, sC, acc, mma_tidx, warp_idx, turn)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        order = turns.state.clone()
        store_pipe, store_warp = epi.store_pipe, epi.store_warp
        subtiles_done = Int32(0)
        # Every tile has the same k-blocks: the other warpgroup's tile is a
        # fixed stretch of the ring to step over.
        skip = Int32(k_tiles)

        work = sched.initial_work()
        if turn == 1:
            work = sched.advance()
            read.advance(skip)
            release.advance(skip)
        while work.is_valid:
            m, n, l = work.tile
            turns.wait(order)
            if const_expr(trace is not None):
                start = trace_now()
            read, release = self._mma_issue(tiled_mma, load_pipe, tCrA, tCrB, acc, k_tiles, read, release)
            order = turns.arrive(order)
            release = self._mma_drain(load_pipe, k_tiles, release)
            turns.wait(order)
            subtiles_done = self._store_tile(epi, acc, tma_c, gC[(None, None, m, n, l)], subtiles_done)
            if store_warp:
                store_pipe.producer_tail()
            # Every thread arrives: the turn passes after the store warp's wait.
            order = turns.arrive(order)
            if const_expr(trace is not None):
                if mma_tidx == 0:
                    trace.record(work.tile, start, trace_now())
            work = sched.advance()
            if work.is_valid:
                work = sched.advance()
            read.advance(skip)
            release.advance(skip)
        store_pipe.producer_tail()

    @cute.jit
    def _reduce_partials(self, scratch: PartialScratch, acc, tile_id, count, me, slots, mma_tidx, bar) -> Boolean:
        """Fixup of one tile shared by contributors 0 .. count-1 (K slices of
        split-K or of stream-K), this CTA being `me`: whether `acc` now holds the
        whole sum. `slots(i)` is contributor i's partial slot.

        Each contributor parks its partial and arrives on the tile's
        semaphore; only the last arrival reads the others (in a thread-major
        order that makes every access coalesced) and resets the semaphore for
        the next launch. Nobody waits on anybody, so no co-residency is assumed.
        """
        values = cute.size(acc)
        own = scratch.partial(slots(me), values, self.mma_threads)
        for i in cutlass.range_constexpr(values):
            own[i, mma_tidx] = acc[i]
        last = scratch.arrive(tile_id, count, mma_tidx, bar)
        if last:
            for c in cutlass.range(count):
                if c != me:
                    other = scratch.partial(slots(c), values, self.mma_threads)
                    for i in cutlass.range_constexpr(values):
                        acc[i] = acc[i] + other[i, mma_tidx]
        return last

    # ------------------------------------------------------------------ pieces shared with the grouped kernels

    @cute.jit
    def _prefetch_descriptors(self, warp_idx, atoms) -> None:
        """The load warp pulls the TMA descriptors of `atoms` into cache before their first use."""
        if warp_idx == _LOAD_WARP:
            for atom in atoms:
                cute.nvgpu.cpasync.prefetch_descriptor(atom)

    def _cta_start(self, a_smem, b_smem, c_smem) -> tuple:
        """What every sm90 kernel of the pool sets up first: the CTA's place in
        its cluster and multicast masks, shared storage, the load pipeline and
        the scheduler ring, and the A, B and C staging tensors."""
        cluster_layout = cute.make_layout((*self.cluster_mn, 1))
        rank = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        cluster_coord = cluster_layout.get_flat_coord(rank)
        # A is shared by the CTAs of a cluster row (same m), B by a column.
        a_mask = cute.make_layout_image_mask(cluster_layout, cluster_coord, mode=1) if self.a_mcast > 1 else 0
        b_mask = cute.make_layout_image_mask(cluster_layout, cluster_coord, mode=0) if self.b_mcast > 1 else 0

        smem = SmemAllocator()
        storage = smem.allocate(self.shared_storage)
        load_pipe, ring, turns = self._pipelines(storage, cluster_layout)
        pipeline_init_arrive(cluster_shape_mn=self.cluster_mn, is_relaxed=True)

        sA = storage.sA.get_tensor(a_smem.outer, swizzle=a_smem.inner)
        sB = storage.sB.get_tensor(b_smem.outer, swizzle=b_smem.inner)
        sC = storage.sC.get_tensor(c_smem.outer, swizzle=c_smem.inner)
        return cluster_layout, cluster_coord, a_mask, b_mask, storage, load_pipe, ring, turns, sA, sB, sC

    def _pipelines(self, storage, cluster_layout):
        """(TMA load pipeline, claim ring or None, pingpong turns or None); barrier
        init is deferred to the cluster sync."""
        # Every warp of the tile's consumers releases a stage once per CTA that filled it.
        releases = (self.a_mcast + self.b_mcast - 1) * self.tile_groups * _WARPS_PER_GROUP
        load_pipe = pipeline.PipelineTmaAsync.create(
            barrier_storage=storage.load_bars.data_ptr(),
            num_stages=self.stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, releases),
            tx_count=self.stage_bytes,
            cta_layout_vmnk=cute.make_layout((1, *cluster_layout.shape)),
            defer_sync=True,
        )
        ring = None
        if const_expr(self.sched.dynamic):
            ring = ClaimRing.create(
                self.sched, storage.ring_bars.data_ptr(), storage.ring_slots.data_ptr(), self.ring_consumer_warps
            )
        turns = None
        if const_expr(self.pingpong):
            tidx, _, _ = cute.arch.thread_idx()
            turns = pipeline.PipelineOrder.create(
                barrier_storage=storage.turn_bars.data_ptr(),
                depth=_TURN_SECTIONS,
                length=_TURN_GROUPS,
                # The consumer warpgroup's place in the turns (the producer's is unused).
                group_id=cute.arch.make_warp_uniform(tidx // _THREADS_PER_GROUP) - 1,
                producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, _THREADS_PER_GROUP),
                defer_sync=True,
            )
        return load_pipe, ring, turns

    @cute.jit
    def _load_tile(self, sched, load_pipe, state, k_start, k_tiles, tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB,
                   b_mask, head=None):
        """The load warp's share of one tile: its k-blocks k_start .. k_start +
        k_tiles - 1 of A and B into the ring, between the two claim requests
        of `sched`; returns the ring state the next tile continues from.
        With pdl, the first `head` stages hold their weight already
        (`_prefetch_weight`): only the activations are still to load."""
        sched.request_next(True)
        for kt in range(k_start, k_start + k_tiles):
            bar = load_pipe.producer_get_barrier(state)
            operands = (tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB, b_mask, kt, state.index, bar)
            if const_expr(self.cfg.pdl):
                if kt - k_start >= head:
                    load_pipe.producer_acquire(state)
                    self._copy_operand(self.weight_operand, *operands)
                self._copy_operand(self.activation_operand, *operands)
            else:
                load_pipe.producer_acquire(state)
                self._copy_operand("a", *operands)
                self._copy_operand("b", *operands)
            load_pipe.producer_commit(state)
            state.advance()
        sched.request_next(False)
        return state

    @cute.jit
    def _prefetch_weight(self, work, load_pipe, state, k_tiles, tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB,
                         b_mask) -> Int32:
        """pdl: the weight's share of the first tile's first stages is
        requested before the wait on the previous kernel (CUTLASS example 63's
        weight prefetch), whose output only the activations can be. Returns
        how many k-blocks that covered; `state` is left where it was."""
        head = Int32(0)
        if work.is_valid:
            m, n, l = work.tile
            k_start, k_count = work.k_range(k_tiles)
            head = cutlass.min(k_count, Int32(self.stages))
            ahead = state.clone()
            for kt in range(k_start, k_start + head):
                load_pipe.producer_acquire(ahead)
                self._copy_operand(self.weight_operand, tma_a, tAgA[(None, m, None, l)], tAsA, a_mask,
                                   tma_b, tBgB[(None, n, None, l)], tBsB, b_mask, kt, ahead.index,
                                   load_pipe.producer_get_barrier(ahead))
                ahead.advance()
        cute.arch.griddepcontrol_wait()
        return head

    @cute.jit
    def _copy_operand(self, operand: cutlass.Constexpr, tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB, b_mask, kt,
                      index, bar) -> None:
        """k-block `kt` of the kernel's A (`operand` "a") or B ("b") into ring stage `index`."""
        if const_expr(operand == "a"):
            cute.copy(tma_a, tAgA[(None, kt)], tAsA[(None, index)], tma_bar_ptr=bar, mcast_mask=a_mask,
                      **self._hint(self.a_policy))
        else:
            cute.copy(tma_b, tBgB[(None, kt)], tBsB[(None, index)], tma_bar_ptr=bar, mcast_mask=b_mask,
                      **self._hint(self.b_policy))

    @staticmethod
    def _hint(policy: int | None) -> dict:
        return {} if policy is None else {"cache_policy": Int64(policy)}

    @cute.jit
    def _mma_tile(self, tiled_mma, load_pipe, tCrA, tCrB, acc, k_tiles, read, release):
        """acc = the tile's product over `k_tiles` k-blocks of the ring; returns the advanced states."""
        read, release = self._mma_issue(tiled_mma, load_pipe, tCrA, tCrB, acc, k_tiles, read, release)
        return read, self._mma_drain(load_pipe, k_tiles, release)

    @cute.jit
    def _mma_issue(self, tiled_mma, load_pipe, tCrA, tCrB, acc, k_tiles, read, release):
        """Issue the WGMMAs of acc = the tile's product over `k_tiles` k-blocks
        of the ring, the last k-block's still in flight (`_mma_drain` waits);
        returns the advanced states."""
        k_blocks = cute.size(tCrA, mode=[2])
        acc.fill(0.0)
        tiled_mma.set(cute.nvgpu.warpgroup.Field.ACCUMULATE, True)
        cute.nvgpu.warpgroup.fence()
        # Keep one k-tile of WGMMA in flight: release a stage only once
        # the WGMMAs after it were issued.
        for kt in range(k_tiles):
            load_pipe.consumer_wait(read)
            for kb in cutlass.range_constexpr(k_blocks):
                coord = (None, None, kb, read.index)
                cute.gemm(tiled_mma, acc, tCrA[coord], tCrB[coord], acc)
            cute.nvgpu.warpgroup.commit_group()
            read.advance()
            if kt > 0:
                cute.nvgpu.warpgroup.wait_group(1)
                load_pipe.consumer_release(release)
                release.advance()
        return read, release

    @cute.jit
    def _mma_drain(self, load_pipe, k_tiles, release):
        """Wait for the tile's last WGMMAs and release their stage; returns the advanced state."""
        cute.nvgpu.warpgroup.wait_group(0)
        if k_tiles > 0:
            load_pipe.consumer_release(release)
            release.advance()
        return release

    def _epilogue(self, tiled_mma, sC, acc, mma_tidx, warp_idx, turn=0) -> "_Epilogue":
        """The registers -> smem -> TMA-store machinery of one consumer thread
        (of pingpong warpgroup `turn`: each has its own barrier and store warp)."""
        e = _Epilogue()
        # registers -> smem copy of one epilogue sub-tile
        r2s_atom = sm90_utils.sm90_get_smem_store_op(self.c_layout, elem_ty_d=self.c_dtype, elem_ty_acc=cutlass.Float32)
        # x4 stores 16 columns a warp, x2 eight (sub-tiles of tile_n 72, 168, ...).
        matrices = 4 if self.epi_tile[1] % 16 == 0 else 2
        stmatrix = cute.make_copy_atom(
            cute.nvgpu.warp.StMatrix8x8x16bOp(self.c_layout.is_m_major_c(), matrices), self.c_dtype
        )
        if matrices == 2 and self.c_dtype.width == 16:
            r2s_atom = stmatrix
        e.r2s = cute.make_tiled_copy_S(r2s_atom, cute.make_tiled_copy_C_atom(stmatrix, tiled_mma))
        thr_r2s = e.r2s.get_slice(mma_tidx)
        e.sC = sC
        e.tRS_sC = thr_r2s.partition_D(sC)
        e.tRS_acc = e.r2s.retile(acc)
        sub_shape = cute.shape(thr_r2s.partition_S(sC))[:3]
        e.sub_acc = cute.make_rmem_tensor(sub_shape, cutlass.Float32)
        e.sub_out = cute.make_rmem_tensor(sub_shape, self.c_dtype)
        # tRS_acc is ((values of one 64-row block, column chunks), row blocks);
        # a sub-tile takes `sub_chunks` chunks of every row block.
        e.chunk_vals = cute.size(e.sub_acc, mode=[0])
        e.row_blocks = cute.size(e.sub_acc, mode=[1])
        e.sub_chunks = cute.size(e.sub_acc, mode=[2])
        e.block_vals = cute.size(e.tRS_acc, mode=[0])
        e.bar = pipeline.NamedBarrier(barrier_id=_EPILOGUE_BARRIER_ID + turn, num_threads=self.mma_threads)
        e.store_pipe = pipeline.PipelineTmaStore.create(
            num_stages=self.epi_stages,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, self.mma_threads),
        )
        e.store_warp = warp_idx == _WARPS_PER_GROUP * (1 + turn)
        return e

    @cute.jit
    def _store_tile(self, e: "_Epilogue", acc, tma_c, gC_tile, subtiles_done):
        """Store the (tile_m, tile_n) tile `gC_tile` by TMA; returns the sub-tiles stored so far."""
        tiles = cute.zipped_divide(gC_tile, self.epi_tile)
        bSG_sC, bSG_gC = cute.nvgpu.cpasync.tma_partition(
            tma_c, 0, cute.make_layout(1), cute.group_modes(e.sC, 0, 2), tiles
        )
        subtiles = cute.size(tiles, mode=[1])
        store_pipe, store_warp = e.store_pipe, e.store_warp
        for sub in cutlass.range_constexpr(subtiles):
            buf = (subtiles_done + sub) % self.epi_stages
            self._stage_subtile(e, sub, buf)
            # Generic-proxy smem writes must be visible to the TMA store.
            cute.arch.fence_proxy("async.shared", space="cta")
            e.bar.arrive_and_wait()
            if store_warp:
                cute.copy(tma_c, bSG_sC[(None, buf)], bSG_gC[(None, (0, sub))])
                store_pipe.producer_commit()
                store_pipe.producer_acquire()
            e.bar.arrive_and_wait()
        return subtiles_done + subtiles

    @cute.jit
    def _stage_subtile(self, e: "_Epilogue", sub: int, buf):
        """Accumulator columns of epilogue sub-tile `sub`, in the output dtype, into smem buffer `buf`."""
        for i in cutlass.range_constexpr(cute.size(e.sub_acc)):
            v, rest = i % e.chunk_vals, i // e.chunk_vals
            block, chunk = rest % e.row_blocks, sub * e.sub_chunks + rest // e.row_blocks
            e.sub_acc[i] = e.tRS_acc[v + e.chunk_vals * chunk + e.block_vals * block]
        e.sub_out.store(e.sub_acc.load().to(self.c_dtype))
        cute.copy(e.r2s, e.sub_out, e.tRS_sC[(None, None, None, buf)])


def _load_policies(cfg: GemmConfig) -> tuple[int | None, int | None]:
    """L2 policies of the kernel's A and B loads (None: the default) from
    `cfg.l2_hint`, which names the caller's operands: with swap_ab the
    caller's b, the weight, is the kernel's A."""
    weight = _L2_EVICT_FIRST if cfg.l2_hint == "b_first" else None
    return (weight, None) if cfg.swap_ab else (None, weight)


class _Epilogue:
    """Per-thread epilogue state built once by `Sm90GemmKernel._epilogue`."""
