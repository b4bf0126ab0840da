"""Grouped GEMM: host decode mirror, skewed group sizes, offline compiles (CI), correctness on a GPU."""

from __future__ import annotations

import itertools
import random

import pytest
import torch

from kernels import compile as kc
from kernels.grouped import LIGHT_ROWS, MAX_GROUPS, work_order
from kernels.space import GemmConfig
from tuner.backends.gpu_worker import group_bounds

DYN = "dynamic_persistent"
STATIC = "static_persistent"


# ---------------------------------------------------------------- host side


def test_work_order_counts_tiles_per_group():
    # 128-row cluster tiles, 3 clusters along N.
    order = work_order([37, 300, 300, 429, 1000], "rows", 1000, 0, 3, 128)
    tiles = [sum(1 for g, _ in order if g == grp) for grp in range(5)]
    assert tiles == [3, 9, 0, 6, 15]
    # Offsets past the extent are clipped to it.
    assert work_order([100, 5000], "rows", 200, 0, 1, 64) == [(0, 0), (0, 1), (1, 0), (1, 1)]


def test_work_order_is_group_order_for_one_class():
    # The K form, and rows forms whose groups are all light or all heavy.
    assert work_order([64, 64, 512], "k", 512, 4, 2, 128) == [(g, t) for g in range(3) for t in range(8)]
    assert work_order([100, 100, 300], "rows", 300, 0, 1, 128) == [(0, 0), (2, 0), (2, 1)]
    big = [1000, 2000, 3000]
    assert work_order(big, "rows", 3000, 0, 1, 128) == [(g, t) for g in range(3) for t in range(8)]


def test_work_order_merges_heavy_and_light_groups_evenly():
    # Group 0 heavy (1024 rows: 8 tiles), groups 1-8 light (128 rows: 1 tile each), empty group 9.
    sizes = [1024] + [128] * 8 + [0]
    offs = list(itertools.accumulate(sizes))
    order = work_order(offs, "rows", offs[-1], 0, 1, 128)
    assert sorted(order) == [(0, t) for t in range(8)] + [(g, 0) for g in range(1, 9)]
    assert [g == 0 for g, _ in order] == [False, True] * 8
    # Within each class, groups and their tiles keep their order.
    assert [t for g, t in order if g == 0] == list(range(8))
    assert [g for g, _ in order if g != 0] == list(range(1, 9))
    assert 3 * 128 > LIGHT_ROWS >= 2 * 128


def test_group_bounds_equal_without_skew():
    assert group_bounds(100, 4, 0.0) == [0, 25, 50, 75, 100]
    assert group_bounds(10, 4, 0.0) == [0, 2, 4, 6, 10]


