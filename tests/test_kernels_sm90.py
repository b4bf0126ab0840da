"""The sm90 kernel pool: offline compiles with PTX checks (CI), correctness on a GPU."""

from __future__ import annotations

import os
import random
import re

import pytest
import torch
from cuda.bindings import driver

from kernels import compile as kc
from kernels import space
from kernels.space import GemmConfig, check_problem

DYN = "dynamic_persistent"
STATIC = "static_persistent"
SINGLE = "single_tile"
SK = "stream_k"
PP = "pingpong"


def _v(layout="tn", dtype_in="bf16", dtype_out="bf16", **fields) -> kc.Variant:
    return kc.Variant(GemmConfig(**fields), dtype_in, dtype_out, layout)


# A spread over schedulers, tiles (1 and 2 consumer warpgroups), clusters
# (multicast of A and of B), stages, swizzle/raster, layouts, dtypes, split-K.
OFFLINE = [
    _v(scheduler=STATIC),
    _v(scheduler=STATIC, tile_m=128, tile_n=256, stages=4, swizzle=4),
    _v("nn", scheduler=STATIC, tile_m=256, tile_n=128, stages=3, swizzle=2, raster="n"),
    _v("nn", scheduler=STATIC, tile_m=64, tile_n=64, stages=8, swizzle=8),
    _v(scheduler=STATIC, tile_m=64, tile_n=256, stages=5, cluster_m=2),
    _v("nn", scheduler=STATIC, tile_m=128, tile_n=192, cluster_n=2),
    _v(scheduler=STATIC, tile_m=128, tile_n=96, stages=2, cluster_m=2, cluster_n=2),
    _v(scheduler=SINGLE),
    _v("nn", scheduler=SINGLE, tile_m=64, tile_n=96, cluster_m=2, stages=6),
    _v(scheduler=SINGLE, tile_m=256, tile_n=64, cluster_n=2, stages=3),
    _v(scheduler=DYN),
    _v("nn", scheduler=DYN, tile_m=128, tile_n=256, sched_depth=2, cluster_m=2),
    _v(scheduler=DYN, tile_m=64, tile_n=160, sched_depth=2, cluster_n=2, swizzle=4, raster="n"),
    _v("nn", scheduler=DYN, tile_m=256, tile_n=128, stages=3, cluster_m=2, swizzle=2),
    _v(scheduler=DYN, cluster_m=2, cluster_n=2, sched_depth=2),
    _v(scheduler=STATIC, split_k=2, tile_m=64, tile_n=128),
    _v("nn", scheduler=DYN, split_k=4, tile_m=128, tile_n=64, sched_depth=2),
    _v(scheduler=SINGLE, split_k=8, tile_m=64, tile_n=64),
    _v(scheduler=STATIC, dtype_out="fp32"),
    _v("nn", scheduler=DYN, dtype_out="fp32", tile_n=64),
    _v(scheduler=STATIC, dtype_in="fp16", dtype_out="fp16", tile_n=160),
    _v("nn", scheduler=SINGLE, dtype_in="fp16", dtype_out="fp32", tile_m=64),
    _v(scheduler=STATIC, tile_n=224, stages=4),
    _v("nn", scheduler=DYN, tile_n=224, stages=4, cluster_m=2),
    _v(scheduler=STATIC, split_k=3, tile_n=192),
    _v("nn", scheduler=DYN, split_k=3, tile_m=64, tile_n=224, sched_depth=2),
    # Widths in steps of 16 (16-column epilogue sub-tiles where 32 does not
    # divide) and tile_m 192 on three consumer warpgroups (512 threads).
    _v(scheduler=STATIC, tile_m=128, tile_n=176, stages=5, swizzle=4),
    _v("nn", scheduler=DYN, tile_m=64, tile_n=80, stages=8, sched_depth=2),
    _v(scheduler=SINGLE, tile_m=256, tile_n=112, stages=4, cluster_m=2),
    _v("nn", scheduler=STATIC, tile_m=128, tile_n=208, stages=4, cluster_n=2, dtype_out="fp32"),
    _v(scheduler=STATIC, tile_m=192, tile_n=128, stages=4, swizzle=4),
    _v("nn", scheduler=DYN, tile_m=192, tile_n=192, stages=3, cluster_m=2, cluster_n=2, sched_depth=2),
    _v(scheduler=SINGLE, tile_m=192, tile_n=176, stages=4, cluster_n=2, dtype_in="fp16", dtype_out="fp32"),
    _v(scheduler=DYN, tile_m=128, tile_n=144, stages=5, cluster_m=2, sched_depth=1),
    # Pingpong consumers (two warpgroups, a tile each) under every scheduler,
    # with clusters, both tile_m, 16-column epilogue sub-tiles.
    _v(scheduler=STATIC, consumer=PP, swizzle=4),
    _v("nn", scheduler=DYN, consumer=PP, cluster_m=2, sched_depth=2),
    _v(scheduler=SINGLE, consumer=PP, tile_m=64, tile_n=256, cluster_n=2),
    _v("nn", scheduler=DYN, consumer=PP, tile_m=64, tile_n=176, stages=6, dtype_out="fp32"),
    # Stream-K: both tile_m, clusters (the units of a cluster's CTAs), fp32 out.
    _v(scheduler=SK, swizzle=4),
    _v("nn", scheduler=SK, tile_m=64, tile_n=256, stages=5, cluster_n=2),
    _v(scheduler=SK, tile_m=128, tile_n=256, stages=4, cluster_m=2, dtype_out="fp32"),
    _v("nn", scheduler=SK, tile_m=128, tile_n=192, cluster_m=2, cluster_n=2, raster="n", swizzle=2),
    _v(scheduler=SK, tile_m=256, tile_n=128, stages=3, cluster_m=2, swizzle=4),
    # Clusters of four along M (B multicast to four CTAs, 44-row slices of a
    # 176-wide tile) or N, under every scheduler and both consumer modes.
    _v(scheduler=STATIC, tile_m=128, tile_n=176, stages=5, cluster_m=4, swizzle=4),
    _v("nn", scheduler=SINGLE, tile_m=64, tile_n=128, stages=8, cluster_n=4),
    _v(scheduler=DYN, tile_m=128, tile_n=192, stages=4, cluster_m=4, sched_depth=2),
    _v(scheduler=SK, tile_m=128, tile_n=256, stages=4, cluster_m=4, dtype_out="fp32"),
    _v(scheduler=STATIC, split_k=2, tile_m=64, tile_n=128, cluster_m=4),
    _v("nn", scheduler=STATIC, consumer=PP, tile_m=64, tile_n=192, stages=6, cluster_n=4),
    # swap_ab: the weight on the MMA's M side, 8 to 128 activation rows on
    # its N side, an M-major output (transposed stmatrix), fp32 out too.
    _v(scheduler=SINGLE, tile_m=64, tile_n=16, stages=8, swap_ab=True),
    _v(scheduler=STATIC, tile_m=128, tile_n=32, stages=8, swizzle=4, swap_ab=True, dtype_out="fp32"),
    _v(scheduler=DYN, tile_m=64, tile_n=48, stages=8, cluster_m=2, swap_ab=True),
    _v(scheduler=SINGLE, tile_m=64, tile_n=64, stages=8, cluster_n=4, swap_ab=True, dtype_in="fp16", dtype_out="fp16"),
    # ... and with K split: slices of the transposed tile reduce in the kernel.
    _v(scheduler=SINGLE, tile_m=64, tile_n=16, stages=8, split_k=3, swap_ab=True),
    _v(scheduler=STATIC, tile_m=128, tile_n=64, stages=8, split_k=2, cluster_m=2, swap_ab=True, dtype_out="fp32"),
    _v(scheduler=DYN, tile_m=128, tile_n=48, stages=8, split_k=4, swap_ab=True),
    # ... and with up to 128 activation rows (48- and 32-column epilogue sub-tiles).
    _v(scheduler=SINGLE, tile_m=128, tile_n=96, stages=6, swap_ab=True),
    _v(scheduler=STATIC, tile_m=64, tile_n=128, stages=8, cluster_m=2, swap_ab=True, dtype_out="fp32"),
    _v(scheduler=SINGLE, tile_m=128, tile_n=80, stages=8, split_k=2, swap_ab=True),
    # ... and streamed: stream-K in even ranges of the weight's k-blocks.
    _v(scheduler=SK, tile_m=64, tile_n=8, stages=8, swap_ab=True),
    _v(scheduler=SK, tile_m=128, tile_n=16, stages=5, cluster_m=2, swap_ab=True, tile_k=128, pdl=True,
       dtype_out="fp32"),
    _v(scheduler=SK, tile_m=64, tile_n=64, stages=8, cluster_n=2, swap_ab=True, l2_hint="b_first"),
    # Widths of an odd number of 8-row atoms: B's TMA box from a one-stage
    # layout, 24- or 8-column epilogue sub-tiles (stmatrix x2, 16-bit out).
    _v(scheduler=SINGLE, tile_m=128, tile_n=168, stages=4, cluster_m=2),
    _v("nn", scheduler=DYN, tile_m=64, tile_n=72, stages=8, sched_depth=2, dtype_out="fp16"),
    _v(scheduler=STATIC, tile_m=192, tile_n=168, stages=3, cluster_n=2),
    _v("nn", scheduler=STATIC, consumer=PP, tile_m=128, tile_n=136, stages=4),
    _v(scheduler=SINGLE, tile_m=64, tile_n=8, stages=8, swap_ab=True),
    _v(scheduler=STATIC, tile_m=128, tile_n=8, stages=8, swap_ab=True, dtype_out="fp32"),
    _v(scheduler=SINGLE, tile_m=64, tile_n=8, stages=8, split_k=3, swap_ab=True),
    # Up to 200 accumulators a consumer thread under setmaxnreg: pingpong
    # 128-row tiles and cooperative 256-row ones wider than 136.
    _v(scheduler=STATIC, consumer=PP, tile_m=128, tile_n=200, stages=4, swizzle=4),
    _v("nn", scheduler=SINGLE, consumer=PP, tile_m=128, tile_n=168, stages=5, cluster_n=2, dtype_out="fp16"),
    _v(scheduler=DYN, tile_m=256, tile_n=168, stages=3, cluster_m=2),
    _v("nn", scheduler=SK, tile_m=256, tile_n=192, stages=2, swizzle=4, dtype_out="fp32"),
    # B's loads evict-first in L2: plain, multicast, pingpong, stream-K and
    # swap_ab (where B is the kernel's A).
    _v(scheduler=STATIC, tile_n=176, stages=5, cluster_m=2, swizzle=4, consumer=PP, l2_hint="b_first"),
    _v("nn", scheduler=SK, tile_n=256, stages=4, cluster_m=2, l2_hint="b_first"),
    _v(scheduler=SINGLE, tile_m=128, tile_n=16, stages=8, swap_ab=True, l2_hint="b_first"),
    # Stages of K 128: two swizzle rows a box row, eight WGMMAs a stage.
    _v(scheduler=SINGLE, tile_m=128, tile_n=16, stages=5, swap_ab=True, l2_hint="b_first", tile_k=128),
    _v("nn", scheduler=DYN, tile_m=128, tile_n=128, stages=3, cluster_m=2, tile_k=128),
    _v(scheduler=SK, tile_m=128, tile_n=256, stages=2, tile_k=128),
    # Programmatic dependent launch: the weight (A under swap_ab, else B,
    # multicast too) requested before the wait, under every scheduler.
    _v(scheduler=STATIC, tile_m=64, tile_n=8, stages=8, swap_ab=True, pdl=True),
    _v(scheduler=DYN, tile_m=128, tile_n=16, stages=5, split_k=2, swap_ab=True, tile_k=128, pdl=True),
    _v(scheduler=SK, tile_m=128, tile_n=128, stages=4, cluster_m=2, pdl=True),
    _v("nn", scheduler=SINGLE, consumer=PP, tile_n=64, cluster_n=2, pdl=True),
]


