"""Blackwell (sm100) tcgen05 GEMM with a pluggable tile scheduler.

C (M, N) = A (M, K) @ B, A K-major, B either (N, K) K-major ("tn") or
(K, N) N-major ("nn"), bf16/fp16 in, fp32 accumulation in tensor memory.

Warp roles per CTA: four epilogue warps (TMEM -> registers -> smem -> TMA
store), one MMA warp (tcgen05.mma, issued by the leader CTA of an MMA pair
when cta_group == 2), one TMA load warp (A and B multicast across the
cluster), and for the dynamic schedulers and stream-K one scheduler warp
that claims the next tile (atomic counter or CLC) and broadcasts it
through an smem ring.

With acc_stages == 2 the accumulator is double-buffered in TMEM so the
epilogue of one tile overlaps the mainloop of the next.

Stream-K: the load and MMA warps walk each unit's k-blocks, and the
epilogue warps reduce the tiles that units share in the kernel
(`kernels.partials`): a unit short of its tile's K parks its partial,
read from TMEM, in the scratch `sched_buf` and counts itself on the tile's
semaphore; the last to arrive adds the others' partials to its own,
subtile by subtile, and runs the epilogue, the others store nothing.
Each CTA of a 2-CTA MMA pair reduces its own half of the tile, in its own
TMEM, so the pair needs no agreement beyond the unit it shares.
"""

from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import SmemAllocator, TmemAllocator, get_num_tmem_alloc_cols
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.tensor_utils import LayoutEnum
from cutlass.utils.gemm.sm100 import (
    epilogue_smem_copy_and_partition,
    epilogue_tmem_copy_and_partition,
    transform_partitioned_tensor_layout,
)

from kernels import space
from kernels.partials import PartialScratch, UnitSlots
from kernels.schedulers import ClaimRing, SchedulerSpec, TileGrid, TileScheduler
from kernels.sm100 import clc
from kernels.space import GemmConfig, InvalidConfig
from kernels.trace_device import TileTrace
from kernels.trace_device import now as trace_now

# Epilogue staging buffers in smem: one being filled while the previous one's
# TMA store drains.
_C_STAGES = 2


