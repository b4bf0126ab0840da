"""Mixture-of-experts blocks through the grouped dispatch (`tuner.runtime.experts`)."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from tuner.runtime import dispatch, experts

ROOT = Path(__file__).resolve().parents[1]


def _moe_model(device="cpu", dtype=torch.float32):
    """A small Qwen3-MoE on transformers' grouped experts products."""
    transformers = pytest.importorskip("transformers")
    config = json.loads((ROOT / "bench" / "configs" / "qwen3-30b-a3b.json").read_text())
    config.update(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64, intermediate_size=512,
                  moe_intermediate_size=128, num_experts=8, num_experts_per_tok=2, num_hidden_layers=2,
                  vocab_size=512)
    cfg = transformers.AutoConfig.for_model(**config)
    cfg._experts_implementation = experts.GROUPED
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).eval()


@pytest.fixture(autouse=True)
def quiet():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", dispatch.FallbackWarning)
        yield


def test_the_tuned_experts_forward_computes_what_transformers_grouped_forward_does(monkeypatch):
    model = _moe_model()
    ids = torch.randint(0, 512, (3, 7))
    calls = []

    def gemm(a, b, out=None, *, offs=None):
        calls.append((a.shape[0], tuple(b.shape), offs[-1].item()))
        return torch._grouped_mm(a, b, offs=offs)
    monkeypatch.setattr(dispatch, "gemm", gemm)
    with torch.no_grad():
        want = model(ids, use_cache=False).logits
        assert not calls
        blocks = experts.grouped_blocks(model)
        assert len(blocks) == 2 and experts.register()
        for block in blocks:
            experts.use(block, experts.IMPLEMENTATION)
        got = model(ids, use_cache=False).logits
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    # Two grouped products a block, over top-2 x 21 tokens' rows; b is W.mT.
    rows = 2 * 3 * 7
    assert calls == [(rows, (8, 256, 256), rows), (rows, (8, 128, 256), rows)] * 2
    # Each block was switched on its own: the model's config is untouched.
    assert model.config._experts_implementation == experts.GROUPED


def test_patch_switches_blocks_whose_families_are_tuned_and_unpatch_switches_back(monkeypatch):
    import tuner
    from tuner.runtime.patch import PatchWarning

    model = _moe_model()
    # On the CPU nothing is tuned: the blocks stay on transformers' products.
    assert experts.patch_experts(model) == []
    asked = []

    def tuned(block):
        asked.append(tuple(block.gate_up_proj.shape))
        return True
    monkeypatch.setattr(experts, "_tuned", tuned)  # as if on a GPU, its families tuned
    with pytest.warns(PatchWarning):
        tuner.patch(model)  # no CUDA linear layer: said, the experts still switched
    blocks = experts.grouped_blocks(model)
    assert asked == [(8, 256, 256)] * 2
    assert all(b.config._experts_implementation == experts.IMPLEMENTATION for b in blocks)
    tuner.unpatch(model)
    assert all(b.config._experts_implementation == experts.GROUPED for b in blocks)


def test_blocks_of_another_implementation_are_left_alone():
    model = _moe_model()
    for block in experts.grouped_blocks(model):
        experts.use(block, "eager")
    assert experts.grouped_blocks(model) == []


@pytest.mark.gpu
def test_the_tuned_experts_forward_on_a_pool_kernel_matches_transformers_on_the_gpu(monkeypatch):
    """Both grouped products on a pool kernel (as a map's interval would
    choose it), eager and replayed from a CUDA graph."""
    import kernels.compile as kc
    from kernels.space import GemmConfig

    model = _moe_model("cuda", torch.bfloat16)
    ids = torch.randint(0, 512, (4, 64), device="cuda")
    run = kc.get_kernel(GemmConfig(scheduler="dynamic_persistent"), dtype_in="bf16", dtype_out="bf16", layout="tn",
                        grouped="rows")
    calls = []

    def gemm(a, b, out=None, *, offs=None):
        out = torch.empty(a.shape[0], b.shape[-1], dtype=a.dtype, device=a.device)
        run(a, b.mT, offs, out)  # the runner takes the weights as stored, (E, N, K)
        calls.append(a.shape[0])
        return out
    monkeypatch.setattr(dispatch, "gemm", gemm)
    with torch.no_grad():
        want = model(ids, use_cache=False).logits.float()
        experts.register()
        for block in experts.grouped_blocks(model):
            experts.use(block, experts.IMPLEMENTATION)
        got = model(ids, use_cache=False).logits.float()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            replayed = model(ids, use_cache=False).logits
        graph.replay()
        torch.cuda.synchronize()
    assert calls and set(calls) == {4 * 64 * 2}
    for out in (got, replayed.float()):
        err = (torch.linalg.vector_norm(out - want) / torch.linalg.vector_norm(want)).item()
        assert err < 2e-2