@pytest.fixture(scope="module")
def offline():
    return kc.compile_offline(OFFLINE, workers=os.cpu_count() or 1)


@pytest.mark.parametrize("i", range(len(OFFLINE)), ids=[v.key() for v in OFFLINE])
def test_offline_ptx(offline, i):
    _check_ptx(OFFLINE[i], offline[i])


@pytest.mark.slow
def test_configs_the_space_draws_compile_and_pass_the_checks():
    rng = random.Random(90)
    variants = []
    while len(variants) < 24:
        try:  # eighth widths store 16-bit outputs only (`space.check_output`)
            variants.append(kc.Variant(space.sample("sm90", rng), rng.choice(space.DTYPES_IN),
                                       rng.choice(space.DTYPES_OUT), rng.choice(space.LAYOUTS)))
        except space.InvalidConfig:
            continue
    for v, k in zip(variants, kc.compile_offline(variants, workers=os.cpu_count() or 1), strict=True):
        _check_ptx(v, k)


def _check_ptx(v: kc.Variant, k: kc.OfflineKernel) -> None:
    assert ".target sm_90a" in k.ptx
    assert "wgmma.mma_async" in k.ptx
    # The claim counter's relaxed add: the atomic scheduler's and stream-K's
    # (but the weight-streaming kind's: its ranges are dealt, not claimed).
    claims = v.cfg.scheduler == DYN or v.cfg.stream_k and not v.cfg.swap_ab
    assert ("atom.global.add" in k.ptx) == claims
    # Split-K slices and stream-K units count themselves on a tile semaphore
    # and reduce in the kernel; nothing else touches global atomics.
    assert ("atom.global.acq_rel.add" in k.ptx) == (v.cfg.scheduler == DYN or v.cfg.reduces_partials)
    assert ("atom.global" in k.ptx) == (v.cfg.scheduler == DYN or v.cfg.reduces_partials)
    assert ("fence.acq_rel.gpu" in k.ptx) == v.cfg.reduces_partials
    # Pingpong warpgroups each sync their own epilogue: the barrier id is a
    # register (the warpgroup's), the count one warpgroup.
    assert bool(re.search(r"bar\.sync \t%r\d+, 128;", k.ptx)) == v.cfg.pingpong
    # Only a cluster's leader claims; others receive over DSMEM.
    assert ("st.async" in k.ptx) == (claims and v.cfg.cluster_size > 1)
    assert ("multicast::cluster" in k.ptx) == (v.cfg.cluster_size > 1)
    # pdl: the load warp's wait after its weight prefetch, the scheduler
    # warp's and the consumers' before they touch global memory; one trigger.
    assert k.ptx.count("griddepcontrol.wait") == (3 if v.cfg.pdl else 0)
    assert k.ptx.count("griddepcontrol.launch_dependents") == (1 if v.cfg.pdl else 0)
    # ptxas keeps every thread within its launch share of the register file.
    assert 0 < k.registers <= space.sm90_launch_registers(v.cfg)
    producer, consumer = space.sm90_registers(v.cfg)
    assert f"setmaxnreg.dec.sync.aligned.u32 \t{producer};" in k.ptx
    assert f"setmaxnreg.inc.sync.aligned.u32 \t{consumer};" in k.ptx
    assert k.stack_bytes == 0, "register spills"
    # The space's budget covers what the kernel allocates.
    assert k.smem_bytes <= v.cfg.smem_bytes()
    # A hinted load names the evict-first policy (CUTLASS's EVICT_FIRST) for
    # the weight only; the others keep the default (0).
    policies = _load_policies(k.ptx, v.cfg.tile_m * v.cfg.tile_k * space.DTYPE_BYTES[v.dtype_in])
    weight, other = ("a", "b") if v.cfg.swap_ab else ("b", "a")
    assert policies[other] == {0}
    assert policies[weight] == ({0x12F0000000000000} if v.cfg.l2_hint == "b_first" else {0})


