"""In-process dispatch: `tuner.gemm` and the decision rules behind it."""

import subprocess
import sys
import warnings
from dataclasses import replace

import pytest
import torch

from db.store import Store
from kernels import space
from kernels.grouped import MAX_GROUPS
from tuner import explain, gemm
from tuner.runtime import dispatch
from tuner.backends.gpu_worker import versions
from tuner.key import Key, Problem

DEVICE = "TestGPU"
N, K = 512, 1024


def _rel_err(got, want):
    return (torch.linalg.vector_norm(got.float() - want) / torch.linalg.vector_norm(want)).item()


def _operands(m, n, k, device="cpu", dtype=torch.bfloat16, seed=0):
    gen = torch.Generator(device=device).manual_seed(seed)
    a = torch.randn(m, k, generator=gen, device=device).div_(k ** 0.25).to(dtype)
    w = torch.randn(n, k, generator=gen, device=device).div_(k ** 0.25).to(dtype)
    return a, w


def _store_winner(store, key, config, vers):
    env = store.environment("gpu", key.arch, key.device, vers)
    kid = store.key_id(key.to_dict(), "test")
    store.set_winner(
        kid, env, config_name=config.name() if config else "cublas",
        scheduler=config.scheduler if config else "cublas", config=config.to_dict() if config else None,
        ms=1.0, baseline_ms=1.2, best_by_scheduler={}, trials=1,
    )


@pytest.fixture
def db(tmp_path):
    path = tmp_path / "winners.db"
    dispatch.configure(str(path))
    yield path
    dispatch.configure(None)


# ---------------------------------------------------------------- CPU


def test_import_is_cheap_and_exports_the_functions():
    code = (
        "import sys, tuner; assert 'torch' not in sys.modules and 'sqlalchemy' not in sys.modules;"
        # Importing the modules behind the names must not hide the functions.
        "import tuner.runtime.dispatch, tuner.runtime.lookup; from tuner import lookup, gemm, explain;"
        "from tuner.runtime.lookup import decide;"
        "assert lookup is tuner.lookup is sys.modules['tuner.runtime.lookup'].lookup, lookup;"
        "assert gemm is sys.modules['tuner.runtime.dispatch'].gemm"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


@pytest.mark.parametrize("layout", ["tn", "nn"])
def test_cpu_gemm_is_the_product_and_explains_why_torch(layout, db):
    a, w = _operands(48, 64, 128)
    b = w.t() if layout == "tn" else w.t().contiguous()
    want = a.float() @ w.float().t()
    with pytest.warns(dispatch.FallbackWarning, match="tensors on cpu"):
        got = gemm(a, b)
    assert got.dtype == torch.bfloat16 and got.shape == (48, 64)
    assert _rel_err(got, want) < 1e-2
    why = explain(a, b)
    assert (why.path, why.fallback, why.config_name) == ("torch", True, None)
    assert "cpu" in why.reason
    out = torch.empty(48, 64)
    with pytest.warns(dispatch.FallbackWarning, match=">float32"):
        assert gemm(a, b, out) is out
    assert _rel_err(out, want) < 1e-5


def test_fallback_warns_once_per_reason_and_key(db):
    a, w = _operands(16, 64, 128)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            gemm(a, w.t())
        gemm(a[:8], w.t())
    assert [str(c.message).split(":")[0] for c in caught] == [
        "gemm 16x64x128 bfloat16,bfloat16>bfloat16 tn on cpu", "gemm 8x64x128 bfloat16,bfloat16>bfloat16 tn on cpu",
    ]


def test_grouped_cpu_gemm_matches_each_group(db):
    a, _ = _operands(40, 32, 64)
    b = torch.randn(3, 64, 32).to(torch.bfloat16)
    offs = torch.tensor([8, 24, 40], dtype=torch.int32)
    with pytest.warns(dispatch.FallbackWarning):
        got = gemm(a, b, offs=offs)
    want = torch.cat([a[s:e].float() @ b[i].float() for i, (s, e) in enumerate([(0, 8), (8, 24), (24, 40)])])
    assert _rel_err(got, want) < 1e-2


def test_shape_mismatch_is_an_error():
    a, w = _operands(16, 64, 128)
    with pytest.raises(ValueError, match="inner dimensions"):
        gemm(a, w)
    with pytest.raises(ValueError, match="out"):
        gemm(a, w.t(), torch.empty(16, 63))


def test_decision_rules_over_a_real_store(db):
    store = Store(str(db))
    current = versions(DEVICE)
    cfg = space.defaults("sm90")["static_persistent"]
    split = space.GemmConfig(arch="sm90", scheduler="static_persistent", split_k=4)

    def key(m, n=N, k=K, groups=1):
        return Key("sm90", DEVICE, Problem(m, n, k, groups))

    _store_winner(store, key(128), cfg, current)
    _store_winner(store, key(128, n=2 * N), cfg, {**current, "torch": "0.0-old"})
    _store_winner(store, key(128, n=3 * N), None, current)
    _store_winner(store, key(4096, k=K + 8), split, current)
    _store_winner(store, key(1024, groups=8), cfg, current)
    store.close()

    exact = dispatch.explain_key(key(128))
    assert (exact.path, exact.exact, exact.tuned_m, exact.config_name) == ("kernel", True, 128, cfg.name())
    near = dispatch.explain_key(key(100))
    assert (near.path, near.exact, near.tuned_m) == ("kernel", False, 128)
    assert "nearest tuned M=128" in near.reason and near.interval is None
    assert dispatch.explain_key(key(200)).path == "torch"  # over sqrt(2) from 128: not measured
    stale = dispatch.explain_key(key(128, n=2 * N))
    assert (stale.path, stale.stale, stale.fallback) == ("torch", True, True)
    assert "stale" in stale.reason and "torch" in stale.reason
    cublas = dispatch.explain_key(key(100, n=3 * N))
    assert (cublas.path, cublas.fallback, cublas.config_name) == ("torch", False, "cublas")
    # Split 4 ways, K = 1032 leaves slices that are not 16-byte multiples.
    unfit = dispatch.explain_key(key(4096, k=K + 8))
    assert unfit.path == "torch" and "cannot run this shape" in unfit.reason
    missing = dispatch.explain_key(key(128, n=4 * N))
    assert missing.path == "torch" and "no measured choice" in missing.reason
    grouped = dispatch.explain_key(key(1000, groups=8))
    assert (grouped.path, grouped.tuned_m) == ("kernel", 1024)
    assert dispatch.explain_key(key(1024, groups=4)).path == "torch"
    too_many = dispatch.explain_key(key(4096, groups=MAX_GROUPS + 1))
    assert too_many.path == "torch" and f"at most {MAX_GROUPS}" in too_many.reason


def test_no_database_file_means_torch_and_none_is_created(tmp_path):
    path = tmp_path / "absent.db"
    dispatch.configure(str(path))
    try:
        why = dispatch.explain_key(Key("sm90", DEVICE, Problem(128, N, K)))
    finally:
        dispatch.configure(None)
    assert why.path == "torch" and "no readable winners database" in why.reason
    assert not path.exists()


def test_the_op_passes_torch_library_checks():
    a, w = _operands(16, 64, 128)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dispatch.FallbackWarning)
        torch.library.opcheck(torch.ops.gemm_tuner.gemm.default, (a, w.t(), None))
        torch.library.opcheck(torch.ops.gemm_tuner.gemm_out.default, (a, w.t(), torch.empty(16, 64), None))


