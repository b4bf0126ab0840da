"""Cluster Launch Control (CLC) tile scheduling for the sm100 GEMM.

The grid covers every cluster tile (optionally a padded worst case). Each
cluster starts on the tile its blockIdx names; afterwards the scheduler warp
of the cluster's leader CTA steals not-yet-launched clusters with
`clusterlaunchcontrol.try_cancel` and every warp of every CTA in the cluster
decodes the stolen cluster's id from the 16-byte response.

- One elected thread of the leader's scheduler warp issues every try_cancel;
  with more than one CTA per cluster the response is multicast
  (`.multicast::cluster::all`) into each CTA's copy of the response ring.
- The ring has `sched_depth` slots guarded by a PipelineClcFetchAsync. The
  scheduler warp waits for the response of its own query before issuing the
  next one, so at most one query is in flight and no try_cancel ever follows
  an observed failure (undefined behaviour per the PTX ISA). Depth is how far
  the scheduler may run ahead of the slowest consumer warp: deeper hides the
  CLC round trip but reserves tiles early, which costs balance (seed article
  on CLC: deep pipelines hurt).
- Tail cancel: on a padded grid a granted cluster may lie past the real work.
  Grants come in increasing order, so such a phantom grant proves that no
  real tile is still pending: the scheduler warp then fires a capped burst of
  try_cancels whose responses are never decoded (so no failure is observed),
  draining phantom clusters instead of letting each one launch, spin up and
  exit. It waits for the burst's transactions before the CTA exits, because a
  response landing in the smem of an exited CTA is undefined.
  Only a *granted* phantom triggers the burst: a failed query says nothing
  about the pool, and bursting on it could cancel real clusters.
"""


from dataclasses import dataclass
from typing import Optional

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass.cutlass_dsl import Boolean, Int32, extract_mlir_values, new_from_mlir_values

from kernels.space import GemmConfig

# Bytes of one try_cancel response; every ring slot is one response.
RESPONSE_BYTES = 16
_SLOT_WORDS = RESPONSE_BYTES // 4
# Most try_cancels one retiring cluster fires at a phantom tail. A cluster
# that finds a phantom has no work left, so the burst only delays its own
# exit; beyond a few dozen the phantoms are cheaper to launch than to cancel.
TAIL_CANCEL_BURST = 16


@dataclass(frozen=True)
class RingSize:
    stages: int
    words: int


def ring_slots(cfg: GemmConfig) -> int:
    """16-byte slots the scheduler needs: its ring and the tail-cancel burst's."""
    stages = cfg.sched_depth if cfg.dynamic else 0
    tail = TAIL_CANCEL_BURST if cfg.tail_cancel else 0
    return max(1, stages + tail)


def ring_words(cfg: GemmConfig) -> RingSize:
    """Smem the scheduler needs, in Int32 words, and the depth of its ring."""
    return RingSize(cfg.sched_depth if cfg.dynamic else 0, ring_slots(cfg) * _SLOT_WORDS)


class SchedulerParams:
    """Host-side problem description handed to the kernel (runtime sizes, static policy)."""

    def __init__(
        self,
        cfg: GemmConfig,
        clusters_mn: tuple,
        max_active_clusters: Int32,
        rows: Optional[cute.Tensor],
        cluster_tile_m: int,
    ):
        self.cfg = cfg
        self.clusters_mn = clusters_mn
        self.max_active_clusters = max_active_clusters
        self.rows = rows
        self.cluster_tile_m = cluster_tile_m

    def __extract_mlir_values__(self):
        values = extract_mlir_values(self.clusters_mn) + extract_mlir_values(self.max_active_clusters)
        self._n_rows_values = 0
        if self.rows is not None:
            rows_values = extract_mlir_values(self.rows)
            self._n_rows_values = len(rows_values)
            values += rows_values
        return values

    def __new_from_mlir_values__(self, values):
        clusters_mn = new_from_mlir_values(self.clusters_mn, values[:2])
        max_active = new_from_mlir_values(self.max_active_clusters, values[2:3])
        rows = None
        if self.rows is not None:
            rows = new_from_mlir_values(self.rows, values[3:3 + self._n_rows_values])
        return SchedulerParams(self.cfg, clusters_mn, max_active, rows, self.cluster_tile_m)

    def grid_clusters(self):
        """Clusters to launch: every tile for single_tile and clc, else at most one wave."""
        total = self.clusters_mn[0] * self.clusters_mn[1]
        if cutlass.const_expr(self.cfg.persistent and self.cfg.scheduler != "clc"):
            total = cutlass.min(total, self.max_active_clusters)
        return total

    def grid(self):
        return (self.cfg.cluster_m * self.grid_clusters(), self.cfg.cluster_n, 1)