def test_group_bounds_skewed_are_uneven_and_repeatable():
    bounds = group_bounds(8192, 64, 1.0)
    sizes = [b - a for a, b in zip(bounds, bounds[1:])]
    assert bounds[0] == 0 and bounds[-1] == 8192 and min(sizes) >= 0
    assert max(sizes) > 4 * (8192 // 64)
    assert group_bounds(8192, 64, 1.0) == bounds
    assert group_bounds(8192, 64, 1.0, seed=1) != bounds


# ---------------------------------------------------------------- offline (CI)


def _v(form, layout="tn", **fields) -> kc.Variant:
    return kc.Variant(GemmConfig(**fields), "bf16", "bf16", layout, form)


OFFLINE = [
    _v("rows", scheduler=STATIC),
    _v("rows", scheduler=DYN),
    _v("rows", "nn", scheduler=DYN, tile_m=128, tile_n=256, cluster_m=2),
    _v("rows", "nn", scheduler=STATIC, tile_m=64, tile_n=128, cluster_n=2),
    _v("k", scheduler=STATIC),
    _v("k", "nn", scheduler=DYN, sched_depth=2),
    # The group table fits beside the most stages an fp32 output leaves room for.
    kc.Variant(GemmConfig(scheduler=DYN, tile_m=128, tile_n=256, stages=4, sched_depth=2),
               "bf16", "fp32", "tn", "rows"),
    # Three consumer warpgroups, 16-column epilogue sub-tiles (row-masked copies too).
    _v("rows", scheduler=DYN, tile_m=192, tile_n=176, stages=4),
    # K slices of the k form, reduced in the kernel.
    _v("k", scheduler=DYN, tile_m=128, tile_n=256, cluster_m=2, stages=4, split_k=2),
    _v("k", "nn", scheduler=STATIC, split_k=4),
]


@pytest.fixture(scope="module")
def offline():
    return kc.compile_offline(OFFLINE, workers=2)


def test_offline_grouped_variants_compile(offline):
    for v, k in zip(OFFLINE, offline, strict=True):
        assert "wgmma.mma_async" in k.ptx, v.key()
        # Only the dynamic scheduler claims work with a global atomic.
        assert ("atom.global.add" in k.ptx) == (v.cfg.scheduler == DYN), v.key()
        # K slices make their partials visible before they count themselves
        # on their tile's semaphore.
        assert ("fence.acq_rel.gpu" in k.ptx) == (v.cfg.split_k > 1), v.key()
        assert k.stack_bytes == 0, v.key()
        assert k.smem_bytes <= 227 * 1024, v.key()
        # A group's last, partial tile leaves smem in 16-byte copies.
        assert ("st.global.v4" in k.ptx) == (v.grouped == "rows"), v.key()


def test_variant_key_names_the_form():
    assert _v("rows").key().endswith("-grouped_rows")
    assert kc.Variant(GemmConfig()).key() == kc.Variant(GemmConfig(), grouped="").key()


# ---------------------------------------------------------------- GPU


GPU_CFGS = [
    GemmConfig(scheduler=STATIC),
    GemmConfig(scheduler=DYN),
    GemmConfig(scheduler=DYN, tile_m=128, tile_n=256, cluster_m=2),
    GemmConfig(scheduler=STATIC, tile_m=64, tile_n=128, cluster_n=2, swizzle=2),
    GemmConfig(scheduler=DYN, tile_m=192, tile_n=176, stages=4),
]


def _rows_patterns() -> dict[str, list[int]]:
    rng = random.Random(7)
    many = [rng.choice([0, 0, 1, 17, 64, 128, 200]) for _ in range(64)]
    return {
        "uneven": [37, 300, 0, 129, 64, 1],
        "empty_ends": [0, 0, 200, 0],
        "one_holds_all": [0, 0, 517, 0],
        "tile_multiple": [128, 128, 128, 128],
        "single": [777],
        "many": many,
        "short_offs": [100, 50],  # rows past offs[-1] belong to no group
        "heavy_and_light": [600, 5, 0, 300, 64, 1000, 17, 128, 0, 257],
    }


def _offs(sizes):
    return torch.tensor(sizes, dtype=torch.int32).cumsum(0).to(torch.int32).cuda()


def _rows_case(sizes, n, k, layout, extra_rows=0):
    g, total = len(sizes), sum(sizes) + extra_rows
    a = torch.randn(total, k, device="cuda").mul_(k ** -0.25).bfloat16()
    shape = (g, n, k) if layout == "tn" else (g, k, n)
    b = torch.randn(*shape, device="cuda").mul_(k ** -0.25).bfloat16()
    return a, b, _offs(sizes)


def _rows_reference(a, b, offs, layout):
    out, lo = torch.full((a.shape[0], b.shape[1] if layout == "tn" else b.shape[2]), float("nan")), 0
    for g, hi in enumerate(offs.tolist()):
        w = b[g].float()
        out[lo:hi] = (a[lo:hi].float() @ (w.t() if layout == "tn" else w)).cpu()
        lo = hi
    return out


def _assert_close(got, ref, case=""):
    got = got.float().cpu()
    assert torch.equal(torch.isnan(got), torch.isnan(ref)), f"{case}: rows outside every group written or missed"
    live = ~torch.isnan(ref)
    err = (got[live] - ref[live]).norm() / ref[live].norm().clamp_min(1e-6)
    assert err < 2e-2, f"{case}: relative error {err}"


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["tn", "nn"])
@pytest.mark.parametrize("cfg", GPU_CFGS, ids=lambda c: c.name())
def test_rows_form_every_pattern(cfg, layout):
    _check_rows_patterns(cfg, layout, "bf16")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", GPU_CFGS[1:3], ids=lambda c: c.name())