class Sm100GemmKernel:
    """One kernel variant of the sm100 pool; `cfg` fixes everything but the sizes.

    ``__call__(a, b, out, sched_buf, max_clusters, stream, rows=None)`` takes
    2-D row-major A (M, K), B ((N, K) for "tn", (K, N) for "nn") and `out`
    (M, N) or, with split-K, the fp32 workspace (S, M, N): each K slice is
    one batch of the tile walk and the caller sums the slices. `sched_buf` is
    the int32[2] buffer of the atomic scheduler (unused by the others) and
    `max_clusters` the clusters the device runs at once (a runtime value, so
    an SM carve-out needs no recompile). With stream-K `sched_buf` is the
    scratch laid out by `kernels.space.split_k_scratch_words` instead.
    `rows`, an optional device int32[1], makes the launch a padded one: A and
    `out` are worst-case buffers of which only the first rows[0] rows are
    real. The grid still covers the whole buffer (as a CUDA graph needs) and
    tiles past the real work are phantoms the schedulers skip (clc with
    tail_cancel drains them).
    """

    def __init__(self, cfg: GemmConfig, layout: str = "tn"):
        self.can_implement(cfg, layout)
        # Set only while `traced` builds the launch (kernels.trace).
        self._trace_buf = None
        self.cfg = cfg
        self.layout = layout
        self.acc_dtype = cutlass.Float32
        self.sched = clc.ClcSpec.from_config(cfg) if cfg.scheduler == "clc" else SchedulerSpec.from_config(cfg)
        self.ring_words = (
            clc.storage_words(self.sched) if cfg.scheduler == "clc" else ClaimRing.storage_words(self.sched)
        )
        self.use_2cta_instrs = cfg.cta_group == 2
        self.cta_group = tcgen05.CtaGroup.TWO if self.use_2cta_instrs else tcgen05.CtaGroup.ONE
        self.cluster_shape_mn = (cfg.cluster_m, cfg.cluster_n)
        self.mma_tiler_mn = (cfg.tile_m, cfg.tile_n)
        self.num_ab_stage = cfg.stages
        self.num_acc_stage = cfg.acc_stages
        self.num_c_stage = _C_STAGES

        self.epilogue_warp_id = (0, 1, 2, 3)
        self.mma_warp_id = 4
        self.tma_warp_id = 5
        self.sched_warp_id = 6
        # Stream-K claims its work as the atomic scheduler does.
        self.has_sched_warp = cfg.dynamic or cfg.stream_k
        # Warps that walk the schedule and so read every published tile.
        self.ring_consumer_warps = 6
        self.threads_per_cta = 32 * (self.ring_consumer_warps + int(self.has_sched_warp))
        # Named barrier ids (0 is __syncthreads).
        self.epilog_sync_bar_id = 1
        self.tmem_alloc_sync_bar_id = 2

    @staticmethod
    def can_implement(cfg: GemmConfig, layout: str = "tn") -> None:
        """Raise InvalidConfig unless this class builds `cfg` (the config space decides the rest)."""
        if cfg.arch != "sm100":
            raise InvalidConfig(f"{cfg.arch} config given to the sm100 kernel")
        if layout not in space.LAYOUTS:
            raise InvalidConfig(f"unknown layout {layout!r}")

    # ------------------------------------------------------------------ host

    def _views(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor):
        """(m, k, l), (n, k, l) and (m, n, l) views of the operands; l is the K slice."""
        return operand_views(a, b, c, self.layout, self.cfg.split_k)

    def _setup(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor):
        self.a_dtype = a.element_type
        self.b_dtype = b.element_type
        self.c_dtype = c.element_type
        if cutlass.const_expr(self.a_dtype != self.b_dtype):
            raise TypeError(f"A and B must share a dtype: {self.a_dtype} != {self.b_dtype}")
        self.a_major_mode = LayoutEnum.from_tensor(a).mma_major_mode()
        self.b_major_mode = LayoutEnum.from_tensor(b).mma_major_mode()
        self.c_layout = LayoutEnum.from_tensor(c)

        tiled_mma = sm100_utils.make_trivial_tiled_mma(
            self.a_dtype, self.a_major_mode, self.b_major_mode, self.acc_dtype,
            self.cta_group, self.mma_tiler_mn,
        )
        mma_k = cute.size(tiled_mma.shape_mnk, mode=[2])
        # Four MMA instructions per k-block of 64 16-bit elements, one 128-byte swizzle row.
        self.mma_tiler = (*self.mma_tiler_mn, mma_k * (self.cfg.tile_k // mma_k))
        self.cta_tile_shape_mnk = (
            self.mma_tiler[0] // cute.size(tiled_mma.thr_id.shape),
            self.mma_tiler[1],
            self.mma_tiler[2],
        )
        self.cluster_layout_vmnk = cute.tiled_divide(
            cute.make_layout((*self.cluster_shape_mn, 1)), (tiled_mma.thr_id.shape,)
        )
        self.num_mcast_ctas_a = cute.size(self.cluster_layout_vmnk.shape[2])
        self.num_mcast_ctas_b = cute.size(self.cluster_layout_vmnk.shape[1])
        self.is_a_mcast = self.num_mcast_ctas_a > 1
        self.is_b_mcast = self.num_mcast_ctas_b > 1

        self.epi_tile = sm100_utils.compute_epilogue_tile_shape(
            self.cta_tile_shape_mnk, self.use_2cta_instrs, self.c_layout, self.c_dtype
        )
        self.a_smem_layout_staged = sm100_utils.make_smem_layout_a(
            tiled_mma, self.mma_tiler, self.a_dtype, self.num_ab_stage
        )
        self.b_smem_layout_staged = sm100_utils.make_smem_layout_b(
            tiled_mma, self.mma_tiler, self.b_dtype, self.num_ab_stage
        )
        self.c_smem_layout_staged = sm100_utils.make_smem_layout_epi(
            self.c_dtype, self.c_layout, self.epi_tile, self.num_c_stage
        )
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        acc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage))
        self.num_tmem_alloc_cols = get_num_tmem_alloc_cols(acc_fake, arch="sm_100")
        self.shared_storage = self._shared_storage()
        return tiled_mma

    def _shared_storage(self):
        n_ring_bars, n_ring_words = self.ring_words

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.num_ab_stage * 2]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, self.num_acc_stage * 2]
            tmem_dealloc_mbar: cutlass.Int64
            tmem_holding_buf: cutlass.Int32
            ring_bars: cute.struct.MemRange[cutlass.Int64, n_ring_bars]
            ring_slots: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, n_ring_words], 16]
            # Stream-K: a unit's arrival count, from the thread that counted to the others.
            arrivals: cute.struct.MemRange[cutlass.Int32, 1 if self.sched.stream_k else 0]
            sC: cute.struct.Align[
                cute.struct.MemRange[self.c_dtype, cute.cosize(self.c_smem_layout_staged.outer)], 1024
            ]
            sA: cute.struct.Align[
                cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem_layout_staged.outer)], 1024
            ]
            sB: cute.struct.Align[
                cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem_layout_staged.outer)], 1024
            ]

        return SharedStorage

    @cute.jit
    def __call__(
        self,
        a: cute.Tensor,
        b: cute.Tensor,
        c: cute.Tensor,
        sched_buf: cute.Tensor,
        max_clusters: cutlass.Int32,
        stream,
        rows: Optional[cute.Tensor] = None,
    ):
        a, b, c = self._views(a, b, c)
        tiled_mma = self._setup(a, b, c)
        tma_atom_a, tma_tensor_a, tma_atom_b, tma_tensor_b = self._tma_loads(a, b, tiled_mma)

        epi_smem_layout = cute.select(self.c_smem_layout_staged, mode=[0, 1])
        tma_atom_c, tma_tensor_c = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), c, epi_smem_layout, self.epi_tile
        )

        # The launch covers the whole (possibly padded) output buffer.
        tiles = TileGrid.of(c.shape, self.cta_tile_shape_mnk[:2], self.cluster_shape_mn)
        # Stream-K sizes its grid by the k-blocks there are to share.
        k_tiles = (a.shape[1] + self.mma_tiler[2] - 1) // self.mma_tiler[2]

        self.kernel(
            tiled_mma, tma_atom_a, tma_tensor_a, tma_atom_b, tma_tensor_b, tma_atom_c, tma_tensor_c,
            self.cluster_layout_vmnk, self.a_smem_layout_staged, self.b_smem_layout_staged,
            self.c_smem_layout_staged, self.epi_tile, sched_buf, rows, self._trace_buf,
        ).launch(
            grid=self.sched.grid_shape(tiles, max_clusters, k_tiles),
            block=[self.threads_per_cta, 1, 1],
            cluster=(*self.cluster_shape_mn, 1),
            smem=self.shared_storage.size_in_bytes(),
            stream=stream,
        )

    @cute.jit
    def traced(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, sched_buf: cute.Tensor,
               max_clusters: cutlass.Int32, trace_buf: cute.Tensor, stream):
        """The launch of `__call__` with every tile's record written to
        `trace_buf` (the trace build flag; `kernels.trace`)."""
        self._trace_buf = trace_buf
        self.__call__(a, b, c, sched_buf, max_clusters, stream)

    # ---------------------------------------------------------------- device

    @cute.kernel
    def kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA_mkl: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_nkl: cute.Tensor,
        tma_atom_c: cute.CopyAtom,
        mC_mnl: cute.Tensor,
        cluster_layout_vmnk: cute.Layout,
        a_smem_layout_staged: cute.ComposedLayout,
        b_smem_layout_staged: cute.ComposedLayout,
        c_smem_layout_staged: cute.ComposedLayout,
        epi_tile: cute.Tile,
        sched_buf: cute.Tensor,
        rows: Optional[cute.Tensor],
        trace_buf: Optional[cute.Tensor],
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.tma_warp_id:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)
            cpasync.prefetch_descriptor(tma_atom_c)

        use_2cta_instrs = cute.size(tiled_mma.thr_id.shape) == 2
        bidx, _, _ = cute.arch.block_idx()
        mma_tile_coord_v = bidx % cute.size(tiled_mma.thr_id.shape)
        is_leader_cta = mma_tile_coord_v == 0
        cta_rank_in_cluster = cute.arch.make_warp_uniform(cute.arch.block_idx_in_cluster())
        block_in_cluster_coord_vmnk = cluster_layout_vmnk.get_flat_coord(cta_rank_in_cluster)
        tidx, _, _ = cute.arch.thread_idx()

        storage = SmemAllocator().allocate(self.shared_storage)

        ab_producer, ab_consumer, acc_pipeline, ring, tmem = self._cta_start(
            storage, cluster_layout_vmnk, use_2cta_instrs
        )

        sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
        sC = storage.sC.get_tensor(c_smem_layout_staged.outer, swizzle=c_smem_layout_staged.inner)

        a_full_mcast_mask, b_full_mcast_mask = self._mcast_masks(
            cluster_layout_vmnk, block_in_cluster_coord_vmnk, use_2cta_instrs
        )

        # (bM, bK, RestM, RestK, RestL)
        gA_mkl = cute.local_tile(mA_mkl, cute.slice_(self.mma_tiler, (None, 0, None)), (None, None, None))
        # (bN, bK, RestN, RestK, RestL)
        gB_nkl = cute.local_tile(mB_nkl, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        # (bM, bN, RestM, RestN, RestL)
        gC_mnl = cute.local_tile(mC_mnl, cute.slice_(self.mma_tiler, (None, None, 0)), (None, None, None))
        k_tile_cnt = cute.size(gA_mkl, mode=[3])

        thr_mma = tiled_mma.get_slice(mma_tile_coord_v)
        tCgA = thr_mma.partition_A(gA_mkl)
        tCgB = thr_mma.partition_B(gB_nkl)
        tCgC = thr_mma.partition_C(gC_mnl)

        a_cta_layout = cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, 0, None, 0)).shape)
        tAsA, tAgA = cpasync.tma_partition(
            tma_atom_a, block_in_cluster_coord_vmnk[2], a_cta_layout,
            cute.group_modes(sA, 0, 3), cute.group_modes(tCgA, 0, 3),
        )
        b_cta_layout = cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, None, 0, 0)).shape)
        tBsB, tBgB = cpasync.tma_partition(
            tma_atom_b, block_in_cluster_coord_vmnk[1], b_cta_layout,
            cute.group_modes(sB, 0, 3), cute.group_modes(tCgB, 0, 3),
        )

        tCrA = tiled_mma.make_fragment_A(sA)
        tCrB = tiled_mma.make_fragment_B(sB)
        acc_shape = tiled_mma.partition_shape_C(self.mma_tiler[:2])
        tCtAcc_fake = tiled_mma.make_fragment_C(cute.append(acc_shape, self.num_acc_stage))

        # The real work: the first rows[0] rows of a padded buffer, else all of it.
        work_rows = mC_mnl.shape[0]
        if cutlass.const_expr(rows is not None):
            work_rows = rows[0]
        tiles = TileGrid.of(
            (work_rows, mC_mnl.shape[1], mC_mnl.shape[2]), self.cta_tile_shape_mnk[:2], self.cluster_shape_mn
        )

        pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)
        trace = None
        if cutlass.const_expr(trace_buf is not None):
            trace = TileTrace.create(trace_buf, tiles, self.cluster_shape_mn)

        # ---- TMA load warp
        if warp_idx == self.tma_warp_id:
            sched = self._scheduler(tiles, ring, k_tile_cnt)
            work = sched.initial_work()
            while work.is_valid:
                mma_m, mma_n, mma_l = self._mma_tile(work, tiled_mma)
                tAgA_slice = tAgA[(None, mma_m, None, mma_l)]
                tBgB_slice = tBgB[(None, mma_n, None, mma_l)]
                k_start, k_count = work.k_range(k_tile_cnt)
                ab_producer = self._load_tile(
                    sched, ab_producer, k_count, tma_atom_a, tAgA_slice, tAsA, a_full_mcast_mask,
                    tma_atom_b, tBgB_slice, tBsB, b_full_mcast_mask, k_start,
                )
                work = sched.advance()
            ab_producer.tail()

        # ---- scheduler warp: claims tiles for the whole cluster
        if cutlass.const_expr(self.has_sched_warp):
            if warp_idx == self.sched_warp_id:
                self._scheduler(tiles, ring, k_tile_cnt).serve_claims(sched_buf, trace)

        # ---- MMA warp
        if warp_idx == self.mma_warp_id:
            self._mma_role(
                tiles, ring, tmem, tCtAcc_fake, tiled_mma, ab_consumer, acc_pipeline, tCrA, tCrB, k_tile_cnt,
                is_leader_cta, trace,
            )

        # ---- epilogue warps
        if warp_idx < self.mma_warp_id:
            tmem.allocate(self.num_tmem_alloc_cols)
            tCtAcc_base = self._accumulators(tmem, tCtAcc_fake)
            acc_consumer_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.num_acc_stage
            )
            c_pipeline = pipeline.PipelineTmaStore.create(
                num_stages=self.num_c_stage,
                producer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, 32 * len(self.epilogue_warp_id)
                ),
            )
            epi = self._epilogue(tidx, tma_atom_c, tCtAcc_base, sC, tCgC, epi_tile)
            scratch = None
            if cutlass.const_expr(self.sched.stream_k):
                # Laid out for the whole (possibly padded) buffer, as the runner sizes it.
                scratch = PartialScratch.create(
                    sched_buf, storage.arrivals.get_tensor(cute.make_layout(1)),
                    TileGrid.of(mC_mnl.shape, self.cta_tile_shape_mnk[:2], self.cluster_shape_mn),
                    self.cluster_shape_mn,
                )
            subtiles_done = cutlass.Int32(0)
            sched = self._scheduler(tiles, ring, k_tile_cnt)
            work = sched.initial_work()
            while work.is_valid:
                tile = work.tile
                mma_tile_coord = self._mma_tile(work, tiled_mma)
                unit = None
                if cutlass.const_expr(self.sched.stream_k):
                    unit = _SharedUnit.of(work, sched, scratch, k_tile_cnt, self.cluster_shape_mn)
                # Take the next tile before the stores, so the scheduler's
                # ring slot frees as early as possible.
                work = sched.advance()
                acc_consumer_state, subtiles_done = self._store_tile(
                    epi, tidx, warp_idx, tma_atom_c, mma_tile_coord, acc_consumer_state, acc_pipeline,
                    c_pipeline, subtiles_done, unit,
                )
                if cutlass.const_expr(trace is not None):
                    # Thread 0's warp issues the TMA stores; the epilogue's
                    # last barrier is behind them.
                    if tidx == 0:
                        trace.record(tile, None, trace_now())
            c_pipeline.producer_tail()
            tmem.relinquish_alloc_permit()
            tmem.free(tCtAcc_base.iterator)

    def _epilogue(self, tidx, tma_atom_c, tCtAcc_base, sC, tCgC, epi_tile) -> "_Epilogue":
        """The TMEM -> registers -> smem -> TMA-store partitions of one epilogue
        thread: those `cutlass.utils.gemm.sm100.epilogue_tma_store` builds for
        every tile, built once; `_store_tile` is that function's loop with
        the stream-K fixup added."""
        # ((MMA_ATOM_M, MMA_M), (MMA_ATOM_N, MMA_N), ...) views of C and the accumulators
        tCgC_mn = transform_partitioned_tensor_layout(tCgC)
        t2r, tTR_tAcc, tTR_rAcc = epilogue_tmem_copy_and_partition(
            self, tidx, transform_partitioned_tensor_layout(tCtAcc_base), tCgC_mn, epi_tile, self.use_2cta_instrs
        )
        tTR_rC = cute.make_rmem_tensor(tTR_rAcc.shape, self.c_dtype)
        r2s, tRS_rC, tRS_sC = epilogue_smem_copy_and_partition(self, t2r, tTR_rC, tidx, sC)
        bSG_sC, bSG_gC = cpasync.tma_partition(
            tma_atom_c, 0, cute.make_layout(1), cute.group_modes(sC, 0, 2),
            cute.group_modes(cute.flat_divide(tCgC_mn, epi_tile), 0, 2),
        )
        threads = 32 * len(self.epilogue_warp_id)
        if cutlass.const_expr(self.sched.stream_k):
            # A partial slot holds one CTA tile (`kernels.space.split_k_scratch_words`):
            # the epilogue threads' values must cover it once, or slots would overlap.
            parked = cute.size(tTR_rAcc) * cute.size(tTR_tAcc, mode=[3]) * cute.size(tTR_tAcc, mode=[4]) * threads
            if parked != self.cta_tile_shape_mnk[0] * self.cta_tile_shape_mnk[1]:
                raise InvalidConfig(f"stream-K partial of {parked} values for a {self.cta_tile_shape_mnk[:2]} CTA tile")
        bar = pipeline.NamedBarrier(barrier_id=self.epilog_sync_bar_id, num_threads=threads)
        return _Epilogue(t2r, tTR_tAcc, tTR_rAcc, r2s, tRS_rC, tRS_sC, bSG_sC, bSG_gC, bar)

    @cute.jit
    def _store_tile(
        self, e: "_Epilogue", tidx, warp_idx, tma_atom_c, mma_tile_coord, acc_state, acc_pipeline, c_pipeline,
        subtiles_done, unit=None,
    ):
        """The epilogue of one accumulator stage: wait for it, store its tile
        by TMA in epilogue subtiles, release it. A stream-K `unit` that shares
        its tile is reduced first (`_SharedUnit`); unless it arrived last it
        stores nothing. Returns the advanced stage and the subtiles stored
        so far (the smem buffers rotate by stored subtiles)."""
        # (T2R, T2R_M, T2R_N, subtile) of this stage, ((ATOM_V, REST_V), subtile) of this tile
        tTR_tAcc = e.tTR_tAcc[(None, None, None, None, None, acc_state.index)]
        tTR_tAcc = cute.group_modes(tTR_tAcc, 3, cute.rank(tTR_tAcc))
        bSG_gC = e.bSG_gC[(None, None, None, *mma_tile_coord)]
        bSG_gC = cute.group_modes(bSG_gC, 1, cute.rank(bSG_gC))
        subtiles = cute.size(tTR_tAcc.shape, mode=[3])
        # Written inside branches: a store through `e` would carry all of it through them.
        tTR_rAcc, tRS_rC = e.tTR_rAcc, e.tRS_rC
        values = cute.size(tTR_rAcc)
        threads = 32 * len(self.epilogue_warp_id)

        acc_pipeline.consumer_wait(acc_state)
        store = cutlass.Boolean(True)
        if cutlass.const_expr(unit is not None):
            if unit.shared:
                own = unit.partial(unit.me, values * subtiles, threads)
                for sub in cutlass.range(subtiles):
                    cute.copy(e.t2r, tTR_tAcc[(None, None, None, sub)], tTR_rAcc)
                    for i in cutlass.range_constexpr(values):
                        own[sub * values + i, tidx] = tTR_rAcc[i]
                store = unit.scratch.arrive(unit.tile_id, unit.count, tidx, e.bar)
        if store:
            for sub in cutlass.range(subtiles):
                cute.copy(e.t2r, tTR_tAcc[(None, None, None, sub)], tTR_rAcc)
                if cutlass.const_expr(unit is not None):
                    # Empty unless the unit shares its tile (and arrived last).
                    for c in cutlass.range(unit.count):
                        if c != unit.me:
                            other = unit.partial(c, values * subtiles, threads)
                            for i in cutlass.range_constexpr(values):
                                tTR_rAcc[i] = tTR_rAcc[i] + other[sub * values + i, tidx]
                acc_vec = e.r2s.retile(tTR_rAcc).load()
                tRS_rC.store(acc_vec.to(self.c_dtype))
                buf = (subtiles_done + sub) % self.num_c_stage
                cute.copy(e.r2s, tRS_rC, e.tRS_sC[(None, None, None, buf)])
                # Generic-proxy smem writes must be visible to the TMA store.
                cute.arch.fence_proxy("async.shared", space="cta")
                e.bar.arrive_and_wait()
                if warp_idx == self.epilogue_warp_id[0]:
                    cute.copy(tma_atom_c, e.bSG_sC[(None, buf)], bSG_gC[(None, sub)])
                    c_pipeline.producer_commit()
                    c_pipeline.producer_acquire()
                e.bar.arrive_and_wait()
            subtiles_done = subtiles_done + subtiles
        # As `epilogue_tma_store`: the epilogue warps leave the stage together.
        e.bar.arrive_and_wait()
        with cute.arch.elect_one():
            acc_pipeline.consumer_release(acc_state)
        acc_state.advance()
        return acc_state, subtiles_done

    def _cta_start(self, storage, cluster_layout_vmnk: cute.Layout, use_2cta_instrs: bool) -> tuple:
        """The pipelines (loads -> MMA, MMA -> epilogue), the scheduler ring and
        the TMEM allocator every sm100 kernel of the pool sets up first."""
        ab_producer, ab_consumer = pipeline.PipelineTmaUmma.create(
            barrier_storage=storage.ab_mbar.data_ptr(),
            num_stages=self.num_ab_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, self.num_mcast_ctas_a + self.num_mcast_ctas_b - 1
            ),
            tx_count=self.num_tma_load_bytes,
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        ).make_participants()

        acc_pipeline = pipeline.PipelineUmmaAsync.create(
            barrier_storage=storage.acc_mbar.data_ptr(),
            num_stages=self.num_acc_stage,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, len(self.epilogue_warp_id) * (2 if use_2cta_instrs else 1)
            ),
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )

        ring = None
        if cutlass.const_expr(self.cfg.scheduler == "clc"):
            ring = clc.ClcRing.create(
                self.sched, storage.ring_bars.data_ptr(), storage.ring_slots.data_ptr(),
                self.ring_consumer_warps, cluster_layout_vmnk,
            )
        elif cutlass.const_expr(self.sched.dynamic):
            ring = ClaimRing.create(
                self.sched, storage.ring_bars.data_ptr(), storage.ring_slots.data_ptr(),
                self.ring_consumer_warps,
            )

        tmem = TmemAllocator(
            storage.tmem_holding_buf.ptr,
            barrier_for_retrieve=pipeline.NamedBarrier(
                barrier_id=self.tmem_alloc_sync_bar_id,
                num_threads=32 * len((self.mma_warp_id, *self.epilogue_warp_id)),
            ),
            allocator_warp_id=self.epilogue_warp_id[0],
            is_two_cta=use_2cta_instrs,
            two_cta_tmem_dealloc_mbar_ptr=storage.tmem_dealloc_mbar.ptr,
        )

        # Barrier inits must be visible cluster-wide before any peer signals them.
        pipeline_init_arrive(cluster_shape_mn=cluster_layout_vmnk, is_relaxed=True)
        return ab_producer, ab_consumer, acc_pipeline, ring, tmem

    def _mcast_masks(self, cluster_layout_vmnk: cute.Layout, block_in_cluster_coord_vmnk, use_2cta_instrs: bool):
        """TMA multicast masks of A (along the cluster's N) and B (along its M)."""
        a_full_mcast_mask = None
        b_full_mcast_mask = None
        if cutlass.const_expr(self.is_a_mcast or self.is_b_mcast or use_2cta_instrs):
            a_full_mcast_mask = cpasync.create_tma_multicast_mask(
                cluster_layout_vmnk, block_in_cluster_coord_vmnk, mcast_mode=2
            )
            b_full_mcast_mask = cpasync.create_tma_multicast_mask(
                cluster_layout_vmnk, block_in_cluster_coord_vmnk, mcast_mode=1
            )
        return a_full_mcast_mask, b_full_mcast_mask

    @cute.jit
    def _load_tile(
        self, sched, ab_producer, k_tile_cnt, tma_atom_a, tAgA, tAsA, a_mcast_mask, tma_atom_b, tBgB, tBsB,
        b_mcast_mask, k_start=0,
    ):
        """TMA loads of a tile's k-blocks k_start .. k_start + k_tile_cnt - 1
        of A and B into the stage ring, between the two claim requests of
        `sched`; returns the producer, whose ring position the caller carries
        to the next tile."""
        sched.request_next(True)
        ab_producer.reset()
        peek_empty = ab_producer.try_acquire()
        for _k in cutlass.range(0, k_tile_cnt, 1, unroll=1):
            handle = ab_producer.acquire_and_advance(peek_empty)
            cute.copy(
                tma_atom_a, tAgA[(None, k_start + handle.count)], tAsA[(None, handle.index)],
                tma_bar_ptr=handle.barrier, mcast_mask=a_mcast_mask,
            )
            cute.copy(
                tma_atom_b, tBgB[(None, k_start + handle.count)], tBsB[(None, handle.index)],
                tma_bar_ptr=handle.barrier, mcast_mask=b_mcast_mask,
            )
            peek_empty = cutlass.Boolean(1)
            if handle.count + 1 < k_tile_cnt:
                peek_empty = ab_producer.try_acquire()
        sched.request_next(False)
        return ab_producer

    @cute.jit
    def _mma_role(
        self, work_tiles, ring, tmem: TmemAllocator, tCtAcc_fake: cute.Tensor, tiled_mma: cute.TiledMma,
        ab_consumer, acc_pipeline, tCrA: cute.Tensor, tCrB: cute.Tensor, k_tile_cnt, is_leader_cta, trace=None,
    ):
        """The MMA warp: one accumulator stage per tile (stream-K: per unit) of
        `work_tiles` (see `_scheduler`).

        Traced, the leader CTA's MMA warp writes when the mainloop began into
        the record of every CTA tile its MMAs compute (its own; with a 2-CTA
        MMA also the peer's, the next tile along M); the epilogue warps write
        the rest (`kernels.trace`).
        """
        tCtAcc_base = self._accumulators(tmem, tCtAcc_fake)
        acc_producer_state = pipeline.make_pipeline_state(
            pipeline.PipelineUserType.Producer, self.num_acc_stage
        )
        sched = self._scheduler(work_tiles, ring, k_tile_cnt)
        work = sched.initial_work()
        while work.is_valid:
            _, k_count = work.k_range(k_tile_cnt)
            tCtAcc = tCtAcc_base[(None, None, None, acc_producer_state.index)]
            ab_consumer.reset()
            peek_full = cutlass.Boolean(1)
            if is_leader_cta:
                peek_full = ab_consumer.try_wait()
                acc_pipeline.producer_acquire(acc_producer_state)
                if cutlass.const_expr(trace is not None):
                    self._trace_start(trace, work.tile, tiled_mma)
            tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
            for _k in range(k_count):
                if is_leader_cta:
                    handle = ab_consumer.wait_and_advance(peek_full)
                    num_kblocks = cute.size(tCrA, mode=[2])
                    for kblk in cutlass.range(num_kblocks, unroll_full=True):
                        crd = (None, None, kblk, handle.index)
                        cute.gemm(tiled_mma, tCtAcc, tCrA[crd], tCrB[crd], tCtAcc)
                        tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                    handle.release()
                    peek_full = cutlass.Boolean(1)
                    if handle.count + 1 < k_count:
                        peek_full = ab_consumer.try_wait()
            if is_leader_cta:
                acc_pipeline.producer_commit(acc_producer_state)
            acc_producer_state.advance()
            work = sched.advance()
        acc_pipeline.producer_tail(acc_producer_state)

    @cute.jit
    def _trace_start(self, trace: TileTrace, tile, tiled_mma: cute.TiledMma) -> None:
        """The start words of the CTA tiles of the MMA tile that begins now at `tile` (the leader's)."""
        start = trace_now()
        m, n, l = tile
        with cute.arch.elect_one():
            for v in cutlass.range_constexpr(cute.size(tiled_mma.thr_id.shape)):
                trace.begin((m + v, n, l), start)

    def _tma_loads(self, a: cute.Tensor, b: cute.Tensor, tiled_mma: cute.TiledMma) -> tuple:
        """TMA atoms and tensors of A and B (multicast across the cluster), and the
        bytes one stage's loads bring to a CTA's barrier."""
        atom_thr_size = cute.size(tiled_mma.thr_id.shape)

        a_op = sm100_utils.cluster_shape_to_tma_atom_A(self.cluster_shape_mn, tiled_mma.thr_id)
        a_smem_layout = cute.slice_(self.a_smem_layout_staged, (None, None, None, 0))
        tma_atom_a, tma_tensor_a = cute.nvgpu.make_tiled_tma_atom_A(
            a_op, a, a_smem_layout, self.mma_tiler, tiled_mma, self.cluster_layout_vmnk.shape
        )
        b_op = sm100_utils.cluster_shape_to_tma_atom_B(self.cluster_shape_mn, tiled_mma.thr_id)
        b_smem_layout = cute.slice_(self.b_smem_layout_staged, (None, None, None, 0))
        tma_atom_b, tma_tensor_b = cute.nvgpu.make_tiled_tma_atom_B(
            b_op, b, b_smem_layout, self.mma_tiler, tiled_mma, self.cluster_layout_vmnk.shape
        )
        # Each CTA of an MMA pair receives both halves' bytes on its barrier.
        self.num_tma_load_bytes = (
            cute.size_in_bytes(self.a_dtype, a_smem_layout) + cute.size_in_bytes(self.b_dtype, b_smem_layout)
        ) * atom_thr_size
        return tma_atom_a, tma_tensor_a, tma_atom_b, tma_tensor_b

    def _accumulators(self, tmem: TmemAllocator, fake: cute.Tensor) -> cute.Tensor:
        """The TMEM accumulator stages, once the epilogue warps' allocation has landed."""
        tmem.wait_for_alloc()
        return cute.make_tensor(tmem.retrieve_ptr(self.acc_dtype), fake.layout)

    def _scheduler(self, tiles: TileGrid, ring, k_tiles=None):
        """The scheduler every warp role walks (a grouped kernel walks its group
        table instead); stream-K needs a tile's k-blocks, `k_tiles`."""
        if cutlass.const_expr(self.cfg.scheduler == "clc"):
            return clc.ClcScheduler.create(self.sched, tiles, ring)
        return TileScheduler.create(self.sched, tiles, ring, k_tiles)

    @cute.jit
    def _mma_tile(self, work, tiled_mma: cute.TiledMma):
        """MMA tile coordinate of a work tile given in CTA tiles (a 2-CTA MMA spans two)."""
        m, n, l = work.tile
        return (m // cute.size(tiled_mma.thr_id.shape), n, l)


# Frozen: a dynamic branch may then call into them without carrying them
# through the branch as values (the DSL treats frozen dataclasses as read-only).
@dataclass(frozen=True)
class _Epilogue:
    """Per-thread epilogue state built once by `Sm100GemmKernel._epilogue`:
    TMEM -> register copy and its partitions (t2r, tTR_tAcc, tTR_rAcc),
    register -> smem copy (r2s, tRS_rC, tRS_sC), TMA store partitions
    (bSG_sC, bSG_gC) and the epilogue warps' barrier."""

    t2r: cute.TiledCopy
    tTR_tAcc: cute.Tensor
    tTR_rAcc: cute.Tensor
    r2s: cute.TiledCopy
    tRS_rC: cute.Tensor
    tRS_sC: cute.Tensor
    bSG_sC: cute.Tensor
    bSG_gC: cute.Tensor
    bar: pipeline.NamedBarrier


@dataclass(frozen=True)
class _SharedUnit:
    """A stream-K unit as the epilogue reduces it: whether it shares its tile
    (covers fewer than all of its k-blocks), the tile's semaphore, the
    `count` slices whose units cover the tile and this unit's slice `me`.
    A unit that covers its whole tile has count 0: it adds nothing."""

    shared: cutlass.Boolean
    scratch: PartialScratch
    tile_id: cutlass.Int32
    count: cutlass.Int32
    me: cutlass.Int32
    slots: UnitSlots

    @staticmethod
    def of(work, sched, scratch: PartialScratch, k_tiles, cluster_mn) -> "_SharedUnit":
        """The unit of `work`, read before `sched` advances past it."""
        shared = work.k_tiles < k_tiles
        count = cutlass.Int32(cutlass.select_(shared, work.count, 0))
        m, n, _ = work.tile
        return _SharedUnit(
            shared, scratch, scratch.tile_id(m, n), count, work.slice, UnitSlots(sched, work.unit_tile, cluster_mn)
        )

    def partial(self, s, values: int, threads: int) -> cute.Tensor:
        """The (value, thread) partial of slice `s`'s unit in this tile."""
        return self.scratch.partial(self.slots(s), values, threads)


@cute.jit
def operand_views(a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, layout: str, split_k: int):
    """(m, k, l), (n, k, l) and (m, n, l) views of 2-D row-major operands.

    With split_k > 1, l indexes the K slices and `c` is the (S, M, N) fp32
    workspace the slices are written to.
    """
    m, k = a.shape
    k_slice = k
    if cutlass.const_expr(split_k > 1):
        k_slice = cute.assume(k // split_k, divby=8)
    a3 = cute.make_tensor(a.iterator, cute.make_layout((m, k_slice, split_k), stride=(a.stride[0], 1, k_slice)))
    if cutlass.const_expr(layout == "tn"):
        n = b.shape[0]
        b3 = cute.make_tensor(b.iterator, cute.make_layout((n, k_slice, split_k), stride=(b.stride[0], 1, k_slice)))
    else:
        n = b.shape[1]
        b3 = cute.make_tensor(
            b.iterator, cute.make_layout((n, k_slice, split_k), stride=(1, b.stride[0], b.stride[0] * k_slice))
        )
    if cutlass.const_expr(split_k > 1):
        c3 = cute.make_tensor(c.iterator, cute.make_layout((m, n, split_k), stride=(c.stride[1], 1, c.stride[0])))
    else:
        c3 = cute.make_tensor(c.iterator, cute.make_layout((m, n, 1), stride=(c.stride[0], 1, m * c.stride[0])))
    return a3, b3, c3
