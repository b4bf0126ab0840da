"""The gpu backend: worker protocol and restarts (CPU, with fake workers), and on a GPU
the cuBLAS baseline, fault recovery and the SM carve-out."""

from __future__ import annotations

import math
import os
import sys
import textwrap

import pytest

from kernels.grouped import MAX_GROUPS
from kernels.space import GemmConfig
from tuner.backends import gpu_worker as worker
from tuner.backends.carveout import check_sms, expected_slowdown
from tuner.backends.gpu import (
    GpuBackend,
    GpuUnavailable,
    WorkerLost,
    WorkerProcess,
    measurement_from_json,
    problem_to_json,
)
from tuner.key import Key, Problem

DEVICE = "Fake GPU"

# A worker that speaks the protocol without CUDA. Its behaviour on `measure`
# is chosen by the problem's M: 1 exits, 2 hangs, 3 replies fatal, 4 prints
# garbage on stdout, anything else replies with a time that echoes the request.
_FAKE = textwrap.dedent(
    """
    import json, os, sys, time
    print("noise on stderr", file=sys.stderr, flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        if req["op"] == "hello":
            reply = {"ok": True, "device_name": %(device)r, "capability": %(cap)r, "sm_count": 132,
                     "l2_bytes": 52428800, "versions": {"torch": "x", "pid": str(os.getpid())}}
        elif req["op"] == "measure":
            m = req["problem"]["m"]
            if m == 1:
                sys.exit(3)
            if m == 2:
                time.sleep(60)
            if m == 3:
                reply = {"ok": False, "error": "CUDA context lost: illegal address", "fatal": True}
            elif m == 4:
                sys.stdout.write("not json\\n"); sys.stdout.flush(); continue
            else:
                reply = {"ok": True, "ms": 1.5, "rel_err": 1e-3,
                         "detail": {"check": req["check"], "pid": os.getpid(),
                                    "baseline": req["config"] is None}}
        elif req["op"] == "remeasure":
            reply = {"ok": True, "results": [
                {"ok": True, "ms": 1.0 + i, "detail": {"check": c}}
                for i, c in enumerate(req["check"])]}
        print(json.dumps(reply), flush=True)
    """
)


def _fake_argv(tmp_path, capability=(9, 0)) -> list[str]:
    script = tmp_path / "fake_worker.py"
    script.write_text(_FAKE % {"device": DEVICE, "cap": list(capability)})
    return [sys.executable, str(script)]


def _key(m: int = 256, **kw) -> Key:
    return Key("sm90", DEVICE, Problem(m, 512, 1024, **kw))


@pytest.fixture
def fake_backend(tmp_path):
    backend = GpuBackend("sm90", argv=_fake_argv(tmp_path), timeout_s=3.0)
    yield backend
    backend.close()


def test_problem_and_measurement_json_round_trip():
    p = Problem(64, 128, 256, groups=2, group_k=(128, 256), carveout=20)
    d = problem_to_json(p)
    assert d["group_k"] == [128, 256] and d["carveout"] == 20
    assert Problem(**{**d, "group_k": tuple(d["group_k"])}) == p
    m = measurement_from_json({"ok": True, "ms": 0.5, "rel_err": 2e-3, "detail": {"a": 1}})
    assert m.ok and m.ms == 0.5 and m.rel_err == 2e-3 and m.detail == {"a": 1}
    # A reply that claims success without a time cannot become a winner.
    assert not measurement_from_json({"ok": True}).ok


def test_rotation_count_covers_twice_l2_within_memory():
    l2 = 50 * 2**20
    assert worker.rotation_count(10 * 2**20, l2, 2**40) == 10
    # Operands larger than L2 still rotate through two sets.
    assert worker.rotation_count(300 * 2**20, l2, 2**40) == 2
    # Memory bounds the count, but one set is always allowed.
    assert worker.rotation_count(10 * 2**20, l2, 35 * 2**20) == 3
    assert worker.rotation_count(10 * 2**20, l2, 2**20) == 1
    assert worker.rotation_count(1, l2, 2**40) == worker.MAX_BUFFER_SETS
    with pytest.raises(ValueError):
        worker.rotation_count(0, l2, 2**40)


def test_set_bytes_of_dense_grouped_and_per_group_k_problems():
    dense = problem_to_json(Problem(128, 256, 512))
    assert worker.set_bytes(dense) == (128 * 512 + 256 * 512) * 2 + 128 * 256 * 2
    moe = problem_to_json(Problem(128, 256, 512, groups=4, dtype_out="fp32"))
    assert worker.set_bytes(moe) == (128 * 512 + 4 * 256 * 512) * 2 + 128 * 256 * 4
    mixed = problem_to_json(Problem(128, 256, 512, groups=2, group_k=(256, 512)))
    assert worker.set_bytes(mixed) == (128 * 768 + 256 * 768) * 2 + 2 * 128 * 256 * 2


