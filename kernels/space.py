"""The config space of the GEMM kernel pool, per architecture.

One frozen dataclass describes a kernel variant; `validate` is the single place
that decides whether a variant may exist at all (shared memory, TMEM, register,
cluster and tile rules), and `check_problem` whether a valid variant can run a
given problem (alignment, split-K divisibility). Invalid variants never reach
the compiler: the search sees them as pruned, not as slow.
"""

from __future__ import annotations

import itertools
import random
from dataclasses import asdict, dataclass, fields
from typing import Iterator

ARCHS = ("sm90", "sm100")
SCHEDULERS = ("single_tile", "static_persistent", "dynamic_persistent", "stream_k", "clc")
RASTERS = ("m", "n")
# How the consumer warpgroups of an sm90 CTA share work: "cooperative" splits
# each tile between them; "pingpong" gives each of two warpgroups its own
# tile, in turns, so that one's epilogue runs under the other's mainloop
# (CUTLASS KernelTmaWarpSpecializedPingpong).
CONSUMERS = ("cooperative", "pingpong")
# L2 eviction priority of the sm90 TMA loads (`GemmConfig.l2_hint`).
L2_HINTS = ("normal", "b_first")
_L2_TAGS = {"b_first": "bf"}
_L2_NAMES = {tag: hint for hint, tag in _L2_TAGS.items()}

# Bytes of one element, for the dtypes the pool accepts in and out.
DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
DTYPES_IN = ("bf16", "fp16")
DTYPES_OUT = ("bf16", "fp16", "fp32")
# "tn": B stored (N, K), K-major, as nn.Linear keeps its weight (x @ W.T).
# "nn": B stored (K, N), N-major (a @ b). A is always (M, K) row-major.
LAYOUTS = ("tn", "nn")
# Bounds of a key, for every input path (shape files, imports, HTTP): sizes
# beyond 2**31 are typos or probes, not GEMMs anyone runs; a key's groups and
# held SMs stay within what any device and the tables hold; an all-reduce
# beside (`tuner.key.Problem.overlap`) moves at most 1 TiB.
MAX_DIM = 2**31
MAX_KEY_GROUPS = 4096
MAX_CARVEOUT = 1024
MAX_OVERLAP = 2**40
# Width of the key name column (db.models.GemmKey.name).
MAX_NAME = 128

# K extent of one mainloop stage by default (`GemmConfig.tile_k`): 64 16-bit
# elements = one 128-byte swizzle row. Grouped kernels pack their problems'
# K in steps of it.
TILE_K = 64

# Shared memory a CTA may use (bytes). H100: 227 KB per block opt-in
# (CUDA C Programming Guide, compute capability 9.0); B200: 228 KB per SM,
# 227 KB per block (compute capability 10.0).
SMEM_BYTES = {"sm90": 232448, "sm100": 232448}
# Reserved for mbarriers (the pingpong turn barriers among them), the
# scheduler's smem ring and the CLC response.
SMEM_RESERVED = 1024
# The sm90 epilogue stages the output through smem in sub-tiles of 32
# columns, or 16, 24 or 8 where 32 does not divide tile_n (`epi_subtile_n`): two fp32
# buffers' worth of bytes, more buffers for narrower outputs (`epi_buffers`).
# Pingpong warpgroups share these buffers: their epilogues take turns.
EPI_SUBTILE_MAX_N = 32
EPI_BUFFERS = 2
# On sm100 an epilogue sub-tile holds 4096 elements whatever the CTA tile
# (128x32, or 64x64 for 64-row CTA tiles), as the tcgen05 TMEM loads dictate.
SM100_EPI_SUBTILE_ELEMS = 4096
# Tensor memory on sm100: 512 columns of 32-bit cells per SM (128 lanes).
TMEM_COLUMNS = 512
# sm90 registers. ptxas gives every thread of the kernel the launch share of
# the SM's 64K registers (65536 / threads, in steps of 8, at most 255);
# setmaxnreg then moves registers from the producer warpgroup to the
# consumers, per consumer warpgroups (producer, consumer), within
# 128 * (producer + consumers * consumer) <= 65536. A consumer thread's fp32
# accumulators plus SM90_NON_ACC_REGS (addresses, pipeline state, the WGMMA
# descriptors) must fit in its setmaxnreg budget, and the accumulators of
# one WGMMA (64 rows: tile_n / 2 a thread) plus those in the launch share,
# else ptxas fails ("insufficient registers") or spills. Offline compiles
# (ptxas of CUDA 13, nvidia-cutlass-dsl 4.8.1): two consumer warpgroups hold
# 200 accumulators (pingpong 128x200, cooperative 256x192: no stack frame),
# not 208 (1280 bytes of spills); three hold 96 (192x192) but not 112
# (192x224: "insufficient registers (128)").
SM90_REGISTERS = 65536
SM90_NON_ACC_REGS = 32
SM90_REG_BUDGETS = {1: (40, 232), 2: (40, 232), 3: (32, 160)}
# In-kernel split-K (sm90) and stream-K (sm90, sm100) work in an int32
# scratch buffer: the dynamic scheduler's two counters, one arrival semaphore
# per CTA tile, then, from a 128-byte boundary, the fp32 partial CTA tiles:
# one per (CTA tile, K slice) for split-K, two per CTA of the persistent grid
# for stream-K (unit u parks in slot u, and a launch has at most two units
# a cluster: `StreamKScheduler`).
SPLIT_K_COUNTERS = 2
# Archs whose kernels reduce split-K slices themselves, in a scratch buffer;
# the others write fp32 partials (S, M, N) that the runner sums.
SPLIT_K_IN_KERNEL = ("sm90",)
_SPLIT_K_PARTIALS_ALIGN = 32
# Activation rows a swap_ab tile holds at most (its tile_n).
SWAP_AB_MAX_ROWS = 128
# Largest cluster: 8 CTAs is portable, 16 needs the non-portable attribute.
MAX_CLUSTER = {"sm90": 4, "sm100": 16}

