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
        want = model(ids).logits
        assert not calls
        blocks = experts.grouped_blocks(model)
        assert len(blocks) == 2 and experts.register()
        for block in blocks:
            experts.use(block, experts.IMPLEMENTATION)
        got = model(ids).logits
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
def test_tuned_experts_on_the_gpu_match_transformers_grouped_products(tmp_path):
    model = _moe_model("cuda", torch.bfloat16)
    ids = torch.randint(0, 512, (4, 64), device="cuda")
    dispatch.configure(str(tmp_path / "t.db"), online=True)  # every M measured on its first call
    try:
        with torch.no_grad():
            want = model(ids).logits.float()
            experts.register()
            for block in experts.grouped_blocks(model):
                experts.use(block, experts.IMPLEMENTATION)
            model(ids)  # first calls tune online
            got = model(ids).logits.float()
    finally:
        dispatch.configure(None)
    err = (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item()
    assert err < 2e-2
