"""Analytic performance model of the kernel pool: the `model` measurement backend.

A prediction has three layers:

1. Per work tile (one cluster tile), two paths per 64-deep k-block. The
   compute path is the slower of MMA issue (tile-shape dependent: shared-
   memory operand reads, a fixed per-k-block synchronisation cost and, on
   sm90, a fixed issue cost per wgmma.m64nNk16, so small and tall-narrow
   tiles are less efficient) and L2 -> SM traffic (cluster multicast shares
   A along cluster N and B along cluster M). The load path is Little's law
   with a load-dependent latency: `stages - 1` k-blocks in flight cover the
   unloaded latency, and DRAM queueing joins it (a fitted p-norm,
   `load_overlap`) with the launch's HBM bytes (L2 reuse
   within a wave of concurrently running tiles, set by raster order and
   swizzle) over the chip's bandwidth, counted once for the whole launch
   because the SMs share it (so a partial last wave of a load-bound launch
   runs at the bandwidth the idle SMs leave, not at a full wave's cost). The
   two paths overlap imperfectly: a load-bound tile exposes a share of its
   MMA time (`compute_exposed`), a compute-bound one a share of its loads
   (`load_exposed`). Fitted to an H100 (`tuner calibrate`) this orders a
   key's configs far better than one roofline max per k-block did, which
   made every load-bound config of a decode key cost the same. The epilogue
   (output store) is overlapped with the next tile's mainloop to a degree
   that depends on the scheduler and, on sm100, on the accumulator stages in
   TMEM; sm90 pingpong consumers run one warpgroup's epilogue under the
   other's mainloop, so a worker with several tiles pays max(mainloop,
   epilogue) per tile (their epilogues take turns too), one with a single
   tile all of both.
2. Assignment of tiles to workers (clusters), simulated over the workers:
   static persistent gives tile i to worker i mod W; dynamic (atomic counter)
   and CLC hand the next tile to whichever worker claims first; single-tile
   launches are dispatched by the hardware to whichever SM frees first, each
   paying a CTA start and an unhidden epilogue. Uniform-cost runs of tiles
   are assigned in closed form (exact for greedy earliest-free assignment);
   only claims made ahead of time (`sched_depth` > 1, seed 000's warning) on
   few-wave problems need the tile-by-tile event simulation. Stream-K hands
   out the whole waves as the atomic scheduler does, then cuts the tiles a
   static walk would leave in a partial wave into K slices, claimed after;
   the slices of a tile each park an fp32 partial and arrive on a
   semaphore, and the last to arrive reads the others' partials and stores
   the tile.
3. The launch: kernel launch overhead, SMs held by another kernel
   (`Problem.carveout`, seed 003), phantom clusters of a worst-case padded
   CLC or single-tile grid (seed 002) with or without tail cancellation, and
   sm100's split-K reduction pass (sm90's slices reduce in the kernel: each
   parks its whole fp32 CTA tile, the last reads them back).

Scheduler semantics modelled (the kernels must match them):
- `sched_depth` is the number of claims in flight. Depth 1 claims the next
  tile when the current tile's last loads are issued (a few k-blocks before
  its mainloop ends), so the claim's round trip overlaps the end of the
  mainloop and the epilogue and nothing is reserved early. Depth d > 1 keeps
  d - 1 tiles claimed ahead (the claim for a worker's tile p is issued when
  its tile p - d + 1 starts; the atomic scheduler stops at d = 2): latency
  is hidden, balance is lost.
- A dynamic persistent worker takes its first tile from the counter too, so
  CTAs that cannot launch (SMs held) own no tile; a CLC grid's first wave is
  whatever clusters fit, the rest are cancelled by the running ones.
- Static persistent kernels size their grid for every SM: the CTAs that land
  on held SMs start when the other kernel ends or a resident CTA exits,
  whichever is first. The other kernel is modelled as running as long as
  this GEMM's ideal time (its FLOPs at the device's sustained MMA rate).

Times are microseconds inside the module; the public functions return ms.
All constants are estimates unless a source is named; the model's error
against measured H100 results is reported by the benchmarks, not assumed.
"""

from __future__ import annotations

import heapq
import json
import math
import os
from dataclasses import dataclass, replace
from functools import lru_cache
from pathlib import Path

import numpy as np

from kernels.space import (
    DTYPE_BYTES, GemmConfig, InvalidConfig, epi_subtile_n, smem_bytes,
)
from tuner.key import Key, Problem
from tuner.backends.measure import Measurement

MODEL_VERSION = "6"


