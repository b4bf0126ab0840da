"""Blackwell (sm100) tcgen05 GEMM with a pluggable tile scheduler.

C (M, N) = A (M, K) @ B, A K-major, B either (N, K) K-major ("tn") or
(K, N) N-major ("nn"), bf16/fp16 in, fp32 accumulation in tensor memory.

Warp roles per CTA: four epilogue warps (TMEM -> registers -> smem -> TMA
store), one MMA warp (tcgen05.mma, issued by the leader CTA of an MMA pair
when cta_group == 2), one TMA load warp (A and B multicast across the
cluster), and for the dynamic schedulers one scheduler warp that claims the
next tile (atomic counter or CLC) and broadcasts it through an smem ring.

With acc_stages == 2 the accumulator is double-buffered in TMEM so the
epilogue of one tile overlaps the mainloop of the next.
"""


from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
import cutlass.utils as utils
import cutlass.utils.blackwell_helpers as sm100_utils
from cutlass.cute.nvgpu import cpasync, tcgen05
from cutlass.memory import TmemAllocator, get_num_tmem_alloc_cols
from cutlass.pipeline import pipeline_init_arrive, pipeline_init_wait
from cutlass.utils.gemm.sm100 import epilogue_tma_store

from kernels import space
from kernels.sm100 import clc
from kernels.space import GemmConfig, InvalidConfig

_DTYPES = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}
# Epilogue staging buffers in smem: one being filled while the previous one's
# TMA store drains.
_C_STAGES = 2


