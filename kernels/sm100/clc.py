"""Cluster Launch Control (CLC): Blackwell's hardware dynamic tile scheduler.

The same interface as `kernels.schedulers.TileScheduler` (create,
initial_work, advance, serve_claims) with the same work-index decode; only
the way a cluster finds its next index differs:

- The grid covers every cluster tile (optionally a padded worst case) and a
  cluster starts on the index its blockIdx names.
- Afterwards the scheduler warp of the cluster's leader CTA steals a
  not-yet-launched cluster with `clusterlaunchcontrol.try_cancel`, issued by
  one elected thread; with more than one CTA per cluster the 16-byte response
  is multicast (`.multicast::cluster::all`) into every CTA's ring slot, and
  every warp of every CTA decodes the stolen cluster's index itself.
- The ring has `sched_depth` slots (a PipelineClcFetchAsync). The scheduler
  warp decodes the response of its own query before it issues the next one,
  so at most one query is in flight and no try_cancel ever follows an
  observed failure (undefined behaviour in the PTX ISA). The depth is how far
  the scheduler may run ahead of the slowest warp: deeper hides the CLC round
  trip but reserves tiles early, which costs balance.
- Tail cancel (`tail_cancel`): on a padded grid a granted cluster may lie
  past the real work. Grants come in launch order, so a granted phantom
  proves no real tile is pending: the scheduler warp fires a capped burst of
  try_cancels whose responses it never decodes (no failure is observed, so
  the burst is legal), draining phantom clusters instead of letting each one
  launch, start up and exit. It waits for the burst's transactions before
  the CTA exits, because a response landing in the shared memory of an
  exited CTA is undefined. A failed query never triggers the burst: it says
  nothing about what is still pending.
"""

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Boolean, Int32, const_expr

from kernels.schedulers import SchedulerSpec, TileGrid, TileScheduler, WorkTile
from kernels.trace_device import now as trace_now

# Bytes of one try_cancel response; one ring slot holds one response.
RESPONSE_BYTES = 16
_SLOT_WORDS = RESPONSE_BYTES // 4
# Most try_cancels one retiring cluster fires at a phantom tail. The burst
# delays only that cluster's exit; past a few dozen, phantoms are cheaper to
# launch than to cancel (the seed article's tiers top out similarly).
TAIL_CANCEL_BURST = 16


@dataclass(frozen=True)
class ClcSpec(SchedulerSpec):
    """A `SchedulerSpec` of kind "clc"; `depth` is the CLC pipeline depth."""

    kind: str = "clc"
    tail_cancel: bool = False

    def __post_init__(self) -> None:
        if self.kind != "clc":
            raise ValueError(f"a ClcSpec is of kind 'clc', not {self.kind!r}")

    @staticmethod
    def from_config(cfg) -> "ClcSpec":
        return ClcSpec(
            cluster_mn=(cfg.cluster_m, cfg.cluster_n), swizzle=cfg.swizzle, raster_m=cfg.raster == "m",
            depth=cfg.sched_depth, tail_cancel=cfg.tail_cancel,
        )

    @property
    def slots(self) -> int:
        return self.depth + (TAIL_CANCEL_BURST if self.tail_cancel else 0)

    def grid_shape(self, grid: TileGrid, max_clusters: Int32, k_tiles: Int32 | None = None) -> tuple:
        """Every cluster tile is launched: CLC steals from the launch queue, it never sizes it."""
        return (self.cluster_mn[0] * grid.count, self.cluster_mn[1], 1)


def storage_words(spec: ClcSpec) -> tuple[int, int]:
    """(Int64 mbarriers, Int32 words) a kernel reserves: the ring, the tail burst's barrier and slots."""
    return 2 * spec.depth + 1, _SLOT_WORDS * spec.slots