@pytest.mark.parametrize("estimate_ms", [0.004, 0.02, 0.3, 1.0, 5.0, 40.0])
def test_timing_plan_keeps_replays_long_and_measurements_short(estimate_ms):
    launches, replays = worker.plan(estimate_ms)
    assert 1 <= launches <= worker.MAX_LAUNCHES_PER_REPLAY
    assert worker.MIN_REPLAYS <= replays <= worker.MAX_REPLAYS
    per_replay = launches * estimate_ms
    assert per_replay >= min(worker.REPLAY_MS, worker.MAX_LAUNCHES_PER_REPLAY * estimate_ms)
    # The timed part stays near TIMED_MS unless the minimum replay count forces more.
    assert per_replay * replays <= max(2 * worker.TIMED_MS, worker.MIN_REPLAYS * per_replay)


def test_interleaved_rounds_of_long_calls_are_capped_by_time():
    # Microsecond calls keep every round asked for.
    assert worker.capped_rounds(25, [0.02] * 7) == 25
    # Seven candidates of 12 ms: MIN_ROUNDS rounds, not 25.
    assert worker.capped_rounds(25, [12.0] * 7) == worker.MIN_ROUNDS
    # In between, about ROUND_CAP_MS of calls.
    n = worker.capped_rounds(25, [8.0, 8.0])
    assert worker.MIN_ROUNDS < n < 25 and (n - 1) * 16.0 < worker.ROUND_CAP_MS <= n * 16.0
    assert worker.capped_rounds(3, [12.0]) == 3


def test_rel_error_flags_nan_and_wrong_results():
    torch = pytest.importorskip("torch")
    ref = torch.randn(64, 64)
    assert worker.rel_error(ref.bfloat16(), ref) < worker.REL_ERR_LIMIT["bf16"]
    assert worker.rel_error(ref * 1.1, ref) == pytest.approx(0.1, rel=1e-4)
    broken = ref.clone()
    broken[3, 5] = float("nan")
    assert worker.rel_error(broken, ref) == math.inf


def test_carveout_bounds_and_expected_slowdown():
    assert expected_slowdown(66, 132) == pytest.approx(2.0)
    assert expected_slowdown(20, 132) == pytest.approx(132 / 112)
    for bad in (0, 132, -1):
        with pytest.raises(ValueError):
            check_sms(bad, 132)


def test_fake_worker_measures_and_checks_once_per_problem(fake_backend):
    cfg = GemmConfig()
    assert fake_backend.device_name == DEVICE
    assert fake_backend.versions()["torch"] == "x"
    first = fake_backend.measure(_key(), cfg)
    assert first.ok and first.ms == 1.5 and first.detail["check"] is True
    again = fake_backend.measure(_key(), cfg)
    assert again.detail["check"] is False
    # Another problem (here: with SMs held) is checked again.
    held = fake_backend.measure(_key(carveout=20), cfg)
    assert held.detail["check"] is True
    base = fake_backend.baseline(_key())
    assert base.ok and base.detail["baseline"] is True
    assert fake_backend.restarts == 0


@pytest.mark.parametrize("m, reason", [(1, "exited"), (2, "no reply within"), (3, "illegal address"),
                                       (4, "unreadable reply")])
def test_worker_failure_is_recorded_and_the_worker_restarts(fake_backend, m, reason):
    cfg = GemmConfig()
    before = fake_backend.measure(_key(), cfg)
    failed = fake_backend.measure(_key(m), cfg)
    assert not failed.ok and failed.ms is None
    assert reason in failed.error
    after = fake_backend.measure(_key(), cfg)
    assert after.ok and fake_backend.restarts == 1
    assert after.detail["pid"] != before.detail["pid"]
    # The fresh worker has no memory, but the backend's record of checked configs stands.
    assert after.detail["check"] is False


def test_crash_reports_exit_code_and_stderr(tmp_path):
    proc = WorkerProcess(_fake_argv(tmp_path))
    proc.start()
    with pytest.raises(WorkerLost, match=r"exit code 3.*noise on stderr"):
        proc.call({"op": "measure", "problem": {"m": 1}, "config": None, "check": True}, 5.0)
    assert not proc.alive
    proc.kill()