def _load_policies(ptx: str, a_box_bytes: int) -> dict[str, set[int]]:
    """The L2 cache policies of the kernel's A and B TMA loads, told apart by
    their smem offsets: A's ring comes first, one box a stage, B's (one box
    or several) after it."""
    movs = dict(re.findall(r"mov\.b64 \t(%rd\d+), (-?\d+);", ptx))
    loads = re.findall(
        r"cp\.async\.bulk\.tensor\.\dd\.shared::(?:cta|cluster)\.global\.[^\n]*?\[%r\d+(?:\+(\d+))?\][^\n]*?(%rd\d+);", ptx
    )
    first = min(int(offset or 0) for offset, _ in loads)
    out: dict[str, set[int]] = {"a": set(), "b": set()}
    for offset, reg in loads:
        out["a" if int(offset or 0) < first + a_box_bytes else "b"].add(int(movs[reg]))
    return out


# ---------------------------------------------------------------- GPU

GPU_CONFIGS = [
    GemmConfig(scheduler=SINGLE),
    GemmConfig(scheduler=SINGLE, tile_m=64, tile_n=96, cluster_m=2),
    GemmConfig(scheduler=STATIC, swizzle=4),
    GemmConfig(scheduler=STATIC, tile_m=256, tile_n=128, stages=3, cluster_n=2, raster="n", swizzle=2),
    GemmConfig(scheduler=STATIC, tile_m=64, tile_n=256, stages=5, cluster_m=2, cluster_n=2),
    GemmConfig(scheduler=DYN),
    GemmConfig(scheduler=DYN, tile_m=128, tile_n=256, sched_depth=2, cluster_m=2, swizzle=4),
    GemmConfig(scheduler=DYN, tile_m=64, tile_n=160, sched_depth=2, cluster_n=2, raster="n"),
    GemmConfig(scheduler=DYN, tile_m=256, tile_n=64, stages=4, cluster_m=2, sched_depth=2),
    GemmConfig(scheduler=DYN, tile_n=192, stages=3, cluster_m=2, cluster_n=2, sched_depth=2),
    GemmConfig(scheduler=STATIC, tile_n=160, cluster_m=2, raster="n", swizzle=8),
    GemmConfig(scheduler=STATIC, tile_n=224, stages=4, swizzle=4),
    GemmConfig(scheduler=DYN, tile_n=224, stages=4, cluster_m=2),
    GemmConfig(scheduler=STATIC, tile_n=256, stages=4, cluster_m=2, cluster_n=2),
    GemmConfig(scheduler=DYN, tile_m=64, tile_n=80, stages=8, sched_depth=2),
    GemmConfig(scheduler=SINGLE, tile_m=256, tile_n=112, stages=4, cluster_m=2),
]
SPLIT_K_CONFIGS = [
    GemmConfig(scheduler=STATIC, split_k=2, tile_m=64, tile_n=128),
    GemmConfig(scheduler=DYN, split_k=4, tile_m=128, tile_n=64, sched_depth=2),
    # More CTAs than fit at once: no slice may wait for another.
    GemmConfig(scheduler=SINGLE, split_k=8, tile_m=64, tile_n=64),
    GemmConfig(scheduler=STATIC, split_k=2, tile_m=128, tile_n=192, cluster_m=2),
    GemmConfig(scheduler=DYN, split_k=3, tile_m=128, tile_n=224),
    GemmConfig(scheduler=STATIC, split_k=2, tile_m=64, tile_n=128, cluster_m=4),
]
# Sizes off every tile multiple, a single row, a single k-block, N = 8.
SHAPES = [(1, 256, 4096), (300, 200, 136), (1000, 1000, 1000), (129, 8, 520), (77, 264, 8), (2048, 1536, 1024)]
# Run in a row on one scratch buffer: a semaphore left set would break the next.
# K is a multiple of 3 x 8 so that every slice count of SPLIT_K_CONFIGS applies.
SPLIT_K_SHAPES = [(1, 256, 4608), (300, 200, 1536), (129, 8, 2304), (1000, 3000, 4608), (300, 200, 1536)]
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