def test_torch_compile_fullgraph_on_cpu():
    a, w = _operands(32, 64, 128)
    out = torch.empty(32, 64)

    def block(x, weight, o):
        return gemm(x, weight.t()).float().relu() + gemm(x, weight.t(), o)

    compiled = torch.compile(block, fullgraph=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dispatch.FallbackWarning)
        got = compiled(a, w, out)
    want = a.float() @ w.float().t()
    assert _rel_err(got, want.relu() + want) < 1e-2


# ---------------------------------------------------------------- GPU


@pytest.fixture
def tuned(db):
    """A winner for the exact key of a (256, 512, 1024) bf16 GEMM on this GPU, in each layout."""
    major = torch.cuda.get_device_capability()[0]
    arch = {9: "sm90", 10: "sm100"}[major]
    device = torch.cuda.get_device_name()
    cfg = space.defaults(arch)["static_persistent"]
    store = Store(str(db))
    for layout in ("tn", "nn"):
        _store_winner(store, Key(arch, device, Problem(256, N, K, layout=layout)), cfg, versions(device))
    store.close()
    return cfg


@pytest.mark.gpu
@pytest.mark.parametrize("layout", ["tn", "nn"])
def test_tuned_kernel_runs_and_matches(tuned, layout):
    a, w = _operands(256, N, K, device="cuda")
    b = w.t() if layout == "tn" else w.t().contiguous()
    why = explain(a, b)
    assert (why.path, why.exact, why.config_name) == ("kernel", True, tuned.name())
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.FallbackWarning)
        got = gemm(a, b)
    assert _rel_err(got, a.float() @ w.float().t()) < 2e-2


@pytest.mark.gpu
def test_an_overlap_hint_runs_the_overlap_keys_winner(tuned, db):
    device = torch.cuda.get_device_name()
    beside = replace(tuned, tile_n=64, sm_budget=100)
    store = Store(str(db))
    _store_winner(store, Key(tuned.arch, device, Problem(256, N, K, overlap=1 << 20)), beside, versions(device))
    store.close()
    dispatch.configure(str(db))
    a, w = _operands(256, N, K, device="cuda")
    assert explain(a, w.t()).config_name == tuned.name()
    with dispatch.overlap(1 << 20):
        assert explain(a, w.t()).config_name == beside.name()
        got = gemm(a, w.t())
    with dispatch.overlap(2 << 20):
        assert explain(a, w.t()).path == "torch"  # nothing tuned beside this all-reduce
    assert _rel_err(got, a.float() @ w.float().t()) < 2e-2


