"""The DRAM floor bench (`bench.roofline`) and the e2e bench's decode output
check (`bench.e2e`): their pure parts, on the CPU."""

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bench import roofline
from bench.e2e import REL_ERR_LIMIT, _batches, _forced, _greedy, _pairs, summarize

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("numel", [1, 100, 4096, 4097, 8192 * 7 + 3, 16384 * 1000, 4096 * 2000 + 5])
@pytest.mark.parametrize("variant", roofline.READ_VARIANTS)
def test_the_read_kernels_grid_reads_every_element_once(numel, variant):
    """Program p reads blocks p, p + programs, ... below the full blocks,
    and the last program the partial block: together every element, once."""
    block, _, per_sm, _ = variant
    programs, full, tail = roofline.read_grid(numel, block, per_sm, sm_count=132)
    assert tail == full * block <= numel < tail + block
    if per_sm:
        assert programs <= per_sm * 132
    else:
        assert programs >= full
    read = [b for p in range(programs) for b in range(p, full, programs)]
    assert sorted(read) == list(range(full))  # the full blocks, each once
    assert programs - 1 >= 0  # the last program exists to read the tail


def test_one_launch_bound_charges_a_whole_launch_where_the_copy_floor_halves_it():
    # H100, Llama 3.1 8B's q/o weight: a 26.9 us copy, 3.93 us a launch.
    assert roofline.one_launch_bound(26.9 / 2, 26.9, 3.93) == pytest.approx(13.45 / 15.415)
    # No launch cost: a kernel at the copy's rate reaches the floor.
    assert roofline.one_launch_bound(50.0, 100.0, 0.0) == 1.0


def test_the_read_variants_have_distinct_names_and_fit_a_thread():
    names = {roofline.variant_name(*v) for v in roofline.READ_VARIANTS}
    assert len(names) == len(roofline.READ_VARIANTS)
    for block, warps, per_sm, evict in roofline.READ_VARIANTS:
        per_thread = block // (32 * warps)
        assert per_thread in (32, 64) and block % (32 * warps) == 0
        assert evict in ("", "evict_first")
        # The persistent programs of an SM fit its 2048 threads at once.
        assert per_sm * warps * 32 <= 2048


def test_the_floor_is_the_faster_of_half_a_copy_and_the_read():
    assert roofline.choose_floor(60.0, 31.0) == (30.0, "copy")
    assert roofline.choose_floor(60.0, 29.0) == (29.0, "read")
    assert roofline.choose_floor(60.0, 30.0) == (30.0, "copy")
    assert roofline.of_floor(30.0, 40.0) == pytest.approx(0.75)
    assert roofline.of_floor(30.0, None) is None


def test_the_kernel_gemm_ran_is_its_config_or_cublas():
    assert roofline.kernel_of(SimpleNamespace(path="kernel", config_name="sm90-x")) == "sm90-x"
    assert roofline.kernel_of(SimpleNamespace(path="torch", config_name="sm90-x")) == "cublas"  # a fallback
    assert roofline.kernel_of(SimpleNamespace(path="torch", config_name=None)) == "cublas"


def _family(name: str, gemm: bool) -> dict:
    points = [{"m": m, "cublas_us": 31.5 + m, "cublas_of_floor": 0.9, "gemm_us": 30.0 + m if gemm else None,
               "gemm_of_floor": 0.95 if gemm else None,
               "kernel": "sm90-dynamic_persistent-t128x128x128-c2x2-s6-w1m-d1-k3-ab-Lbf" if gemm else None}
              for m in (1, 4, 16, 64, 128, 8192)]
    return {"name": name, "weight_mb": 1234.5, "floor_us": 28.4, "floor_from": "copy", "copy_gbps": 2950.0,
            "read_gbps": 3010.0, "launch_us": 2.1, "points": points}


@pytest.mark.parametrize("gemm", [True, False])
def test_the_table_fits_80_columns(gemm):
    record = {"families": [_family("gemma3-27b.gate_up", gemm),
                           _family("a-very-long-model-name-of-many-parts.q_proj+k_proj+v_proj", gemm)]}
    lines = roofline.table(record)
    assert len(lines) == 2 + 2 * 7
    assert all(len(line) <= roofline.TABLE_WIDTH for line in lines), max(lines, key=len)
    assert "gemma3-27b.gate_up" in lines[2] and "copy" in lines[2]
    row = lines[3].split()
    assert row[:3] == ["1", "32.5", "0.900"]
    if gemm:
        assert row[3:5] == ["31.0", "0.950"] and row[5].startswith("dynamic_persistent-t128x128x128")
    else:
        assert len(row) == 3


