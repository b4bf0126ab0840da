"""Grouped GEMM for Blackwell (sm_100a), MoE "rows" form, on `Sm100GemmKernel`'s warp roles.

A (total_M, K) is split into G groups by ``offs`` (int32, cumulative group
ends on device, as ``torch._grouped_mm``); group g multiplies rows
``[offs[g-1], offs[g])`` by B[g] ((G, N, K) "tn" or (G, K, N) "nn") into the
same rows of out (total_M, N).

The launch depends on shapes only (no host sync, CUDA-graph safe): the grid
is sized for the worst case, every tile of total_M rows plus one partial
tile per group boundary, and one warp turns ``offs`` into the shared-memory
group table (`kernels.group_table`) that every role decodes its work from.
Clusters whose index lies past the real work are phantoms: the persistent
schedulers skip them, and with ``clc`` every padded cluster is launched, so
the first grant of a phantom proves the real work is taken and, with
tail_cancel, fires `kernels.sm100.clc`'s capped cancel burst.

A tile reads A from its group's first row plus its own offset through one
descriptor, so rows of the next group may be loaded; they are never stored:
the epilogue writes from registers with a row bound at the group's end.
"""

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, const_expr
from cutlass.cute.nvgpu import cpasync
from cutlass.memory import SmemAllocator
from cutlass.pipeline import pipeline_init_wait
from cutlass.utils.gemm.sm100 import epilogue

from kernels.group_table import GroupedTileScheduler, GroupTable
from kernels.grouped import MAX_GROUPS
from kernels.sm100 import clc
from kernels.sm100.gemm import Sm100GemmKernel
from kernels.space import GemmConfig, InvalidConfig
from kernels.trace_device import TileTrace
from kernels.trace_device import now as trace_now

# Builds the group table before the roles split (the TMA warp: it has the
# least to do before its first load).
_TABLE_WARP = 5