@dataclass(frozen=True)
class DeviceModel:
    """What the model knows about one GPU. Rates are per second, sizes in bytes."""

    name: str
    arch: str
    sms: int
    flops_per_clk_sm: int      # dense bf16/fp16 tensor-core FLOP per clock per SM
    clock_hz: float            # the clock the datasheet peak is quoted at
    hbm_bw: float              # peak DRAM bandwidth
    l2_bytes: int
    l2_bw: float               # L2 -> SM bandwidth, whole chip
    smem_per_sm: int
    # Sustained fraction of peak on a well-shaped tile (clocks drop under
    # full tensor-core load; issue and barrier gaps).
    mma_efficiency: float
    hbm_efficiency: float      # achievable fraction of peak DRAM bandwidth
    kblock_overhead_clk: int   # per-k-block barrier / issue cost of the mainloop
    # sm90: issue cost of one wgmma.m64nNk16 beyond its N / 2 MMA clocks (the
    # A fragment's shared-memory read, the async-group bookkeeping): a CTA
    # tile of M rows issues M / 64 * 4 of them per 64-deep k-block, so tall,
    # narrow tiles (256x112, 192x128) pay more per FLOP than 128x224.
    wgmma_issue_clk: float = 0.0
    smem_read_bytes_per_clk: int = 128
    sm_load_bytes_per_clk: int = 128   # TMA load bandwidth one SM can pull
    load_latency_us: float = 0.6       # TMA load round trip, unloaded
    # Overlap of a tile's compute and loads (0: perfect). A load-bound
    # mainloop exposes this share of its MMA time: a consumer holds a stage
    # until its MMA is done, so compute adds to every stage's turnaround. A
    # compute-bound one exposes this share of its load time (the loads run
    # stages ahead, so little of it shows).
    compute_exposed: float = 0.5
    load_exposed: float = 0.1
    # sm90, extra clocks of a wgmma whose N is an odd multiple of 16 (176,
    # 208, 240: the B tile's 8-row swizzle atoms are not a multiple of 4).
    # Measured on the H100 (such tiles ran 4-22 % slower than the next width
    # that is a multiple of 32, whatever their wave fit); the cause is not
    # established. Twice that for an odd multiple of 8 (an odd number of
    # atoms): 128x184 ran 16 % behind 128x176 on 27B o at M = 512, both in
    # one wave (bench.probes.sm90_variants, `...-sm90-variants-eighths.json`).
    wgmma_n16_clk: float = 0.0
    launch_us: float = 2.0             # kernel launch + drain, back to back
    cta_start_us: float = 1.0          # CTA launch, barrier init, descriptor prefetch, exit
    epilogue_fixed_us: float = 0.5     # accumulators -> smem -> TMA store issue
    atomic_claim_us: float = 1.0       # global atomic round trip (dynamic_persistent)
    # How a load path's latency (`load_latency_us` per `stages - 1` k-blocks)
    # and its DRAM time (bytes at the bandwidth) combine: their p-norm with
    # this p. 1 adds them (the stages in flight matter even where DRAM is
    # the limit); large p takes the longer. The H100 fit takes p = 2; with
    # its constants and the sum, an H200's few-row swap_ab configs on an
    # 88 MB weight would be predicted 46-57 % slower than measured, with
    # the norm 11-17 %.
    load_overlap: float = 1.0
    # fp32 partial tiles (split-K, stream-K) go between the consumers'
    # registers and L2 by plain loads and stores, not TMA: bytes per clock
    # one SM moves that way (at most its share of L2). Priced at the SM's
    # TMA rate, non-swap split-K on the H100's decode keys (64 x 256 fp32
    # partials) ran 9-15 % slower than modelled, swap_ab's (128 x 16)
    # within 5 %.
    partial_bytes_per_clk: float = 64.0
    clc_claim_us: float = 0.35         # try_cancel -> response in smem (clc)
    # Fraction of the epilogue the MMA pipe waits for when the accumulator has
    # a single buffer (all of sm90: accumulators in the consumers' registers;
    # sm100 with acc_stages == 1): the TMA store is asynchronous and the
    # producer has prefetched the next tile, but the register/TMEM -> smem
    # copy is not hidden.
    epilogue_exposed: float = 0.5
    # DRAM bandwidth a load of 256-byte runs per operand row (tile_k 128 of
    # 16-bit elements) gets over one of 128-byte runs (tile_k 64), which
    # `hbm_efficiency` describes. H100: the same swap_ab tiles at the same
    # shared memory ran 1.030 -> 1.057x cuBLAS on 27B gate_up at M = 8 and
    # 1.040 -> 1.060x on Qwen2.5's lm_head (bench/results/logs/
    # ...-tile-k-probe-*.json); a read-only kernel streamed the gate_up
    # weight at 2.49 TB/s in 128-byte runs and 2.78 in 256-byte ones.
    long_run_gain: float = 1.0
    # Fixup of a tile that split-K slices or stream-K units share, per
    # contributing CTA: the fence that makes its partial visible, the
    # acq_rel atomic on the tile's semaphore and the consumers' barrier
    # around it. Fitted to the split-K trials (stream-K pays the same).
    semaphore_us: float = 1.0
    # (cluster size, clusters that run at once) where measured: a cluster
    # lives in one GPC, so this can be below sms // size, the fallback.
    max_clusters: tuple[tuple[int, int], ...] = ()

    def clusters(self, size: int) -> int:
        """Clusters of `size` CTAs the device runs at once."""
        return min(dict(self.max_clusters).get(size, self.sms), self.sms // size)

    @property
    def peak_flops(self) -> float:
        return self.sms * self.flops_per_clk_sm * self.clock_hz


# H100 SXM5: 132 SMs, 989.4 TFLOP/s dense BF16, 3.35 TB/s HBM3, 50 MB L2
# (NVIDIA H100 Tensor Core GPU datasheet); 228 KB shared memory per SM (CUDA
# C Programming Guide, compute capability 9.0). The clock is the one the peak
# implies at 4096 dense FLOP/clk/SM: 989.4e12 / (132 * 4096) = 1.83 GHz.
# Peak is derived per SM, so a variant with fewer SMs has a smaller peak.
# L2 bandwidth is an estimate; ncu on an H100 (bench/results/logs/ncu/) saw
# 2.47 GB read from L2 in 293 us at 86 % of L2 throughput, about 9.8 TB/s at
# peak, a figure not yet folded in. Clusters that run at once:
# cuOccupancyMaxActiveClusters on the same H100.
H100 = DeviceModel(
    name="H100-model", arch="sm90", sms=132, flops_per_clk_sm=4096, clock_hz=1.83e9,
    hbm_bw=3.35e12, l2_bytes=50 * 2**20, l2_bw=12e12, smem_per_sm=228 * 1024,
    mma_efficiency=0.86, hbm_efficiency=0.90, kblock_overhead_clk=80,
    wgmma_issue_clk=16.0, wgmma_n16_clk=16.0, long_run_gain=1.025, max_clusters=((1, 132), (2, 66), (4, 30)),
)

# B200 (HGX B200): 148 SMs, 2.25 PFLOP/s dense FP16/BF16, 8 TB/s HBM3e
# (NVIDIA HGX B200 / DGX B200 datasheet; the driver reports a 7680-bit bus at
# 3996 MHz, i.e. ~7.67 TB/s, pytorch/ao PR #4002); L2 126.5 MB and 228 KB
# shared memory per SM (CUDA device query in the same PR; chipsandcheese,
# "Nvidia's B200", measures 126 MB). Clock implied by 8192 dense
# FLOP/clk/SM: 2.25e15 / (148 * 8192) = 1.86 GHz. L2 bandwidth: estimate.
# tcgen05 is issued by one thread and runs asynchronously, so the per-k-block
# overhead is smaller than WGMMA's, and less of the MMA time enters a load-bound
# stage's turnaround (an estimate: no B200 has been calibrated).
B200 = DeviceModel(
    name="B200-model", arch="sm100", sms=148, flops_per_clk_sm=8192, clock_hz=1.856e9,
    hbm_bw=8.0e12, l2_bytes=int(126.5 * 2**20), l2_bw=20e12, smem_per_sm=228 * 1024,
    mma_efficiency=0.75, hbm_efficiency=0.88, kblock_overhead_clk=32, wgmma_issue_clk=0.0,
    compute_exposed=0.2,
)

DEVICES = {"sm90": H100, "sm100": B200}

# Constants fitted to a real device's measured trials (`tuner calibrate`),
# per device name: a versioned JSON file that ships with the package, so a
# fit made on one machine serves every user of that device. $TUNER_CALIBRATION
# names another file.
CALIBRATION_ENV = "TUNER_CALIBRATION"
CALIBRATION_FORMAT = "gemm-tuner-calibration"
CALIBRATION_VERSION = 1
_SHIPPED_CALIBRATION = Path(__file__).parents[1] / "data" / "calibration.json"
# The constants a calibration may set and the range it may set them in: the
# rates and costs the datasheets do not state (sizes and peaks they do).
CALIBRATION_BOUNDS = {
    "mma_efficiency": (0.5, 1.0),
    "hbm_efficiency": (0.5, 1.0),
    "kblock_overhead_clk": (4.0, 400.0),
    "l2_bw": (3e12, 30e12),
    "sm_load_bytes_per_clk": (32.0, 256.0),
    "load_latency_us": (0.2, 3.0),
    "wgmma_issue_clk": (1.0, 120.0),
    "compute_exposed": (0.01, 1.0),
    "load_exposed": (0.01, 1.0),
    "wgmma_n16_clk": (1.0, 200.0),
    "launch_us": (0.5, 10.0),
    "cta_start_us": (0.1, 5.0),
    "epilogue_fixed_us": (0.05, 5.0),
    "epilogue_exposed": (0.05, 1.0),
    "atomic_claim_us": (0.1, 5.0),
    "semaphore_us": (0.1, 5.0),
    "load_overlap": (1.0, 6.0),
    "partial_bytes_per_clk": (4.0, 256.0),
}
# Per-tile cost of the static scheduler's index arithmetic.
STATIC_NEXT_US = 0.02
# Fewest k-blocks a stream-K unit is given and most slices a stream-K tile
# is cut into (kernels.schedulers.SK_MIN_K_TILES and SK_MAX_SLICES, not
# imported: that module needs the CUTLASS DSL, the model does not).
SK_MIN_K_TILES = 8
SK_MAX_SLICES = 8
# Bytes of one fp32 accumulator, as stream-K's partial tiles hold it.
ACC_BYTES = 4
# Per sm90 epilogue sub-tile: two named barriers of the consumer warpgroups
# and a TMA store issue (an estimate, ~100 clocks): 16-column sub-tiles of a
# width 32 does not divide cost twice as many.
EPI_SUBTILE_US = 0.05
# Operands that fit in this share of L2 are read from HBM once per launch.
L2_RESIDENT_SHARE = 0.5
# seed 002's tail cancel: cancel requests per padded claim, by how many times
# the real clusters the padding is ("found via benchmarking"); the cap is
# the kernel's MAX_CLC_CANCEL_ATTEMPTS, which the seed does not print.
TAIL_CANCEL_TIERS = ((8, 64), (4, 32), (2, 16), (1, 8))
TAIL_CANCEL_DEFAULT = 2
# Claims made ahead only change the assignment where tile costs differ (on
# equal tiles every order is the same): those problems are simulated tile by
# tile up to this many tiles; beyond it the reservation skew is small against
# the run and the closed form is used.
EVENT_SIM_MAX_TILES = 1024
# Standard tiles a vendor heuristic picks from (cuBLAS-like baseline).
_BASELINE_TILES = {
    "sm90": ((128, 128, 1, 1, 1), (128, 256, 2, 1, 1), (256, 128, 1, 2, 1), (64, 128, 1, 1, 1)),
    "sm100": ((256, 128, 2, 1, 2), (256, 256, 2, 1, 2), (128, 128, 1, 1, 1), (128, 64, 1, 1, 1)),
}


@dataclass(frozen=True)
class _Segment:
    """A run of consecutive work tiles with the same cost."""

    tiles: int
    mainloop: float     # us, mainloop of one tile on its compute path (MMA issue, L2 loads)
    epilogue: float     # us, the full epilogue of one tile
    lead: float         # us, how far the producer runs ahead of the MMA
    bound: str          # the compute path's bound: "compute" or "l2"
    waits: float = 0.0  # us, one tile's load path before DRAM queueing (latency / stages in flight)
    hbm_bytes: float = 0.0  # DRAM bytes of one tile (operands after L2 reuse, output)


@dataclass(frozen=True)
class _Plan:
    segments: tuple[_Segment, ...]
    tiles: int
    grid: int           # clusters the launch grid covers (>= tiles when padded)
    workers: int        # persistent clusters the grid holds (all SMs)
    free_workers: int   # clusters that fit on the SMs not held


def predict_ms(
    key_or_problem: Key | Problem, cfg: GemmConfig, device: DeviceModel | None = None,
    *, padding: float = 1.0,
) -> float:
    """Predicted kernel time of `cfg` on the problem, in milliseconds.

    `padding` > 1 sizes a CLC or single-tile grid for that many times the
    rows actually present (seed 002's worst-case MoE buffer); the useful work
    does not change. Raises InvalidConfig if `cfg` cannot run the problem.
    """
    return _predict(key_or_problem, cfg, device, padding)[0]


def wave_fit(problem: Problem, tile_m: int, tile_n: int, sms: int) -> float:
    """Share of the SM time a launch of `tile_m` x `tile_n` tiles spends on
    real output: the partial last wave and the padding of edge tiles both
    waste (1.0: whole waves of whole tiles). Grouped problems count each
    group's tiles."""
    rows = [m for m, _ in _group_shapes(problem) if m]
    tiles = sum(_cdiv(m, tile_m) for m in rows) * _cdiv(problem.n, tile_n)
    slots = _cdiv(tiles, sms) * sms
    return sum(rows) * problem.n / (slots * tile_m * tile_n)


def baseline_ms(problem: Key | Problem, device: DeviceModel | None = None) -> float:
    """A modelled cuBLAS: the best of a few standard static-persistent configs.

    Like a vendor heuristic it knows nothing of SMs held by another kernel;
    a grouped problem is a loop of per-group calls, each paying its launch.
    """
    problem, device = _resolve(problem, device, None)
    if problem.groups == 1:
        return _baseline_dense(problem, device)
    per_shape: dict[tuple[int, int], float] = {}
    for m, k in _group_shapes(problem):
        if m and (m, k) not in per_shape:
            per_shape[m, k] = _baseline_dense(replace(problem, m=m, k=k, groups=1, group_k=()), device)
    return sum(per_shape[m, k] for m, k in _group_shapes(problem) if m)


def calibration_path() -> Path:
    """The calibration file in effect: $TUNER_CALIBRATION, else the shipped one."""
    return Path(os.environ.get(CALIBRATION_ENV) or _SHIPPED_CALIBRATION)


def calibration_stamp() -> tuple[str, int]:
    """The calibration file in effect and its modification time: what a
    cache of model results must key on."""
    path = calibration_path()
    try:
        return str(path), path.stat().st_mtime_ns
    except FileNotFoundError:
        return str(path), 0


def device_model(arch: str, device: str | None = None) -> DeviceModel:
    """The model of `device` (a device name as keys store it): the arch's
    datasheet model with the constants calibrated for that device, if any."""
    if arch not in DEVICES:
        raise ValueError(f"no device model for arch {arch!r}; expected one of {tuple(DEVICES)}")
    entry = _entry(arch, device)
    if entry is None:
        facts = _live_facts.get(device) if device else None
        return replace(DEVICES[arch], name=device, **facts) if facts else DEVICES[arch]
    return replace(DEVICES[arch], name=device, **entry.get("facts", {}), **entry["constants"])


def _entry(arch: str, device: str | None) -> dict | None:
    """The calibration entry in effect for `device` on `arch`, if any.
    Constants fitted to another version of the model mean something else in
    this one (the file's format is the same): none until the device is
    calibrated again."""
    entry = _calibrations(calibration_path()).get(device) if device else None
    if entry is None or entry["arch"] != arch or entry.get("model_version") != MODEL_VERSION:
        return None
    return entry


# What a device that runs the model's datasheet defaults may replace: the
# driver's figures (`tuner.backends.probe.facts`), or a quick calibration's.
FACT_FIELDS = ("sms", "clock_hz", "hbm_bw", "l2_bytes", "smem_per_sm")
# Facts of devices this process measures that have no calibration entry
# (`register_facts`): their model is the datasheet's with these.
_live_facts: dict[str, dict] = {}


def register_facts(device: str, facts: dict) -> None:
    """Model `device` (without a calibration entry) with the driver's `facts`."""
    known = {f: facts[f] for f in FACT_FIELDS if facts.get(f)}
    if known:
        _live_facts[device] = known


def model_source(arch: str, device: str) -> str:
    """Which model `device_model(arch, device)` gives, in a few words."""
    entry = _entry(arch, device)
    if entry is not None:
        kind = "quick calibration" if entry.get("source") == "quick" else "fitted calibration"
        return f"{kind} of {device} ({str(entry.get('fitted_at', ''))[:10]})"
    if device == DEVICES[arch].name:
        return f"{device} (the {arch} datasheet model)"
    if device in _live_facts:
        return f"{DEVICES[arch].name} with the driver's figures of {device} (not calibrated)"
    return f"{DEVICES[arch].name} (not calibrated for {device})"


def read_calibrations(path: Path) -> dict[str, dict]:
    """Device name -> calibration entry of a calibration file ({} if there is
    none); a file of another format or with unknown constants is an error
    naming the file and the field."""
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a calibration file: {exc}") from None
    if not isinstance(data, dict) or data.get("format") != CALIBRATION_FORMAT:
        raise ValueError(f"{path}: format is not {CALIBRATION_FORMAT!r}")
    if data.get("version") != CALIBRATION_VERSION:
        raise ValueError(f"{path}: version {data.get('version')!r}, expected {CALIBRATION_VERSION}")
    devices = data.get("devices")
    if not isinstance(devices, dict):
        raise ValueError(f"{path}: 'devices' must be an object")
    for name, entry in devices.items():
        where = f"{path}: devices.{name}"
        if entry.get("arch") not in DEVICES:
            raise ValueError(f"{where}.arch: expected one of {tuple(DEVICES)}")
        for field, value in entry.get("facts", {}).items():
            if field not in FACT_FIELDS:
                raise ValueError(f"{where}.facts.{field}: not a device fact of the model")
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"{where}.facts.{field}: must be a positive number")
        for field, value in entry.get("constants", {}).items():
            if field not in CALIBRATION_BOUNDS:
                raise ValueError(f"{where}.constants.{field}: not a calibrated constant of the model")
            lo, hi = CALIBRATION_BOUNDS[field]
            if not isinstance(value, (int, float)) or not lo <= value <= hi:
                raise ValueError(f"{where}.constants.{field}: must be a number in [{lo:g}, {hi:g}]")
    return devices