def make_params(cfg: GemmConfig, c: cute.Tensor, cta_tile_mn: tuple, max_active_clusters, rows=None):
    """Scheduler parameters for output `c`, tiled by CTA tiles of `cta_tile_mn`."""
    cluster_tile_m = cta_tile_mn[0] * cfg.cluster_m
    cluster_tile_n = cta_tile_mn[1] * cfg.cluster_n
    clusters_m = Int32((c.shape[0] + cluster_tile_m - 1) // cluster_tile_m)
    clusters_n = Int32((c.shape[1] + cluster_tile_n - 1) // cluster_tile_n)
    return SchedulerParams(cfg, (clusters_m, clusters_n), Int32(max_active_clusters), rows, cluster_tile_m)


class Work:
    """A work tile: CTA-tile coordinate (m, n, l), its cluster's linear id, validity.

    `cursor` is the reading position of a ring-fed scheduler. It lives in the
    work record, which every role loop rebinds, because the DSL threads loop
    state through rebound locals only, never through attributes of another
    object.
    """

    def __init__(self, tile_idx, linear: Int32, is_valid_tile: Boolean, cursor=None):
        self.tile_idx = tile_idx
        self.linear = linear
        self.is_valid_tile = is_valid_tile
        self.cursor = cursor

    def __extract_mlir_values__(self):
        values = (
            extract_mlir_values(self.tile_idx)
            + extract_mlir_values(self.linear)
            + extract_mlir_values(self.is_valid_tile)
        )
        if self.cursor is not None:
            values += extract_mlir_values(self.cursor)
        return values

    def __new_from_mlir_values__(self, values):
        cursor = None
        if self.cursor is not None:
            cursor = new_from_mlir_values(self.cursor, values[5:])
        return Work(
            new_from_mlir_values(self.tile_idx, values[:3]),
            new_from_mlir_values(self.linear, values[3:4]),
            new_from_mlir_values(self.is_valid_tile, values[4:5]),
            cursor,
        )


@cute.jit
def _decode(params: SchedulerParams, linear: Int32, real_clusters_m: Int32) -> tuple:
    """Cluster (m, n) of a linear cluster id: `swizzle`-wide bands walked along `raster`."""
    cfg = params.cfg
    cm_total = real_clusters_m
    cn_total = params.clusters_mn[1]
    if cutlass.const_expr(cfg.raster == "n"):
        cm_total, cn_total = cn_total, cm_total
    band_tiles = cfg.swizzle * cm_total
    band = linear // band_tiles
    rest = linear - band * band_tiles
    width = cutlass.min(cfg.swizzle, cn_total - band * cfg.swizzle)
    major = rest // width
    minor = band * cfg.swizzle + rest - major * width
    cm, cn = major, minor
    if cutlass.const_expr(cfg.raster == "n"):
        cm, cn = minor, major
    return cm, cn


class _Base:
    """Tile walk shared by every scheduler: blockIdx gives the first cluster id."""

    def __init__(self, params: SchedulerParams):
        self.params = params
        cfg = params.cfg
        bidx, bidy, _ = cute.arch.block_idx()
        self.cta_in_cluster = (bidx % cfg.cluster_m, bidy)
        self.first_linear = bidx // cfg.cluster_m
        real_m = params.clusters_mn[0]
        if cutlass.const_expr(params.rows is not None):
            real_m = (params.rows[0] + params.cluster_tile_m - 1) // params.cluster_tile_m
        self.real_clusters_m = real_m
        self.real_clusters = real_m * params.clusters_mn[1]

    # A scheduler is immutable after kernel start (its values dominate every
    # role's branch); all per-warp state travels in the Work record.
    def __extract_mlir_values__(self):
        return []

    def __new_from_mlir_values__(self, values):
        return self

    @cute.jit
    def _work(self, linear: Int32, granted: Boolean, cursor=None) -> Work:
        valid = granted & (linear < self.real_clusters)
        cm, cn = _decode(self.params, linear, self.real_clusters_m)
        cfg = self.params.cfg
        tile = (cm * cfg.cluster_m + self.cta_in_cluster[0], cn * cfg.cluster_n + self.cta_in_cluster[1], Int32(0))
        return Work(tile, linear, valid, cursor)

    def _first_cursor(self):
        return None

    def initial_work(self) -> Work:
        return self._work(self.first_linear, Boolean(True), self._first_cursor())


class StaticScheduler(_Base):
    """single_tile (one tile per cluster) and static_persistent (stride = clusters launched)."""

    @cute.jit
    def next_work(self, work: Work) -> Work:
        if cutlass.const_expr(not self.params.cfg.persistent):
            return self._work(work.linear, Boolean(False))
        grid_clusters = cute.arch.grid_dim()[0] // self.params.cfg.cluster_m
        return self._work(work.linear + grid_clusters, Boolean(True))


class ClcScheduler(_Base):
    """Consumer and producer sides of the CLC ring (see the module docstring)."""

    def __init__(
        self,
        params: SchedulerParams,
        ring: pipeline.PipelineClcFetchAsync,
        slots: cute.Pointer,
        tail_mbar: cute.Pointer,
    ):
        super().__init__(params)
        self.ring = ring
        # (words, slot): slicing a slot keeps the 16-byte alignment query_cancel needs.
        self.slots = cute.make_tensor(slots, cute.make_layout((_SLOT_WORDS, ring_slots(params.cfg))))
        self.tail_mbar = tail_mbar

    def _first_cursor(self):
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, self.params.cfg.sched_depth)

    def _slot(self, index) -> cute.Pointer:
        return self.slots[None, index].iterator

    @cute.jit
    def next_work(self, work: Work) -> Work:
        """Wait for the next response in the ring, decode it, free the slot."""
        cursor = work.cursor
        self.ring.consumer_wait(cursor)
        x, _, _, granted = cute.arch.clc_response(self._slot(cursor.index))
        # The response was written by the async proxy; order this generic
        # read before the release lets the next query overwrite the slot.
        cute.arch.fence_proxy("async.shared", space="cta")
        self.ring.consumer_release(cursor)
        cursor.advance()
        linear = x // self.params.cfg.cluster_m
        return self._work(linear, Boolean(granted != 0), cursor)

    @cute.jit
    def produce(self, work: Work):
        """Scheduler warp of the leader CTA: one query per tile until a query fails or a phantom is granted."""
        cfg = self.params.cfg
        if cute.arch.block_idx_in_cluster() == 0:
            producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, cfg.sched_depth)
            last = work
            while work.is_valid_tile:
                self.ring.producer_acquire(producer)
                mbar = self.ring.producer_get_barrier(producer)
                with cute.arch.elect_one():
                    cute.arch.issue_clc_query(mbar, self._slot(producer.index), multicast=cfg.cluster_size > 1)
                producer.advance()
                work = self.next_work(work)
                last = work
            self.ring.producer_tail(producer)
            if cutlass.const_expr(cfg.tail_cancel):
                self._cancel_tail(last)

    @cute.jit
    def _cancel_tail(self, last: Work):
        # `last` is the response that ended the loop: granted but past the
        # real work means a phantom, and every real tile is already taken.
        grid_clusters = cute.arch.grid_dim()[0] // self.params.cfg.cluster_m
        phantom = last.linear < grid_clusters
        phantom = phantom & (last.linear >= self.real_clusters)
        budget = cutlass.min(Int32(TAIL_CANCEL_BURST), grid_clusters - last.linear - 1)
        if phantom & (budget > 0):
            first = self.params.cfg.sched_depth
            with cute.arch.elect_one():
                cute.arch.mbarrier_init(self.tail_mbar, 1)
                cute.arch.mbarrier_init_fence()
                cute.arch.mbarrier_arrive_and_expect_tx(self.tail_mbar, budget * RESPONSE_BYTES)
                for i in cutlass.range_constexpr(TAIL_CANCEL_BURST):
                    if i < budget:
                        cute.arch.issue_clc_query(self.tail_mbar, self._slot(first + i), multicast=False)
            cute.arch.mbarrier_wait(self.tail_mbar, 0)


def make_scheduler(
    cfg: GemmConfig,
    params: SchedulerParams,
    ring_mbar: cute.Pointer,
    slots: cute.Pointer,
    tail_mbar: cute.Pointer,
    cluster_layout_vmnk: cute.Layout,
    warps_per_cta: int,
):
    """The scheduler of `cfg`, built by every thread at kernel start (barrier inits included)."""
    if cfg.scheduler == "dynamic_persistent":
        raise NotImplementedError("the atomic-counter scheduler is not wired into the sm100 kernel yet")
    if cfg.scheduler != "clc":
        return StaticScheduler(params)
    # Every warp of every CTA consumes each response, except the scheduler
    # warps of non-leader CTAs, which have nothing to do.
    consumers = 32 * (cfg.cluster_size * (warps_per_cta - 1) + 1)
    ring = pipeline.PipelineClcFetchAsync.create(
        barrier_storage=ring_mbar,
        num_stages=cfg.sched_depth,
        producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
        consumer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, consumers),
        tx_count=RESPONSE_BYTES,
        cta_layout_vmnk=cluster_layout_vmnk,
        defer_sync=True,
    )
    return ClcScheduler(params, ring, slots, tail_mbar)