@pytest.mark.gpu
def test_tuned_kernel_under_compile_and_graph_capture(tuned):
    a, w = _operands(256, N, K, device="cuda")
    want = a.float() @ w.float().t()
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.FallbackWarning)
        compiled = torch.compile(lambda x, weight: gemm(x, weight.t()), fullgraph=True)
        assert _rel_err(compiled(a, w), want) < 2e-2

        static_a = a.clone()
        out = torch.empty(256, N, device="cuda", dtype=torch.bfloat16)
        gemm(static_a, w.t(), out)  # warm-up: decides and builds before capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            gemm(static_a, w.t(), out)
        a2, _ = _operands(256, N, K, device="cuda", seed=1)
        static_a.copy_(a2)
        graph.replay()
        torch.cuda.synchronize()
    assert _rel_err(out, a2.float() @ w.float().t()) < 2e-2


@pytest.mark.gpu
def test_stale_winner_falls_back_with_one_warning(db):
    arch = {9: "sm90", 10: "sm100"}[torch.cuda.get_device_capability()[0]]
    device = torch.cuda.get_device_name()
    store = Store(str(db))
    cfg = space.defaults(arch)["static_persistent"]
    _store_winner(store, Key(arch, device, Problem(128, N, K)), cfg, {**versions(device), "torch": "0.0-old"})
    store.close()
    a, w = _operands(128, N, K, device="cuda")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            got = gemm(a, w.t())
    fallbacks = [str(c.message) for c in caught if issubclass(c.category, dispatch.FallbackWarning)]
    assert len(fallbacks) == 1 and "stale" in fallbacks[0]
    assert explain(a, w.t()).stale
    assert _rel_err(got, a.float() @ w.float().t()) < 2e-2


@pytest.mark.gpu
def test_grouped_winner_runs_the_grouped_kernel(db):
    arch = {9: "sm90", 10: "sm100"}[torch.cuda.get_device_capability()[0]]
    device = torch.cuda.get_device_name()
    cfg = space.defaults(arch)["static_persistent"]
    store = Store(str(db))
    _store_winner(store, Key(arch, device, Problem(512, N, K, groups=4)), cfg, versions(device))
    store.close()
    a, _ = _operands(512, N, K, device="cuda")
    w = torch.randn(4, N, K, device="cuda").div_(K ** 0.25).to(torch.bfloat16)
    bounds = [0, 64, 192, 320, 512]
    offs = torch.tensor(bounds[1:], device="cuda", dtype=torch.int32)
    why = explain(a, w.mT, offs=offs)
    assert (why.path, why.config_name) == ("kernel", cfg.name())
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.FallbackWarning)
        got = gemm(a, w.mT, offs=offs)
    want = torch.cat([a[s:e].float() @ w[g].float().t() for g, (s, e) in enumerate(zip(bounds, bounds[1:]))])
    assert _rel_err(got, want) < 2e-2


def test_call_signature_separates_everything_the_rules_read():
    from tuner.runtime.dispatch import _signature

    x = torch.empty(64, 128, dtype=torch.bfloat16)
    w = torch.empty(256, 128, dtype=torch.bfloat16)
    b_nn = torch.empty(128, 256, dtype=torch.bfloat16)
    base = _signature(x, w.t(), None, None)
    assert base == _signature(torch.empty_like(x), torch.empty_like(w).t(), None, None)
    others = [
        _signature(x, b_nn, None, None),                       # same shape, other layout
        _signature(x.half(), w.t(), None, None),                # dtype
        _signature(x, w.t(), torch.empty(64, 256, dtype=torch.float32), None),  # output dtype
        _signature(x[:, :64], w[:, :64].t(), None, None),       # shape
        _signature(torch.empty(128, 64, dtype=torch.bfloat16).t(), w.t(), None, None),  # a strides
    ]
    with dispatch.overlap(1 << 20):
        others.append(_signature(x, w.t(), None, None))         # the overlap in effect
    assert base not in others and len(set(others)) == len(others)
    assert _signature(x, w.t(), None, None) == base  # the block's end restores it


@pytest.mark.parametrize("nbytes", [-1, 2**41, 1.5, True, "1MB"])
def test_an_overlap_hint_takes_a_byte_count(nbytes):
    with pytest.raises(ValueError, match="overlap takes the all-reduce's bytes"):
        with dispatch.overlap(nbytes):
            pass