def _operands(m, n, k, layout, dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    a = torch.randn(m, k, device="cuda", generator=gen).to(dtype)
    b = torch.randn((n, k) if layout == "tn" else (k, n), device="cuda", generator=gen).to(dtype)
    ref = a.float() @ (b.float().T if layout == "tn" else b.float())
    return a, b, ref


def _rel_err(out, ref) -> float:
    return (torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref)).item()


def _check(cfg, layout, shapes, dtype_out="bf16"):
    runner = kc.get_kernel(cfg, dtype_in="bf16", dtype_out=dtype_out, layout=layout)
    for m, n, k in shapes:
        check_problem(cfg, m, n, k, dtype_out=dtype_out, layout=layout)
        a, b, ref = _operands(m, n, k, layout)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=DTYPES[dtype_out])
        runner(a, b, out)
        torch.cuda.synchronize()
        err = _rel_err(out, ref)
        assert err < 2e-2, f"{cfg.name()} {layout} {(m, n, k)}: rel err {err}"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["tn", "nn"])
@pytest.mark.parametrize("cfg", GPU_CONFIGS, ids=lambda c: c.name())
def test_correct_on_awkward_shapes(cfg, layout):
    _check(cfg, layout, SHAPES)


BUDGET_SHAPES = [(4096, 4096, 1024), (777, 5000, 520), (1, 8192, 4096), (300, 264, 8192)]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg, shapes", [
    (GemmConfig(scheduler=STATIC, sm_budget=20), BUDGET_SHAPES),
    (GemmConfig(scheduler=DYN, tile_n=256, cluster_m=2, sm_budget=100), BUDGET_SHAPES),
    (GemmConfig(scheduler="stream_k", tile_n=256, sm_budget=66), BUDGET_SHAPES),
    (GemmConfig(scheduler=STATIC, tile_m=64, tile_n=8, stages=8, swap_ab=True, split_k=4, sm_budget=32),
     [(1, 8192, 4096), (5, 5000, 512)]),
    (GemmConfig(scheduler="stream_k", tile_m=64, tile_n=8, stages=8, swap_ab=True, sm_budget=50),
     [(1, 8192, 4096), (5, 5000, 512), (1, 256, 4096)]),
], ids=lambda c: c.name() if isinstance(c, GemmConfig) else "")
def test_a_persistent_grid_on_an_sm_budget_covers_every_tile(cfg, shapes):
    """Fewer clusters than the device holds walk every tile (many waves of
    them, partial ones, K split or streamed)."""
    _check(cfg, "tn", shapes)


# Tiles that fit the problem (widths in steps of 16, 192 rows): sizes off
# every tile multiple, a partial last wave and the 27B o shape they are for.
NEW_TILE_CONFIGS = [
    GemmConfig(scheduler=STATIC, tile_n=176, stages=5, swizzle=4),
    GemmConfig(scheduler=DYN, tile_n=208, stages=4, cluster_n=2),
    GemmConfig(scheduler=STATIC, tile_m=192, tile_n=128, stages=4, swizzle=4, raster="n"),
    GemmConfig(scheduler=DYN, tile_m=192, tile_n=176, stages=4, cluster_m=2),
    GemmConfig(scheduler=SINGLE, tile_m=192, tile_n=192, stages=3, cluster_n=2),
    GemmConfig(scheduler=STATIC, tile_m=64, tile_n=240, stages=5),
]
NEW_TILE_SHAPES = [(300, 5000, 520), (512, 5376, 4096), (193, 176, 64), (1, 8, 8), (2049, 1040, 264)]


# Widths of an odd number of 8-row atoms (24- and 8-column epilogue
# sub-tiles), 27B o and down at M = 512 on 128x168 (32 tiles across N).
EIGHTH_CONFIGS = [
    GemmConfig(scheduler=SINGLE, tile_n=168, stages=4, cluster_m=2),
    GemmConfig(scheduler=DYN, tile_m=64, tile_n=72, stages=8, sched_depth=2),
    GemmConfig(scheduler=STATIC, tile_m=192, tile_n=168, stages=3, cluster_n=2),
    GemmConfig(scheduler=STATIC, tile_n=136, stages=5, swizzle=2),
    GemmConfig(scheduler=STATIC, consumer=PP, tile_n=136, stages=4),
    GemmConfig(scheduler=DYN, consumer=PP, tile_m=64, tile_n=200, stages=6, cluster_n=2),
]
EIGHTH_SHAPES = NEW_TILE_SHAPES + [(512, 5376, 21504)]


