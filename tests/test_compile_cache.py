"""The on-disk compile cache: compiled once in a worker, loaded by any process."""

from __future__ import annotations

import pytest
import torch

from kernels import compile as kc
from kernels.space import GemmConfig

CFG = GemmConfig(scheduler="dynamic_persistent", tile_m=64, tile_n=64, stages=3)


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KERNELS_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(kc, "_compiled", {})
    return tmp_path


def test_compile_many_fills_the_cache_once(cache):
    assert kc.compile_many([CFG], workers=1) == 1
    path = kc._cache_path(kc.Variant(CFG))
    assert path.is_file() and path.is_relative_to(cache)
    assert f"cutlass-dsl-{kc._dsl_version()}" in str(path)
    # A second run finds everything compiled.
    assert kc.compile_many([CFG], workers=1) == 0
    # The object loads without a GPU and holds the exported entry point.
    assert callable(kc._load(path))


def test_key_separates_variants(cache):
    paths = {
        kc._cache_path(kc.Variant(CFG, *v))
        for v in [("bf16", "bf16", "tn"), ("bf16", "bf16", "nn"), ("fp16", "fp16", "tn"), ("bf16", "fp32", "tn")]
    }
    paths.add(kc._cache_path(kc.Variant(GemmConfig(scheduler="dynamic_persistent", tile_m=64, tile_n=64, stages=4))))
    assert len(paths) == 5


@pytest.mark.gpu
def test_runner_loaded_from_disk_is_correct(cache, monkeypatch):
    kc.compile_many([CFG], workers=1, layouts=("nn",))

    def no_compile(*args, **kwargs):
        raise AssertionError("compiled instead of loading from disk")

    monkeypatch.setattr(kc, "_compile", no_compile)
    runner = kc.get_kernel(CFG, dtype_in="bf16", dtype_out="bf16", layout="nn")
    a = torch.randn(333, 200, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(200, 136, device="cuda", dtype=torch.bfloat16)
    out = torch.full((333, 136), float("nan"), device="cuda", dtype=torch.bfloat16)
    runner(a, b, out)
    ref = a.float() @ b.float()
    assert (torch.linalg.vector_norm(out.float() - ref) / torch.linalg.vector_norm(ref)).item() < 2e-2


def test_compile_queue_compiles_a_waited_for_config_ahead_of_the_queue(cache):
    """A tune queues a family's candidates; the one it is about to measure
    goes next, not after the others."""
    cfgs = [GemmConfig(scheduler="dynamic_persistent", tile_m=64, tile_n=n, stages=3) for n in (64, 96, 128, 160)]
    queue = kc.CompileQueue(1)
    queue.submit(cfgs)
    queue.submit(cfgs)  # queued once
    queue.wait(cfgs[-1])
    done = [kc.cache_path(c).exists() for c in cfgs]
    # The first was running already; the last jumped the two between.
    assert done[-1] and not all(done[1:3])
    for cfg in cfgs:
        queue.wait(cfg)
    assert all(kc.cache_path(c).exists() for c in cfgs)
    queue.submit(cfgs)  # cached: nothing to do
    queue.wait(cfgs[0])


def test_compile_queue_builds_the_variant_asked_for(cache):
    queue = kc.CompileQueue(1)
    queue.submit([CFG], grouped="rows")
    queue.wait(CFG, grouped="rows")
    assert kc._cache_path(kc.Variant(CFG, grouped="rows")).exists()
    assert not kc._cache_path(kc.Variant(CFG)).exists()
