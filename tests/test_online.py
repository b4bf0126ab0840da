"""Online tuning: a new M is measured once on the live device and stored; later
processes use the stored choice; nothing is measured during CUDA graph
capture or torch.compile tracing. CPU tests drive the same storage path with
the model backend's times."""

import os
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch

from db.store import Store
from kernels import space
from tuner.runtime import dispatch
from tuner.runtime import online
from tuner.backends.gpu_worker import versions
from tuner.key import Key, Problem
from tuner.runtime.lookup import RANGE, lookup
from tuner.backends.model import ModelBackend

ROOT = Path(__file__).resolve().parents[1]
N, K = 1024, 2048


def _store_winner(store, key, cfg, vers, backend="gpu"):
    env = store.environment(backend, key.arch, key.device, vers)
    kid = store.key_id(key.to_dict(), "t")
    store.set_winner(kid, env, config_name=cfg.name(), scheduler=cfg.scheduler, config=cfg.to_dict(),
                     ms=1.0, baseline_ms=1.1, best_by_scheduler={}, trials=1)


# ---------------------------------------------------------------- CPU


@pytest.fixture
def model_family(tmp_path):
    """The model backend, a store with its winners at M = 256 and 4096 of a
    family (no M map), that winner's config and the family's key at M = 1000."""
    model = ModelBackend("sm90")
    store = Store(str(tmp_path / "t.db"))
    cfg = space.defaults("sm90")["static_persistent"]
    key = Key("sm90", model.device_name, Problem(1000, N, K))
    for m in (256, 4096):
        _store_winner(store, key.with_m(m), cfg, model.versions(), backend="model")
    return model, store, cfg, key


def test_online_choice_is_stored_once_and_served_from_the_map(tmp_path, model_family):
    model, store, cfg, key = model_family
    assert lookup(store, key) is None  # 1000 is in neither winner's own interval
    assert online.candidates(store, key) == [cfg]
    calls = []

    def measure(cands):
        calls.append(list(cands))
        return [m.ms for m in model.remeasure(key, list(cands))]

    d = online.tune(store, key, measure, "model", model.versions())
    assert len(calls) == 1 and calls[0] == [None, cfg]
    assert (d.how, d.source, d.interval, d.exact) == (RANGE, "online", (1000, 1000), True)
    assert set(d.evidence[0]["ms"]) == {"cublas", cfg.name()}
    # Stored: a fresh reader serves it without measuring; a second writer does not add another.
    again = lookup(Store(str(tmp_path / "t.db"), writer=False), key)
    assert (again.config_name, again.source) == (d.config_name, "online")
    assert not store.add_online_range(online.family_of(key), 1, {
        "m_lo": 1000, "m_hi": 1000, "config_name": "cublas", "scheduler": "cublas", "config": None,
        "evidence": []})
    assert len(store.ranges(n=N, k=K)) == 1


def test_a_measurement_in_a_slow_spell_decides_nothing(tmp_path, model_family):
    model, store, cfg, key = model_family
    # The winner stored at M = 4096 timed cuBLAS at 1.1 ms: 2 ms at M = 1000
    # is a slow spell, in which the kernel reads ahead.
    assert online.tune(store, key, lambda cands: [2.0, 1.9], "model", model.versions()) is None
    assert store.ranges(n=N, k=K) == []
    # The dispatcher says so, and runs cuBLAS.
    dispatch.configure(str(tmp_path / "t.db"), online=True)
    try:
        seen, cfg_run = dispatch._choose(key, measure=lambda cands: [2.0, 1.9])
    finally:
        dispatch.configure(None)
    assert (seen.path, cfg_run) == ("torch", None) and "slow spell" in seen.reason
    d = online.tune(store, key, lambda cands: [1.0, 0.9], "model", model.versions())
    assert (d.config_name, d.source) == (cfg.name(), "online")


def test_online_is_off_by_default(monkeypatch):
    monkeypatch.delenv(online.ENV_VAR, raising=False)
    dispatch.configure(None)
    assert not dispatch._online()
    monkeypatch.setenv(online.ENV_VAR, "1")
    assert dispatch._online()
    dispatch.configure(None, online=False)
    assert not dispatch._online()
    dispatch.configure(None)