_KNOBS = {
    "sm90": {
        "scheduler": SCHEDULERS[:4],
        # tile_m 192 is three 64-row consumer warpgroups. tile_n: any
        # multiple of 8 up to 256, as WGMMA takes, so that a tile can cut N
        # into whole waves (Gemma 3 27B's N = 5376 is 32 tiles of 168).
        "tile_m": (64, 128, 192, 256),
        # Under 64 only with swap_ab: the activations' few rows on the MMA's
        # N side.
        "tile_n": tuple(range(8, 257, 8)),
        "cluster_m": (1, 2, 4),
        "cluster_n": (1, 2, 4),
        "stages": (2, 3, 4, 5, 6, 7, 8),
        "swizzle": (1, 2, 4, 8),
        "raster": RASTERS,
        "sched_depth": (1, 2),
        "tail_cancel": (False,),
        "split_k": (1, 2, 3, 4, 8),
        "cta_group": (1,),
        "acc_stages": (1,),
        "consumer": CONSUMERS,
        "swap_ab": (False, True),
        # K of a stage: one 128-byte swizzle row of each operand row, or two.
        # A weight streamed from DRAM in 256-byte runs a row, not 128, ran
        # faster at few rows (H100, the same swap_ab tiles at the same shared
        # memory: 27B gate_up at M = 8 to 64 0.995-1.030x cuBLAS with 64,
        # 1.039-1.057x with 128; Qwen2.5's lm_head at 8 to 128 1.012-1.040x
        # and 1.047-1.060x).
        "tile_k": (64, 128),
    },
    "sm100": {
        "scheduler": ("single_tile", "static_persistent", "dynamic_persistent", "stream_k", "clc"),
        "tile_m": (64, 128, 256),
        "tile_n": (32, 64, 96, 128, 160, 192, 224, 256),
        "cluster_m": (1, 2, 4),
        "cluster_n": (1, 2, 4),
        "stages": (2, 3, 4, 5, 6, 7, 8),
        "swizzle": (1, 2, 4, 8),
        "raster": RASTERS,
        "sched_depth": (1, 2, 3),
        "tail_cancel": (False, True),
        "split_k": (1, 2, 4, 8),
        "cta_group": (1, 2),
        "acc_stages": (1, 2, 4),
        # The tcgen05 MMA is issued by one thread; TMEM accumulator stages
        # (acc_stages) are sm100's way of overlapping the epilogue.
        "consumer": ("cooperative",),
        "swap_ab": (False,),
        "tile_k": (64,),
    },
}


# Most SMs an SM budget may name (more than any GPU of the pool's archs has).
MAX_SMS = 1024


class InvalidConfig(ValueError):
    """A config the pool cannot build, or cannot run on a given problem."""