def test_remeasure_keeps_order_and_refuses_what_cannot_run(fake_backend):
    cfgs = [GemmConfig(), None, GemmConfig(arch="sm100", tile_m=128, tile_n=128, cta_group=1)]
    got = fake_backend.remeasure(_key(), cfgs)
    assert [m.ok for m in got] == [True, True, False]
    assert got[0].ms == 1.0 and got[1].ms == 2.0
    assert "sm100" in got[2].error
    assert fake_backend.remeasure(_key(), cfgs[:2])[0].detail["check"] is False


def test_grouped_limits_and_mismatched_keys_are_refused_without_the_worker(fake_backend):
    too_many_groups = Key("sm90", DEVICE, Problem(1024, 512, 1024, groups=MAX_GROUPS + 1))
    assert f"at most {MAX_GROUPS}" in fake_backend.measure(too_many_groups, GemmConfig()).error
    mixed_k = Key("sm90", DEVICE, Problem(1024, 512, 1000, groups=2, group_k=(1000, 512)))
    assert "multiples of 64" in fake_backend.measure(mixed_k, GemmConfig()).error
    grouped = Key("sm90", DEVICE, Problem(1024, 512, 1024, groups=4))
    assert fake_backend.measure(grouped, GemmConfig()).ok
    other_gpu = Key("sm90", "Another GPU", Problem(256, 512, 1024))
    assert "Another GPU" in fake_backend.measure(other_gpu, GemmConfig()).error
    too_many = _key(carveout=132)
    assert not fake_backend.baseline(too_many).ok
    split = GemmConfig(split_k=8)
    assert "invalid" in fake_backend.measure(Key("sm90", DEVICE, Problem(128, 512, 256)), split).error


def test_a_device_of_another_arch_is_unavailable(tmp_path):
    with pytest.raises(GpuUnavailable, match="cannot run sm90"):
        GpuBackend("sm90", argv=_fake_argv(tmp_path, capability=(8, 0)))


def test_an_overlap_key_needs_the_gpus_of_its_all_reduce(tmp_path, fake_backend):
    refused = fake_backend.measure(_key(overlap=1 << 20), GemmConfig())
    assert not refused.ok and "needs the GPUs it spans: tune with --tp" in refused.error
    # The fake worker sees one GPU: an all-reduce over two cannot be timed.
    with pytest.raises(GpuUnavailable, match=r"an all-reduce over GPUs \[0, 1\]: 1 are visible"):
        GpuBackend("sm90", argv=_fake_argv(tmp_path), overlap_devices=(1,))


def test_a_worker_that_cannot_start_makes_the_gpu_unavailable(tmp_path):
    with pytest.raises(GpuUnavailable):
        GpuBackend("sm90", argv=[sys.executable, "-c", "import sys; sys.exit(1)"])


# ---------------------------------------------------------------- on a GPU

_FAULTING = textwrap.dedent(
    """
    import triton
    import triton.language as tl

    import tuner.backends.gpu_worker as w


    @triton.jit
    def _wild_store(ptr):
        tl.store(ptr + (1 << 40), 1.0)


    def _pool_launch(cfg, problem):
        def launch(a, b, out):
            _wild_store[(1,)](out)
            return out
        return launch


    w._pool_launch = _pool_launch
    w.main()
    """
)


@pytest.fixture(scope="module")
def gpu():
    backend = GpuBackend("sm90")
    yield backend
    backend.close()


def _gpu_key(backend, m, n, k, **kw) -> Key:
    return Key("sm90", backend.device_name, Problem(m, n, k, **kw))


@pytest.mark.gpu
def test_cublas_baseline_is_correct_and_timed(gpu):
    key = _gpu_key(gpu, 2048, 5376, 4096)
    m = gpu.baseline(key)
    assert m.ok, m.error
    assert m.rel_err < 1e-2
    assert m.detail["buffer_sets"] >= 2 and m.detail["timing"] in ("graph", "events")
    # 90 GFLOP: well under 10 ms, and not faster than a dense-FP16 H100/H200 peak.
    assert 2 * 2048 * 5376 * 4096 / (m.ms * 1e-3) < 1.0e15
    assert m.ms < 10.0
    assert gpu.versions()["device"] == gpu.device_name


@pytest.mark.gpu
def test_grouped_baselines_are_correct(gpu):
    moe = gpu.baseline(_gpu_key(gpu, 4096, 1024, 2048, groups=8))
    assert moe.ok and moe.rel_err < 1e-2, moe.error
    mixed = gpu.baseline(_gpu_key(gpu, 512, 1024, 4096, groups=3, group_k=(1024, 2048, 4096)))
    assert mixed.ok and mixed.rel_err < 1e-2, mixed.error
    loop, = gpu.remeasure(_gpu_key(gpu, 4096, 1024, 2048, groups=8), [worker.CUBLAS_LOOP])
    assert loop.ok and loop.rel_err < 1e-2, loop.error
    refused, = gpu.remeasure(_gpu_key(gpu, 512, 1024, 4096), [worker.CUBLAS_LOOP])
    assert "MoE" in refused.error