def worst_case_clusters(total_m, n, groups, cluster_rows: int, cluster_cols: int):
    """Cluster tiles of the worst-case offs: each group boundary can add one partial cluster row.

    Takes Python or DSL integers: the grid is sized from shapes only.
    """
    clusters_n = (n + cluster_cols - 1) // cluster_cols
    return ((total_m + cluster_rows - 1) // cluster_rows + groups) * clusters_n


class GroupedClcScheduler(clc.ClcScheduler):
    """`clc.ClcScheduler` whose indices decode through a `GroupTable` (phantoms: past its count)."""

    _work = GroupedTileScheduler._work

    def __new_from_mlir_values__(self, values: list) -> "GroupedClcScheduler":
        base = super().__new_from_mlir_values__(values)
        return GroupedClcScheduler(
            self.spec, self.grid, self.num_clusters, self.rank_mn, base._idx, self._ring, base._state
        )

    @staticmethod
    def create(spec: clc.ClcSpec, table: GroupTable, ring: clc.ClcRing) -> "GroupedClcScheduler":
        base = clc.ClcScheduler.create(spec, table, ring)
        return GroupedClcScheduler(spec, table, base.num_clusters, base.rank_mn, base._idx, ring, base._state)


class Sm100GroupedGemmKernel(Sm100GemmKernel):
    """``__call__(a, b, out, offs, sched_buf, max_clusters, stream)``; see the module doc."""

    def __init__(self, cfg: GemmConfig, layout: str = "tn", form: str = "rows"):
        super().__init__(cfg, layout)
        self.can_implement_grouped(cfg, form)
        self.form = form

    @staticmethod
    def can_implement_grouped(cfg: GemmConfig, form: str) -> None:
        if form != "rows":
            raise InvalidConfig(f"the sm100 grouped kernel takes the 'rows' form, not {form!r}")
        if cfg.split_k != 1:
            raise InvalidConfig("grouped kernels do not split K")
        if cfg.scheduler == "single_tile":
            raise InvalidConfig("the sm100 grouped kernel needs a persistent or clc scheduler")

    # ------------------------------------------------------------------ host

    def _grouped_views(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor):
        """(m, k, 1), (n, k, G), (m, n, 1) views."""
        m, k = a.shape
        groups = b.shape[0]
        a3 = cute.make_tensor(a.iterator, cute.make_layout((m, k, 1), stride=(a.stride[0], 1, 0)))
        if const_expr(self.layout == "tn"):
            n = b.shape[1]
            b3 = cute.make_tensor(b.iterator, cute.make_layout((n, k, groups), stride=(b.stride[1], 1, b.stride[0])))
        else:
            n = b.shape[2]
            b3 = cute.make_tensor(b.iterator, cute.make_layout((n, k, groups), stride=(1, b.stride[1], b.stride[0])))
        c3 = cute.make_tensor(c.iterator, cute.make_layout((m, n, 1), stride=(c.stride[0], 1, 0)))
        return a3, b3, c3

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
            bounds: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, MAX_GROUPS + 1], 16]
            starts: cute.struct.Align[cute.struct.MemRange[cutlass.Int32, MAX_GROUPS + 1], 16]
            order: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, MAX_GROUPS], 16]
            heavy: cute.struct.MemRange[cutlass.Int32, 1]
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
        offs: cute.Tensor,
        sched_buf: cute.Tensor,
        max_clusters: Int32,
        stream,
    ):
        a, b, c = self._grouped_views(a, b, c)
        tiled_mma = self._setup(a, b, c)
        tma_atom_a, tma_tensor_a, tma_atom_b, tma_tensor_b = self._tma_loads(a, b, tiled_mma)

        clusters = worst_case_clusters(
            c.shape[0], c.shape[1], offs.shape[0], self.cta_tile_shape_mnk[0] * self.cluster_shape_mn[0],
            self.cta_tile_shape_mnk[1] * self.cluster_shape_mn[1],
        )
        if const_expr(self.cfg.scheduler != "clc"):
            clusters = cutlass.min(clusters, max_clusters)

        self.grouped_kernel(
            tiled_mma, tma_atom_a, tma_tensor_a, tma_atom_b, tma_tensor_b, c, offs,
            self.cluster_layout_vmnk, self.a_smem_layout_staged, self.b_smem_layout_staged,
            self.epi_tile, sched_buf, self._trace_buf,
        ).launch(
            grid=(self.cluster_shape_mn[0] * clusters, self.cluster_shape_mn[1], 1),
            block=[self.threads_per_cta, 1, 1],
            cluster=(*self.cluster_shape_mn, 1),
            smem=self.shared_storage.size_in_bytes(),
            stream=stream,
        )

    @cute.jit
    def traced(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, offs: cute.Tensor, sched_buf: cute.Tensor,
               max_clusters: Int32, trace_buf: cute.Tensor, stream):
        """`__call__` with every tile's record written to `trace_buf` (`kernels.trace`)."""
        self._trace_buf = trace_buf
        self.__call__(a, b, c, offs, sched_buf, max_clusters, stream)

    # ---------------------------------------------------------------- device

    @cute.kernel
    def grouped_kernel(
        self,
        tiled_mma: cute.TiledMma,
        tma_atom_a: cute.CopyAtom,
        mA_mkl: cute.Tensor,
        tma_atom_b: cute.CopyAtom,
        mB_nkl: cute.Tensor,
        mC_mnl: cute.Tensor,
        offs: cute.Tensor,
        cluster_layout_vmnk: cute.Layout,
        a_smem_layout_staged: cute.ComposedLayout,
        b_smem_layout_staged: cute.ComposedLayout,
        epi_tile: cute.Tile,
        sched_buf: cute.Tensor,
        trace_buf: cute.Tensor | None,
    ):
        warp_idx = cute.arch.make_warp_uniform(cute.arch.warp_idx())
        if warp_idx == self.tma_warp_id:
            cpasync.prefetch_descriptor(tma_atom_a)
            cpasync.prefetch_descriptor(tma_atom_b)

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

        m_total, n_total, _ = mC_mnl.shape
        cluster_rows = self.cta_tile_shape_mnk[0] * self.cluster_shape_mn[0]
        cluster_cols = self.cta_tile_shape_mnk[1] * self.cluster_shape_mn[1]
        table = GroupTable(
            "rows",
            storage,
            offs.shape[0],
            (m_total + cluster_rows - 1) // cluster_rows,
            (n_total + cluster_cols - 1) // cluster_cols,
            cluster_rows,
        )
        table.build(offs, m_total, warp_idx == _TABLE_WARP)
        cute.arch.sync_threads()

        sA = storage.sA.get_tensor(a_smem_layout_staged.outer, swizzle=a_smem_layout_staged.inner)
        sB = storage.sB.get_tensor(b_smem_layout_staged.outer, swizzle=b_smem_layout_staged.inner)

        a_full_mcast_mask, b_full_mcast_mask = self._mcast_masks(
            cluster_layout_vmnk, block_in_cluster_coord_vmnk, use_2cta_instrs
        )

        mma_m_rows = self.mma_tiler[0]
        tiler_a = cute.slice_(self.mma_tiler, (None, 0, None))
        # (bN, bK, RestN, RestK, G)
        gB_nkl = cute.local_tile(mB_nkl, cute.slice_(self.mma_tiler, (0, None, None)), (None, None, None))
        k_tile_cnt = cute.size(gB_nkl, mode=[3])

        thr_mma = tiled_mma.get_slice(mma_tile_coord_v)
        tCgB = thr_mma.partition_B(gB_nkl)
        a_cta_layout = cute.make_layout(cute.slice_(cluster_layout_vmnk, (0, 0, None, 0)).shape)
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
        trace = None
        if const_expr(trace_buf is not None):
            # Slots for every group's tiles up to the largest group's (all rows).
            trace = TileTrace.create(trace_buf, table, self.cluster_shape_mn)

        # ---- TMA load warp
        if warp_idx == self.tma_warp_id:
            sched = self._scheduler(table, ring)
            work = sched.initial_work()
            while work.is_valid:
                m, n, g = work.tile
                row0 = table.bounds[g] + (m // cute.size(tiled_mma.thr_id.shape)) * mma_m_rows
                # (bM, bK, RestK) of this tile, from its group's first row.
                gA = cute.local_tile(cute.domain_offset((row0, 0, 0), mA_mkl), tiler_a, (0, None, 0))
                tAsA, tAgA = cpasync.tma_partition(
                    tma_atom_a, block_in_cluster_coord_vmnk[2], a_cta_layout,
                    cute.group_modes(sA, 0, 3), cute.group_modes(thr_mma.partition_A(gA), 0, 3),
                )
                ab_producer = self._load_tile(
                    sched, ab_producer, k_tile_cnt, tma_atom_a, tAgA, tAsA, a_full_mcast_mask,
                    tma_atom_b, tBgB[(None, n, None, g)], tBsB, b_full_mcast_mask,
                )
                work = sched.advance()
            ab_producer.tail()

        # ---- scheduler warp
        if const_expr(self.has_sched_warp):
            if warp_idx == self.sched_warp_id:
                self._scheduler(table, ring).serve_claims(sched_buf, trace)

        # ---- MMA warp
        if warp_idx == self.mma_warp_id:
            self._mma_role(
                table, ring, tmem, tCtAcc_fake, tiled_mma, ab_consumer, acc_pipeline, tCrA, tCrB, k_tile_cnt,
                is_leader_cta, trace,
            )

        # ---- epilogue warps: registers -> global, rows bounded by the group's end
        if warp_idx < self.mma_warp_id:
            tmem.allocate(self.num_tmem_alloc_cols)
            tCtAcc_base = self._accumulators(tmem, tCtAcc_fake)
            acc_consumer_state = pipeline.make_pipeline_state(
                pipeline.PipelineUserType.Consumer, self.num_acc_stage
            )
            tiler_c = cute.slice_(self.mma_tiler, (None, None, 0))
            sched = self._scheduler(table, ring)
            work = sched.initial_work()
            while work.is_valid:
                m, n, g = work.tile
                row0 = table.bounds[g] + (m // cute.size(tiled_mma.thr_id.shape)) * mma_m_rows
                end = table.bounds[g + 1]
                work = sched.advance()
                # C and its coordinates cut at the group's end, from the tile's first row.
                mC_g = cute.make_tensor(mC_mnl.iterator, cute.make_layout((end, n_total, 1), stride=mC_mnl.stride))
                gC = cute.local_tile(cute.domain_offset((row0, 0, 0), mC_g), tiler_c, (None, None, None))
                cC = cute.local_tile(
                    cute.domain_offset((row0, 0, 0), cute.make_identity_tensor(mC_g.shape)), tiler_c,
                    (None, None, None),
                )
                acc_consumer_state = epilogue(
                    self, tidx, tCtAcc_base, thr_mma.partition_C(gC), epi_tile, lambda x: x,
                    (Int32(0), n, Int32(0)), acc_consumer_state, acc_pipeline,
                    thr_mma.partition_C(cC), mC_g,
                )
                if const_expr(trace is not None):
                    # Every epilogue thread stores its own rows: thread 0's
                    # last store stands for the tile's.
                    if tidx == 0:
                        trace.record((m, n, g), None, trace_now())
            tmem.relinquish_alloc_permit()
            tmem.free(tCtAcc_base.iterator)

    def _scheduler(self, table: GroupTable, ring, k_tiles=None):
        """The grouped walk: work indices decode to (tile, group) through the
        group table (whole tiles: `k_tiles` is for stream-K, which grouped
        GEMM does not take)."""
        if const_expr(self.cfg.scheduler == "clc"):
            return GroupedClcScheduler.create(self.sched, table, ring)
        return GroupedTileScheduler.create(self.sched, table, ring)