class GemmSm100:
    """One kernel variant of the sm100 pool, built from a GemmConfig.

    gemm = GemmSm100(cfg)
    gemm(a, b, c, max_active_clusters, stream)        # inside cute.compile

    a: (M, K, 1), b: (N, K, 1) with either stride order, c: (M, N, 1).
    max_active_clusters is a runtime value (clusters resident at once, e.g.
    148 // cluster_size on a B200), so an SM carve-out needs no recompile.
    `rows`, an optional device Int32[1], makes the launch a padded one: A and
    C are worst-case buffers of which only the first rows[0] rows are real.
    The grid still covers every tile of the buffer (what a CUDA graph needs),
    and tiles past the real work are phantoms the schedulers skip.
    """

    def __init__(self, cfg: GemmConfig, acc_dtype: type[cutlass.Numeric] = cutlass.Float32):
        self.can_implement(cfg)
        self.cfg = cfg
        self.acc_dtype = acc_dtype
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
        self.has_sched_warp = cfg.dynamic
        warps = 7 if self.has_sched_warp else 6
        self.threads_per_cta = 32 * warps
        # Named barrier ids (0 is __syncthreads).
        self.epilog_sync_bar_id = 1
        self.tmem_alloc_sync_bar_id = 2

    @staticmethod
    def can_implement(cfg: GemmConfig) -> None:
        """Raise InvalidConfig unless this kernel builds `cfg` (the config space decides the rest)."""
        if cfg.arch != "sm100":
            raise InvalidConfig(f"GemmSm100 builds sm100 configs, not {cfg.arch}")
        if cfg.split_k != 1:
            raise InvalidConfig("the sm100 kernel has no split-K")
        if cfg.tile_n % 32:
            raise InvalidConfig(f"the TMA-store epilogue needs tile_n a multiple of 32, not {cfg.tile_n}")
        space.validate(cfg)

    # ------------------------------------------------------------------ host

    def _setup(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor):
        self.a_dtype = a.element_type
        self.b_dtype = b.element_type
        self.c_dtype = c.element_type
        if cutlass.const_expr(self.a_dtype != self.b_dtype):
            raise TypeError(f"A and B must share a dtype: {self.a_dtype} != {self.b_dtype}")
        self.a_major_mode = utils.LayoutEnum.from_tensor(a).mma_major_mode()
        self.b_major_mode = utils.LayoutEnum.from_tensor(b).mma_major_mode()
        self.c_layout = utils.LayoutEnum.from_tensor(c)

        tiled_mma = sm100_utils.make_trivial_tiled_mma(
            self.a_dtype, self.a_major_mode, self.b_major_mode, self.acc_dtype,
            self.cta_group, self.mma_tiler_mn,
        )
        mma_k = cute.size(tiled_mma.shape_mnk, mode=[2])
        # Four MMA instructions per k-block: 64 16-bit elements, one 128-byte swizzle row.
        self.mma_tiler = (*self.mma_tiler_mn, mma_k * (space.TILE_K // mma_k))
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
        ring = clc.ring_words(self.cfg)

        @cute.struct
        class SharedStorage:
            ab_mbar: cute.struct.MemRange[cutlass.Int64, self.num_ab_stage * 2]
            acc_mbar: cute.struct.MemRange[cutlass.Int64, self.num_acc_stage * 2]
            tmem_dealloc_mbar: cutlass.Int64
            tmem_holding_buf: cutlass.Int32
            sched_mbar: cute.struct.MemRange[cutlass.Int64, max(1, ring.stages) * 2]
            tail_mbar: cutlass.Int64
            # 16-byte slots: CLC responses (written by the async proxy) or
            # broadcast tile records, plus the tail-cancel burst's slots.
            sched_buf: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, ring.words], 16]
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
        max_active_clusters: cutlass.Int32,
        stream,
        rows: Optional[cute.Tensor] = None,
    ):
        tiled_mma = self._setup(a, b, c)
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

        epi_smem_layout = cute.select(self.c_smem_layout_staged, mode=[0, 1])
        tma_atom_c, tma_tensor_c = cpasync.make_tiled_tma_atom(
            cpasync.CopyBulkTensorTileS2GOp(), c, epi_smem_layout, self.epi_tile
        )

        sched_params = clc.make_params(
            self.cfg, c, self.cta_tile_shape_mnk[:2], max_active_clusters, rows
        )
        grid = sched_params.grid()

        self.kernel(
            tiled_mma, tma_atom_a, tma_tensor_a, tma_atom_b, tma_tensor_b, tma_atom_c, tma_tensor_c,
            self.cluster_layout_vmnk, self.a_smem_layout_staged, self.b_smem_layout_staged,
            self.c_smem_layout_staged, self.epi_tile, sched_params,
        ).launch(
            grid=grid,
            block=[self.threads_per_cta, 1, 1],
            cluster=(*self.cluster_shape_mn, 1),
            smem=self.shared_storage.size_in_bytes(),
            stream=stream,
        )

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
        sched_params: clc.SchedulerParams,
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

        smem = utils.SmemAllocator()
        storage = smem.allocate(self.shared_storage)

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

        sched = clc.make_scheduler(
            self.cfg, sched_params, storage.sched_mbar.data_ptr(), storage.sched_buf.data_ptr(),
            storage.tail_mbar.ptr, cluster_layout_vmnk, self.threads_per_cta // 32,
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

        sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)
        sC = storage.sC.get_tensor(c_smem_layout_staged.outer, swizzle=c_smem_layout_staged.inner)

        a_full_mcast_mask = None
        b_full_mcast_mask = None
        if cutlass.const_expr(self.is_a_mcast or self.is_b_mcast or use_2cta_instrs):
            a_full_mcast_mask = cpasync.create_tma_multicast_mask(
                cluster_layout_vmnk, block_in_cluster_coord_vmnk, mcast_mode=2
            )
            b_full_mcast_mask = cpasync.create_tma_multicast_mask(
                cluster_layout_vmnk, block_in_cluster_coord_vmnk, mcast_mode=1
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

        pipeline_init_wait(cluster_shape_mn=cluster_layout_vmnk)

        work = sched.initial_work()

        # ---- TMA load warp
        if warp_idx == self.tma_warp_id:
            while work.is_valid_tile:
                mma_m, mma_n, mma_l = self._mma_tile(work, tiled_mma)
                tAgA_slice = tAgA[(None, mma_m, None, mma_l)]
                tBgB_slice = tBgB[(None, mma_n, None, mma_l)]
                ab_producer.reset()
                peek_empty = ab_producer.try_acquire()
                for _k in cutlass.range(0, k_tile_cnt, 1, unroll=1):
                    handle = ab_producer.acquire_and_advance(peek_empty)
                    cute.copy(
                        tma_atom_a, tAgA_slice[(None, handle.count)], tAsA[(None, handle.index)],
                        tma_bar_ptr=handle.barrier, mcast_mask=a_full_mcast_mask,
                    )
                    cute.copy(
                        tma_atom_b, tBgB_slice[(None, handle.count)], tBsB[(None, handle.index)],
                        tma_bar_ptr=handle.barrier, mcast_mask=b_full_mcast_mask,
                    )
                    peek_empty = cutlass.Boolean(1)
                    if handle.count + 1 < k_tile_cnt:
                        peek_empty = ab_producer.try_acquire()
                work = sched.next_work(work)
            ab_producer.tail()

        # ---- scheduler warp: claims tiles for the whole cluster
        if cutlass.const_expr(self.has_sched_warp):
            if warp_idx == self.sched_warp_id:
                sched.produce(work)

        # ---- MMA warp
        if warp_idx == self.mma_warp_id:
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc_base = cute.make_tensor(tmem_ptr, tCtAcc_fake.layout)
            acc_producer_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Producer, self.num_acc_stage
            )
            while work.is_valid_tile:
                tCtAcc = tCtAcc_base[(None, None, None, acc_producer_state.index)]
                ab_consumer.reset()
                peek_full = cutlass.Boolean(1)
                if is_leader_cta:
                    peek_full = ab_consumer.try_wait()
                    acc_pipeline.producer_acquire(acc_producer_state)
                tiled_mma.set(tcgen05.Field.ACCUMULATE, False)
                for _k in range(k_tile_cnt):
                    if is_leader_cta:
                        handle = ab_consumer.wait_and_advance(peek_full)
                        num_kblocks = cute.size(tCrA, mode=[2])
                        for kblk in cutlass.range(num_kblocks, unroll_full=True):
                            crd = (None, None, kblk, handle.index)
                            cute.gemm(tiled_mma, tCtAcc, tCrA[crd], tCrB[crd], tCtAcc)
                            tiled_mma.set(tcgen05.Field.ACCUMULATE, True)
                        handle.release()
                        peek_full = cutlass.Boolean(1)
                        if handle.count + 1 < k_tile_cnt:
                            peek_full = ab_consumer.try_wait()
                if is_leader_cta:
                    acc_pipeline.producer_commit(acc_producer_state)
                acc_producer_state.advance()
                work = sched.next_work(work)
            acc_pipeline.producer_tail(acc_producer_state)

        # ---- epilogue warps
        if warp_idx < self.mma_warp_id:
            tmem.allocate(self.num_tmem_alloc_cols)
            tmem.wait_for_alloc()
            tmem_ptr = tmem.retrieve_ptr(self.acc_dtype)
            tCtAcc_base = cute.make_tensor(tmem_ptr, tCtAcc_fake.layout)
            acc_consumer_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.num_acc_stage
            )
            c_pipeline = pipeline.PipelineTmaStore.create(
                num_stages=self.num_c_stage,
                producer_group=pipeline.CooperativeGroup(
                    pipeline.Agent.Thread, 32 * len(self.epilogue_warp_id)
                ),
            )
            tiles_done = cutlass.Int32(0)
            while work.is_valid_tile:
                mma_tile_coord = self._mma_tile(work, tiled_mma)
                # Claim the next tile before the stores so the scheduler ring
                # slot frees as early as possible.
                work = sched.next_work(work)
                acc_consumer_state = epilogue_tma_store(
                    self, tidx, warp_idx, tma_atom_c, tCtAcc_base, sC, tCgC, epi_tile,
                    tiles_done, lambda x: x, mma_tile_coord, acc_consumer_state,
                    acc_pipeline, c_pipeline,
                )
                tiles_done += 1
            c_pipeline.producer_tail()
            tmem.relinquish_alloc_permit()
            tmem.free(tmem_ptr)

    @cute.jit
    def _mma_tile(self, work, tiled_mma: cute.TiledMma):
        """MMA tile coordinate of a work tile given in CTA tiles (a 2-CTA MMA spans two)."""
        m, n, l = work.tile_idx
        return (m // cute.size(tiled_mma.thr_id.shape), n, l)


def dtype(name: str) -> type[cutlass.Numeric]:
    """The CuTe element type of a pool dtype name ("bf16", "fp16", "fp32")."""
    return _DTYPES[name]
