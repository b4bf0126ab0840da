"""Tile traces: the build flag (offline PTX), the summary and pictures, and a
traced launch on a GPU."""

from __future__ import annotations

import hashlib
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernels import compile as kc
from kernels.space import GemmConfig
from kernels.trace import FIELDS
from tuner.key import Key, Problem
from tuner.observe.trace import Trace, group_rows, slots, summarise, write

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [
    GemmConfig(scheduler="static_persistent", swizzle=4),
    GemmConfig(scheduler="dynamic_persistent", cluster_m=2),
    GemmConfig(scheduler="single_tile", tile_m=64, split_k=2),
    # Each pingpong warpgroup records its own tiles.
    GemmConfig(scheduler="dynamic_persistent", cluster_m=2, consumer="pingpong"),
]
_TWO_CTA = dict(arch="sm100", tile_m=256, tile_n=128, cluster_m=2, cta_group=2, acc_stages=2)
# (config, grouped form): every kernel class with the flag, every scheduler
# (sm100: compiled only, no Blackwell GPU has run them).
BUILDS = [(c, "") for c in CONFIGS] + [
    (GemmConfig(scheduler="dynamic_persistent", tile_n=256), "k"),
    (GemmConfig(scheduler="static_persistent", cluster_n=2), "rows"),
    (GemmConfig(arch="sm100", scheduler="single_tile", split_k=2, tile_n=64), ""),
    (GemmConfig(scheduler="static_persistent", swizzle=4, **_TWO_CTA), ""),
    (GemmConfig(arch="sm100", scheduler="dynamic_persistent", sched_depth=2, cluster_m=2), ""),
    (GemmConfig(arch="sm100", scheduler="clc", sched_depth=1), ""),
    (GemmConfig(scheduler="clc", sched_depth=2, tail_cancel=True, **_TWO_CTA), ""),
    (GemmConfig(arch="sm100", scheduler="static_persistent"), "rows"),
    (GemmConfig(scheduler="dynamic_persistent", sched_depth=1, **_TWO_CTA), "rows"),
    (GemmConfig(arch="sm100", scheduler="clc", sched_depth=1, tail_cancel=True, cluster_n=2), "rows"),
]

# The untraced builds of one arch (argv[1]: its CUTE_DSL_ARCH), compiled
# where every device-side trace helper raises: with the flag off, building
# the kernel must not touch them.
_POISONED = """
import hashlib, os, sys
os.environ["CUTE_DSL_ARCH"] = sys.argv[1]
import kernels.trace_device as t
def boom(*args, **kw):
    raise AssertionError("trace code reached with the flag off")
t.now = boom
t.TileTrace.create = staticmethod(boom)
from kernels import compile as kc
from kernels.space import GemmConfig
for arg in sys.argv[2:]:
    name, grouped = arg.split("/")
    ptx = kc._offline_job(kc.Variant(GemmConfig.from_name(name), grouped=grouped)).ptx
    print(hashlib.sha256(ptx.encode()).hexdigest())
"""


@pytest.fixture(scope="module")
def builds():
    variants = [kc.Variant(c, grouped=g, trace=t) for c, g in BUILDS for t in (False, True)]
    ptx = [r.ptx for r in kc.compile_offline(variants, workers=os.cpu_count() or 1)]
    return {(v.cfg, v.grouped, v.trace): p for v, p in zip(variants, ptx)}


