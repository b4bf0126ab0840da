"""Grouped GEMM for Hopper (sm_90a): G problems in one persistent launch.

Built on `Sm90GemmKernel` (same warp roles, pipelines, WGMMA mainloop and
TMA-store epilogue); what changes is which operand coordinates a tile reads
and writes, decoded per tile from `kernels.grouped`'s on-device group table.
Two forms, both driven by ``offs`` (int32, cumulative group ends on device):

- ``"rows"`` (MoE, as ``torch._grouped_mm``): A (total_M, K), B (G, N, K)
  ("tn") or (G, K, N) ("nn"), out (total_M, N); group g owns rows
  ``[offs[g-1], offs[g])``. One TMA descriptor covers all of A: a tile reads
  from its group's first row plus its own offset, so rows of the next group
  may be loaded but never stored. Tiles that end inside their group store
  by TMA; a group's last, partial tile leaves smem in row-masked copies,
  so the next group's rows stay untouched.
- ``"k"`` (G problems of M x N with their own K, packed along K): A (M, ΣK),
  B (N, ΣK) ("tn") or (ΣK, N) ("nn"), out (G, M, N); group g is the K range
  ``[offs[g-1], offs[g])``, each a multiple of `TILE_K` so a k-block never
  straddles two groups. Packing keeps one descriptor per operand, so no
  descriptor is rewritten in the kernel. With split_k S every tile of a
  group is S units, each an even share of the group's k-blocks, reduced in
  the kernel as the dense split-K is (`kernels.partials`): where a few
  groups are much deeper than the rest, their tiles alone would leave most
  SMs idle or, with wide tiles, too few to fill the device.
"""

from __future__ import annotations

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Int32, Int64, const_expr
from cutlass.pipeline import pipeline_init_wait

from kernels.group_table import GroupedTileScheduler, GroupTable
from kernels.grouped import FORMS, MAX_GROUPS
from kernels.partials import PartialScratch, SliceSlots
from kernels.schedulers import TileGrid
from kernels.sm90.gemm import (
    _LOAD_WARP,
    _SCHED_WARP,
    _SMEM_ALIGN,
    _THREADS_PER_GROUP,
    _WARPS_PER_GROUP,
    Sm90GemmKernel,
)
from kernels.space import TILE_K, GemmConfig, InvalidConfig
from kernels.trace_device import TileTrace
from kernels.trace_device import now as trace_now

# The warp that builds the group table (free before the roles split).
_TABLE_WARP = 2


