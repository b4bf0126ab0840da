"""The sm100 kernel pool: offline compiles for sm_100a with PTX checks (CI), correctness on a Blackwell GPU.

No Blackwell GPU runs these kernels in CI: what is verified here is that every
variant of the spread compiles for sm_100a and that its PTX holds what its
scheduler promises (`bench.kernels_sm100.ptx_checks`, and `checks` here for
stream-K's in-kernel reduction).
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from bench.kernels_sm100 import AWKWARD, CORRECTNESS_CONFIGS, OFFLINE_VARIANTS, _lines_with, ptx_checks
from kernels import compile as kc
from kernels import space
from kernels.sm100.clc import TAIL_CANCEL_BURST
from kernels.space import GemmConfig, InvalidConfig


def _stream_k(layout="tn", dtype_in="bf16", dtype_out="bf16", **fields) -> kc.Variant:
    return kc.Variant(GemmConfig(arch="sm100", scheduler="stream_k", **fields), dtype_in, dtype_out, layout)


# Stream-K, whose units share tiles and reduce them in the kernel: 1-CTA
# tiles of 128 and 64 rows, a 2x2 cluster, 2-CTA pairs of 256 and 128 rows
# (CTA tiles of 128 and 64), one, two and four TMEM stages, both layouts,
# bf16, fp16 and fp32 out.
STREAM_K_VARIANTS = [
    _stream_k(),
    _stream_k("nn", tile_m=64, tile_n=256, cluster_m=2, cluster_n=2, acc_stages=2, swizzle=4, dtype_out="fp32"),
    _stream_k(tile_m=256, tile_n=128, cluster_m=2, cta_group=2, acc_stages=2, swizzle=4),
    _stream_k("nn", tile_m=128, tile_n=64, cluster_m=2, cluster_n=2, cta_group=2, stages=8, acc_stages=4,
              dtype_in="fp16", dtype_out="fp16"),
    _stream_k(tile_n=256, stages=4, swizzle=2, raster="n"),
]
VARIANTS = OFFLINE_VARIANTS + STREAM_K_VARIANTS


def checks(v: kc.Variant, k: kc.OfflineKernel) -> dict[str, bool]:
    """`ptx_checks`, and what the stream-K fixup puts in the PTX and nothing else does."""
    cfg = v.cfg
    atomics = _lines_with(k.ptx, "atom.global")
    return {
        **ptx_checks(v, k),
        # Stream-K's global atomics: the claim counter's relaxed add and, with
        # acq_rel, the finished clusters' count and the tile's semaphore.
        "stream_k: a claim and two acq_rel atomics": not cfg.stream_k
        or len(atomics) == 3 and sum("atom.global.acq_rel.add" in a for a in atomics) == 2,
        # Partials are parked before the arrival and read after it.
        "fence.acq_rel.gpu exactly in stream_k": ("fence.acq_rel.gpu" in k.ptx) == cfg.stream_k,
        "no atom.global unless stream_k or dynamic": cfg.stream_k or cfg.dynamic or not atomics,
    }


@pytest.fixture(scope="module")
def offline():
    return kc.compile_offline(VARIANTS, workers=os.cpu_count() or 1)


@pytest.mark.parametrize("i", range(len(VARIANTS)), ids=[v.key() for v in VARIANTS])
def test_offline_ptx(offline, i):
    assert [name for name, holds in checks(VARIANTS[i], offline[i]).items() if not holds] == []


def test_spread_covers_schedulers_depths_tail_cancel_and_clusters():
    cfgs = [v.cfg for v in VARIANTS]
    assert {c.scheduler for c in cfgs} == set(space.SCHEDULERS)
    clc = [c for c in cfgs if c.scheduler == "clc"]
    assert {(c.sched_depth, c.tail_cancel) for c in clc} == {(d, t) for d in (1, 2, 3) for t in (False, True)}
    clusters = {(c.cluster_m, c.cluster_n, c.cta_group) for c in cfgs}
    assert {(1, 1, 1), (2, 1, 2), (2, 2, 1), (4, 1, 1), (4, 4, 2)} <= clusters
    assert {v.layout for v in OFFLINE_VARIANTS} == {"tn", "nn"}
    assert any(c.split_k > 1 for c in cfgs) and any(v.dtype_out == "fp32" for v in OFFLINE_VARIANTS)
    stream_k = {(c.cta_group, c.cluster_size > 1, c.acc_stages) for c in cfgs if c.stream_k}
    assert {(1, False, 1), (1, True, 2), (2, True, 2), (2, True, 4)} <= stream_k


@pytest.mark.slow
def test_configs_the_space_draws_compile_and_pass_the_checks():
    rng = random.Random(2024)
    variants = [
        kc.Variant(space.sample("sm100", rng), rng.choice(space.DTYPES_IN), rng.choice(space.DTYPES_OUT),
                   rng.choice(space.LAYOUTS))
        for _ in range(40)
    ]
    kernels = kc.compile_offline(variants, workers=os.cpu_count() or 1)
    failed = {
        v.key(): [name for name, holds in checks(v, k).items() if not holds]
        for v, k in zip(variants, kernels, strict=True)
    }
    assert {key: names for key, names in failed.items() if names} == {}


def test_checks_catch_a_wrong_scheduler(offline):
    # The PTX of a static kernel fails the checks of a CLC config of the same shape.
    static = next(i for i, v in enumerate(OFFLINE_VARIANTS) if v.cfg.scheduler == "static_persistent")
    v = OFFLINE_VARIANTS[static]
    as_clc = kc.Variant(GemmConfig(**{**v.cfg.to_dict(), "scheduler": "clc"}), v.dtype_in, v.dtype_out, v.layout)
    got = checks(as_clc, offline[static])
    assert not got["try_cancel exactly in clc"] and not got["threads per CTA"]
    # ... and those of a stream-K config: no semaphore, no fence.
    as_stream_k = kc.Variant(GemmConfig(**{**v.cfg.to_dict(), "scheduler": "stream_k"}), v.dtype_in, v.dtype_out,
                             v.layout)
    got = checks(as_stream_k, offline[static])
    assert not got["stream_k: a claim and two acq_rel atomics"] and not got["fence.acq_rel.gpu exactly in stream_k"]
    # A stream-K kernel's atomics are no static kernel's.
    sk = next(i for i, v in enumerate(VARIANTS) if v.cfg.stream_k and v.cfg.cta_group == 1)
    v = VARIANTS[sk]
    as_static = kc.Variant(GemmConfig(**{**v.cfg.to_dict(), "scheduler": "static_persistent"}), v.dtype_in,
                           v.dtype_out, v.layout)
    got = checks(as_static, offline[sk])
    assert not got["no atom.global unless stream_k or dynamic"] and not got["fence.acq_rel.gpu exactly in stream_k"]


def test_stream_k_reduces_in_a_scratch_of_cta_tiles():
    # The runner hands stream-K the in-kernel scratch; sm100 split-K still a workspace it sums.
    v = STREAM_K_VARIANTS[2]
    assert v.scratch and not v.workspace
    split = kc.Variant(GemmConfig(arch="sm100", split_k=2))
    assert split.workspace and not split.scratch
    # A 2-CTA pair's tile is two CTA tiles, each with its own semaphore and partials.
    cfg = v.cfg
    assert (cfg.tile_m, cfg.cta_group, cfg.cluster_m) == (256, 2, 2)
    assert space.split_k_tiles(cfg, 1024, 512) == 8 * 4
    words = space.split_k_scratch_words(cfg, 1024, 512, clusters=74)
    assert words == space.split_k_partials_offset(32) + 2 * 74 * 2 * 128 * 128


# A padded launch (CUDA-graph style): A and C are worst-case buffers, a device
# int32 holds the real row count. Compiled in a fresh process, which must
# pick the target before cutlass is imported.
_PADDED = textwrap.dedent("""
    import json, os, sys, tempfile
    os.environ["CUTE_DSL_ARCH"] = "sm_100a"
    import cutlass, cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream
    from kernels.space import GemmConfig
    from kernels.sm100.gemm import Sm100GemmKernel

    cfg = GemmConfig(**json.loads(sys.argv[1]))
    m, n, k = cute.sym_int(), cute.sym_int(divisibility=8), cute.sym_int(divisibility=8)
    bf16 = cutlass.BFloat16
    args = [make_fake_compact_tensor(bf16, shape, stride_order=(1, 0), assumed_align=16)
            for shape in ((m, k), (n, k), (m, n))]
    args += [make_fake_compact_tensor(cutlass.Int32, (2,)), cutlass.Int32(1), make_fake_stream(),
             make_fake_compact_tensor(cutlass.Int32, (1,))]
    with tempfile.TemporaryDirectory() as tmp:
        ptx = cute.compile(Sm100GemmKernel(cfg), *args, options=f"--keep-ptx --dump-dir={tmp}").__ptx__
        if "\\n" not in ptx:
            ptx = open(ptx).read()
    print(json.dumps({"try_cancel": ptx.count("clusterlaunchcontrol.try_cancel"),
                      "mma": ptx.count("tcgen05.mma")}))
