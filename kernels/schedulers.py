"""Tile schedulers: which output tile a cluster computes next.

A kernel's work is a linear sequence of *work indices*, one per cluster tile
(the cluster_m x cluster_n CTA tiles one cluster computes together), batch by
batch. `decode_tile` turns an index into a tile; the scheduler decides which
indices a cluster visits:

- ``single_tile``: grid = every cluster tile; each cluster computes the tile of
  its own index and stops. With ``turns`` 2 (pingpong consumers, which take
  turns on a CTA's tiles) each cluster computes two consecutive indices, so
  that both warpgroups have a tile: the grid is half as large.
- ``static_persistent``: grid = the clusters that fit on the device at once;
  cluster c visits c, c + grid, c + 2 grid, ...
- ``stream_k`` (Osama et al., PPoPP 2023; CUTLASS's stream-K scheduler): a
  persistent grid whose full waves of tiles are claimed as in
  ``dynamic_persistent``, while the tiles that would make a partial wave are
  cut into K slices of equal k-block counts, claimed after them, so that
  the last wave keeps every SM busy; the clusters that share a tile reduce
  their partial accumulators in the kernel (`StreamKScheduler`). With
  ``even`` (swap_ab tiles: the weight streamed at few rows) the paper's own
  split instead: every cluster gets an equal, contiguous range of the
  launch's k-blocks, tile after tile, and no index is claimed.
- ``dynamic_persistent``: cluster c starts at c; afterwards the scheduler warp
  of its leader CTA claims the next index with a global ``atomic_add`` on a
  claim counter and publishes it to every warp role of every CTA of the
  cluster through a ring of ``depth`` shared-memory slots (a pipeline: the
  scheduler warp produces, every other warp role consumes). An index at or
  past the tile count means stop. A claim is made only when the leader's
  load warp asks for it: with ``depth`` 1 once it has issued the last loads
  of its current tile, so that a cluster busy with a long tile never holds a
  second one an idle cluster could run; with ``depth`` 2 or more as it
  begins the current tile, which hides the claim's latency when tiles are
  short.

The claim counter needs no host work between launches: it shares one
persistent ``int32[2]`` buffer (claims, finished clusters) with a finished
counter, and the last cluster to finish (its ``atomic_add`` on the finished
counter returns grid - 1) sets both back to zero. That holds under CUDA graph
replay; two launches sharing one buffer *concurrently* (different streams)
would not be safe, so each stream gets its own buffer.

Interface, the same for every scheduler and architecture; every warp role of
a kernel calls it at the same three places::

    sched = TileScheduler.create(spec, grid, ring)    # ring: None unless dynamic
    work = sched.initial_work()
    while work.is_valid:
        m, n, l = work.tile            # CTA tile coordinate
        ...
        work = sched.advance()

and the kernel's scheduler warp calls ``sched.serve_claims(counter)`` once
(a no-op unless dynamic); the load warp calls ``sched.request_next(True)``
before a tile's loads and ``sched.request_next(False)`` after them (no-ops
unless dynamic). Another way of choosing the next index (Blackwell's
cluster launch control, say) is another ``advance`` behind the same calls,
reusing `decode_tile`, `TileGrid` and `WorkTile`.
"""

from __future__ import annotations

from dataclasses import dataclass

import cutlass
import cutlass.cute as cute
import cutlass.pipeline as pipeline
from cutlass import Boolean, Int32, Int64, const_expr

from kernels.trace_device import now as _trace_now

KINDS = ("single_tile", "static_persistent", "dynamic_persistent", "stream_k")

# Fewest k-blocks a stream-K unit is given: below it the partials' round trip
# through global memory costs more than the k-blocks it spreads.
SK_MIN_K_TILES = 8
# Most slices a stream-K tile is cut into: its last unit reads every other
# slice's partial before it stores the tile.
SK_MAX_SLICES = 8

