"""sm100 grouped GEMM ("rows" form): offline compiles for sm_100a with PTX checks (CI), correctness on Blackwell."""

from __future__ import annotations

import os
import random

import pytest
import torch

from bench.kernels_sm100 import ptx_checks
from kernels import compile as kc
from kernels.grouped import work_order
from kernels.space import GemmConfig, InvalidConfig
from tests.test_grouped import _assert_close, _offs, _rows_case, _rows_patterns, _rows_reference

_TWO_CTA = dict(tile_m=256, tile_n=128, cluster_m=2, cta_group=2, acc_stages=2)


def _v(layout="tn", **fields) -> kc.Variant:
    return kc.Variant(GemmConfig(arch="sm100", **fields), "bf16", "bf16", layout, "rows")


# Every scheduler the grouped kernel takes; CLC at depths 1-3 with and
# without tail cancel; 1-CTA and 2-CTA MMA; clusters of 1, 2 and 4 CTAs; both layouts.
OFFLINE = [
    _v(scheduler="static_persistent"),
    _v("nn", scheduler="static_persistent", **_TWO_CTA),
    _v(scheduler="dynamic_persistent", sched_depth=2),
    _v("nn", scheduler="dynamic_persistent", sched_depth=2, **_TWO_CTA),
    _v(scheduler="clc", sched_depth=1),
    _v("nn", scheduler="clc", sched_depth=1, tail_cancel=True),
    _v(scheduler="clc", sched_depth=2, **_TWO_CTA),
    _v("nn", scheduler="clc", sched_depth=2, tail_cancel=True, **_TWO_CTA),
    _v(scheduler="clc", sched_depth=3, cluster_m=2, cluster_n=2),
    _v(scheduler="clc", sched_depth=3, tail_cancel=True, cluster_n=2, **_TWO_CTA),
]


@pytest.fixture(scope="module")
def offline():
    return kc.compile_offline(OFFLINE, workers=os.cpu_count() or 1)


@pytest.mark.parametrize("i", range(len(OFFLINE)), ids=[v.key() for v in OFFLINE])
def test_offline_ptx(offline, i):
    checks = ptx_checks(OFFLINE[i], offline[i])
    assert [name for name, holds in checks.items() if not holds] == []


def test_spread_covers_schedulers_depths_tail_cancel_and_clusters():
    cfgs = [v.cfg for v in OFFLINE]
    assert {c.scheduler for c in cfgs} == {"static_persistent", "dynamic_persistent", "clc"}
    clc = [c for c in cfgs if c.scheduler == "clc"]
    assert {(c.sched_depth, c.tail_cancel) for c in clc} == {(d, t) for d in (1, 2, 3) for t in (False, True)}
    assert {c.cta_group for c in cfgs} == {1, 2} and {c.cluster_size for c in cfgs} == {1, 2, 4}
    assert {v.layout for v in OFFLINE} == {"tn", "nn"}


def test_checks_catch_a_kernel_without_clc(offline):
    # The static kernel's PTX fails the checks of the CLC config of the same shape.
    v = OFFLINE[0]
    as_clc = kc.Variant(GemmConfig(**{**v.cfg.to_dict(), "scheduler": "clc"}), "bf16", "bf16", "tn", "rows")
    assert not ptx_checks(as_clc, offline[0])["try_cancel exactly in clc"]


def test_worst_case_grid_holds_every_offs():
    from kernels.sm100.grouped import worst_case_clusters

    rng = random.Random(3)
    for _ in range(500):
        total, groups = rng.randint(1, 5000), rng.randint(1, 64)
        cuts = sorted(rng.randint(0, total) for _ in range(groups - 1))
        offs = [*cuts, total]
        rows, cols, n = rng.choice([64, 128, 256, 512]), rng.choice([64, 128, 256]), rng.randint(8, 3000)
        clusters_n = -(-n // cols)
        need = len(work_order(offs, "rows", total, 0, clusters_n, rows))
        assert need <= worst_case_clusters(total, n, groups, rows, cols)
    # Near tight: two groups of 129 rows take 4 of the 5 cluster tiles the grid is padded to.
    assert len(work_order([129, 258], "rows", 258, 0, 1, 128)) == 4 == worst_case_clusters(258, 8, 2, 128, 8) - 1


def test_kernel_refuses_other_forms_schedulers_and_split_k():
    from kernels.sm100.grouped import Sm100GroupedGemmKernel

    with pytest.raises(InvalidConfig, match="form"):
        Sm100GroupedGemmKernel(GemmConfig(arch="sm100"), form="k")
    with pytest.raises(InvalidConfig, match="scheduler"):
        Sm100GroupedGemmKernel(GemmConfig(arch="sm100", scheduler="single_tile"))
    with pytest.raises(InvalidConfig, match="split"):
        Sm100GroupedGemmKernel(GemmConfig(arch="sm100", scheduler="static_persistent", split_k=2))


# ---------------------------------------------------------------- Blackwell GPU


def _blackwell() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


GPU_CFGS = [v.cfg for v in OFFLINE[::3]] + [OFFLINE[7].cfg]


@pytest.mark.gpu
@pytest.mark.skipif(not _blackwell(), reason="needs a Blackwell (sm_100) GPU")
@pytest.mark.parametrize("layout", ["tn", "nn"])
@pytest.mark.parametrize("cfg", GPU_CFGS, ids=GemmConfig.name)
def test_rows_form_matches_torch(cfg, layout):
    run = kc.get_kernel(cfg, dtype_in="bf16", dtype_out="bf16", layout=layout, grouped="rows")
    for name, sizes in _rows_patterns().items():
        a, b, offs = _rows_case(sizes, 264, 320, layout, extra_rows=19 if name == "short_offs" else 0)
        out = torch.full((a.shape[0], 264), float("nan"), device="cuda", dtype=torch.bfloat16)
        run(a, b, offs, out)
        torch.cuda.synchronize()
        _assert_close(out, _rows_reference(a, b, offs, layout), name)


@pytest.mark.gpu
@pytest.mark.skipif(not _blackwell(), reason="needs a Blackwell (sm_100) GPU")
def test_clc_tail_cancel_replays_in_a_cuda_graph_with_new_offsets():
    # The padded grid is sized from shapes: one capture serves every offs.
    run = kc.get_kernel(OFFLINE[7].cfg, dtype_in="bf16", dtype_out="bf16", layout="tn", grouped="rows")
    patterns = [[300, 0, 212, 0], [0, 512, 0, 0], [1, 2, 3, 506]]
    a, b, offs = _rows_case(patterns[0], 264, 320, "tn")
    out = torch.empty(512, 264, device="cuda", dtype=torch.bfloat16)
    run(a, b, offs, out)
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