class Sm90GroupedGemmKernel(Sm90GemmKernel):
    """``__call__(a, b, out, offs, sched_buf, max_clusters, stream)``; see the module doc."""

    def __init__(self, cfg: GemmConfig, layout: str = "tn", form: str = "rows"):
        super().__init__(cfg, layout)
        self.can_implement_grouped(cfg, form)
        self.form = form

    @staticmethod
    def can_implement_grouped(cfg: GemmConfig, form: str) -> None:
        if form not in FORMS:
            raise InvalidConfig(f"unknown grouped form {form!r}; expected one of {FORMS}")
        if cfg.split_k != 1 and form != "k":
            raise InvalidConfig("grouped kernels split K only in the k form (groups with their own K)")
        if cfg.pingpong:
            raise InvalidConfig("grouped kernels have cooperative consumers only")
        if cfg.tile_k != TILE_K:
            raise InvalidConfig(f"grouped kernels walk K in stages of {TILE_K}")
        if cfg.pdl:
            raise InvalidConfig("grouped kernels launch without pdl: their B need not be a constant weight")

    # ------------------------------------------------------------------ host side

    def _grouped_views(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor):
        """(m, k, l), (n, k, l), (m, n, l) views; l is the group where the operand has one."""
        m, k = a.shape
        a3 = cute.make_tensor(a.iterator, cute.make_layout((m, k, 1), stride=(a.stride[0], 1, 0)))
        if const_expr(self.form == "rows"):
            groups, _, _ = b.shape
            if const_expr(self.layout == "tn"):
                n = b.shape[1]
                b3 = cute.make_tensor(b.iterator, cute.make_layout((n, k, groups), stride=(b.stride[1], 1, b.stride[0])))
            else:
                n = b.shape[2]
                b3 = cute.make_tensor(b.iterator, cute.make_layout((n, k, groups), stride=(1, b.stride[1], b.stride[0])))
            c3 = cute.make_tensor(c.iterator, cute.make_layout((m, n, 1), stride=(c.stride[0], 1, 0)))
        else:
            if const_expr(self.layout == "tn"):
                n = b.shape[0]
                b3 = cute.make_tensor(b.iterator, cute.make_layout((n, k, 1), stride=(b.stride[0], 1, 0)))
            else:
                n = b.shape[1]
                b3 = cute.make_tensor(b.iterator, cute.make_layout((n, k, 1), stride=(1, b.stride[0], 0)))
            c3 = cute.make_tensor(c.iterator, cute.make_layout((m, n, c.shape[0]), stride=(c.stride[1], 1, c.stride[0])))
        return a3, b3, c3

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
        a3, b3, c3 = self._grouped_views(a, b, c)
        tma_a, ta, tma_b, tb, tma_c, tc = self._tma_atoms(a3, b3, c3)
        tm, tn, _ = self.tile_mnk
        # Upper bound of the work: the launch must not depend on offs (no sync).
        cluster_rows = tm * self.cluster_mn[0]
        clusters_n = (c3.shape[1] + tn * self.cluster_mn[1] - 1) // (tn * self.cluster_mn[1])
        groups = offs.shape[0]
        if const_expr(self.form == "rows"):
            bound = ((c3.shape[0] + cluster_rows - 1) // cluster_rows + groups) * clusters_n
        else:
            bound = (c3.shape[0] + cluster_rows - 1) // cluster_rows * clusters_n * groups * self.split_k
        clusters = bound
        if const_expr(self.sched.kind != "single_tile"):
            clusters = cutlass.min(bound, max_clusters)

        @cute.struct
        class SharedStorage:
            load_bars: cute.struct.MemRange[Int64, 2 * self.stages]
            ring_bars: cute.struct.MemRange[Int64, self.ring_words[0]]
            ring_slots: cute.struct.Align[cute.struct.MemRange[Int32, self.ring_words[1]], 16]
            bounds: cute.struct.Align[cute.struct.MemRange[Int32, MAX_GROUPS + 1], 16]
            starts: cute.struct.Align[cute.struct.MemRange[Int32, MAX_GROUPS + 1], 16]
            order: cute.struct.Align[cute.struct.MemRange[cutlass.Uint8, MAX_GROUPS], 16]
            heavy: cute.struct.MemRange[Int32, 1]
            arrivals: cute.struct.MemRange[Int32, 1]
            sA: cute.struct.Align[cute.struct.MemRange[self.a_dtype, cute.cosize(self.a_smem)], _SMEM_ALIGN]
            sB: cute.struct.Align[cute.struct.MemRange[self.b_dtype, cute.cosize(self.b_smem)], _SMEM_ALIGN]
            sC: cute.struct.Align[cute.struct.MemRange[self.c_dtype, cute.cosize(self.c_smem)], _SMEM_ALIGN]

        self.shared_storage = SharedStorage
        self.grouped_kernel(
            tma_a, ta, tma_b, tb, tma_c, tc, c3, offs, self.tiled_mma, self.a_smem, self.b_smem, self.c_smem,
            sched_buf, self._trace_buf,
        ).launch(
            grid=(self.cluster_mn[0] * clusters, self.cluster_mn[1], 1),
            block=[self.threads, 1, 1],
            cluster=(*self.cluster_mn, 1),
            min_blocks_per_mp=1,
            stream=stream,
        )

    @cute.jit
    def traced(self, a: cute.Tensor, b: cute.Tensor, c: cute.Tensor, offs: cute.Tensor, sched_buf: cute.Tensor,
               max_clusters: Int32, trace_buf: cute.Tensor, stream):
        """`__call__` with every tile's record written to `trace_buf` (`kernels.trace`)."""
        self._trace_buf = trace_buf
        self.__call__(a, b, c, offs, sched_buf, max_clusters, stream)

    # ------------------------------------------------------------------ device side

    @cute.kernel
    def grouped_kernel(
        self,
        tma_a: cute.CopyAtom,
        mA: cute.Tensor,
        tma_b: cute.CopyAtom,
        mB: cute.Tensor,
        tma_c: cute.CopyAtom,
        mC: cute.Tensor,
        c3: cute.Tensor,
        offs: cute.Tensor,
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

        (cluster_layout, cluster_coord, a_mask, b_mask, storage, load_pipe, ring, _,
         sA, sB, sC) = self._cta_start(a_smem, b_smem, c_smem)

        tm, tn, tk = self.tile_mnk
        m_total, n_total, _ = c3.shape
        clusters_n = (n_total + tn * self.cluster_mn[1] - 1) // (tn * self.cluster_mn[1])
        cluster_rows = tm * self.cluster_mn[0]
        table = GroupTable(
            self.form,
            storage,
            offs.shape[0],
            (m_total + cluster_rows - 1) // cluster_rows,
            clusters_n,
            cluster_rows,
            self.split_k,
        )
        table.build(offs, m_total if const_expr(self.form == "rows") else mA.shape[1], warp_idx == _TABLE_WARP)
        cute.arch.sync_threads()

        group_idx = cute.arch.make_warp_uniform(tidx // _THREADS_PER_GROUP)
        pipeline_init_wait(cluster_shape_mn=self.cluster_mn)
        trace = None
        if const_expr(trace_buf is not None):
            # Slots for every group's tiles up to the largest group's (all rows).
            trace = TileTrace.create(trace_buf, table, self.cluster_mn)

        if group_idx == 0:
            cute.arch.setmaxregister_decrease(self.producer_regs)
            if warp_idx == _LOAD_WARP:
                sched = GroupedTileScheduler.create(self.sched, table, ring)
                work = sched.initial_work()
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.stages)
                while work.is_valid:
                    m, n, g = work.tile
                    row0, k0, k_tiles, la, lb, _, _ = self._placement(table, m, g, mA.shape[1])
                    gA = cute.local_tile(cute.domain_offset((row0, k0, 0), mA), (tm, tk), (0, None, la))
                    gB = cute.local_tile(cute.domain_offset((0, k0, 0), mB), (tn, tk), (n, None, lb))
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
                    state = self._load_tile(
                        sched, load_pipe, state, Int32(0), k_tiles, tma_a, tAgA, tAsA, a_mask, tma_b, tBgB, tBsB,
                        b_mask,
                    )
                    work = sched.advance()
                load_pipe.producer_tail(state)
            if warp_idx == _SCHED_WARP:
                GroupedTileScheduler.create(self.sched, table, ring).serve_claims(sched_buf, trace)
        else:
            cute.arch.setmaxregister_increase(self.consumer_regs)
            self._consume_grouped(
                tiled_mma, load_pipe, sA, sB, sC, mC, c3, tma_c, table, mA.shape[1], tidx, warp_idx, group_idx,
                GroupedTileScheduler.create(self.sched, table, ring), sched_buf,
                storage.arrivals.get_tensor(cute.make_layout(1)), trace,
            )

    def _placement(self, table: GroupTable, m, u, k_packed):
        """Where tile (m, ., u) lives: (first row, first k, k-tiles, l of A, l of B, l of C, rows left).

        `u` is the group, or in the k form group * split_k + K slice."""
        tm = self.tile_mnk[0]
        if const_expr(self.form == "rows"):
            lo = table.bounds[u]
            row0 = lo + m * tm
            return row0, Int32(0), (k_packed + TILE_K - 1) // TILE_K, Int32(0), u, Int32(0), table.bounds[u + 1] - row0
        g = u // self.split_k
        s = u - g * self.split_k
        lo = table.bounds[g]
        blocks = (table.bounds[g + 1] - lo) // TILE_K
        first = s * blocks // self.split_k
        last = (s + 1) * blocks // self.split_k
        return m * tm, lo + first * TILE_K, last - first, Int32(0), Int32(0), g, Int32(tm)

    @cute.jit
    def _consume_grouped(
        self, tiled_mma, load_pipe, sA, sB, sC, mC, c3, tma_c, table, k_packed, tidx, warp_idx, group_idx, sched,
        sched_buf, arrivals, trace=None,
    ):
        """Consumer warpgroups: the dense mainloop, the split-K fixup and the
        epilogue at the tile's group coordinates."""
        tm, tn, _ = self.tile_mnk
        mma_tidx = tidx - _THREADS_PER_GROUP
        thr_mma = tiled_mma.get_slice(
            cute.make_layout(self.mma_groups, stride=_THREADS_PER_GROUP)(group_idx - 1)
        )
        tCrA = tiled_mma.make_fragment_A(thr_mma.partition_A(sA))
        tCrB = tiled_mma.make_fragment_B(thr_mma.partition_B(sB))
        acc = cute.make_rmem_tensor(thr_mma.partition_C(cute.make_identity_tensor((tm, tn))).shape, cutlass.Float32)
        epi = self._epilogue(tiled_mma, sC, acc, mma_tidx, warp_idx)
        s2g = self._row_copy(mma_tidx)
        read = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        release = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.stages)
        subtiles_done = Int32(0)
        n_total = c3.shape[1]
        scratch = None
        if const_expr(self.split_k > 1):
            # One semaphore and split_k slots per CTA tile of every group's output.
            every = TileGrid(table.clusters_m * table.groups, table.clusters_n, Int32(1))
            scratch = PartialScratch.create(sched_buf, arrivals, every, self.cluster_mn)
            tiles_m = table.clusters_m * self.cluster_mn[0]

        work = sched.initial_work()
        while work.is_valid:
            m, n, u = work.tile
            row0, _, k_tiles, _, _, lc, rows_left = self._placement(table, m, u, k_packed)
            if const_expr(trace is not None):
                start = trace_now()
            read, release = self._mma_tile(tiled_mma, load_pipe, tCrA, tCrB, acc, k_tiles, read, release)
            if const_expr(self.split_k > 1):
                tile_id = scratch.tile_id(lc * tiles_m + m, n)
                if self._reduce_partials(scratch, acc, tile_id, Int32(self.split_k), u - lc * self.split_k,
                                         SliceSlots(tile_id, self.split_k), mma_tidx, epi.bar):
                    gC = cute.local_tile(cute.domain_offset((row0, 0, 0), mC), (tm, tn), (0, n, lc))
                    subtiles_done = self._store_tile(epi, acc, tma_c, gC, subtiles_done)
            elif rows_left >= tm:
                gC = cute.local_tile(cute.domain_offset((row0, 0, 0), mC), (tm, tn), (0, n, lc))
                subtiles_done = self._store_tile(epi, acc, tma_c, gC, subtiles_done)
            else:
                gC = cute.local_tile(cute.domain_offset((row0, 0, 0), c3), (tm, tn), (0, n, lc))
                subtiles_done = self._store_rows(epi, s2g, gC, rows_left, n_total - n * tn, subtiles_done)
            if const_expr(trace is not None):
                if mma_tidx == 0:
                    trace.record(work.tile, start, trace_now())
            work = sched.advance()
        epi.store_pipe.producer_tail()

    def _row_copy(self, mma_tidx):
        """This thread's slice of a 16-byte-per-thread copy of an epilogue sub-tile, row by row."""
        vec = 128 // self.c_dtype.width
        per_row = self.epi_tile[1] // vec
        atom = cute.make_copy_atom(cute.nvgpu.CopyUniversalOp(), self.c_dtype, num_bits_per_copy=128)
        threads = cute.make_ordered_layout((self.mma_threads // per_row, per_row), order=(1, 0))
        return atom, cute.make_tiled_copy_tv(atom, threads, cute.make_layout((1, vec))).get_slice(mma_tidx)

    @cute.jit
    def _store_rows(self, e, s2g, gC_tile, rows_left, cols_left, subtiles_done):
        """Store the first `rows_left` rows of a tile whose group ends inside it.

        TMA stores cannot stop at the group's last row, so the sub-tiles go
        through the same smem buffers and leave them in row-masked 16-byte
        copies: coalesced, unlike per-accumulator stores. Returns the
        sub-tiles staged so far.
        """
        atom, thr_copy = s2g
        tm, tn, _ = self.tile_mnk
        # Earlier tiles' TMA stores may still read the buffers about to be rewritten.
        store_pipe, store_warp = e.store_pipe, e.store_warp
        if store_warp:
            store_pipe.producer_tail()
        e.bar.arrive_and_wait()
        coords = cute.make_identity_tensor((tm, tn))
        subtiles = tn // self.epi_tile[1]
        for sub in cutlass.range_constexpr(subtiles):
            buf = (subtiles_done + sub) % self.epi_stages
            self._stage_subtile(e, sub, buf)
            # One barrier a sub-tile: a buffer is rewritten only `epi_stages`
            # sub-tiles later, after every thread passed a later barrier.
            e.bar.arrive_and_wait()
            src = thr_copy.partition_S(e.sC[(None, None, buf)])
            dst = thr_copy.partition_D(cute.local_tile(gC_tile, self.epi_tile, (0, sub)))
            at = thr_copy.partition_D(cute.local_tile(coords, self.epi_tile, (0, sub)))
            for i in cutlass.range_constexpr(cute.size(src, mode=[1])):
                r, col = at[(0, i, 0)]
                if r < rows_left and col < cols_left:
                    cute.copy(atom, src[(None, i, None)], dst[(None, i, None)])
        return subtiles_done + subtiles