""")


@pytest.mark.parametrize("tail_cancel", [False, True])
def test_padded_launch_compiles(tail_cancel):
    cfg = GemmConfig(arch="sm100", scheduler="clc", sched_depth=2, tail_cancel=tail_cancel, tile_m=256,
                     tile_n=128, cluster_m=2, cta_group=2, acc_stages=2)
    done = subprocess.run(
        [sys.executable, "-c", _PADDED, json.dumps(cfg.to_dict())],
        capture_output=True, text=True, check=True, timeout=300, cwd=Path(__file__).parents[1],
    )
    got = json.loads(done.stdout.strip().splitlines()[-1])
    assert got["mma"] > 0
    assert got["try_cancel"] == 1 + (TAIL_CANCEL_BURST if tail_cancel else 0)


def test_kernel_refuses_other_archs_and_layouts():
    from kernels.sm100.gemm import Sm100GemmKernel

    with pytest.raises(InvalidConfig, match="sm90"):
        Sm100GemmKernel(GemmConfig(arch="sm90"))
    with pytest.raises(InvalidConfig, match="layout"):
        Sm100GemmKernel(GemmConfig(arch="sm100"), layout="tt")


# ---------------------------------------------------------------- Blackwell GPU


# Stream-K on one CTA, on 2-CTA pairs and in a 2x2 cluster of multicasts.
STREAM_K_CORRECTNESS = [
    GemmConfig(arch="sm100", scheduler="stream_k"),
    GemmConfig(arch="sm100", scheduler="stream_k", tile_m=256, tile_n=128, cluster_m=2, cta_group=2, acc_stages=2),
    GemmConfig(arch="sm100", scheduler="stream_k", tile_m=64, tile_n=128, cluster_m=2, cluster_n=2, acc_stages=2),
]
# Few tiles of long K: every tile is shared by several units.
STREAM_K_SHAPES = [
    (256, 520, 8200, "tn", "bf16"),
    (700, 264, 16384, "nn", "fp32"),
]


def _blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


@pytest.mark.gpu
@pytest.mark.skipif(not _blackwell(), reason="needs a Blackwell (sm_100) GPU")
@pytest.mark.parametrize("cfg", CORRECTNESS_CONFIGS + STREAM_K_CORRECTNESS, ids=GemmConfig.name)
def test_matches_fp32_reference_on_awkward_shapes(cfg):
    torch.manual_seed(0)
    for m, n, k, layout, dtype_out in AWKWARD + (STREAM_K_SHAPES if cfg.stream_k else []):
        if cfg.split_k > 1 and k % (8 * cfg.split_k):
            continue
        dtype_in = "fp16" if dtype_out == "fp16" else "bf16"
        run = kc.get_kernel(cfg, dtype_in=dtype_in, dtype_out=dtype_out, layout=layout)
        t_in = {"bf16": torch.bfloat16, "fp16": torch.float16}[dtype_in]
        t_out = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype_out]
        a = torch.randn(m, k, device="cuda", dtype=t_in)
        b = torch.randn((n, k) if layout == "tn" else (k, n), device="cuda", dtype=t_in)
        out = torch.full((m, n), float("nan"), device="cuda", dtype=t_out)
        run(a, b, out)
        ref = a.float() @ (b.float().T if layout == "tn" else b.float())
        err = ((out.float() - ref).norm() / ref.norm()).item()
        assert err < 2e-2, (m, n, k, layout, dtype_out, err)