def test_rows_form_fp32_out(cfg):
    # fp32 partial tiles leave smem in 4-value copies through two buffers, not 8 through four.
    _check_rows_patterns(cfg, "tn", "fp32")


def _check_rows_patterns(cfg, layout, dtype_out):
    run = kc.get_kernel(cfg, dtype_in="bf16", dtype_out=dtype_out, layout=layout, grouped="rows")
    torch_out = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype_out]
    for name, sizes in _rows_patterns().items():
        a, b, offs = _rows_case(sizes, 264, 320, layout, extra_rows=19 if name == "short_offs" else 0)
        out = torch.full((a.shape[0], 264), float("nan"), device="cuda", dtype=torch_out)
        run(a, b, offs, out)
        torch.cuda.synchronize()
        _assert_close(out, _rows_reference(a, b, offs, layout), name)


def _k_case(ks, m, n, layout):
    a = torch.cat([torch.randn(m, k, device="cuda").mul_(k ** -0.25) for k in ks], dim=1).bfloat16()
    parts = [torch.randn(n, k, device="cuda").mul_(k ** -0.25) for k in ks]
    b = (torch.cat(parts, dim=1) if layout == "tn" else torch.cat([p.t() for p in parts], dim=0)).bfloat16()
    return a, b, _offs(ks)


def _k_reference(a, b, offs, layout):
    outs, lo = [], 0
    for hi in offs.tolist():
        x = a[:, lo:hi].float()
        w = b[:, lo:hi].float().t() if layout == "tn" else b[lo:hi].float()
        outs.append((x @ w).cpu())
        lo = hi
    return torch.stack(outs)


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["tn", "nn"])
@pytest.mark.parametrize("cfg", GPU_CFGS[:3], ids=lambda c: c.name())
def test_k_form_mixed_k(cfg, layout):
    run = kc.get_kernel(cfg, dtype_in="bf16", dtype_out="bf16", layout=layout, grouped="k")
    for ks, m in (([64, 1024, 128, 2048], 200), ([512], 129), ([4096, 64, 64], 384)):
        a, b, offs = _k_case(ks, m, 264, layout)
        out = torch.full((len(ks), m, 264), float("nan"), device="cuda", dtype=torch.bfloat16)
        run(a, b, offs, out)
        torch.cuda.synchronize()
        _assert_close(out, _k_reference(a, b, offs, layout))