def test_the_roofline_cli_names_its_options():
    proc = subprocess.run([sys.executable, "-m", "bench.roofline", "--help"], capture_output=True, text=True,
                          cwd=ROOT)
    assert proc.returncode == 0, proc.stderr
    for option in ("--shapes", "--only", "--db", "--m", "--rounds", "--suffix", "--out"):
        assert option in proc.stdout
    assert "1,4,16,64,128" in roofline.__doc__


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="needs Triton (its interpreter runs on the CPU)")
def test_the_read_kernel_sums_every_element_in_the_triton_interpreter():
    script = """
import torch
from bench.roofline import READ_VARIANTS, read_grid, stream_read
torch.manual_seed(0)
for n, k in [(3, 5000), (4, 4096), (5, 16391), (1, 100)]:
    w = torch.randn(n, k).to(torch.bfloat16)
    want = w.abs().sum(dtype=torch.float32).item()
    for v in READ_VARIANTS:
        programs = read_grid(w.numel(), v[0], v[2], 2)[0]
        out = torch.zeros(programs + 3)
        stream_read(w, out, *v, 2)
        assert abs(out.sum().item() - want) <= 1e-5 * want, (n, k, v)
        assert not out[programs:].any()
print("summed")
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, cwd=ROOT, env=env)
    assert proc.returncode == 0 and "summed" in proc.stdout, proc.stderr


# -- bench.e2e: the decode output check ---------------------------------------------------------------


class _Toy:
    """A decode step of a toy model: logits of (the fed token, the step),
    each off by a relative `noise`, which flips the argmax where the top
    two are close, so that free-running greedy runs part."""

    def __init__(self, noise: float, vocab: int = 50, seed: int = 0) -> None:
        self.table = torch.randn(vocab, 64, vocab, generator=torch.Generator().manual_seed(seed))
        self.noise = torch.Generator().manual_seed(seed + 1)
        self.scale = noise
        self.out = None

    def __call__(self, token: torch.Tensor, i: int) -> torch.Tensor:
        logits = self.table[token.squeeze(-1), i]
        logits = logits * (1 + self.scale * torch.randn(logits.shape, generator=self.noise))
        if self.out is None:
            self.out = logits
        self.out.copy_(logits)  # as a graph's replay does, the next call overwrites what this one returned
        return self.out


def test_the_decode_check_compares_logits_of_the_same_tokens():
    first = torch.tensor([[3], [7], [11], [19]])
    reference, patched = _Toy(0.0), _Toy(0.05)
    want, tokens = _greedy(reference, first, 40)
    assert len(want) == len(tokens) == 40 and tokens[0].shape == (4, 1)
    # Free-running, the perturbed greedy run parts from the reference's after a few steps ...
    free, free_tokens = _greedy(patched, first, 40)
    agree_free = torch.cat([a == b for a, b in zip(free_tokens, tokens)]).float().mean().item()
    assert agree_free < 0.6
    free_err = max((f - w).norm().item() / w.norm().item() for f, w in zip(free, want))
    # ... teacher-forced, every step sees the reference's tokens: the error is the perturbation's.
    err, agreement = _forced(_Toy(0.05), first, want, tokens)
    assert err < 0.08 < 0.5 < free_err
    assert 0.0 < agreement < 1.0  # near-ties flip under forcing too: information, not the check
    assert _forced(_Toy(0.0), first, want, tokens) == (0.0, 1.0)


def test_the_decode_check_feeds_the_references_tokens_step_by_step():
    first = torch.tensor([[1]])
    seen = []

    def step(token, i):
        seen.append(int(token))
        return torch.nn.functional.one_hot(torch.tensor([(int(token) * 7 + i) % 10]), 10).float() + 0.5

    want, tokens = _greedy(step, first, 5)
    fed = list(seen)
    seen.clear()
    _forced(step, first, want, tokens)
    assert seen == fed == [1] + [int(t) for t in tokens[:-1]]


def test_the_e2e_takes_no_prefill_or_no_decode_cases():
    assert _pairs("none") == [] and _pairs("") == []
    assert _pairs("1x512,4x1024") == [(1, 512), (4, 1024)]
    assert _batches("1,4,16") == [1, 4, 16] and _batches("none") == []


def test_the_e2e_output_limit_is_unchanged():
    assert REL_ERR_LIMIT == 2e-2
    case = {"batch": 1, "prompt": 128, "steps": 64, "kernel_calls": {"eager": (3, 10), "compiled": (3, 10)}}
    decode = {**case, "eager": {"speedup": 1.01, "log_se": 0.001, "rel_err": 0.019, "token_agreement": 0.9}}
    out = summarize([{"model": "m", "prefill": [], "decode": [decode]}])
    assert out["outputs_within_limit"] and math.isclose(out["max_rel_err"], 0.019)
    decode["eager"]["rel_err"] = 0.021
    assert not summarize([{"model": "m", "prefill": [], "decode": [decode]}])["outputs_within_limit"]


def test_the_e2e_tunes_and_swaps_a_mixture_of_experts_grouped_products():
    from bench.e2e import _Role, shape_file
    from tests.test_experts import _moe_model
    from tuner.runtime import experts
    from tuner.shapes import parse_text

    text = shape_file(["bench/configs/qwen3-30b-a3b.json"], 2, [(1, 512)], [1, 16])
    grouped = {(e.problem.m, e.problem.n, e.problem.k, e.problem.groups) for e in parse_text(text, "e2e")
               if e.problem.groups > 1}
    # The layers' rows (1, 16, 512 tokens) times top-8, over 128 experts.
    assert grouped == {(m * 8, n, k, 128) for m in (1, 16, 512) for n, k in ((1536, 2048), (2048, 768))}
    model = _moe_model()
    blocks = experts.grouped_blocks(model)
    for block in blocks:
        experts.use(block, experts.IMPLEMENTATION)
    role = _Role(model, [], patched=False)
    role.apply()
    assert all(b.config._experts_implementation == experts.GROUPED for b in blocks)
    role.patched = True
    role.apply()
    assert all(b.config._experts_implementation == experts.IMPLEMENTATION for b in blocks)