@dataclass(frozen=True)
class GemmConfig:
    """One kernel variant of the pool.

    tile_m x tile_n is the MMA tile: on sm90 the CTA tile (64 rows per
    consumer warpgroup up to 192 = three of them, 256 = two warpgroups of
    128), on sm100 the tcgen05 tile, which spans two CTAs when cta_group == 2.
    sched_depth is how far ahead the atomic scheduler claims (1: when the
    current tile's loads are issued, 2: as they begin) or the CLC
    pipeline depth; it is 1 for schedulers that claim nothing.

    consumer "pingpong" (sm90): two consumer warpgroups each compute a whole
    tile_m x tile_n tile (tile_m 64 or 128, one warpgroup's rows), taking
    alternate tiles of the CTA's schedule. Configs stored before the knob
    existed have no such field and load as "cooperative".

    swap_ab (sm90, B an nn.Linear weight): the kernel computes out.T = W @
    x.T, so that the weight's rows take the MMA's M side (64 a warpgroup)
    and the activations' rows its N side (8 or a multiple of 16, at most
    SWAP_AB_MAX_ROWS): a decode step's few rows then fill a 64 x 8 tile
    instead of padding a 64-row one, and the weight's N rows make many tiles (what
    cuBLAS runs at M = 1 on an H100: a 64x8 "tst" kernel). tile_m then
    counts weight rows (N) and tile_n activation rows (M). Under the
    stream-K scheduler a swap_ab kernel streams the weight: every SM gets
    an equal contiguous share of its k-blocks (`kernels.schedulers`, even).

    tile_k is the K extent of one pipeline stage (named only where it is
    not the default, "t128x16x128"): at the same shared memory, 128 halves
    the stages and doubles each operand row's run of bytes per load, which
    DRAM streams faster. Configs stored before the knob existed load as 64.

    pdl (sm90): launched as a programmatic dependent of the kernel before
    it on the stream. Its CTAs start while that kernel drains; the load warp
    requests the weight's first `stages` k-blocks at once (a weight is never
    the previous kernel's output) and every other access of global memory
    waits for that kernel (`griddepcontrol.wait`). Only a caller whose B is
    a constant weight may run it (`tuner.runtime.patch`), so it is a launch
    variant of a stored winner, not a knob the search samples (named "pdl").

    sm_budget (persistent schedulers): the SMs the persistent grid may
    cover, 0 for all of them: a grid of fewer clusters leaves the other SMs
    to a kernel running beside (a collective). It sizes the launch, not the
    code: every budget runs one compiled kernel (named "sm<N>").
    """

    arch: str = "sm90"
    scheduler: str = "static_persistent"
    tile_m: int = 128
    tile_n: int = 128
    cluster_m: int = 1
    cluster_n: int = 1
    stages: int = 4
    swizzle: int = 1
    raster: str = "m"
    sched_depth: int = 1
    tail_cancel: bool = False
    split_k: int = 1
    cta_group: int = 1
    acc_stages: int = 1
    consumer: str = "cooperative"
    swap_ab: bool = False
    l2_hint: str = "normal"
    tile_k: int = TILE_K
    pdl: bool = False
    sm_budget: int = 0

    def __post_init__(self) -> None:
        validate(self)

    @property
    def cluster_size(self) -> int:
        return self.cluster_m * self.cluster_n

    @property
    def persistent(self) -> bool:
        return self.scheduler != "single_tile"

    def budget_clusters(self, wave: int) -> int:
        """Clusters the persistent grid launches, `wave` of them on the
        whole device: as many as the SM budget holds (at least one)."""
        return min(wave, max(1, self.sm_budget // self.cluster_size)) if self.sm_budget else wave

    @property
    def dynamic(self) -> bool:
        return self.scheduler in ("dynamic_persistent", "clc")

    @property
    def stream_k(self) -> bool:
        return self.scheduler == "stream_k"

    @property
    def reduces_partials(self) -> bool:
        """Whether CTAs share tiles and reduce fp32 partials (split-K, stream-K)."""
        return self.split_k > 1 or self.stream_k

    @property
    def split_k_in_kernel(self) -> bool:
        """Whether split-K slices reduce their partials in the kernel (sm90),
        rather than a pass summing the (S, M, N) fp32 slices (sm100)."""
        return self.split_k > 1 and self.arch in SPLIT_K_IN_KERNEL

    @property
    def cta_tile_m(self) -> int:
        """Rows of the output tile one CTA owns."""
        return self.tile_m // self.cta_group

    @property
    def m_rows(self) -> int:
        """Rows of M (the activations) one MMA tile covers."""
        return self.tile_n if self.swap_ab else self.tile_m

    @property
    def cluster_tile(self) -> tuple[int, int]:
        """Output rows and columns one cluster covers per work tile."""
        return (self.cta_tile_m * self.cluster_m, self.tile_n * self.cluster_n)

    @property
    def pingpong(self) -> bool:
        return self.consumer == "pingpong"

    @property
    def consumer_warpgroups(self) -> int:
        """sm90 consumer warpgroups of a CTA."""
        if self.pingpong:
            return 2
        return {64: 1, 192: 3}.get(self.tile_m, 2)

    @property
    def tile_warpgroups(self) -> int:
        """sm90 consumer warpgroups that share one tile (and its accumulators)."""
        return 1 if self.pingpong else self.consumer_warpgroups

    def smem_bytes(self) -> int:
        return smem_bytes(self)

    def name(self) -> str:
        """Stable, readable id: used for compile-cache entries and in tables."""
        parts = [
            self.arch,
            self.scheduler,
            f"t{self.tile_m}x{self.tile_n}" + (f"x{self.tile_k}" if self.tile_k != TILE_K else ""),
            f"c{self.cluster_m}x{self.cluster_n}",
            f"s{self.stages}",
            f"w{self.swizzle}{self.raster}",
        ]
        if self.dynamic:
            parts.append(f"d{self.sched_depth}")
        if self.tail_cancel:
            parts.append("tc")
        if self.split_k > 1:
            parts.append(f"k{self.split_k}")
        if self.arch == "sm100":
            parts.append(f"g{self.cta_group}a{self.acc_stages}")
        if self.pingpong:
            parts.append("pp")
        if self.swap_ab:
            parts.append("ab")
        if self.l2_hint != "normal":
            parts.append("L" + _L2_TAGS[self.l2_hint])
        if self.pdl:
            parts.append("pdl")
        if self.sm_budget:
            parts.append(f"sm{self.sm_budget}")
        return "-".join(parts)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict) -> "GemmConfig":
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise InvalidConfig(f"unknown config fields: {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def from_name(cls, name: str) -> "GemmConfig":
        """The config `name()` names (e.g. "sm90-dynamic_persistent-t128x256-c2x1-s4-w4m-d1")."""
        parts = name.split("-")
        if len(parts) < 6:
            raise InvalidConfig(f"{name!r} is not a config name (arch-scheduler-tMxN[xK]-cMxN-sS-wSR[-...])")
        fields_ = {"arch": parts[0], "scheduler": parts[1]}
        try:
            tile = [int(x) for x in parts[2].removeprefix("t").split("x")]
            if len(tile) not in (2, 3):
                raise ValueError(parts[2])
            fields_["tile_m"], fields_["tile_n"], *tile_k = tile
            if tile_k:
                fields_["tile_k"] = tile_k[0]
            fields_["cluster_m"], fields_["cluster_n"] = (int(x) for x in parts[3].removeprefix("c").split("x"))
            fields_["stages"] = int(parts[4].removeprefix("s"))
            fields_["swizzle"], fields_["raster"] = int(parts[5][1:-1]), parts[5][-1]
            for part in parts[6:]:
                if part == "tc":
                    fields_["tail_cancel"] = True
                elif part == "pp":
                    fields_["consumer"] = "pingpong"
                elif part == "ab":
                    fields_["swap_ab"] = True
                elif part == "pdl":
                    fields_["pdl"] = True
                elif part.startswith("sm"):
                    fields_["sm_budget"] = int(part[2:])
                elif part[0] == "L" and part[1:] in _L2_NAMES:
                    fields_["l2_hint"] = _L2_NAMES[part[1:]]
                elif part[0] == "d":
                    fields_["sched_depth"] = int(part[1:])
                elif part[0] == "k":
                    fields_["split_k"] = int(part[1:])
                elif part[0] == "g":
                    fields_["cta_group"], fields_["acc_stages"] = (int(x) for x in part[1:].split("a"))
                else:
                    raise ValueError(part)
        except ValueError:
            raise InvalidConfig(f"{name!r} is not a config name (arch-scheduler-tMxN[xK]-cMxN-sS-wSR[-...])") from None
        cfg = cls(**fields_)
        if cfg.name() != name:
            raise InvalidConfig(f"{name!r} is not a config name; did you mean {cfg.name()!r}?")
        return cfg


def smem_bytes(cfg: GemmConfig, dtype_in: str = "bf16") -> int:
    """Shared memory one CTA of `cfg` needs: the A/B ring, epilogue buffers, barriers."""
    elem = DTYPE_BYTES[dtype_in]
    # With the 2-CTA MMA each CTA of the pair loads half of the A and B tiles.
    a_rows = cfg.tile_m // cfg.cta_group
    b_rows = cfg.tile_n // cfg.cta_group
    stage = (a_rows + b_rows) * cfg.tile_k * elem
    if cfg.arch == "sm100":
        epilogue = SM100_EPI_SUBTILE_ELEMS * DTYPE_BYTES["fp32"] * EPI_BUFFERS
    else:
        epilogue = cfg.cta_tile_m * epi_subtile_n(cfg) * DTYPE_BYTES["fp32"] * EPI_BUFFERS
    return cfg.stages * stage + epilogue + SMEM_RESERVED


def epi_subtile_n(cfg: GemmConfig) -> int:
    """Columns of one sm90 epilogue sub-tile: the widest multiple of 16 up to
    `EPI_SUBTILE_MAX_N` that divides tile_n (stmatrix x4 stores 16 a warp),
    else of 8 (x2: tile_n 72, 168, ...)."""
    for step in (16, 8):
        fits = [w for w in range(step, EPI_SUBTILE_MAX_N + 1, step) if cfg.tile_n % w == 0]
        if fits:
            return max(fits)
    raise InvalidConfig(f"tile_n {cfg.tile_n} is not a multiple of 8")


def sm90_registers(cfg: GemmConfig) -> tuple[int, int]:
    """(producer, consumer) setmaxnreg budgets of an sm90 config, per thread."""
    return SM90_REG_BUDGETS[cfg.consumer_warpgroups]


def sm90_accumulators(cfg: GemmConfig) -> int:
    """fp32 accumulator registers per consumer thread of an sm90 config."""
    return cfg.tile_m * cfg.tile_n // (128 * cfg.tile_warpgroups)


def sm90_launch_registers(cfg: GemmConfig) -> int:
    """Registers per thread ptxas may allocate an sm90 kernel of `cfg` (its launch share)."""
    threads = 128 * (1 + cfg.consumer_warpgroups)
    return min(255, SM90_REGISTERS // threads // 8 * 8)


def epi_buffers(out_bits: int) -> int:
    """sm90 epilogue buffers for an output of `out_bits` per element.

    `smem_bytes` sizes the staging for fp32; a narrower output fills the same
    bytes with more buffers, so a sub-tile's TMA store is almost never still
    reading its buffer when the buffer comes round again.
    """
    return EPI_BUFFERS * DTYPE_BYTES["fp32"] * 8 // out_bits


def split_k_partials_offset(tiles):
    """Int32 words of the split-K scratch before its partials (ints or DSL integers)."""
    return (SPLIT_K_COUNTERS + tiles + _SPLIT_K_PARTIALS_ALIGN - 1) // _SPLIT_K_PARTIALS_ALIGN * _SPLIT_K_PARTIALS_ALIGN


def split_k_tiles(cfg: GemmConfig, m: int, n: int, groups: int = 1) -> int:
    """CTA tiles of `groups` M x N outputs, each padded to whole clusters: the split-K semaphores."""
    # A 2-CTA MMA tile (sm100) is two CTA tiles, each with its own semaphore.
    if cfg.swap_ab:  # the kernel tiles out.T
        m, n = n, m
    tiles_m = _cdiv(_cdiv(m, cfg.cta_tile_m), cfg.cluster_m) * cfg.cluster_m
    tiles_n = _cdiv(_cdiv(n, cfg.tile_n), cfg.cluster_n) * cfg.cluster_n
    return tiles_m * tiles_n * groups


def split_k_scratch_words(cfg: GemmConfig, m: int, n: int, clusters: int = 0, groups: int = 1) -> int:
    """Int32 words of the in-kernel split-K or stream-K scratch for `groups`
    M x N outputs (stream-K: on a device that runs `clusters` clusters at once)."""
    tiles = split_k_tiles(cfg, m, n, groups)
    partials = 2 * clusters * cfg.cluster_size if cfg.stream_k else tiles * cfg.split_k
    return split_k_partials_offset(tiles) + partials * cfg.cta_tile_m * cfg.tile_n


_INT32_MAX = 2**31 - 1


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def knobs(arch: str) -> dict[str, tuple]:
    """Every knob of `arch` with its candidate values (for samplers)."""
    if arch not in _KNOBS:
        raise InvalidConfig(f"unknown arch {arch!r}; expected one of {ARCHS}")
    return dict(_KNOBS[arch])


def validate(cfg: GemmConfig) -> None:
    """Raise InvalidConfig naming the first rule `cfg` breaks."""
    if cfg.arch not in ARCHS:
        raise InvalidConfig(f"unknown arch {cfg.arch!r}; expected one of {ARCHS}")
    for name, choices in _KNOBS[cfg.arch].items():
        value = getattr(cfg, name)
        if value not in choices:
            raise InvalidConfig(f"{name}={value!r} is not one of {choices} on {cfg.arch}")

    if cfg.l2_hint not in L2_HINTS:
        raise InvalidConfig(f"l2_hint={cfg.l2_hint!r} is not one of {L2_HINTS}")
    if cfg.l2_hint != "normal" and cfg.arch != "sm90":
        raise InvalidConfig(f"l2_hint applies to sm90 TMA loads only, not {cfg.arch}")
    if cfg.pdl not in (False, True):
        raise InvalidConfig(f"pdl={cfg.pdl!r} is not a bool")
    if cfg.pdl and cfg.arch != "sm90":
        raise InvalidConfig(f"pdl (programmatic dependent launch) is built for sm90 only, not {cfg.arch}")
    if isinstance(cfg.sm_budget, bool) or not isinstance(cfg.sm_budget, int) or not 0 <= cfg.sm_budget <= MAX_SMS:
        raise InvalidConfig(f"sm_budget={cfg.sm_budget!r} is not a count of SMs from 0 (all) to {MAX_SMS}")
    if cfg.sm_budget and not cfg.persistent:
        raise InvalidConfig("sm_budget sizes a persistent grid; single_tile launches a CTA a tile")
    if 0 < cfg.sm_budget < cfg.cluster_size:
        raise InvalidConfig(f"sm_budget={cfg.sm_budget} holds no cluster of {cfg.cluster_size} CTAs")

    # Knobs that do not apply must sit at their neutral value, so that one
    # kernel has exactly one config (no duplicates for the search to time).
    if not cfg.dynamic and cfg.sched_depth != 1:
        raise InvalidConfig(f"sched_depth applies to dynamic schedulers only, not {cfg.scheduler}")
    if cfg.scheduler == "dynamic_persistent" and cfg.sched_depth > 2:
        raise InvalidConfig("the atomic scheduler claims at most one tile ahead: sched_depth 1 or 2")
    if cfg.tail_cancel and cfg.scheduler != "clc":
        raise InvalidConfig("tail_cancel applies to the clc scheduler only")
    if cfg.swizzle > 1 and cfg.scheduler == "single_tile":
        raise InvalidConfig("swizzle groups tiles of a persistent walk; single_tile has none")
    if cfg.stream_k and cfg.split_k > 1:
        raise InvalidConfig("stream-K splits K itself: split_k must be 1")
    if cfg.split_k > 1 and cfg.tile_m > 128:
        raise InvalidConfig("split-K is for small-M keys: tile_m must be 64 or 128")
    # sm90 stream-K reduces in registers, as split-K does, and takes 256 rows
    # too (two warpgroups of 128: as many accumulators a thread as 128x256),
    # so that a 2x1 cluster covers M = 512 and reads each B panel once. Not
    # 192 rows: three warpgroups hold 96 accumulators at most.
    # sm100 stream-K reduces from TMEM one epilogue subtile at a time, each
    # CTA its own rows: its CTA tiles are never over 128 rows, and the pair
    # of a 2-CTA MMA splits a 256-row tile.
    if cfg.stream_k and cfg.cta_tile_m == 192:
        raise InvalidConfig("stream-K reduces tiles of 64, 128 or 256 rows, not 192")
    what = "stream-K" if cfg.stream_k else "split-K"
    # The sm90 fixup beside an epilogue of 16-column sub-tiles spills
    # (128x240, layout nn: 24 bytes of stack); it keeps 32-column ones.
    # swap_ab tiles, whose sub-tiles run along the weight rows, do not.
    if cfg.arch == "sm90" and cfg.reduces_partials and cfg.tile_n % 32 and not cfg.swap_ab:
        raise InvalidConfig(f"{what} takes a tile_n that is a multiple of 32 on sm90, not {cfg.tile_n}")

    if cfg.cluster_size > MAX_CLUSTER[cfg.arch]:
        raise InvalidConfig(
            f"cluster {cfg.cluster_m}x{cfg.cluster_n} exceeds {MAX_CLUSTER[cfg.arch]} CTAs on {cfg.arch}"
        )

    if cfg.arch == "sm90":
        if cfg.tile_n < 64 and not cfg.swap_ab:
            raise InvalidConfig(f"tile_n={cfg.tile_n} is for swap_ab tiles only (activation rows)")
        # Up to 128 activation rows: past 64 a non-swapped tile pads a row
        # block of 128 as well, but its weight tiles are 64-256 rows of a
        # long N and stream slower than swap_ab's (H100, M = 57 to 100:
        # 128x64 swap_ab ran 1.02-1.05x cuBLAS where the non-swapped tiles
        # of M = 65 to 128 lost). Past 128, a 128-row tile of activations
        # is the non-swapped kernel's own shape.
        if cfg.swap_ab and (cfg.tile_n > SWAP_AB_MAX_ROWS or cfg.tile_m not in (64, 128)):
            raise InvalidConfig(
                f"a swap_ab tile is 64 or 128 weight rows by at most {SWAP_AB_MAX_ROWS} activation rows"
            )
        # Activation rows of 24, 40 or 56 (odd numbers of 8-row swizzle
        # atoms on the MMA's N side) crashed on the H100; 8 runs.
        if cfg.swap_ab and cfg.tile_n % 16 and cfg.tile_n != 8:
            raise InvalidConfig(f"a swap_ab tile takes 8 or a multiple of 16 activation rows, not {cfg.tile_n}")
        if cfg.swap_ab and cfg.pingpong:
            raise InvalidConfig("swap_ab tiles are cooperative")
        if cfg.pingpong and cfg.tile_m not in (64, 128):
            raise InvalidConfig(f"a pingpong tile is one warpgroup's: tile_m 64 or 128, not {cfg.tile_m}")
        # Split-K is for keys with few tiles, where a CTA rarely has a second
        # tile to overlap; its fixup is built for one tile per CTA at a time.
        if cfg.pingpong and cfg.reduces_partials:
            raise InvalidConfig("pingpong consumers do not split K (split-K, stream-K)")
        acc_per_thread = sm90_accumulators(cfg)
        budget = sm90_registers(cfg)[1]
        most = budget - SM90_NON_ACC_REGS
        if acc_per_thread > most:
            raise InvalidConfig(
                f"tile {cfg.tile_m}x{cfg.tile_n} needs {acc_per_thread} accumulator registers "
                f"per consumer thread (max {most} of the {budget} each of "
                f"{cfg.consumer_warpgroups} consumer warpgroups' threads gets)"
            )
        share = sm90_launch_registers(cfg)
        if cfg.tile_n // 2 > share - SM90_NON_ACC_REGS:
            raise InvalidConfig(
                f"tile_n {cfg.tile_n} needs {cfg.tile_n // 2} accumulator registers per WGMMA, more than "
                f"the {share - SM90_NON_ACC_REGS} the launch share of {share} leaves with "
                f"{cfg.consumer_warpgroups} consumer warpgroups"
            )
    else:
        if cfg.cta_group == 1 and cfg.tile_m not in (64, 128):
            raise InvalidConfig(f"1-CTA tcgen05 MMA takes tile_m 64 or 128, not {cfg.tile_m}")
        if cfg.cta_group == 2 and cfg.tile_m not in (128, 256):
            raise InvalidConfig(f"2-CTA tcgen05 MMA takes tile_m 128 or 256, not {cfg.tile_m}")
        if cfg.cta_group == 2 and cfg.cluster_m % 2:
            raise InvalidConfig("2-CTA MMA needs an even cluster_m")
        if cfg.tile_m == 64 and cfg.tile_n % 8 or cfg.tile_m > 64 and cfg.tile_n % 16:
            raise InvalidConfig(f"tcgen05 MMA with M={cfg.tile_m} cannot take N={cfg.tile_n}")
        columns = cfg.acc_stages * cfg.tile_n
        if columns > TMEM_COLUMNS:
            raise InvalidConfig(
                f"{cfg.acc_stages} accumulator stages of {cfg.tile_n} columns need {columns} "
                f"TMEM columns (max {TMEM_COLUMNS})"
            )

    need = smem_bytes(cfg)
    if need > SMEM_BYTES[cfg.arch]:
        raise InvalidConfig(
            f"{cfg.stages} stages of {cfg.tile_m}x{cfg.tile_n} need {need} bytes of shared memory "
            f"(max {SMEM_BYTES[cfg.arch]})"
        )


def is_valid(cfg_fields: dict) -> bool:
    try:
        GemmConfig(**cfg_fields)
    except InvalidConfig:
        return False
    return True


def check_problem(
    cfg: GemmConfig, m: int, n: int, k: int, groups: int = 1,
    dtype_in: str = "bf16", dtype_out: str = "bf16", layout: str = "tn", group_k: tuple[int, ...] = (),
) -> None:
    """Raise InvalidConfig if `cfg` cannot run this problem (the can_implement check).

    `group_k`: the groups' own K (G problems packed along K, `kernels.grouped`'s
    "k" form); empty for a dense or an MoE ("rows") problem."""
    check_operands(m, n, k, groups, dtype_in, dtype_out, layout)
    check_output(cfg, dtype_out)
    if cfg.pingpong and groups > 1:
        raise InvalidConfig("pingpong consumers are not built for grouped GEMM")
    if cfg.swap_ab and (groups > 1 or layout != "tn"):
        raise InvalidConfig("swap_ab takes B as an nn.Linear weight (layout tn), not grouped")
    if cfg.stream_k and groups > 1:
        raise InvalidConfig("stream-K is not built for grouped GEMM")
    if cfg.tile_k != TILE_K and groups > 1:
        raise InvalidConfig(f"grouped GEMM walks K in stages of {TILE_K}, not {cfg.tile_k}")
    if cfg.split_k > 1 and groups > 1:
        # Problems packed along K split each group's k-blocks in the kernel;
        # MoE groups share K, and their rows, not K, make the work.
        if not group_k:
            raise InvalidConfig("split-K is combined with grouped GEMM only for groups with their own K")
        if cfg.arch != "sm90":
            raise InvalidConfig(f"grouped split-K is built for sm90, not {cfg.arch}")
        if min(group_k) // TILE_K < cfg.split_k:
            raise InvalidConfig(f"K={min(group_k)} split {cfg.split_k} ways leaves slices under one k-block")
    elif cfg.split_k > 1:
        if k % (cfg.split_k * 8):
            raise InvalidConfig(f"K={k} does not split into {cfg.split_k} 16-byte aligned slices")
        if k // cfg.split_k < cfg.tile_k:
            raise InvalidConfig(f"K={k} split {cfg.split_k} ways leaves slices under one k-block")
    # sm90 parks the slices' partials (every group's) in an int32-indexed scratch buffer.
    if cfg.split_k > 1 and cfg.arch == "sm90":
        words = split_k_scratch_words(cfg, m, n, groups=groups)
        if words > _INT32_MAX:
            raise InvalidConfig(
                f"split-K scratch of {words} words for {groups} x {m}x{n} "
                f"exceeds int32 indexing; use fewer slices or larger tiles"
            )


def check_output(cfg: GemmConfig, dtype_out: str) -> None:
    """Raise InvalidConfig if `cfg`'s epilogue does not store `dtype_out`.

    The sm90 epilogue of an 8-column multiple (tile_n 72, 168, ...) stages
    16-bit outputs with stmatrix x2; its fp32 staging is built for 16-column
    sub-tiles only (the H100 read wrong results)."""
    if cfg.arch == "sm90" and not cfg.swap_ab and cfg.tile_n % 16 and DTYPE_BYTES[dtype_out] > 2:
        raise InvalidConfig(f"tile_n {cfg.tile_n} (not a multiple of 16) stores 16-bit outputs, not {dtype_out}")


def check_operands(
    m: int, n: int, k: int, groups: int, dtype_in: str, dtype_out: str, layout: str,
) -> None:
    """Problem rules that hold for every kernel of the pool (TMA needs 16-byte strides)."""
    for name, value in (("M", m), ("N", n), ("K", k), ("groups", groups)):
        if value < 1:
            raise InvalidConfig(f"{name} must be positive, got {value}")
    for name, value in (("M", m), ("N", n), ("K", k)):
        if value > MAX_DIM:
            raise InvalidConfig(f"{name}={value} is over the largest size taken, {MAX_DIM}")
    if groups > MAX_KEY_GROUPS:
        raise InvalidConfig(f"groups={groups} is over the most taken, {MAX_KEY_GROUPS}")
    if dtype_in not in DTYPES_IN:
        raise InvalidConfig(f"unknown input dtype {dtype_in!r}; expected one of {DTYPES_IN}")
    if dtype_out not in DTYPES_OUT:
        raise InvalidConfig(f"unknown output dtype {dtype_out!r}; expected one of {DTYPES_OUT}")
    if layout not in LAYOUTS:
        raise InvalidConfig(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    per_16_bytes = 16 // DTYPE_BYTES[dtype_in]
    if k % per_16_bytes:
        raise InvalidConfig(f"K={k} must be a multiple of {per_16_bytes} for {dtype_in} (16-byte rows)")
    if layout == "nn" and n % per_16_bytes:
        raise InvalidConfig(f"N={n} must be a multiple of {per_16_bytes} for an N-major {dtype_in} B")
    out_per_16 = 16 // DTYPE_BYTES[dtype_out]
    if n % out_per_16:
        raise InvalidConfig(f"N={n} must be a multiple of {out_per_16} for a {dtype_out} output")


def enumerate_configs(arch: str) -> Iterator[GemmConfig]:
    """Every valid config of `arch`, in a fixed order."""
    space = knobs(arch)
    names = list(space)
    for values in itertools.product(*(space[n] for n in names)):
        fields_ = dict(zip(names, values, strict=True))
        fields_["arch"] = arch
        if is_valid(fields_):
            yield GemmConfig(**fields_)


def sample(arch: str, rng: random.Random) -> GemmConfig:
    """A uniformly drawn valid config of `arch` (rejection sampling over the knobs)."""
    space = knobs(arch)
    while True:
        fields_ = {name: rng.choice(choices) for name, choices in space.items()}
        fields_["arch"] = arch
        if is_valid(fields_):
            return GemmConfig(**fields_)


def defaults(arch: str) -> dict[str, GemmConfig]:
    """A sound starting config per scheduler of `arch` (seeds every search)."""
    base = dict(arch=arch, tile_m=128, tile_n=128, stages=4)
    if arch == "sm100":
        base.update(tile_m=256, tile_n=128, cluster_m=2, cta_group=2, acc_stages=2)
    out = {}
    for sched in knobs(arch)["scheduler"]:
        extra = {"swizzle": 1} if sched == "single_tile" else {"swizzle": 4}
        out[sched] = GemmConfig(scheduler=sched, **base, **extra)
    return out