# Tiles of up to 200 accumulators a consumer thread (setmaxnreg's budget):
# pingpong 128x168 as cuBLAS runs 27B o and down at M = 512 (32 tiles
# across N), 128x200, and cooperative 256-row tiles under every scheduler.
REGISTER_CONFIGS = [
    GemmConfig(scheduler=STATIC, consumer=PP, tile_n=168, stages=5, cluster_n=2, swizzle=4),
    GemmConfig(scheduler=DYN, consumer=PP, tile_n=200, stages=4),
    GemmConfig(scheduler=SINGLE, consumer=PP, tile_n=184, stages=4, cluster_m=2),
    GemmConfig(scheduler=DYN, tile_m=256, tile_n=168, stages=3, cluster_m=2),
    GemmConfig(scheduler=SK, tile_m=256, tile_n=192, stages=2, swizzle=4),
    GemmConfig(scheduler=STATIC, tile_m=256, tile_n=160, stages=3, swizzle=4),
]
# B's loads evict-first in L2 (`GemmConfig.l2_hint`), swap_ab's too.
L2_HINT_CONFIGS = [
    GemmConfig(scheduler=STATIC, consumer=PP, tile_n=176, stages=5, cluster_m=2, swizzle=4, l2_hint="b_first"),
    GemmConfig(scheduler=SK, tile_n=256, stages=4, cluster_m=2, l2_hint="b_first"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["tn", "nn"])
@pytest.mark.parametrize("cfg", NEW_TILE_CONFIGS + EIGHTH_CONFIGS + REGISTER_CONFIGS + L2_HINT_CONFIGS,
                         ids=lambda c: c.name())
def test_new_tiles_correct(cfg, layout):
    eighths = cfg.tile_n % 16 != 0
    _check(cfg, layout, EIGHTH_SHAPES if eighths else NEW_TILE_SHAPES)
    # Eighth widths store 16-bit outputs only (`check_output`).
    _check(cfg, layout, NEW_TILE_SHAPES[:1], dtype_out="fp16" if eighths else "fp32")


# Pingpong consumers under every scheduler: single_tile CTAs run two tiles
# (or one, at the end); persistent ones alternate many tiles between the
# two warpgroups (4096 x 4096: 1024 tiles of 128 x 128, ~8 per CTA).
PINGPONG_CONFIGS = [
    GemmConfig(scheduler=SINGLE, consumer=PP),
    GemmConfig(scheduler=SINGLE, consumer=PP, tile_m=64, tile_n=256, cluster_n=2),
    GemmConfig(scheduler=STATIC, consumer=PP, swizzle=4),
    GemmConfig(scheduler=STATIC, consumer=PP, tile_m=64, tile_n=176, stages=6, cluster_m=2, cluster_n=2, raster="n"),
    GemmConfig(scheduler=DYN, consumer=PP),
    GemmConfig(scheduler=DYN, consumer=PP, cluster_m=2, sched_depth=2, swizzle=2),
    GemmConfig(scheduler=DYN, consumer=PP, tile_m=64, tile_n=128, stages=8, cluster_n=2),
]
PINGPONG_SHAPES = SHAPES + [(4096, 4096, 512), (3000, 2056, 264)]


# Clusters of four: B (4x1) or A (1x4) multicast to four CTAs, slices of
# the tile that are not whole 8-row swizzle atoms (176 / 4 = 44 rows), a
# grid that is not a multiple of the cluster, and the 27B o shape at M = 512.
CLUSTER4_CONFIGS = [
    GemmConfig(scheduler=STATIC, tile_n=176, stages=5, cluster_m=4, swizzle=4),
    GemmConfig(scheduler=STATIC, tile_n=192, stages=4, cluster_m=4, raster="n"),
    GemmConfig(scheduler=SINGLE, tile_m=64, tile_n=128, stages=8, cluster_n=4),
    GemmConfig(scheduler=DYN, tile_n=192, stages=4, cluster_m=4, sched_depth=2),
    GemmConfig(scheduler=STATIC, tile_m=64, tile_n=192, stages=6, cluster_n=4, consumer=PP),
]


# swap_ab: out.T = W @ x.T, activation rows on the MMA's N side (8 to 128),
# weight rows on its M side; a single row, rows off every tile multiple,
# N = 8 (one weight row block mostly out of bounds), K under one k-block.
SWAP_AB_CONFIGS = [
    GemmConfig(scheduler=SINGLE, tile_m=64, tile_n=16, stages=8, swap_ab=True),
    GemmConfig(scheduler=STATIC, tile_m=128, tile_n=32, stages=8, swizzle=4, swap_ab=True),
    GemmConfig(scheduler=DYN, tile_m=64, tile_n=48, stages=8, cluster_m=2, swap_ab=True),
    GemmConfig(scheduler=SINGLE, tile_m=64, tile_n=64, stages=8, cluster_n=4, swap_ab=True),
    GemmConfig(scheduler=STATIC, tile_m=64, tile_n=16, stages=8, cluster_m=4, swap_ab=True),
    GemmConfig(scheduler=SINGLE, tile_m=64, tile_n=32, stages=8, split_k=3, swap_ab=True),
    GemmConfig(scheduler=STATIC, tile_m=128, tile_n=64, stages=8, split_k=2, cluster_m=2, swap_ab=True),
    GemmConfig(scheduler=DYN, tile_m=64, tile_n=32, stages=8, split_k=4, swap_ab=True),
    GemmConfig(scheduler=STATIC, tile_m=128, tile_n=16, stages=8, swap_ab=True, l2_hint="b_first"),
    GemmConfig(scheduler=SINGLE, tile_m=128, tile_n=16, stages=8, split_k=3, swap_ab=True),
    GemmConfig(scheduler=STATIC, tile_m=128, tile_n=48, stages=8, split_k=2, swap_ab=True),
    # One 8-row atom of activation rows, K whole or split.
    GemmConfig(scheduler=SINGLE, tile_m=64, tile_n=8, stages=8, swap_ab=True),
    GemmConfig(scheduler=STATIC, tile_m=128, tile_n=8, stages=8, cluster_m=2, swap_ab=True),
    GemmConfig(scheduler=SINGLE, tile_m=64, tile_n=8, stages=8, split_k=3, swap_ab=True),
    # 80 to 128 activation rows.
    GemmConfig(scheduler=SINGLE, tile_m=128, tile_n=80, stages=8, swap_ab=True),
    GemmConfig(scheduler=STATIC, tile_m=128, tile_n=128, stages=6, swap_ab=True),
    GemmConfig(scheduler=DYN, tile_m=64, tile_n=96, stages=8, cluster_m=2, swap_ab=True),
    GemmConfig(scheduler=SINGLE, tile_m=128, tile_n=112, stages=7, split_k=2, swap_ab=True),
]
SWAP_AB_SHAPES = [(1, 5376, 4096), (16, 8192, 5376), (100, 8192, 5376)] + SHAPES
SWAP_AB_SPLIT_K_SHAPES = [(1, 5376, 4608), (16, 8192, 5376)] + SPLIT_K_SHAPES


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", SWAP_AB_CONFIGS, ids=lambda c: c.name())
def test_swap_ab_correct(cfg):
    shapes = SWAP_AB_SPLIT_K_SHAPES if cfg.split_k > 1 else SWAP_AB_SHAPES
    _check(cfg, "tn", shapes)
    _check(cfg, "tn", shapes[:2], dtype_out="fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["tn", "nn"])
@pytest.mark.parametrize("cfg", CLUSTER4_CONFIGS, ids=lambda c: c.name())
def test_clusters_of_four_correct(cfg, layout):
    _check(cfg, layout, NEW_TILE_SHAPES)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["tn", "nn"])
@pytest.mark.parametrize("cfg", PINGPONG_CONFIGS, ids=lambda c: c.name())
def test_pingpong_correct(cfg, layout):
    _check(cfg, layout, PINGPONG_SHAPES)
    _check(cfg, layout, PINGPONG_SHAPES[-1:], dtype_out="fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["tn", "nn"])
@pytest.mark.parametrize("cfg", SPLIT_K_CONFIGS, ids=lambda c: c.name())
def test_split_k_correct(cfg, layout):
    _check(cfg, layout, SPLIT_K_SHAPES)


# Stream-K: fewer tiles than SMs (every tile in K slices), a partial last
# wave in one round of slices or two (27B o at M = 512: 168 tiles of 128 x
# 128 on 132 SMs, the last 36 in seven slices of 9 or 10 k-blocks), up to
# eight slices a tile, partial waves too large to split and whole waves (no
# unit at all), K of one k-block, ragged edges; run back to back on one
# scratch buffer, so a semaphore left set would break the next shape.
STREAM_K_CONFIGS = [
    GemmConfig(scheduler=SK),
    GemmConfig(scheduler=SK, swizzle=4, raster="n"),
    GemmConfig(scheduler=SK, tile_m=64, tile_n=256, stages=5, cluster_n=2),
    GemmConfig(scheduler=SK, tile_m=128, tile_n=256, stages=4, cluster_m=2, swizzle=2),
    GemmConfig(scheduler=SK, tile_n=192, cluster_m=2, cluster_n=2),
    GemmConfig(scheduler=SK, tile_m=256, tile_n=128, stages=3, cluster_m=2, swizzle=4),
    GemmConfig(scheduler=SK, tile_n=256, stages=4, cluster_m=4, swizzle=4),
]
STREAM_K_SHAPES = [
    (128, 5376, 4096), (512, 5376, 4096), (512, 5376, 21504), (1, 256, 4096), (300, 200, 136),
    (129, 8, 520), (77, 264, 8), (2048, 1536, 1024), (1152, 1408, 256), (4224, 4096, 512), (1000, 3000, 4608),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["tn", "nn"])
@pytest.mark.parametrize("cfg", STREAM_K_CONFIGS, ids=lambda c: c.name())
def test_stream_k_correct(cfg, layout):
    _check(cfg, layout, STREAM_K_SHAPES)
    _check(cfg, layout, STREAM_K_SHAPES[1:2], dtype_out="fp32")


# Stream-K over the weight (swap_ab: even k-block ranges a cluster): ranges
# within a tile, over several tiles, fewer k-blocks than clusters (K of one
# k-block: whole tiles only), several activation tiles, ragged edges; back to
# back on one scratch buffer, as above.
STREAMED_CONFIGS = [
    GemmConfig(scheduler=SK, tile_m=64, tile_n=8, stages=8, swap_ab=True),
    GemmConfig(scheduler=SK, tile_m=128, tile_n=16, stages=5, swap_ab=True, tile_k=128),
    GemmConfig(scheduler=SK, tile_m=64, tile_n=32, stages=8, cluster_m=2, swap_ab=True, l2_hint="b_first"),
    GemmConfig(scheduler=SK, tile_m=128, tile_n=64, stages=6, cluster_n=2, swap_ab=True),
]
STREAMED_SHAPES = [
    (1, 5376, 4096), (16, 8192, 5376), (1, 256, 4096), (7, 264, 8), (100, 8192, 5376), (129, 1000, 520),
    (3, 43008, 5376), (8, 4096, 14336), (64, 1024, 4096),
]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", STREAMED_CONFIGS, ids=lambda c: c.name())
def test_streamed_weight_correct(cfg):
    _check(cfg, "tn", STREAMED_SHAPES)
    _check(cfg, "tn", STREAMED_SHAPES[:2], dtype_out="fp32")


# Stages of K 128 (two 128-byte swizzle rows an operand row) under every
# scheduler, swap_ab, split-K, pingpong and 192-row tiles; the shapes' K of
# 8, 136 and 520 end in a k-block TMA fills partly with zeros.
TILE_K_CONFIGS = [
    GemmConfig(scheduler=SINGLE, tile_m=128, tile_n=8, stages=6, swap_ab=True, tile_k=128),
    GemmConfig(scheduler=SINGLE, tile_m=64, tile_n=64, stages=6, swap_ab=True, l2_hint="b_first", tile_k=128),
    GemmConfig(scheduler=SINGLE, tile_m=64, tile_n=16, stages=7, split_k=3, swap_ab=True, tile_k=128),
    GemmConfig(scheduler=STATIC, tile_m=128, tile_n=256, stages=2, tile_k=128),
    GemmConfig(scheduler=DYN, tile_m=128, tile_n=128, stages=3, cluster_m=2, sched_depth=2, tile_k=128),
    GemmConfig(scheduler=STATIC, consumer=PP, tile_m=128, tile_n=128, stages=3, swizzle=4, tile_k=128),
    GemmConfig(scheduler=STATIC, tile_m=192, tile_n=128, stages=2, cluster_n=2, tile_k=128),
    GemmConfig(scheduler=SK, tile_m=128, tile_n=128, stages=3, swizzle=4, tile_k=128),
]


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", TILE_K_CONFIGS, ids=lambda c: c.name())
def test_stages_of_k_128_correct(cfg):
    layouts = ["tn"] if cfg.swap_ab else ["tn", "nn"]
    shapes = SPLIT_K_SHAPES if cfg.split_k > 1 else STREAM_K_SHAPES if cfg.stream_k else SHAPES
    for layout in layouts:
        _check(cfg, layout, shapes)
        _check(cfg, layout, shapes[:1], dtype_out="fp32")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype_out", ["fp32", "fp16"])
@pytest.mark.parametrize(
    "cfg",
    [GemmConfig(scheduler=DYN, sched_depth=2), GemmConfig(scheduler=STATIC, tile_m=256, tile_n=128, stages=3)],
    ids=lambda c: c.name(),
)
def test_output_dtypes(cfg, dtype_out):
    runner = kc.get_kernel(cfg, dtype_in="fp16", dtype_out=dtype_out, layout="tn")
    a, b, ref = _operands(333, 264, 520, "tn", torch.float16)
    out = torch.full((333, 264), float("nan"), device="cuda", dtype=DTYPES[dtype_out])
    runner(a, b, out)
    torch.cuda.synchronize()
    assert _rel_err(out, ref) < 2e-2


def _sched_buf_is_clear() -> bool:
    """Counters and tile semaphores are back at zero (partials may stay)."""
    scratch = [s.buf[:s._zero_end] for s in kc._split_k_scratch.values() if s.buf is not None]
    scratch += [buf[:space.SPLIT_K_COUNTERS + tiles] for s in kc._split_k_scratch.values()
                for tiles, buf in s.captured.items()]
    return all(int(buf.abs().sum()) == 0 for buf in [*kc._sched_bufs.values(), *scratch])


def _node_types(graph: torch.cuda.CUDAGraph) -> list:
    """The node types of a graph captured with keep_graph=True."""
    raw = driver.CUgraph(graph.raw_cuda_graph())
    count = driver.cuGraphGetNodes(raw, 0)[2]
    return [driver.cuGraphNodeGetType(node)[1] for node in driver.cuGraphGetNodes(raw, count)[1]]


@pytest.mark.gpu
def test_split_k_graphs_of_different_tile_counts_replay_in_any_order():
    """Graphs captured on one stream, largest problem first: a smaller
    problem's partials land where a larger one keeps its tile semaphores, and
    no host code runs between replays to clear them."""
    cfg = GemmConfig(scheduler=STATIC, tile_m=64, tile_n=128, stages=6, split_k=3)
    runner = kc.get_kernel(cfg, dtype_in="bf16", dtype_out="bf16", layout="tn")
    graphs = []
    for i, (m, n, k) in enumerate([(1000, 3000, 4608), (300, 1024, 1536), (64, 256, 1536)]):
        a, b, ref = _operands(m, n, k, "tn", seed=i)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=torch.bfloat16)
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph):
            runner(a, b, out)
        # The scratch is cleared once, outside the graph: no node but the kernel replays.
        assert _node_types(graph) == [driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL]
        graphs.append((graph, out, ref, (a, b)))  # a graph does not keep its operands alive
    for graph, out, ref, _ in graphs[::-1] * 2:
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, ref) < 2e-2
    assert _sched_buf_is_clear()


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["sm90-single_tile-t64x8-c1x1-s8-w1m-k2-ab", "sm90-stream_k-t64x64-c1x1-s8-w1m"])
def test_scratch_captured_after_a_freed_temporary(name, monkeypatch):
    """A capture's memory pool hands out blocks freed earlier in the same
    capture, which the graph's earlier kernels write at every replay (a
    model's temporaries before its projection): the scratch whose
    semaphores stay zero from one replay to the next must not be one."""
    monkeypatch.setattr(kc, "_split_k_scratch", {})  # this capture makes its scratch
    cfg = GemmConfig.from_name(name)
    runner = kc.get_kernel(cfg, dtype_in="bf16", dtype_out="bf16", layout="tn")
    m, n, k = (1, 3072, 3072) if cfg.swap_ab else (100, 1024, 5120)
    a, b, ref = _operands(m, n, k, "tn")
    out = torch.empty((m, n), device="cuda", dtype=torch.bfloat16)
    runner(a, b, out)
    words = space.split_k_scratch_words(cfg, m, n, kc._clusters_per_wave(0, cfg.cluster_size))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        junk = torch.full((words,), 7, dtype=torch.int32, device="cuda")
        del junk
        runner(a, b, out)
    for _ in range(2):
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, ref) < 2e-2