@lru_cache(maxsize=4)
def _calibrations_at(path: Path, mtime_ns: int) -> dict[str, dict]:
    return read_calibrations(path)


def _calibrations(path: Path) -> dict[str, dict]:
    try:
        mtime = path.stat().st_mtime_ns
    except FileNotFoundError:
        return {}
    return _calibrations_at(path, mtime)


# Set to 1: the model backend is searched one stored trial at a time, as the
# GPU backend is (`Backend.bulk` False), so that tests can kill and resume
# that path without a GPU.
PER_TRIAL_ENV = "TUNER_MODEL_PER_TRIAL"


class ModelBackend:
    """The analytic model behind the tuner's `Backend` interface.

    A measurement's detail carries the tile and worker counts, waves, the
    bound of the dominant tiles, and the earliest and latest time a worker
    finishes its real work (their spread is the load imbalance).

    A prediction takes a fraction of a millisecond, less than storing it:
    the backend is `bulk` (a key's search in memory, its trials stored
    together) unless `bulk=False` or $TUNER_MODEL_PER_TRIAL=1.
    """

    name = "model"

    def __init__(self, arch: str, device: DeviceModel | None = None, *, bulk: bool | None = None):
        if device is None:
            if arch not in DEVICES:
                raise ValueError(f"no device model for arch {arch!r}; expected one of {tuple(DEVICES)}")
            device = DEVICES[arch]
        if device.arch != arch:
            raise ValueError(f"device model {device.name} is {device.arch}, not {arch}")
        self.arch = arch
        self.device = device
        self.device_name = device.name
        self.sm_count = device.sms
        self.bulk = os.environ.get(PER_TRIAL_ENV, "") in ("", "0") if bulk is None else bulk

    def versions(self) -> dict[str, str]:
        return {"model": MODEL_VERSION}

    def measure(self, key: Key, cfg: GemmConfig) -> Measurement:
        if key.arch != self.arch or cfg.arch != self.arch:
            return Measurement(ms=None, ok=False, error=f"the {self.arch} model cannot time {cfg.arch} on {key.arch}")
        try:
            ms, detail = _predict(key.problem, cfg, self.device, 1.0)
        except InvalidConfig as exc:
            return Measurement(ms=None, ok=False, error=str(exc))
        return Measurement(ms=ms, ok=True, detail=detail)

    def baseline(self, key: Key) -> Measurement:
        try:
            ms = baseline_ms(key.problem, self.device)
        except InvalidConfig as exc:
            return Measurement(ms=None, ok=False, error=str(exc))
        return Measurement(ms=ms, ok=True, detail={"baseline": "modelled cuBLAS"})

    def remeasure(self, key: Key, cfgs: list[GemmConfig | None], *, cold: bool = False) -> list[Measurement]:
        # The model is deterministic and has no cache state: interleaving and
        # the cold protocol change nothing.
        return [self.baseline(key) if cfg is None else self.measure(key, cfg) for cfg in cfgs]