# ---------------------------------------------------------------- GPU


@pytest.fixture
def gpu_db(tmp_path):
    """Winners at M = 256 and 4096 of a (N, K) family on this GPU, no M map."""
    arch = {9: "sm90", 10: "sm100"}[torch.cuda.get_device_capability()[0]]
    device = torch.cuda.get_device_name()
    path = tmp_path / "online.db"
    store = Store(str(path))
    for m in (256, 4096):
        _store_winner(store, Key(arch, device, Problem(m, N, K)), space.defaults(arch)["static_persistent"],
                      versions(device))
    store.close()
    yield path
    dispatch.configure(None)


def _operands(m):
    a = torch.randn(m, K, device="cuda").div_(K ** 0.25).to(torch.bfloat16)
    w = torch.randn(N, K, device="cuda").div_(K ** 0.25).to(torch.bfloat16)
    return a, w


@pytest.mark.gpu
def test_new_m_is_measured_once_then_a_second_process_uses_it(gpu_db, monkeypatch):
    calls = []
    real = online.time_interleaved
    monkeypatch.setattr(online, "time_interleaved", lambda launches: calls.append(1) or real(launches))
    dispatch.configure(str(gpu_db), online=True)
    a, w = _operands(1000)
    with warnings.catch_warnings():
        warnings.simplefilter("error", dispatch.FallbackWarning)
        got = dispatch.gemm(a, w.t())
        dispatch.gemm(a, w.t())
    assert len(calls) == 1
    assert (torch.linalg.vector_norm(got.float() - a.float() @ w.float().t())
            / torch.linalg.vector_norm(a.float() @ w.float().t())) < 2e-2
    [stored] = [r for r in Store(str(gpu_db), writer=False).ranges(n=N, k=K) if r.source == "online"]
    assert (stored.m_lo, stored.m_hi) == (1000, 1000) and "cublas" in stored.evidence[0]["ms"]
    # Another process, online on, finds the stored choice and measures nothing.
    code = (
        "import torch; from tuner.runtime import dispatch, online\n"
        "online.time_interleaved = lambda *a: (_ for _ in ()).throw(AssertionError('measured'))\n"
        f"dispatch.configure({str(gpu_db)!r}, online=True)\n"
        f"a = torch.randn(1000, {K}, device='cuda', dtype=torch.bfloat16)\n"
        f"w = torch.randn({N}, {K}, device='cuda', dtype=torch.bfloat16)\n"
        "dispatch.gemm(a, w.t()); torch.cuda.synchronize()\n"
        "why = dispatch.explain(a, w.t()); assert why.interval == (1000, 1000), why\n"
        "print(why.reason)\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": os.pathsep.join(
                              filter(None, (str(ROOT), os.environ.get("PYTHONPATH"))))})
    assert proc.returncode == 0, proc.stderr
    assert "online" in proc.stdout


@pytest.mark.gpu
def test_no_measurement_under_graph_capture_or_compile_tracing(gpu_db, monkeypatch):
    seen = []
    real = online.tune

    def spy(*args, **kwargs):
        seen.append((torch.compiler.is_compiling(), torch.cuda.is_current_stream_capturing()))
        return real(*args, **kwargs)

    monkeypatch.setattr(online, "tune", spy)
    dispatch.configure(str(gpu_db), online=True)
    a, w = _operands(1500)
    out = torch.empty(1500, N, device="cuda", dtype=torch.bfloat16)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        dispatch.gemm(a, w.t(), out)
    graph.replay()
    torch.cuda.synchronize()
    assert seen == [] and not Store(str(gpu_db), writer=False).ranges(n=N, k=K)
    assert (out.float() - a.float() @ w.float().t()).norm() / (a.float() @ w.float().t()).norm() < 2e-2

    b, _ = _operands(1700)
    compiled = torch.compile(lambda x, weight: dispatch.gemm(x, weight.t()), fullgraph=True)
    compiled(b, w)
    torch.cuda.synchronize()
    # Tracing ran the fake implementation; only the compiled graph's real call measured.
    assert all(not compiling and not capturing for compiling, capturing in seen)