class ClcRing:
    """The response ring: its pipeline and its 16-byte slots."""

    def __init__(self, spec: ClcSpec, pipe: pipeline.PipelineClcFetchAsync, slots: cute.Tensor, tail_bar):
        self.spec = spec
        self.pipe = pipe
        self.slots = slots
        self.tail_bar = tail_bar

    # Immutable after kernel start: nothing to thread through loops.
    def __extract_mlir_values__(self) -> list:
        return []

    def __new_from_mlir_values__(self, values: list) -> "ClcRing":
        return self

    @staticmethod
    def create(spec: ClcSpec, barriers: cute.Pointer, slots: cute.Pointer, consumer_warps: int,
               cluster_layout_vmnk: cute.Layout) -> "ClcRing":
        """Initialise the barriers; the kernel's cluster-wide barrier-init sync must follow.

        `consumer_warps` per CTA read every response; the leader's scheduler
        warp reads them too, to know when to stop.
        """
        pipe = pipeline.PipelineClcFetchAsync.create(
            barrier_storage=barriers,
            num_stages=spec.depth,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, consumer_warps * spec.cluster_size + 1
            ),
            tx_count=RESPONSE_BYTES,
            cta_layout_vmnk=cluster_layout_vmnk,
            defer_sync=True,
        )
        # (word, slot): slicing one slot keeps the 16-byte alignment query_cancel needs.
        tensor = cute.make_tensor(slots, cute.make_layout((_SLOT_WORDS, spec.slots)))
        return ClcRing(spec, pipe, tensor, barriers + 2 * spec.depth)

    def slot(self, index) -> cute.Pointer:
        return self.slots[None, index].iterator

    def receive(self, state: pipeline.PipelineState) -> tuple[Int32, Boolean]:
        """Called by every lane of a consuming warp: (first CTA x of the stolen cluster, granted)."""
        self.pipe.consumer_wait(state)
        x, _, _, granted = cute.arch.clc_response(self.slot(state.index))
        # The response came through the async proxy; order this generic read
        # before the release lets the next query overwrite the slot.
        cute.arch.fence_proxy("async.shared", space="cta")
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            self.pipe.consumer_release(state)
        return x, Boolean(granted != 0)

    @cute.jit
    def query(self, state: pipeline.PipelineState, clocked: cutlass.Constexpr[bool] = False):
        """Called by every lane of the leader's scheduler warp: arm every CTA's slot, issue one try_cancel.

        With `clocked` it returns the %globaltimer of the issue, read after
        the wait for a free slot (the depth's doing, not the query's).
        """
        self.pipe.producer_acquire(state)
        asked = None
        if const_expr(clocked):
            asked = trace_now()
        with cute.arch.elect_one():
            cute.arch.issue_clc_query(
                self.pipe.producer_get_barrier(state), self.slot(state.index),
                multicast=self.spec.cluster_size > 1,
            )
        return asked

    @cute.jit
    def cancel_burst(self, count: Int32) -> None:
        """Fire `count` (<= TAIL_CANCEL_BURST) try_cancels into private slots; wait for them, decode none."""
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(self.tail_bar, 1)
            cute.arch.mbarrier_init_fence()
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            cute.arch.mbarrier_arrive_and_expect_tx(self.tail_bar, count * RESPONSE_BYTES)
            for i in cutlass.range_constexpr(TAIL_CANCEL_BURST):
                if i < count:
                    cute.arch.issue_clc_query(self.tail_bar, self.slot(self.spec.depth + i), multicast=False)
        cute.arch.mbarrier_wait(self.tail_bar, 0)


class ClcScheduler(TileScheduler):
    """One warp role's view of a CLC schedule (each role holds its own instance).

    A failed query moves the cluster to index `num_clusters` (the launched
    clusters), past every tile and distinguishable from a granted phantom.
    """

    def __new_from_mlir_values__(self, values: list) -> "ClcScheduler":
        base = super().__new_from_mlir_values__(values)
        return ClcScheduler(
            self.spec, self.grid, self.num_clusters, self.rank_mn, base._idx, self._ring, base._state
        )

    @staticmethod
    def create(spec: ClcSpec, grid: TileGrid, ring: ClcRing) -> "ClcScheduler":
        """The schedule as seen from the calling CTA; `grid` counts the real work only."""
        base = TileScheduler.create(spec, grid)
        state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, spec.depth)
        return ClcScheduler(spec, grid, base.num_clusters, base.rank_mn, base._idx, ring, state)

    def advance(self) -> WorkTile:
        """Wait for the next response in the ring and move to the cluster it granted."""
        x, granted = self._ring.receive(self._state)
        self._state.advance()
        self._idx = cutlass.select_(granted, x // self.spec.cluster_mn[0], self.num_clusters)
        return self._work()

    @cute.jit
    def serve_claims(self, counter=None, trace=None) -> None:
        """The scheduler warp: one query per tile until a query fails or grants a phantom.

        `counter` is unused (CLC keeps no global state); it keeps the call
        identical to the atomic scheduler's. With a
        `kernels.trace_device.TileTrace`, each query's round trip (issued to
        decoded) goes into the record of the tile it granted the leader CTA.
        """
        if cute.arch.block_idx_in_cluster() == 0:
            _serve(self, self._ring, trace)


@cute.jit
def _serve(sched: ClcScheduler, ring: ClcRing, trace=None) -> None:
    # A free function so that `sched`, advanced inside the loop, is a local
    # the DSL threads through the loop.
    producer = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, sched.spec.depth)
    work = sched.initial_work()
    while work.is_valid:
        asked = ring.query(producer, trace is not None)
        producer.advance()
        work = sched.advance()
        if const_expr(trace is not None):
            with cute.arch.elect_one():
                sched._trace_claim(trace, work, asked)
    ring.pipe.producer_tail(producer)
    if const_expr(sched.spec.tail_cancel):
        # An invalid tile below the launched clusters was granted: a phantom
        # of a padded grid, so every real tile is taken and what is still
        # pending is padding.
        pending = sched.num_clusters - sched._idx - 1
        if pending > 0:
            ring.cancel_burst(cutlass.min(Int32(TAIL_CANCEL_BURST), pending))