# Bytes of one published work index.
_SLOT_BYTES = 4


@dataclass(frozen=True)
class SchedulerSpec:
    """Compile-time description of a scheduler (from a `kernels.space.GemmConfig`)."""

    kind: str
    cluster_mn: tuple[int, int] = (1, 1)
    swizzle: int = 1
    raster_m: bool = True
    depth: int = 1
    # Consumer warpgroups that take turns on a CTA's tiles (pingpong: 2).
    turns: int = 1
    # Stream-K in equal contiguous k-block ranges (`StreamKScheduler`).
    even: bool = False

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise ValueError(f"unknown scheduler {self.kind!r}; expected one of {KINDS}")

    @staticmethod
    def from_config(cfg) -> "SchedulerSpec":
        return SchedulerSpec(
            kind=cfg.scheduler,
            cluster_mn=(cfg.cluster_m, cfg.cluster_n),
            swizzle=cfg.swizzle,
            raster_m=cfg.raster == "m",
            depth=cfg.sched_depth,
            turns=2 if cfg.pingpong else 1,
            even=cfg.stream_k and cfg.swap_ab,
        )

    @property
    def cluster_size(self) -> int:
        return self.cluster_mn[0] * self.cluster_mn[1]

    @property
    def dynamic(self) -> bool:
        """Whether a cluster's work after its first comes from the claim counter."""
        return self.kind == "dynamic_persistent" or self.stream_k and not self.even

    @property
    def stream_k(self) -> bool:
        return self.kind == "stream_k"

    def grid_shape(self, grid: "TileGrid", max_clusters: Int32, k_tiles: Int32 | None = None) -> tuple:
        """Launch grid: cluster_m * clusters along x, cluster_n along y.

        Clusters line up along x so that a tile count far above 65535 (the
        limit of y and z) still launches. Stream-K (which needs `k_tiles`,
        the k-blocks of one tile) fills the device even when there are fewer
        tiles than clusters, as long as each unit keeps `SK_MIN_K_TILES`;
        evenly, as long as no tile is shared by more than `SK_MAX_SLICES`.
        """
        clusters = grid.count
        if const_expr(self.kind == "single_tile"):
            clusters = _ceil_div(clusters, self.turns)
        elif const_expr(self.even):
            clusters = cutlass.min(clusters * cutlass.min(k_tiles, SK_MAX_SLICES - 1), max_clusters)
        elif const_expr(self.stream_k):
            units = cutlass.max(clusters, clusters * k_tiles // SK_MIN_K_TILES)
            clusters = cutlass.min(units, max_clusters)
        else:
            clusters = cutlass.min(clusters, max_clusters)
        return (self.cluster_mn[0] * clusters, self.cluster_mn[1], 1)


class TileGrid:
    """Cluster tiles of a problem: counts along M and N, and batches."""

    def __init__(self, clusters_m: Int32, clusters_n: Int32, batches: Int32):
        self.clusters_m = clusters_m
        self.clusters_n = clusters_n
        self.batches = batches

    @staticmethod
    def of(shape_mnl: tuple, cta_tile_mn: tuple[int, int], cluster_mn: tuple[int, int]) -> "TileGrid":
        tiles_m = _ceil_div(Int32(shape_mnl[0]), cta_tile_mn[0])
        tiles_n = _ceil_div(Int32(shape_mnl[1]), cta_tile_mn[1])
        return TileGrid(
            _ceil_div(tiles_m, cluster_mn[0]), _ceil_div(tiles_n, cluster_mn[1]), Int32(shape_mnl[2])
        )

    @property
    def per_batch(self) -> Int32:
        return self.clusters_m * self.clusters_n

    @property
    def count(self) -> Int32:
        return self.per_batch * self.batches


def _ceil_div(a, b):
    return (a + (b - 1)) // b


def decode_tile(idx: Int32, grid: TileGrid, swizzle: int, raster_m: bool) -> tuple[Int32, Int32, Int32]:
    """Cluster tile coordinate (m, n, l) of work index `idx`.

    Indices run batch by batch. Within a batch, raster "m" walks down M first
    inside a band of `swizzle` cluster columns (N), then moves to the next
    band; raster "n" swaps the roles of M and N. Consecutive indices thus
    share operand panels in L2. A last band narrower than `swizzle` is walked
    with its own width, so no index is wasted on a tile outside the problem.
    """
    l = idx // grid.per_batch
    rest = idx - l * grid.per_batch
    fast, slow = (grid.clusters_m, grid.clusters_n) if raster_m else (grid.clusters_n, grid.clusters_m)
    if const_expr(swizzle == 1):
        s = rest // fast
        f = rest - s * fast
    else:
        band = rest // (swizzle * fast)
        width = cutlass.min(Int32(swizzle), slow - band * swizzle)
        offset = rest - band * (swizzle * fast)
        f = offset // width
        s = band * swizzle + (offset - f * width)
    return (f, s, l) if raster_m else (s, f, l)


class WorkTile:
    """A CTA's tile coordinate (m, n, l) in units of CTA tiles, and whether it exists."""

    def __init__(self, tile: tuple, is_valid):
        self.tile = tile
        self.is_valid = Boolean(is_valid)

    def __extract_mlir_values__(self) -> list:
        return cutlass.extract_mlir_values(self.tile) + cutlass.extract_mlir_values(self.is_valid)

    def __new_from_mlir_values__(self, values: list) -> "WorkTile":
        n = len(cutlass.extract_mlir_values(self.tile))
        return WorkTile(
            cutlass.new_from_mlir_values(self.tile, values[:n]),
            cutlass.new_from_mlir_values(self.is_valid, values[n:]),
        )

    def k_range(self, k_tiles) -> tuple:
        """(first k-block, k-blocks) this work covers of a tile's `k_tiles`: all of them."""
        return Int32(0), k_tiles


class ClaimRing:
    """Shared-memory ring carrying claimed work indices from the scheduler warp.

    The leader CTA's scheduler warp is the only producer; one elected lane of
    every consuming warp of every CTA in the cluster releases a slot on the
    leader's empty barrier. Into a peer CTA the index travels as an
    ``st.async`` that completes the peer's full barrier, so one arrive per
    slot arms it. A last mbarrier carries the load warp's requests to the
    scheduler warp. The kernel reserves the storage: `barriers` holds
    2 * depth + 1 mbarriers (Int64), `slots` depth Int32 (16-byte aligned).
    """

    def __init__(self, spec: SchedulerSpec, pipe: pipeline.PipelineAsync, slots: cute.Tensor, request):
        self.spec = spec
        self.pipe = pipe
        self.slots = slots
        self.request = request

    @staticmethod
    def create(spec: SchedulerSpec, barriers: cute.Pointer, slots: cute.Pointer, consumer_warps: int) -> "ClaimRing":
        """Initialise the barriers (warp 0); the kernel's cluster-wide barrier-init sync must follow."""
        pipe = pipeline.PipelineAsync.create(
            num_stages=spec.depth,
            producer_group=pipeline.CooperativeGroup(pipeline.Agent.Thread, 1),
            consumer_group=pipeline.CooperativeGroup(
                pipeline.Agent.Thread, consumer_warps * spec.cluster_size
            ),
            barrier_storage=barriers,
            consumer_mask=0 if spec.cluster_size > 1 else None,
            defer_sync=True,
        )
        request = barriers + 2 * spec.depth
        _init_request_barrier(request)
        return ClaimRing(spec, pipe, cute.make_tensor(slots, cute.make_layout(spec.depth)), request)

    @staticmethod
    def storage_words(spec: SchedulerSpec) -> tuple[int, int]:
        """(Int64 mbarriers, Int32 slots) a kernel reserves for the ring of `spec`."""
        return 2 * spec.depth + 1, spec.depth

    def receive(self, state: pipeline.PipelineState) -> Int32:
        """Called by every lane of a consuming warp: the next published index."""
        self.pipe.consumer_wait(state)
        idx = self.slots[state.index]
        # The slot may have been written through the async proxy (st.async).
        cute.arch.fence_view_async_shared()
        cute.arch.sync_warp()
        with cute.arch.elect_one():
            self.pipe.consumer_release(state)
        return idx

    @cute.jit
    def publish(self, state: pipeline.PipelineState, idx: Int32) -> None:
        """Called by every lane of the leader CTA's scheduler warp."""
        self.pipe.producer_acquire(state)
        if const_expr(self.spec.cluster_size == 1):
            with cute.arch.elect_one():
                self.slots[state.index] = idx
                self.pipe.producer_commit(state)
        else:
            lane = cute.arch.lane_idx()
            if lane < self.spec.cluster_size:
                full = self.pipe.producer_get_barrier(state)
                cute.arch.mbarrier_arrive_and_expect_tx(full, _SLOT_BYTES, lane)
                cute.arch.store_async_dsmem(
                    (self.slots.iterator + state.index).align(4), idx, full, lane
                )


@cute.jit
def _init_request_barrier(request: cute.Pointer) -> None:
    # Warp 0 initialises every barrier, as the pipelines do.
    if cute.arch.make_warp_uniform(cute.arch.warp_idx()) == 0:
        with cute.arch.elect_one():
            cute.arch.mbarrier_init(request, 1)


def _cta_position(spec: SchedulerSpec) -> tuple:
    """(cluster, clusters, rank (m, n) in the cluster) of the calling CTA,
    on a grid laid out by `SchedulerSpec.grid_shape`."""
    cm, _ = spec.cluster_mn
    bidx, bidy, _ = cute.arch.block_idx()
    gdimx, _, _ = cute.arch.grid_dim()
    cluster = Int32(bidx) // cm
    return cluster, Int32(gdimx) // cm, (Int32(bidx) - cluster * cm, Int32(bidy))


def _claim_state(spec: SchedulerSpec) -> pipeline.PipelineState | None:
    """Where a CTA that claims its work reads the claim ring (None: it does not claim)."""
    if const_expr(spec.dynamic):
        return pipeline.make_pipeline_state(pipeline.PipelineUserType.Consumer, spec.depth)
    return None


class TileScheduler:
    """One warp role's view of the schedule (each role holds its own instance)."""

    def __init__(
        self,
        spec: SchedulerSpec,
        grid: TileGrid,
        num_clusters: Int32,
        rank_mn: tuple,
        idx: Int32,
        ring: ClaimRing | None,
        state: pipeline.PipelineState | None,
    ):
        self.spec = spec
        self.grid = grid
        self.num_clusters = num_clusters
        self.rank_mn = rank_mn
        self._idx = idx
        self._ring = ring
        self._state = state

    def __extract_mlir_values__(self) -> list:
        values = cutlass.extract_mlir_values(self._idx)
        if const_expr(self._state is not None):
            values += cutlass.extract_mlir_values(self._state)
        return values

    def __new_from_mlir_values__(self, values: list) -> "TileScheduler":
        state = None
        if const_expr(self._state is not None):
            state = cutlass.new_from_mlir_values(self._state, values[1:])
        return TileScheduler(
            self.spec, self.grid, self.num_clusters, self.rank_mn,
            cutlass.new_from_mlir_values(self._idx, values[:1]), self._ring, state,
        )

    @staticmethod
    def create(
        spec: SchedulerSpec, grid: TileGrid, ring: ClaimRing | None = None, k_tiles: Int32 | None = None
    ) -> "TileScheduler":
        """The schedule as seen from the calling CTA (grid laid out by
        `SchedulerSpec.grid_shape`); stream-K also needs a tile's k-blocks."""
        if const_expr(spec.stream_k):
            return StreamKScheduler.create(spec, grid, ring, k_tiles)
        cluster, clusters, rank_mn = _cta_position(spec)
        first = cluster * spec.turns if const_expr(spec.kind == "single_tile") else cluster
        return TileScheduler(spec, grid, clusters, rank_mn, first, ring, _claim_state(spec))

    def _work(self) -> WorkTile:
        cl_m, cl_n, l = decode_tile(self._idx, self.grid, self.spec.swizzle, self.spec.raster_m)
        return WorkTile(self._cta_tile(cl_m, cl_n, l), self._idx < self.grid.count)

    def _cta_tile(self, cl_m, cl_n, l) -> tuple:
        """This CTA's tile (m, n, l), warp-uniform, of cluster tile (cl_m, cl_n) in batch `l`."""
        cm, cn = self.spec.cluster_mn
        return (
            cute.arch.make_warp_uniform(cl_m * cm + self.rank_mn[0]),
            cute.arch.make_warp_uniform(cl_n * cn + self.rank_mn[1]),
            cute.arch.make_warp_uniform(l),
        )

    def initial_work(self) -> WorkTile:
        return self._work()

    def advance(self) -> WorkTile:
        """Move to this cluster's next tile (waits on the ring when dynamic)."""
        if const_expr(self.spec.kind == "single_tile" and self.spec.turns == 1):
            self._idx = self.grid.count
        elif const_expr(self.spec.kind == "single_tile"):
            # The cluster's next index while it has turns left, then past the end.
            nxt = self._idx + 1
            self._idx = Int32(cutlass.select_(nxt % self.spec.turns == 0, self.grid.count, nxt))
        elif const_expr(self.spec.kind == "static_persistent"):
            self._idx = self._idx + self.num_clusters
        else:
            self._idx = self._ring.receive(self._state)
            self._state.advance()
        return self._work()

    @cute.jit
    def request_next(self, at_start: cutlass.Constexpr[bool]) -> None:
        """Called by the load warp twice per tile, before its first load
        (`at_start`) and after its last: the leader's scheduler warp claims
        the cluster's next tile at the first call when ``depth > 1`` (a claim
        one tile ahead, its latency hidden behind the whole tile), at the
        second when ``depth == 1`` (no cluster holds a tile it has not begun)."""
        if const_expr(self.spec.dynamic and at_start == (self.spec.depth > 1)):
            if cute.arch.block_idx_in_cluster() == 0:
                with cute.arch.elect_one():
                    cute.arch.mbarrier_arrive(self._ring.request)

    def work_count(self) -> Int32:
        """Work indices of the launch: claims run up to it."""
        return self.grid.count

    def _at(self, idx: Int32) -> WorkTile:
        """The work that index `idx` gives this CTA, decoded as this scheduler decodes."""
        return type(self)(self.spec, self.grid, self.num_clusters, self.rank_mn, idx, None, None)._work()

    @cute.jit
    def _trace_claim(self, trace, work: WorkTile, asked) -> None:
        """Record the claim asked at `asked` that handed `work` to this (the
        leader) CTA in the trace record of its tile; `work` is decoded from
        the answer before the clock is read again, so the read waits for it.
        One thread calls it, after the whole warp decoded `work` (the
        decode's warp-uniform hints are full-warp shuffles)."""
        if work.is_valid:
            trace.claim(work.tile, _trace_now() - asked)

    @cute.jit
    def serve_claims(self, counter: cute.Tensor, trace=None) -> None:
        """The scheduler warp's loop: wait for the load warp's request, claim,
        publish, repeat until past the end.

        Only the leader CTA of a cluster claims. The load warp cannot request
        twice without receiving a claim in between, so the request barrier is
        never more than one phase ahead of this loop. `counter` is the persistent
        int32[2] buffer (claims, finished clusters); the last cluster out
        zeroes it for the next launch. With a `kernels.trace_device.TileTrace`,
        each claim's round trip goes into the record of the tile it claimed.
        """
        if const_expr(self.spec.dynamic):
            if cute.arch.block_idx_in_cluster() == 0:
                lane = cute.arch.lane_idx()
                total = self.work_count()
                state = pipeline.make_pipeline_state(pipeline.PipelineUserType.Producer, self.spec.depth)
                # A cluster launched past the work (a grid sized before the
                # work is known on device) claims nothing: no role would
                # take its publications off the ring.
                nxt = self._idx
                phase = Int32(0)
                while nxt < total:
                    cute.arch.mbarrier_wait(self._ring.request, phase)
                    phase = phase ^ 1
                    claimed = Int32(0)
                    if const_expr(trace is not None):
                        asked = Int64(0)
                    if lane == 0:
                        if const_expr(trace is not None):
                            asked = _trace_now()
                        claimed = cute.arch.atomic_add(counter.iterator, Int32(1), sem="relaxed", scope="gpu")
                    nxt = cute.arch.shuffle_sync(claimed, 0) + self.num_clusters
                    if const_expr(trace is not None):
                        # The whole warp decodes (inside the lane-0 branch
                        # its shuffles hang); lane 0 asked, so it records.
                        work = self._at(nxt)
                        if lane == 0:
                            self._trace_claim(trace, work, asked)
                    self._ring.publish(state, nxt)
                    state.advance()
                self._ring.pipe.producer_tail(state)
                if lane == 0:
                    # acq_rel: this cluster's claims happen before its finish,
                    # and the last finisher sees every other cluster's claims.
                    done = cute.arch.atomic_add(
                        counter.iterator + 1, Int32(1), sem="acq_rel", scope="gpu"
                    )
                    if done == self.num_clusters - 1:
                        counter[0] = Int32(0)
                        counter[1] = Int32(0)


class StreamKWork(WorkTile):
    """A `WorkTile` that covers k-blocks [k_start, k_start + k_tiles) of its
    tile: contributor `slice` of the `count` whose units share stream-K tile
    `unit_tile`, or a whole tile (unit_tile -1, count 1)."""

    def __init__(self, tile: tuple, is_valid, k_start, k_tiles, unit_tile, slice_, count):
        super().__init__(tile, is_valid)
        self.k_start = Int32(k_start)
        self.k_tiles = Int32(k_tiles)
        self.unit_tile = Int32(unit_tile)
        self.slice = Int32(slice_)
        self.count = Int32(count)

    def _fields(self) -> list:
        return [self.k_start, self.k_tiles, self.unit_tile, self.slice, self.count]

    def __extract_mlir_values__(self) -> list:
        return super().__extract_mlir_values__() + cutlass.extract_mlir_values(self._fields())

    def __new_from_mlir_values__(self, values: list) -> "StreamKWork":
        n = len(super().__extract_mlir_values__())
        base = WorkTile.__new_from_mlir_values__(self, values[:n])
        return StreamKWork(base.tile, base.is_valid, *cutlass.new_from_mlir_values(self._fields(), values[n:]))

    def k_range(self, k_tiles) -> tuple:
        return self.k_start, self.k_tiles


class StreamKScheduler(TileScheduler):
    """Stream-K over a persistent grid of P clusters (T tiles of KI k-blocks).

    Work index i below dp = T - sk is whole tile i; from dp on, index
    dp + u is unit u: slice u // sk of the partial wave's tile dp + u % sk
    (with fewer tiles than clusters every tile is in slices), each slice
    KI / S k-blocks. Clusters take indices as ``dynamic_persistent`` does
    (cluster c starts at c, then claims the next), so the units go to the
    clusters that finish their whole tiles first: dealt statically, the
    SMs that ran slower tiles ended 100 us behind the rest (27B down at
    M = 2896, 128x224 tiles, after four whole waves of about 205 us).

    Units of one slice start at about the same time at the same k-block, so
    the tiles that share an operand panel read it together and L2 serves it
    once. Contiguous ranges of k-blocks over the tiles (the paper's split)
    start every unit at another k-block and stream each panel from DRAM once
    per unit (27B down at M = 2048, 128x224 tiles: the units ran 3.5x slower
    a k-block than whole tiles).

    S is the most slices the partial wave's tiles fill the grid with once
    (R = 1), or twice (R = 2) where that makes the partial wave shorter
    (2 / S2 < 1 / S1), each unit keeping `SK_MIN_K_TILES` k-blocks and S at
    most `SK_MAX_SLICES`; with S < 2 there is nothing to gain and every tile
    is whole. Unit u parks in partial slot u: at most 2P slots, two per
    cluster of the grid.

    ``even`` (swap_ab tiles): no operand panel is shared but the few
    activation rows, which L2 holds, so the paper's split costs nothing and
    balances exactly: cluster c owns k-blocks [c W / P, (c + 1) W / P) of
    the W = T KI of the launch, tile by tile (index j: its j-th tile), the
    grid sized to the device (`SchedulerSpec.grid_shape`) so that every SM
    streams the same share of the weight. The clusters whose ranges meet a
    tile are its contributors, in cluster order; a range's first unit parks
    in slot 2c, its last in 2c + 1 (those in between are whole tiles).
    """

    def __init__(self, spec, grid, num_clusters, rank_mn, k_tiles, sk, slices, dp, idx, ring, state,
                 cluster=None, begin=None, end=None):
        super().__init__(spec, grid, num_clusters, rank_mn, idx, ring, state)
        self.k_tiles = k_tiles
        self.sk = sk
        self.slices = slices
        self.dp = dp
        # `even`: this cluster and the k-blocks [begin, end) of its range.
        self.cluster = cluster
        self.begin = begin
        self.end = end

    def _with(self, idx, ring, state) -> "StreamKScheduler":
        return StreamKScheduler(
            self.spec, self.grid, self.num_clusters, self.rank_mn, self.k_tiles, self.sk, self.slices, self.dp,
            idx, ring, state, self.cluster, self.begin, self.end,
        )

    def __new_from_mlir_values__(self, values: list) -> "StreamKScheduler":
        base = TileScheduler.__new_from_mlir_values__(self, values)
        return self._with(base._idx, self._ring, base._state)

    @staticmethod
    def create(spec: SchedulerSpec, grid: TileGrid, ring: ClaimRing | None, k_tiles: Int32) -> "StreamKScheduler":
        cluster, clusters, rank_mn = _cta_position(spec)
        k_tiles = Int32(k_tiles)
        total = grid.count
        if const_expr(spec.even):
            return StreamKScheduler(
                spec, grid, clusters, rank_mn, k_tiles, Int32(0), Int32(1), Int32(0), Int32(0), None, None,
                cluster, _range_start(cluster, total * k_tiles, clusters),
                _range_start(cluster + 1, total * k_tiles, clusters),
            )
        waves = total // clusters
        partial = Int32(cutlass.select_(waves == 0, total, total - waves * clusters))
        most = cutlass.min(k_tiles // SK_MIN_K_TILES, SK_MAX_SLICES)
        once = cutlass.min(clusters // cutlass.max(partial, 1), most)
        twice = cutlass.min(2 * clusters // cutlass.max(partial, 1), most)
        slices = Int32(cutlass.select_(2 * once < twice, twice, once))
        sk = Int32(cutlass.select_(slices > 1, partial, 0))
        return StreamKScheduler(
            spec, grid, clusters, rank_mn, k_tiles, sk, cutlass.max(slices, 1), total - sk, cluster, ring,
            _claim_state(spec),
        )

    def advance(self) -> StreamKWork:
        if const_expr(self.spec.even):
            self._idx = self._idx + 1
            return self._work()
        return super().advance()

    def work_count(self) -> Int32:
        return self.dp + self.sk * self.slices

    def slot(self, s: Int32, unit_tile: Int32) -> Int32:
        """Partial slot, in cluster tiles, of contributor `s` of stream-K tile `unit_tile`."""
        if const_expr(self.spec.even):
            first = self._owner(unit_tile * self.k_tiles)
            # The first contributor's unit here ends its range unless the range starts here.
            starts_before = _range_start(first, self.grid.count * self.k_tiles, self.num_clusters) < (
                unit_tile * self.k_tiles)
            last_unit = cutlass.select_(starts_before, 1, 0)
            return 2 * (first + s) + Int32(cutlass.select_(s == 0, last_unit, 0))
        return s * self.sk + unit_tile

    def _owner(self, kblock: Int32) -> Int32:
        """`even`: the cluster whose range holds k-block `kblock` of the launch."""
        w = Int64(self.grid.count) * Int64(self.k_tiles)
        return Int32((Int64(kblock + 1) * Int64(self.num_clusters) - 1) // w)

    def _at(self, idx: Int32) -> StreamKWork:
        return self._with(idx, None, None)._work()

    def _work(self) -> StreamKWork:
        if const_expr(self.spec.even):
            return self._even_work()
        unit = self._idx - self.dp
        in_sk = unit >= 0
        sk = cutlass.max(self.sk, 1)
        unit_tile = unit % sk
        s = unit // sk
        k_start = s * self.k_tiles // self.slices
        k_end = (s + 1) * self.k_tiles // self.slices
        idx = Int32(cutlass.select_(in_sk, self.dp + unit_tile, self._idx))
        cl_m, cl_n, l = decode_tile(idx, self.grid, self.spec.swizzle, self.spec.raster_m)
        return StreamKWork(
            self._cta_tile(cl_m, cl_n, l),
            self._idx < self.work_count(),
            cute.arch.make_warp_uniform(cutlass.select_(in_sk, k_start, 0)),
            cute.arch.make_warp_uniform(cutlass.select_(in_sk, k_end - k_start, self.k_tiles)),
            cute.arch.make_warp_uniform(cutlass.select_(in_sk, unit_tile, -1)),
            cute.arch.make_warp_uniform(cutlass.select_(in_sk, s, 0)),
            cute.arch.make_warp_uniform(cutlass.select_(in_sk, self.slices, 1)),
        )

    def _even_work(self) -> StreamKWork:
        """Unit `_idx` of this cluster's range: its part of the range's `_idx`-th tile."""
        kt = self.k_tiles
        tile = self.begin // kt + self._idx
        lo = cutlass.max(self.begin, tile * kt)
        hi = cutlass.min(self.end, tile * kt + kt)
        valid = lo < hi
        # Clamped so that a past-the-end tile still decodes to a real one.
        tile = cutlass.min(tile, self.grid.count - 1)
        first = self._owner(tile * kt)
        count = self._owner(tile * kt + kt - 1) - first + 1
        cl_m, cl_n, l = decode_tile(tile, self.grid, self.spec.swizzle, self.spec.raster_m)
        return StreamKWork(
            self._cta_tile(cl_m, cl_n, l),
            valid,
            cute.arch.make_warp_uniform(lo - tile * kt),
            cute.arch.make_warp_uniform(hi - lo),
            cute.arch.make_warp_uniform(cutlass.select_(count > 1, tile, -1)),
            cute.arch.make_warp_uniform(self.cluster - first),
            cute.arch.make_warp_uniform(count),
        )


def _range_start(cluster: Int32, kblocks: Int32, clusters: Int32) -> Int32:
    """First k-block of `cluster`'s range when `kblocks` are shared evenly by `clusters`."""
    return Int32(Int64(cluster) * Int64(kblocks) // Int64(clusters))
