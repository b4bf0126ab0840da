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
from tuner.trace import Trace, slots, summarise, tile_counts, write

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = [
    GemmConfig(scheduler="static_persistent", swizzle=4),
    GemmConfig(scheduler="dynamic_persistent", cluster_m=2),
    GemmConfig(scheduler="single_tile", tile_m=64, split_k=2),
]

# The untraced build, compiled where every device-side trace helper raises:
# with the flag off, building the kernel must not touch them.
_POISONED = """
import hashlib, os, sys
os.environ["CUTE_DSL_ARCH"] = "sm_90a"
import kernels.trace_device as t
def boom(*args, **kw):
    raise AssertionError("trace code reached with the flag off")
t.now = boom
t.TileTrace.create = staticmethod(boom)
from kernels import compile as kc
from kernels.space import GemmConfig
for name in sys.argv[1:]:
    ptx = kc._offline_job(kc.Variant(GemmConfig.from_name(name))).ptx
    print(hashlib.sha256(ptx.encode()).hexdigest())
"""


@pytest.fixture(scope="module")
def builds():
    variants = [kc.Variant(c, trace=t) for c in CONFIGS for t in (False, True)]
    ptx = [r.ptx for r in kc.compile_offline(variants, workers=os.cpu_count() or 1)]
    return {(v.cfg.scheduler, v.trace): p for v, p in zip(variants, ptx)}


def _params(ptx: str) -> int:
    entry = ptx[ptx.index(".entry"):]
    return len(re.findall(r"\.param ", entry[:entry.index(")")]))


def test_untraced_build_emits_no_trace_code(builds):
    proc = subprocess.run([sys.executable, "-c", _POISONED, *(c.name() for c in CONFIGS)], cwd=ROOT,
                          capture_output=True, text=True, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    poisoned = proc.stdout.split()
    for cfg, digest in zip(CONFIGS, poisoned, strict=True):
        untraced = builds[cfg.scheduler, False]
        assert hashlib.sha256(untraced.encode()).hexdigest() == digest
        assert "%globaltimer" not in untraced and "%smid" not in untraced


@pytest.mark.parametrize("cfg", CONFIGS, ids=lambda c: c.scheduler)
def test_traced_build_reads_the_clock_per_tile_and_per_claim(builds, cfg):
    untraced, traced = builds[cfg.scheduler, False], builds[cfg.scheduler, True]
    assert _params(traced) == _params(untraced) + 1   # the record buffer
    assert traced.count("%smid") == 1
    # start and end of every tile; the dynamic scheduler warp times its claims too
    assert traced.count("%globaltimer") == (4 if cfg.scheduler == "dynamic_persistent" else 2)
    assert "wgmma.mma_async" in traced


def test_a_grouped_or_sm100_trace_is_refused_by_name():
    with pytest.raises(ValueError, match="no traced build of grouped sm90"):
        kc.Variant(CONFIGS[0], grouped="rows", trace=True)
    with pytest.raises(ValueError, match="no traced build of sm100"):
        kc.Variant(GemmConfig(arch="sm100", scheduler="clc", tile_m=128), trace=True)


def _record(sm, tile_m, tile_n, start, end, claim=-1, group=0):
    return dict(zip(FIELDS, (sm, sm, tile_m, tile_n, group, start, end, claim)))


def test_summary_and_pictures_of_a_trace(tmp_path):
    key = Key("sm90", "GPU", Problem(200, 256, 1024))  # 2 x 2 tiles of 128 x 128
    cfg = GemmConfig(scheduler="dynamic_persistent")
    assert tile_counts(key, cfg) == (2, 2, 1) and slots(key, cfg) == 4
    records = [_record(0, 0, 0, 0, 4000), _record(0, 1, 1, 5000, 9000, claim=700),
               _record(3, 1, 0, 0, 3000), _record(3, 0, 1, 3000, 6000, claim=900)]
    trace = Trace(key.to_dict(), cfg.name(), "GPU", 4, 4, records)
    s = summarise(trace)
    assert (s["tiles_run"], s["tiles_in_problem"], s["span_us"], s["sms_used"]) == (4, 4, 9.0, 2)
    assert s["per_sm"]["0"] == {"tiles": 2, "busy_us": 8.0, "idle_us": 1.0}
    assert s["per_sm"]["1"] == {"tiles": 0, "busy_us": 0.0, "idle_us": 9.0}
    assert s["idle_us_total"] == 1.0 + 9.0 + 9.0 + 3.0
    assert (s["claims"], s["claim_ns_median"]) == (2, 900)
    files = write(trace, tmp_path)
    assert [f.name for f in files] == ["trace.json", "timeline.png", "tiles_per_sm.png", "sm_idle.png"]
    for f in files[1:]:
        assert f.read_bytes()[:4] == b"\x89PNG"


@pytest.mark.gpu
@pytest.mark.parametrize("cfg", [
    GemmConfig(scheduler="static_persistent", tile_n=256, swizzle=4),
    GemmConfig(scheduler="dynamic_persistent", tile_n=256, cluster_m=2, swizzle=4),
    GemmConfig(scheduler="single_tile", tile_m=64, split_k=2),
], ids=lambda c: c.name())
@pytest.mark.parametrize("held", [0, 20])
def test_traced_launch_records_every_tile_once(cfg, held):
    import torch

    from tuner.trace import run

    key = Key("sm90", torch.cuda.get_device_name(), Problem(4000, 4096, 2048, carveout=held))
    trace = run(key, cfg)
    tm, tn, groups = tile_counts(key, cfg)
    s = summarise(trace)
    assert s["tiles_run"] == slots(key, cfg)
    assert s["tiles_in_problem"] == tm * tn * groups == trace.tiles
    assert len({(r["tile_m"], r["tile_n"], r["group"]) for r in trace.records}) == len(trace.records)
    assert all(0 <= r["sm"] < trace.sms and r["start_ns"] <= r["end_ns"] for r in trace.records)
    # The spinning kernel holds its SMs until the GEMM has finished.
    assert s["sms_used"] <= trace.sms - held
    if cfg.scheduler == "dynamic_persistent":
        clusters = len({r["cta"] // 2 for r in trace.records})
        assert s["claims"] == len(trace.records) // 2 - clusters
    else:
        assert s["claims"] == 0