def _params(ptx: str) -> int:
    entry = ptx[ptx.index(".entry"):]
    return len(re.findall(r"\.param ", entry[:entry.index(")")]))


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_untraced_build_emits_no_trace_code(builds, arch):
    of_arch = [(c, g) for c, g in BUILDS if c.arch == arch]
    args = [kc._TARGETS[arch], *(f"{c.name()}/{g}" for c, g in of_arch)]
    proc = subprocess.run([sys.executable, "-c", _POISONED, *args], cwd=ROOT, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    poisoned = proc.stdout.split()
    for (cfg, grouped), digest in zip(of_arch, poisoned, strict=True):
        untraced = builds[cfg, grouped, False]
        assert hashlib.sha256(untraced.encode()).hexdigest() == digest
        assert "%globaltimer" not in untraced and "%smid" not in untraced
        assert "st.global.b64" not in untraced


@pytest.mark.parametrize("cfg, grouped", BUILDS, ids=lambda x: x.name() if isinstance(x, GemmConfig) else x or "dense")
def test_traced_build_reads_the_clock_per_tile_and_per_claim(builds, cfg, grouped):
    untraced, traced = builds[cfg, grouped, False], builds[cfg, grouped, True]
    assert _params(traced) == _params(untraced) + 1   # the record buffer
    assert traced.count("%smid") == 1
    # start and end of every tile; the scheduler warp of a dynamic or CLC schedule times its claims too
    claims = cfg.scheduler in ("dynamic_persistent", "clc")
    assert traced.count("%globaltimer") == (4 if claims else 2)
    assert ("wgmma.mma_async" if cfg.arch == "sm90" else "tcgen05.mma") in traced
    if cfg.arch == "sm100":
        # The epilogue's record (every word but start and claim), the MMA
        # warp's start of each CTA tile of its MMA, the claim word.
        assert traced.count("st.global.b64") == 6 + cfg.cta_group + claims


def _record(sm, tile_m, tile_n, start, end, claim=-1, group=0):
    return dict(zip(FIELDS, (sm, sm, tile_m, tile_n, group, start, end, claim)))


def test_summary_and_pictures_of_a_trace(tmp_path):
    key = Key("sm90", "GPU", Problem(200, 256, 1024))  # 2 x 2 tiles of 128 x 128
    cfg = GemmConfig(scheduler="dynamic_persistent")
    assert group_rows(key, cfg) == [200] and slots(key, cfg) == 4
    records = [_record(0, 0, 0, 0, 4000), _record(0, 1, 1, 5000, 9000, claim=700),
               _record(3, 1, 0, 0, 3000), _record(3, 0, 1, 3000, 6000, claim=900)]
    trace = Trace(key.to_dict(), cfg.name(), "GPU", 4, [200], records)
    assert trace.tiles == 4
    s = summarise(trace)
    assert (s["tiles_run"], s["tiles_in_problem"], s["span_us"], s["sms_used"]) == (4, 4, 9.0, 2)
    assert s["per_sm"]["0"] == {"tiles": 2, "busy_us": 8.0, "idle_us": 1.0}
    assert s["per_sm"]["1"] == {"tiles": 0, "busy_us": 0.0, "idle_us": 9.0}
    assert s["idle_us_total"] == 1.0 + 9.0 + 9.0 + 3.0
    assert (s["claims"], s["claim_ns_median"]) == (2, 900)
    files = write(trace, tmp_path)
    assert [f.name for f in files] == ["trace.json", "trace.timeline.png", "trace.tiles_per_sm.png",
                                       "trace.sm_idle.png"]
    for f in files[1:]:
        assert f.read_bytes()[:4] == b"\x89PNG"


def test_busy_time_counts_overlapping_tiles_once():
    # sm100: a tile's mainloop runs beside the previous tile's epilogue.
    key = Key("sm100", "GPU", Problem(256, 256, 1024))
    cfg = GemmConfig(arch="sm100", scheduler="clc", acc_stages=2)
    records = [_record(0, 0, 0, 0, 4000), _record(0, 0, 1, 3000, 7000, claim=500), _record(0, 1, 0, 5000, 6000)]
    s = summarise(Trace(key.to_dict(), cfg.name(), "GPU", 1, [256], records))
    assert s["per_sm"]["0"] == {"tiles": 3, "busy_us": 7.0, "idle_us": 0.0}


@pytest.mark.gpu
@pytest.mark.parametrize("cfg, tiles", [
    (GemmConfig(scheduler="static_persistent", tile_n=256, swizzle=4), 32 * 16),
    (GemmConfig(scheduler="dynamic_persistent", tile_n=256, cluster_m=2, swizzle=4), 32 * 16),
    (GemmConfig(scheduler="single_tile", tile_m=64, split_k=2), 63 * 32 * 2),
    (GemmConfig(scheduler="dynamic_persistent", cluster_m=2, swizzle=4, consumer="pingpong"), 32 * 32),
    (GemmConfig(scheduler="single_tile", consumer="pingpong"), 32 * 32),
    # Never run: no Blackwell GPU was at hand (README, "Not yet verified on real hardware").
    (GemmConfig(scheduler="static_persistent", swizzle=4, **_TWO_CTA), 32 * 32),
    (GemmConfig(arch="sm100", scheduler="dynamic_persistent", tile_n=256, cluster_m=2, swizzle=4), 32 * 16),
    (GemmConfig(scheduler="clc", sched_depth=2, **_TWO_CTA), 32 * 32),
], ids=lambda x: x.name() if isinstance(x, GemmConfig) else str(x))
@pytest.mark.parametrize("held", [0, 20])
def test_traced_launch_records_every_tile_once(cfg, tiles, held):
    import torch

    from kernels.compile import device_arch
    from tuner.observe.trace import run

    if device_arch(torch.cuda.current_device()) != cfg.arch:
        pytest.skip(f"needs an {cfg.arch} GPU")
    key = Key(cfg.arch, torch.cuda.get_device_name(), Problem(4000, 4096, 2048, carveout=held))
    trace = run(key, cfg)
    s = summarise(trace)
    assert s["tiles_run"] == slots(key, cfg)
    assert s["tiles_in_problem"] == trace.tiles == tiles
    assert len({(r["tile_m"], r["tile_n"], r["group"]) for r in trace.records}) == len(trace.records)
    assert all(0 <= r["sm"] < trace.sms and 0 <= r["start_ns"] <= r["end_ns"] for r in trace.records)
    # The spinning kernel holds its SMs until the GEMM has finished.
    assert s["sms_used"] <= trace.sms - held
    if cfg.scheduler in ("dynamic_persistent", "clc"):
        # Every tile of a cluster's leader CTA but its first was claimed.
        clusters = len({r["cta"] // cfg.cluster_size for r in trace.records})
        assert s["claims"] == len(trace.records) // cfg.cluster_size - clusters
    else:
        assert s["claims"] == 0


def test_grouped_slots_cover_every_group_and_moe_rows_follow_the_routing():
    cfg = GemmConfig(scheduler="dynamic_persistent", cluster_m=2)
    seed000 = Key("sm90", "GPU", Problem(256, 1024, 4096, groups=3, group_k=(512, 1024, 4096)))
    assert group_rows(seed000, cfg) == [256] * 3 and slots(seed000, cfg) == 2 * 8 * 3
    moe = Key("sm90", "GPU", Problem(1000, 512, 256, groups=8))
    rows = group_rows(moe, cfg)
    assert len(rows) == 8 and sum(rows) == 1000 and len(set(rows)) > 1
    assert slots(moe, cfg) == 8 * 4 * 8


@pytest.mark.gpu
@pytest.mark.parametrize("scheduler", ["static_persistent", "dynamic_persistent"])
@pytest.mark.parametrize("problem", [
    Problem(1024, 4096, 8192, groups=4, group_k=(512, 1024, 4096, 8192)),   # seed 000's form
    Problem(4096, 2048, 1024, groups=16),                                    # MoE
], ids=["seed000", "moe"])
def test_traced_grouped_launch_records_every_tile_once(scheduler, problem):
    import torch

    from tuner.observe.trace import run

    cfg = GemmConfig(scheduler=scheduler, tile_n=256, swizzle=4)
    key = Key("sm90", torch.cuda.get_device_name(), problem)
    trace = run(key, cfg)
    s = summarise(trace)
    assert s["tiles_in_problem"] == trace.tiles
    assert len({(r["tile_m"], r["tile_n"], r["group"]) for r in trace.records}) == len(trace.records)
    assert sorted({r["group"] for r in trace.records}) == [g for g, rows in enumerate(trace.rows) if rows]
    assert (s["claims"] > 0) == (scheduler == "dynamic_persistent")


@pytest.mark.parametrize("args, words", [
    (["--key", "512 1024 1024"], "exactly one of --config NAME and --winner"),
    (["--key", "512 1024 1024", "--config", "sm90-static_persistent-t128x128-c1x1-s4-w1m", "--winner"],
     "exactly one"),
    (["--key", "512 1024", "--config", "sm90-static_persistent-t128x128-c1x1-s4-w1m"], "--key: missing K"),
    (["--key", "512 1024 1024", "--config", "sm90-static-t128"], "--config: 'sm90-static-t128' is not a config name"),
    (["--key", "512 1024 1024", "--config", "sm100-clc-t128x128-c1x1-s4-w1m-d1-g1a1", "--arch", "sm90"],
     "is an sm100 config, not sm90"),
])
def test_trace_command_names_bad_input(tmp_path, args, words):
    proc = subprocess.run([sys.executable, "-m", "tuner.cli", "trace", *args, "-o", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 2 and words in proc.stdout, proc.stdout + proc.stderr


def _sm100_gpu() -> bool:
    import torch

    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] == 10


@pytest.mark.skipif(_sm100_gpu(), reason="an sm100 GPU is here")
def test_trace_command_names_the_gpu_an_sm100_trace_needs(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "tuner.cli", "trace", "--key", "512 1024 1024", "--config",
                           "sm100-clc-t128x128-c1x1-s4-w1m-d1-g1a1", "-o", str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "COLUMNS": "200"})
    assert proc.returncode == 2 and "an sm100 GPU is needed" in proc.stdout, proc.stdout + proc.stderr