@pytest.mark.gpu
def test_a_faulting_kernel_is_recorded_and_the_worker_restarts(tmp_path):
    import torch

    script = tmp_path / "faulting_worker.py"
    script.write_text(_FAULTING)
    name = torch.cuda.get_device_name(0)
    backend = GpuBackend("sm90", argv=[sys.executable, str(script)], timeout_s=120.0)
    try:
        key = Key("sm90", name, Problem(512, 512, 512))
        bad = backend.measure(key, GemmConfig())
        assert not bad.ok
        assert "illegal" in bad.error.lower() or "context" in bad.error.lower()
        good = backend.baseline(key)
        assert good.ok, good.error
        assert backend.restarts == 1
    finally:
        backend.close()


@pytest.mark.gpu
def test_holding_half_the_sms_slows_a_cublas_gemm(gpu):
    free = gpu.baseline(_gpu_key(gpu, 8192, 8192, 8192))
    held = gpu.baseline(_gpu_key(gpu, 8192, 8192, 8192, carveout=gpu.sm_count // 2))
    assert free.ok and held.ok, (free.error, held.error)
    assert held.detail["resident"] == gpu.sm_count // 2
    # Ideal is 2x; anything above 1.5x shows the SMs were really taken.
    assert held.ms / free.ms > 1.5


@pytest.mark.gpu
def test_an_overlap_key_is_timed_by_its_makespan_beside_the_all_reduce():
    import torch

    if torch.cuda.device_count() < 2:
        pytest.skip("an all-reduce needs two GPUs")
    backend = GpuBackend("sm90", overlap_devices=(1,))
    try:
        plain = _gpu_key(backend, 2048, 5376, 2688)
        beside = _gpu_key(backend, 2048, 5376, 2688, overlap=64 << 20)
        alone, = backend.remeasure(plain, [None], cold=True)
        cublas, = backend.remeasure(beside, [None])
        kernel = backend.measure(beside, GemmConfig(scheduler="static_persistent", sm_budget=backend.sm_count - 16))
        assert alone.ok and cublas.ok and kernel.ok, (alone.error, cublas.error, kernel.error)
        assert cublas.rel_err < 1e-2 and kernel.rel_err < 1e-2
        # A 64 MB all-reduce over two GPUs takes longer than this GEMM alone:
        # the makespan holds it.
        assert cublas.ms > alone.ms and kernel.ms > alone.ms * 0.5
    finally:
        backend.close()


@pytest.mark.gpu
def test_quick_probe_reads_the_driver_and_measures_in_seconds(gpu):
    figures, facts = gpu.probe(), gpu.facts
    assert facts["sms"] > 0 and facts["l2_bytes"] > 0 and facts["hbm_bw"] > 1e11 and facts["clock_hz"] > 1e8
    assert figures["seconds"] < 60
    assert 200 < figures["copy_gbps"] < 2e4 and 50 < figures["mma_tflops"] < 1e4 and 0.1 < figures["launch_us"] < 50


def test_compile_workers_take_the_hosts_cores_or_what_a_multi_gpu_tune_shares_out(monkeypatch):
    from tuner.backends.gpu import COMPILE_WORKERS_ENV, compile_workers

    monkeypatch.delenv(COMPILE_WORKERS_ENV, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 16)
    assert compile_workers() == 14
    monkeypatch.setenv(COMPILE_WORKERS_ENV, "7")
    assert compile_workers() == 7
    monkeypatch.setenv(COMPILE_WORKERS_ENV, "none")
    assert compile_workers() == 14


def test_configs_are_compiled_ahead_as_the_key_runs_them():
    """A grouped key's candidates compile as the grouped kernel the worker loads, not the dense one."""
    from tuner.backends.gpu import _variant

    assert _variant(Problem(512, 1536, 2048, groups=128)) == dict(dtype_in="bf16", dtype_out="bf16", layout="tn",
                                                                  grouped="rows")
    assert _variant(Problem(1024, 1024, 4096, groups=2, group_k=(1024, 4096)))["grouped"] == "k"
    assert _variant(Problem(64, 256, 512, layout="nn", dtype_out="fp32")) == dict(
        dtype_in="bf16", dtype_out="fp32", layout="nn", grouped="")