# --------------------------------------------------------------------------
# Prediction


def _resolve(key_or_problem, device, cfg) -> tuple[Problem, DeviceModel]:
    is_key = isinstance(key_or_problem, Key)
    problem = key_or_problem.problem if is_key else key_or_problem
    if problem.overlap:
        raise InvalidConfig("the model does not price an all-reduce beside the GEMM: overlap keys are measured")
    if device is None:
        if cfg is None and not is_key:
            raise ValueError("a bare Problem names no arch: pass a device model")
        arch = cfg.arch if cfg is not None else key_or_problem.arch
        device = device_model(arch, key_or_problem.device if is_key else None)
    return problem, device


def _predict(key_or_problem, cfg: GemmConfig, device, padding: float) -> tuple[float, dict]:
    problem, device = _resolve(key_or_problem, device, cfg)
    if cfg.arch != device.arch:
        raise InvalidConfig(f"config for {cfg.arch} on a {device.arch} device model")
    p = problem
    p.check(cfg)
    if cfg.swap_ab:
        # The kernel runs out.T = W @ x.T: the weight's rows are its M. Its N
        # is the activations' rows, rounded up to the 8 a problem's N takes
        # (the tile pads them to 16 anyway).
        p = replace(p, m=p.n, n=_cdiv(p.m, 8) * 8)
    if padding < 1:
        raise ValueError(f"padding must be >= 1, got {padding}")
    plan = _plan(p, cfg, device, padding)
    # Two paths through the same schedule: the tiles' compute (MMA issue, L2)
    # and their loads (latency per tile, plus the launch's DRAM traffic at
    # the chip's bandwidth, which the SMs share); the longer one sets the
    # time (each tile's cost already holds the share of the shorter one that
    # the pipeline does not hide: `compute_exposed`, `load_exposed`).
    us_c, detail = _schedule(plan, p, cfg, device)
    waiting = replace(plan, segments=tuple(replace(s, mainloop=s.waits) for s in plan.segments))
    us_w, _ = _schedule(waiting, p, cfg, device)
    hbm_us = sum(s.tiles * s.hbm_bytes for s in plan.segments) / _hbm_rate(device, cfg, p) * 1e6
    us_m = _combine(us_w, hbm_us, device.load_overlap)
    us = max(us_c, us_m)
    if us_m > us_c:
        detail["bound"] = "hbm" if hbm_us > us_w else "latency"
    detail["hbm_us"] = round(hbm_us, 3)
    us += device.launch_us
    if cfg.split_k > 1 and not cfg.split_k_in_kernel:
        us += _reduction_us(p, cfg, device)
    detail["split_k_reduction"] = cfg.split_k > 1
    return us / 1000.0, detail