@pytest.mark.gpu
def test_dynamic_back_to_back_launches_reset_the_counter():
    cfg = GemmConfig(scheduler=DYN, cluster_m=2, sched_depth=2)
    runner = kc.get_kernel(cfg, dtype_in="bf16", dtype_out="bf16", layout="tn")
    # Grids of different sizes in a row: a stale counter would skip tiles.
    cases = [_operands(m, n, k, "tn", seed=i) for i, (m, n, k) in enumerate(
        [(4096, 4096, 512), (100, 296, 64), (4096, 4096, 512), (2000, 72, 1024), (64, 64, 64)] * 2
    )]
    outs = [torch.full(ref.shape, float("nan"), device="cuda", dtype=torch.bfloat16) for _, _, ref in cases]
    for (a, b, _), out in zip(cases, outs):
        runner(a, b, out)
    torch.cuda.synchronize()
    for (_, _, ref), out in zip(cases, outs):
        assert _rel_err(out, ref) < 2e-2
    assert _sched_buf_is_clear()


@pytest.mark.gpu
@pytest.mark.parametrize(
    "cfg",
    [GemmConfig(scheduler=DYN, sched_depth=1, swizzle=2), GemmConfig(scheduler=DYN, split_k=2, tile_n=64),
     GemmConfig(scheduler=SK, swizzle=2)],
    ids=lambda c: c.name(),
)
def test_dynamic_under_cuda_graph_replay(cfg):
    runner = kc.get_kernel(cfg, dtype_in="bf16", dtype_out="bf16", layout="nn")
    a, b, ref = _operands(3000, 2056, 256, "nn")
    a2, b2, ref2 = _operands(500, 4096, 128, "nn", seed=1)
    out = torch.empty(ref.shape, device="cuda", dtype=torch.bfloat16)
    out2 = torch.empty(ref2.shape, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        runner(a, b, out)  # first use on this stream creates its buffer outside capture
        stream.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            for _ in range(3):
                runner(a, b, out)
                runner(a2, b2, out2)
    for _ in range(5):
        out.fill_(float("nan"))
        out2.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert _rel_err(out, ref) < 2e-2
        assert _rel_err(out2, ref2) < 2e-2
    assert _sched_buf_is_clear()


@pytest.mark.gpu
def test_dynamic_first_launch_of_a_stream_captured(monkeypatch):
    """A stream whose first dynamic launch is captured gets its scheduler
    buffer outside the graph: no clear replays with the kernel, and no block
    of the capture's pool (freed there by a temporary the graph's earlier
    kernels write) holds the counters that later eager launches share."""
    monkeypatch.setattr(kc, "_sched_bufs", {})  # a pool stream may have launched before
    cfg = GemmConfig(scheduler=DYN, sched_depth=2)
    runner = kc.get_kernel(cfg, dtype_in="bf16", dtype_out="bf16", layout="tn")
    a, b, ref = _operands(1000, 2056, 512, "tn")
    out = torch.empty(ref.shape, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(graph, stream=stream):
            runner(a, b, out)
        assert _node_types(graph) == [driver.CUgraphNodeType.CU_GRAPH_NODE_TYPE_KERNEL]
        for _ in range(3):
            out.fill_(float("nan"))
            graph.replay()
            runner(a, b, out)  # eager, same stream, same buffer
            stream.synchronize()
            assert _rel_err(out, ref) < 2e-2
    assert _sched_buf_is_clear()


@pytest.mark.gpu
def test_persistent_grids_hold_only_clusters_that_fit_at_once():
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    assert kc._clusters_per_wave(0, 1) == sms
    # A cluster must fit in one GPC: whole-GPU division overcounts (H100: 30 of 4, not 33).
    for size in (2, 4):
        assert 0 < kc._clusters_per_wave(0, size) <= sms // size


PDL_CONFIGS = [
    GemmConfig(scheduler=STATIC, tile_m=64, tile_n=8, stages=8, swap_ab=True, pdl=True),
    GemmConfig(scheduler=DYN, tile_m=128, tile_n=16, stages=5, split_k=2, swap_ab=True, tile_k=128, pdl=True),
    GemmConfig(scheduler=SK, tile_m=128, tile_n=128, stages=4, cluster_m=2, pdl=True),
    GemmConfig(scheduler=STATIC, consumer=PP, tile_n=64, cluster_n=2, pdl=True),
]


@pytest.mark.gpu
@pytest.mark.parametrize("captured", [False, True], ids=["eager", "graph"])
@pytest.mark.parametrize("cfg", PDL_CONFIGS, ids=lambda c: c.name())
def test_pdl_kernels_read_what_the_kernel_before_wrote(cfg, captured):
    """A chain of pdl launches, each reading the output of the one before it
    and writing the buffer that one read (ping-pong between two buffers):
    only the weights may be read before the previous kernel is done."""
    runner = kc.get_kernel(cfg, dtype_in="bf16", dtype_out="bf16", layout="tn")
    m, width, depth = 16, 1024, 6
    gen = torch.Generator(device="cuda").manual_seed(3)
    weights = [torch.randn(width, width, device="cuda", generator=gen).div_(width ** 0.5).bfloat16()
               for _ in range(depth)]
    x0 = torch.randn(m, width, device="cuda", generator=gen).bfloat16()
    want, h = [], x0
    for w in weights:
        h = (h.float() @ w.float().T).bfloat16()
        want.append(h)
    bufs = [torch.empty(m, width, device="cuda", dtype=torch.bfloat16) for _ in range(2)]
    x = torch.empty_like(x0)

    def chain():
        x.copy_(x0)
        src = x
        for i, w in enumerate(weights):
            runner(src, w, bufs[i % 2])
            src = bufs[i % 2]

    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        chain()  # first use on this stream: scratch and counters outside capture
        stream.synchronize()
        if captured:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                chain()
    for _ in range(3):
        for b in bufs:
            b.fill_(float("nan"))
        if captured:
            graph.replay()
        else:
            with torch.cuda.stream(stream):
                chain()
        torch.cuda.synchronize()
        assert _rel_err(bufs[(depth - 1) % 2], want[-1].float()) < 2e-2
