"""`bench.overlap`'s pure parts on the CPU: the tensor-parallel shards, the
candidates and the verdicts (the timing itself needs GPUs and NCCL)."""

import math

import pytest

from bench.overlap import _point, candidates, summarize, tp_gemms
from tuner.config_shapes import DecoderShape
from tuner.key import Key, Problem
from tuner.runtime.linears import config_path, load_config


def _shape(model: str) -> DecoderShape:
    return DecoderShape.from_config(load_config(config_path(model)))


def test_column_parallel_projections_shard_n_and_row_parallel_ones_k():
    assert tp_gemms(_shape("gemma-3-27b"), 2) == [
        ("qkv", 4096, 5376), ("o", 5376, 2048), ("gate_up", 21504, 5376), ("down", 5376, 10752)]
    assert tp_gemms(_shape("llama-3.1-8b"), 4) == [
        ("qkv", 1536, 4096), ("o", 4096, 1024), ("gate_up", 7168, 4096), ("down", 4096, 3584)]
    with pytest.raises(ValueError, match="qkv .* does not shard into 3 equal parts along N"):
        tp_gemms(_shape("gemma-3-27b"), 3)


def test_persistent_picks_also_run_on_sm_budgets_that_leave_sms_to_nccl():
    # The model's picks at M = 128: single-tile and static persistent ones.
    key = Key("sm90", "NVIDIA H100 80GB HBM3", Problem(128, 5376, 2688))
    cfgs = candidates(key, 3, [16, 32], sms=132)
    plain = [c for c in cfgs if not c.sm_budget]
    assert len(plain) == 3 and len(cfgs) == len(set(cfgs))
    assert {c.persistent for c in plain} == {True, False}
    for c in plain:
        budgets = sorted(b.sm_budget for b in cfgs if b.sm_budget and b.to_dict() | {"sm_budget": 0} == c.to_dict())
        assert budgets == ([100, 116] if c.persistent else [])


def test_the_verdicts_compare_makespans_and_name_the_free_gpu_winner():
    def cand(alone, span):
        return {"ms_alone": alone, "ms_beside": alone, "allreduce_ms_beside": 0.1, "makespan_ms": span}
    point = _point({"candidates": {"cublas": cand(1.0, 1.2), "a": cand(0.8, 1.1), "a-sm116": cand(0.85, 0.96)}})
    assert point["best"] == "a-sm116" and point["makespan_speedup"] == 1.25
    assert point["free_best"] == "a" and point["free_best_makespan_speedup"] == round(1.2 / 1.1, 4)
    other = _point({"candidates": {"cublas": cand(1.0, 1.0), "b": cand(0.9, 0.8)}})
    summary = summarize([point, other])
    assert summary["makespan_speedup"] == {"geomean": round(math.sqrt(1.25 * 1.25), 4), "min": 1.25}
    assert summary["best_differs_from_free_best"] == 1 and summary["points"] == 2