def _group_shapes(p: Problem) -> list[tuple[int, int]]:
    """(M, K) of every group; MoE groups split the total M evenly."""
    if p.group_k:
        return [(p.m, k) for k in p.group_k]
    base, extra = divmod(p.m, p.groups)
    return [(base + (g < extra), p.k) for g in range(p.groups)]


def _plan(p: Problem, cfg: GemmConfig, dev: DeviceModel, padding: float) -> _Plan:
    cm, cn = cfg.cluster_tile
    cs = cfg.cluster_size
    workers = cfg.budget_clusters(dev.clusters(cs))
    free_workers = min(workers, (dev.sms - p.carveout) // cs)
    if free_workers < 1:
        raise InvalidConfig(
            f"{p.carveout} of {dev.sms} SMs held leave no room for a {cfg.cluster_m}x{cfg.cluster_n} cluster"
        )
    shapes = _group_shapes(p)
    tiles_n = _cdiv(p.n, cn)
    counts = [_cdiv(m, cm) * tiles_n * cfg.split_k for m, _ in shapes]
    tiles = sum(counts)
    if cfg.stream_k:
        # The grid fills the device even with fewer tiles than clusters, as
        # long as every cluster keeps SK_MIN_K_TILES k-blocks, or (swap_ab,
        # even ranges) as long as no tile has more than SK_MAX_SLICES
        # contributors (`SchedulerSpec.grid_shape`); all of its clusters load at once.
        kblocks = _cdiv(p.k, cfg.tile_k)
        reach = (tiles * min(kblocks, SK_MAX_SLICES - 1) if cfg.swap_ab
                 else max(tiles, tiles * kblocks // SK_MIN_K_TILES))
        workers = min(workers, reach)
        free_workers = min(free_workers, workers)
    concurrent = min(free_workers, tiles)
    active_sms = max(1, free_workers if cfg.stream_k else concurrent) * cs
    segments = []
    for (m, k), count in zip(shapes, counts, strict=True):
        if count:
            segments.append(_segment(p, cfg, dev, m, k, count, active_sms, concurrent))
    grid = tiles
    if cfg.scheduler in ("clc", "single_tile"):
        # The grid is sized on the host for the worst case: the padded buffer
        # rows, and for MoE groups one partial tile per group boundary.
        rows = math.ceil(p.m * padding)
        bound = (_cdiv(rows, cm) + (p.groups - 1 if p.groups > 1 and not p.group_k else 0)) * tiles_n
        grid = max(tiles, bound * cfg.split_k)
    return _Plan(tuple(_merge(segments)), tiles, grid, workers, free_workers)


def _merge(segments: list[_Segment]) -> list[_Segment]:
    out: list[_Segment] = []
    for s in segments:
        if out and (out[-1].mainloop, out[-1].epilogue, out[-1].waits, out[-1].hbm_bytes) == (
                s.mainloop, s.epilogue, s.waits, s.hbm_bytes):
            out[-1] = replace(out[-1], tiles=out[-1].tiles + s.tiles)
        else:
            out.append(s)
    return out


def _segment(p, cfg, dev, m, k, count, active_sms, concurrent) -> _Segment:
    """Cost of one work tile of a group with `m` rows and depth `k`."""
    e = DTYPE_BYTES[p.dtype_in]
    cm, cn = cfg.cluster_tile
    cs = cfg.cluster_size
    k_tile = k // cfg.split_k
    tk = cfg.tile_k
    kblocks = _cdiv(k_tile, tk)

    # MMA issue per SM: the hardware computes the whole tile, edge or not.
    mma_clk = 2.0 * cfg.cta_tile_m * cfg.tile_n * tk / dev.flops_per_clk_sm
    if cfg.arch == "sm90":
        # Every warpgroup of the tile reads the whole B slice from smem.
        smem = (cfg.cta_tile_m + cfg.tile_n * cfg.tile_warpgroups) * tk * e
    else:
        smem = (cfg.cta_tile_m + cfg.tile_n // cfg.cta_group) * tk * e
    core_clk = max(mma_clk, smem / dev.smem_read_bytes_per_clk) + dev.kblock_overhead_clk
    if cfg.arch == "sm90":
        # One wgmma.m64nNk16 per 64 rows per 16 of depth, each with a fixed
        # issue cost on top of its MMA clocks.
        per_wgmma = dev.wgmma_issue_clk + dev.wgmma_n16_clk * (2 if cfg.tile_n % 16 else 1 if cfg.tile_n % 32 else 0)
        core_clk += cfg.cta_tile_m // 64 * (tk // 16) * per_wgmma
    t_core = core_clk / dev.clock_hz / dev.mma_efficiency * 1e6

    # Operand traffic: one copy per cluster tile thanks to multicast; only the
    # rows and columns that exist are read.
    rows, cols = min(cm, m), min(cn, p.n)
    l2_per_sm = (rows + cols) * tk * e / cs
    sm_bw = dev.sm_load_bytes_per_clk * dev.clock_hz
    t_l2 = l2_per_sm / _sm_l2_bw(dev, active_sms) * 1e6
    hbm_share = _hbm_rate(dev, cfg, p) / active_sms
    ratio = _hbm_ratio(p, cfg, dev, m, k, concurrent)
    # The compute path of a tile: MMA issue or the SM's share of L2.
    terms = {"compute": t_core, "l2": t_l2}
    bound = max(terms, key=terms.get)
    mainloop = kblocks * terms[bound]
    # The load path (Little's law, the latency growing with DRAM load):
    # `stages - 1` k-blocks in flight give a k-block every latency /
    # (stages - 1) when DRAM is idle; DRAM shared by every SM adds its
    # queueing, the launch's bytes over its bandwidth (counted for the whole
    # launch in `_predict`, so a partial last wave gets the bandwidth the
    # idle SMs leave). Per k-block: latency / (stages - 1) and bytes * SMs
    # loading / bandwidth, combined by their `load_overlap`-norm (1: the
    # sum; on the H100's decode keys the stages in flight change the time
    # even where DRAM is the limit).
    waits = kblocks * dev.load_latency_us / (cfg.stages - 1)
    hbm_bytes = kblocks * (rows + cols) * tk * e * ratio
    # A share of the shorter of a tile's compute and load time (its DRAM
    # bytes at its share of the bandwidth) is not hidden behind the longer.
    loads = _combine(waits, hbm_bytes / (cs * hbm_share) * 1e6, dev.load_overlap)
    exposed = dev.compute_exposed * mainloop if loads > mainloop else dev.load_exposed * loads
    mainloop += exposed
    waits += exposed

    out_bytes = 4 if cfg.split_k > 1 and not cfg.split_k_in_kernel else DTYPE_BYTES[p.dtype_out]
    c_bytes = min(cm, m) * min(cn, p.n) * out_bytes
    c_per_sm = c_bytes / cs
    epilogue = dev.epilogue_fixed_us + c_per_sm / min(sm_bw, hbm_share) * 1e6
    if cfg.arch == "sm90":
        epilogue += cfg.tile_n // epi_subtile_n(cfg) * EPI_SUBTILE_US
    if cfg.split_k_in_kernel:
        # Every slice parks its whole fp32 CTA tile (rows past M included)
        # and arrives on the tile's semaphore; the last to arrive reads the
        # other slices' partials before it stores. The slices run at once,
        # so a tile ends that much after its slices' mainloops. Measured on
        # the H100's decode keys, pricing only the M rows that exist had
        # non-swap split-K 12-30 % too fast against split_k 1.
        write = _partial_us(dev, cfg.cta_tile_m * cfg.tile_n * ACC_BYTES, active_sms)
        epilogue += cfg.split_k * write + dev.semaphore_us
    # The producer warp issues a tile's last load stages - 1 k-blocks before
    # the MMA consumes it: a depth-1 claim made then is answered meanwhile.
    lead = min(kblocks, cfg.stages - 1) * max(terms[bound], dev.load_latency_us / (cfg.stages - 1))
    return _Segment(count, mainloop, epilogue, lead, bound, waits, hbm_bytes + c_bytes)


def _combine(latency: float, transfer: float, p: float) -> float:
    """A load path's time from its latency and DRAM terms (`DeviceModel.load_overlap`)."""
    if p == 1.0:
        return latency + transfer
    return (latency ** p + transfer ** p) ** (1.0 / p)


def _hbm_rate(dev: DeviceModel, cfg: GemmConfig, p: Problem) -> float:
    """The DRAM bandwidth `cfg`'s loads get (bytes/s): runs of 256 bytes a row or more stream faster."""
    long_runs = cfg.tile_k * DTYPE_BYTES[p.dtype_in] >= 256
    return dev.hbm_bw * dev.hbm_efficiency * (dev.long_run_gain if long_runs else 1.0)


def _sm_l2_bw(dev: DeviceModel, active_sms: int) -> float:
    """L2 bandwidth one SM gets while `active_sms` SMs move data (bytes/s)."""
    return min(dev.sm_load_bytes_per_clk * dev.clock_hz, dev.l2_bw / active_sms)


def _partial_us(dev: DeviceModel, nbytes: float, active_sms: int) -> float:
    """Time one SM takes to park or read back an fp32 partial tile of `nbytes`."""
    return nbytes / min(dev.partial_bytes_per_clk * dev.clock_hz, _sm_l2_bw(dev, active_sms)) * 1e6


def _hbm_ratio(p, cfg, dev, m, k, concurrent) -> float:
    """HBM bytes per byte of operand traffic, from L2 reuse."""
    e = DTYPE_BYTES[p.dtype_in]
    cm, cn = cfg.cluster_tile
    rows, cols = min(cm, m), min(cn, p.n)
    tm, tn = _cdiv(m, cm), _cdiv(p.n, cn)
    # Each of the group's A and B panels at least once.
    compulsory = (m + p.n) / (tm * tn * (rows + cols))
    if (m + p.n) * k * e <= L2_RESIDENT_SHARE * dev.l2_bytes:
        return compulsory
    # A wave of `w` concurrent tiles walks `depth` tiles in the raster
    # direction inside strips `swizzle` tiles wide; the panels it shares are
    # read from HBM once per wave.
    w = min(tm * tn, max(1, math.ceil(concurrent / cfg.split_k)))
    swizzle = cfg.swizzle if cfg.persistent else 1
    along, across = (tm, tn) if cfg.raster == "m" else (tn, tm)
    size_along, size_across = (rows, cols) if cfg.raster == "m" else (cols, rows)
    width = min(across, max(swizzle, _cdiv(w, along)))
    depth = min(along, _cdiv(w, width))
    footprint = depth * size_along + width * size_across
    return min(1.0, max(compulsory, footprint / (w * (rows + cols))))


def _schedule(plan: _Plan, p: Problem, cfg: GemmConfig, dev: DeviceModel) -> tuple[float, dict]:
    """Makespan of the tiles over the workers (us, from the first CTA start)."""
    ideal = p.flops / (dev.peak_flops * dev.mma_efficiency) * 1e6
    held = plan.workers - plan.free_workers
    fill = dev.load_latency_us
    start = dev.cta_start_us + fill
    segs = plan.segments
    late_start = ideal + start  # held SMs come back when the other kernel ends

    if cfg.scheduler == "single_tile":
        # The block scheduler hands each CTA to whichever SM frees first; every
        # tile pays a CTA start, its pipeline fill and its whole epilogue.
        # A pingpong CTA runs two tiles, the second's mainloop under the
        # first's epilogue (pairs within a segment: pingpong is never grouped).
        free = _workers(plan.free_workers, held, 0.0, ideal)
        for s in segs:
            pairs, ones = divmod(s.tiles, 2) if cfg.pingpong else (0, s.tiles)
            pair = s.mainloop + max(s.mainloop, s.epilogue) + s.epilogue
            free = _greedy(free, pairs, dev.cta_start_us + fill + pair)
            free = _greedy(free, ones, dev.cta_start_us + fill + s.mainloop + s.epilogue)
        free = _greedy(free, _cdiv(plan.grid - plan.tiles, 2 if cfg.pingpong else 1), dev.cta_start_us)
        finish = free
        end = float(free.max())
    elif cfg.scheduler == "static_persistent":
        end, finish = _static(plan, cfg, dev, start, ideal)
    elif cfg.stream_k:
        end, finish = _stream_k(plan, p, cfg, dev, start, held, late_start)
    else:
        lat = dev.clc_claim_us if cfg.scheduler == "clc" else dev.atomic_claim_us
        # An atomic worker claims its first tile too; CLC's first is blockIdx.
        first = start + (lat if cfg.scheduler == "dynamic_persistent" else 0.0)
        free = _workers(plan.free_workers, held, first, late_start)
        tail = [_exposed_epilogue(cfg, s, dev) for s in segs]
        if cfg.sched_depth > 1 and len(segs) > 1 and plan.tiles <= EVENT_SIM_MAX_TILES:
            free = _event_sim(free, segs, tail, cfg.sched_depth, lat)
        else:
            for s, t in zip(segs, tail, strict=True):
                hidden = s.lead + t + (cfg.sched_depth - 1) * (s.mainloop + t)
                free = _greedy(free, s.tiles, s.mainloop + t + max(0.0, lat - hidden))
        # The last tile's epilogue finishes after the loop ends.
        free = free + (segs[-1].epilogue - tail[-1])
        finish = free
        phantoms = plan.grid - plan.tiles if cfg.scheduler == "clc" else 0
        if phantoms:
            free = _drain_phantoms(free, phantoms, plan.tiles, cfg, dev, lat)
        end = float(free.max())

    detail = {
        "tiles": plan.tiles,
        "grid": plan.grid,
        "workers": plan.free_workers,
        "waves": round(plan.tiles / plan.free_workers, 3),
        "bound": max(segs, key=lambda s: s.tiles * s.mainloop).bound,
        "finish_min_us": round(float(np.min(finish)), 3),
        "finish_max_us": round(float(np.max(finish)), 3),
        "ideal_us": round(ideal, 3),
    }
    return end, detail


def _exposed_epilogue(cfg: GemmConfig, s: _Segment, dev: DeviceModel) -> float:
    if cfg.arch == "sm100" and cfg.acc_stages > 1 or cfg.pingpong:
        # Double-buffered TMEM: the epilogue warps drain one accumulator
        # while the MMA warp fills the next. Pingpong (sm90): one warpgroup
        # stores a tile while the other runs the next tile's mainloop.
        return max(0.0, s.epilogue - s.mainloop)
    return dev.epilogue_exposed * s.epilogue


def _workers(free_n: int, late_n: int, start: float, late: float) -> np.ndarray:
    return np.concatenate([np.full(free_n, start), np.full(late_n, late)])


def _static(plan: _Plan, cfg: GemmConfig, dev: DeviceModel, start: float, ideal: float):
    """Tile i to worker i mod W, W = clusters the whole GPU holds."""
    return _ends(plan, _dealt(plan.segments, plan.workers, cfg, dev), start, ideal)


def _dealt(segments, w: int, cfg: GemmConfig, dev: DeviceModel) -> np.ndarray:
    """Busy time of each of `w` workers dealt the tiles of `segments` in
    turn (tile i to worker i mod w), the last tile's epilogue included."""
    ids = np.arange(w)
    busy = np.zeros(w)
    first = 0
    for s in segments:
        last = first + s.tiles
        count = _strided(last, ids, w) - _strided(first, ids, w)
        busy += count * (s.mainloop + _exposed_epilogue(cfg, s, dev) + STATIC_NEXT_US)
        first = last
    last_seg = segments[-1]
    busy += np.where(busy > 0, last_seg.epilogue - _exposed_epilogue(cfg, last_seg, dev), 0.0)
    return busy


def _ends(plan: _Plan, busy: np.ndarray, start: float, ideal: float):
    """(makespan, end of each worker) of a grid sized for every worker."""
    resident = plan.free_workers
    ends = start + busy
    if resident < plan.workers:
        # CTAs beyond the free SMs launch when an SM frees: the other kernel
        # ends or a resident CTA exits.
        late = min(ideal, float(ends[:resident].min())) + start
        ends[resident:] = late + busy[resident:]
    return float(ends.max()), ends


def _stream_k(plan: _Plan, p: Problem, cfg: GemmConfig, dev: DeviceModel, start: float, held: int,
              late_start: float):
    """Stream-K (`kernels.schedulers.StreamKScheduler`): the whole tiles
    claimed as the atomic scheduler's are, then the partial wave's `sk`
    tiles cut into `slices` K slices, slice-major, claimed after them.

    swap_ab tiles take even, contiguous ranges instead (`StreamKScheduler`).

    Every unit parks its fp32 partial and arrives on its tile's semaphore.
    Units of a slice are claimed together and are as long, so a tile's last
    slice, claimed last, is taken to arrive last: it reads the other slices'
    partials and stores the tile. Partials are not counted as DRAM traffic:
    they are read back soon after they are written, from a scratch of two
    CTA tiles per CTA of the grid, which L2 holds. Units of one slice read
    the same k-blocks at about the same time, so their operands' L2 reuse is
    that of a data-parallel wave (`_segment`'s).
    """
    kblocks = _cdiv(p.k, cfg.tile_k)
    (s,) = plan.segments  # stream-K is never grouped
    exposed = _exposed_epilogue(cfg, s, dev)
    partial = cfg.cta_tile_m * cfg.tile_n * ACC_BYTES
    if cfg.swap_ab:
        # Even ranges: every cluster streams W / P k-blocks, claims nothing,
        # parks its range's first and last units and, on the tiles it ends,
        # adds the partials of the tile's other contributors.
        per = plan.tiles * kblocks / plan.workers
        # Ranges start mid-tile: a tile has up to ceil(KI / per) + 1 contributors.
        sharing = min(plan.workers, math.ceil(kblocks / per) + 1)
        write = _partial_us(dev, partial, plan.free_workers * cfg.cluster_size)
        fixup = 2 * (write + dev.semaphore_us) + (sharing - 1) * write if sharing > 1 else 0.0
        stores = per / kblocks + (1 if sharing > 1 else 0)
        cost = per * s.mainloop / kblocks + fixup + stores * exposed
        free = _greedy(_workers(plan.free_workers, held, start, late_start), plan.workers, cost)
        free = free + (s.epilogue - exposed)
        return float(free.max()), free
    sk, slices = _stream_k_plan(plan.tiles, kblocks, plan.workers)
    lat = dev.atomic_claim_us
    free = _workers(plan.free_workers, held, start + lat, late_start)
    free = _greedy(free, plan.tiles - sk, s.mainloop + exposed + max(0.0, lat - s.lead - exposed))
    if sk:
        write = _partial_us(dev, partial, min(sk * slices, plan.free_workers) * cfg.cluster_size)
        read = _partial_us(dev, partial, sk * cfg.cluster_size)
        unit = s.mainloop / slices + write + dev.semaphore_us + max(0.0, lat - s.lead)
        free = _greedy(free, sk * (slices - 1), unit)
        free = _greedy(free, sk, unit + (slices - 1) * read + exposed)
    # The last store drains after the loop.
    free = free + (s.epilogue - exposed)
    return float(free.max()), free


def _stream_k_plan(tiles: int, kblocks: int, workers: int) -> tuple[int, int]:
    """(sk, slices), as `kernels.schedulers.StreamKScheduler` plans a launch:
    the partial wave's tiles (every tile when there are fewer than workers)
    cut into the most K slices that fill the workers once, or twice where
    that ends the wave sooner, each of SK_MIN_K_TILES k-blocks or more and
    at most SK_MAX_SLICES; (0, 1) where fewer than two slices would do."""
    waves, rest = divmod(tiles, workers)
    partial = rest if waves else tiles
    most = min(kblocks // SK_MIN_K_TILES, SK_MAX_SLICES)
    once = min(workers // max(partial, 1), most)
    twice = min(2 * workers // max(partial, 1), most)
    slices = twice if 2 * once < twice else once
    return (partial, slices) if slices > 1 and partial else (0, 1)


def _strided(x: int, ids: np.ndarray, w: int) -> np.ndarray:
    """How many of the indices [0, x) are congruent to each id mod w."""
    return np.maximum(0, (x - ids + w - 1) // w)


def _greedy(free: np.ndarray, n: int, cost: float) -> np.ndarray:
    """Give `n` tiles of equal `cost` one by one to the earliest-free worker.

    Worker w can start tiles at free[w] + j * cost; the n earliest of those
    starts are the assignment. Writing free[w] = a[w] * cost + b[w], starts
    order by (a[w] + j, b[w]): whole levels are counted in closed form and
    the last partial level goes to the smallest offsets.
    """
    if n <= 0:
        return free
    a = np.floor(free / cost)
    b = free - a * cost
    order = np.argsort(a, kind="stable")
    a_sorted = a[order]
    csum = np.cumsum(a_sorted)
    below = np.arange(1, len(a) + 1) * a_sorted - csum
    j = int(np.searchsorted(below, n, side="right")) - 1
    level = math.floor((n + csum[j]) / (j + 1))
    count = np.maximum(0.0, level - a)
    rest = n - int(count.sum())
    if rest:
        eligible = np.flatnonzero(a <= level)
        pick = eligible[np.argsort(b[eligible], kind="stable")[:rest]]
        count[pick] += 1
    return free + count * cost


def _event_sim(free: np.ndarray, segs, tail, depth: int, lat: float) -> np.ndarray:
    """Tile by tile: claims are served in time order, `depth - 1` tiles ahead.

    A worker's tile p is claimed when its tile p - depth + 1 starts (its first
    tiles when it starts), and starts when both the previous tile is done and
    the claim has come back.
    """
    costs = []
    for s, t in zip(segs, tail, strict=True):
        costs.extend([(s.mainloop, t, s.lead)] * s.tiles)
    total = len(costs)
    n = len(free)
    busy_until = [float(x) for x in free]
    starts: list[list[float]] = [[] for _ in range(n)]
    # Claims issued at the same moment are served worker by worker, earlier
    # queue positions first.
    heap = [(busy_until[w], 0, w) for w in range(n)]
    heapq.heapify(heap)
    done = list(busy_until)
    nxt = 0
    while heap:
        claim, _, w = heapq.heappop(heap)
        if nxt >= total:
            done[w] = max(busy_until[w], claim + lat)
            continue
        mainloop, exposed, lead = costs[nxt]
        nxt += 1
        mine = starts[w]
        ready = claim + lat if mine else claim
        begin = max(busy_until[w], ready)
        mine.append(begin)
        busy_until[w] = begin + mainloop + exposed
        done[w] = busy_until[w]
        # The claim for this worker's next tile, position len(mine).
        if depth == 1:
            again = begin + mainloop - lead
        else:
            again = mine[max(0, len(mine) - depth + 1)]
        heapq.heappush(heap, (again, len(mine), w))
    return np.array(done)


def _drain_phantoms(free: np.ndarray, phantoms: int, real: int, cfg: GemmConfig,
                    dev: DeviceModel, lat: float) -> np.ndarray:
    """Clear the clusters of a padded CLC grid that lie past the real work.

    Each phantom is launched (or claimed) only to find it has nothing to do.
    With tail cancel, every one that does so also fires a capped burst of
    cancels whose answers it never reads (seed 002).
    """
    per_event = 1
    if cfg.tail_cancel:
        per_event += next(
            (budget for scale, budget in TAIL_CANCEL_TIERS if phantoms >= real * scale),
            TAIL_CANCEL_DEFAULT,
        )
    return _greedy(free, _cdiv(phantoms, per_event), dev.cta_start_us + lat)


def _reduction_us(p: Problem, cfg: GemmConfig, dev: DeviceModel) -> float:
    """The split-K reduction pass of an arch that does not reduce in the
    kernel (sm100): it reads every slice's fp32 partial and writes the
    output (sm90's slices reduce in the kernel: `_segment`)."""
    moved = cfg.split_k * p.m * p.n * 4 + p.m * p.n * DTYPE_BYTES[p.dtype_out]
    return dev.launch_us + moved / (dev.hbm_bw * dev.hbm_efficiency) * 1e6


def _baseline_dense(p: Problem, dev: DeviceModel) -> float:
    best = math.inf
    split_ks = (1, 2, 4) if p.m <= 128 else (1,)
    for tile_m, tile_n, cluster_m, cluster_n, cta_group in _BASELINE_TILES[dev.arch]:
        for split_k in split_ks:
            for stages in (6, 5, 4, 3):
                fields = dict(
                    arch=dev.arch, scheduler="static_persistent", tile_m=tile_m, tile_n=tile_n,
                    cluster_m=cluster_m, cluster_n=cluster_n, stages=stages, swizzle=4,
                    split_k=split_k if tile_m <= 128 else 1,
                )
                if dev.arch == "sm100":
                    fields.update(cta_group=cta_group, acc_stages=2)
                try:
                    cfg = GemmConfig(**fields)
                    if smem_bytes(cfg, p.dtype_in) > dev.smem_per_sm:
                        continue
                    best = min(best, _predict(p, cfg, dev, 1.0)[0])
                except InvalidConfig:
                    continue
                break  # the deepest pipeline that fits
    if best == math.inf:
        raise InvalidConfig(f"no standard kernel runs {p.label()}")
    return best


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