K_SPLIT_CFGS = [
    GemmConfig(scheduler=STATIC, split_k=2),
    GemmConfig(scheduler=DYN, tile_m=128, tile_n=256, cluster_m=2, stages=4, split_k=2),
    GemmConfig(scheduler=DYN, tile_m=64, tile_n=128, cluster_n=2, split_k=4),
]


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["tn", "nn"])
@pytest.mark.parametrize("cfg", K_SPLIT_CFGS, ids=lambda c: c.name())
def test_k_form_split_k(cfg, layout):
    """Slices of uneven depth (a group of one k-block leaves a slice none),
    launches of different tile counts one after another on the same scratch,
    then a graph replayed with new offsets: every slice is counted once."""
    run = kc.get_kernel(cfg, dtype_in="bf16", dtype_out="bf16", layout=layout, grouped="k")
    cases = (([64, 1024, 128, 2048], 200), ([512, 8192], 129), ([4096, 64, 192], 384))
    for ks, m in cases:
        a, b, offs = _k_case(ks, m, 264, layout)
        out = torch.full((len(ks), m, 264), float("nan"), device="cuda", dtype=torch.bfloat16)
        run(a, b, offs, out)
        torch.cuda.synchronize()
        _assert_close(out, _k_reference(a, b, offs, layout), f"{ks} x {m}")
    a, b, offs = _k_case([1024, 3072], 256, 264, layout)
    out = torch.empty(2, 256, 264, device="cuda", dtype=torch.bfloat16)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run(a, b, offs, out)
    for ks in ([1024, 3072], [3968, 128], [2048, 2048]) * 2:
        offs.copy_(_offs(ks))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out, _k_reference(a, b, offs, layout), f"replayed {ks}")


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [GPU_CFGS[1], GPU_CFGS[2]], ids=lambda c: c.name())
def test_dynamic_replays_in_a_cuda_graph_with_new_offsets(cfg):
    run = kc.get_kernel(cfg, dtype_in="bf16", dtype_out="bf16", layout="tn", grouped="rows")
    patterns = [[300, 0, 212, 0], [0, 512, 0, 0], [1, 2, 3, 506]]
    a, b, offs = _rows_case(patterns[0], 264, 320, "tn")
    out = torch.empty(512, 264, device="cuda", dtype=torch.bfloat16)
    run(a, b, offs, out)  # compile and load outside the capture
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            run(a, b, offs, out)
    for sizes in patterns * 2:
        offs.copy_(_offs(sizes))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _assert_close(out, _rows_reference(a, b, offs, "tn"))


@pytest.mark.gpu
def test_too_many_groups_is_refused():
    run = kc.get_kernel(GemmConfig(scheduler=STATIC), dtype_in="bf16", dtype_out="bf16", layout="tn", grouped="rows")
    g = MAX_GROUPS + 1
    a, b, offs = _rows_case([1] * g, 64, 64, "tn")
    with pytest.raises(kc.InvalidConfig):
        run(a, b, offs, torch.empty(g, 64, device="cuda", dtype=torch.bfloat16))


def test_grouped_kernels_refuse_pdl():
    """Their B (experts' weights) may be what the kernel before wrote, as a
    generic grouped `gemm` call cannot vouch otherwise."""
    from kernels.sm90.grouped import Sm90GroupedGemmKernel

    with pytest.raises(kc.InvalidConfig, match="pdl"):
        Sm90GroupedGemmKernel.can_implement_grouped(GemmConfig(scheduler=STATIC, pdl=True), "rows")


def test_the_grouped_bench_times_the_moe_models_routed_experts_and_sums_up():
    from bench.grouped import model_problems, parse_args, summary

    keys = {name: (p.m, p.n, p.k, p.groups) for name, p in model_problems(2048)}
    assert keys["qwen3-30b-a3b.experts.gate_up"] == (2048 * 8, 1536, 2048, 128)
    assert keys["mixtral-8x7b.experts.down"] == (2048 * 2, 4096, 14336, 8)
    assert keys["deepseek-v3.experts.gate_up ep64"] == (2048 * 8, 4096, 7168, 4)
    assert keys["deepseek-v3.experts.down ep32"] == (2048 * 8, 7168, 2048, 8)
    assert len(keys) == 8
    records = [
        {"part": "seed000", "K": 32768, "speedup_vs_loop": 0.8},
        {"part": "seed000", "K": 32768, "speedup_vs_loop": 0.95},   # the better tile counts
        {"part": "models", "speedup_vs_grouped_mm": 1.2, "speedup_vs_loop": 1.5},
        {"part": "moe", "speedup_vs_grouped_mm": 1.05},
    ]
    got = summary(records)
    assert got["speedup_vs_loop"]["min"] == 0.95 and got["speedup_vs_loop"]["points"] == 2
    assert abs(got["speedup_vs_grouped_mm"]["geomean"] - (1.2 * 1.05) ** 0.5) < 1e-12
    assert parse_args(["--part", "models"]).skews is None
    with pytest.raises(SystemExit):
        parse_args(["--part", "moe", "--skews", "0.8"])
