"""Sibling projections of one input as one product (`tuner.runtime.fusion`)."""

from __future__ import annotations

import copy
import io

import pytest
import torch
from torch import nn

from tuner.runtime import fusion

TINY = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, vocab_size=256)


def _llama():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", **TINY)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def _products(groups):
    """Counts the fused products each group computes."""
    calls = []
    for i, group in enumerate(groups):
        group.linear.register_forward_hook(lambda mod, args, out, i=i: calls.append(i))
    return calls


def test_fused_siblings_compute_what_the_plain_layers_do_with_one_product_a_group():
    model = _llama()
    ids = torch.randint(0, TINY["vocab_size"], (2, 9))
    state = {k: v.clone() for k, v in model.state_dict().items()}
    with torch.no_grad():
        want = model(ids).logits
        groups = fusion.fuse(model, lambda m: True)
        # q, k, v and gate, up of each of the two layers; o, down and lm_head stay apart.
        assert [len(g.layers) for g in groups] == [3, 2, 3, 2]
        assert [tuple(g.linear.weight.shape) for g in groups[:2]] == [(128 + 64 + 64, 128), (2 * 256, 128)]
        assert fusion.sibling_shapes(model) == [("q_proj+k_proj+v_proj", 256, 128), ("gate_proj+up_proj", 512, 128)]
        calls = _products(groups)
        got = model(ids).logits
    torch.testing.assert_close(got, want)
    assert calls == [0, 1, 2, 3]
    with torch.inference_mode():  # its tensors keep no version counter
        torch.testing.assert_close(model(ids).logits, want)
    assert calls == [0, 1, 2, 3] * 2
    # Each weight is its rows of the group's buffer; the state dict is as it was.
    attn = model.model.layers[0].self_attn
    assert attn.k_proj.weight.data_ptr() == groups[0].linear.weight[128:].data_ptr()
    assert model.state_dict().keys() == state.keys()
    for name, value in model.state_dict().items():
        assert torch.equal(value, state[name]), name
    assert type(attn.q_proj) is fusion.FusedSibling and type(attn.o_proj) is nn.Linear
    # Fusing again keeps the groups as they are; unfuse leaves plain layers that compute the same.
    assert fusion.fuse(model, lambda m: True) == groups
    fusion.unfuse(model)
    assert not fusion.groups(model) and type(attn.q_proj) is nn.Linear
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want)


def test_a_sibling_computes_its_own_product_for_another_input_or_under_autograd():
    model = _llama()
    [attn_group, *_] = fusion.fuse(model, lambda m: True)
    attn = model.model.layers[0].self_attn
    calls = _products([attn_group])
    x, y = torch.randn(5, 128), torch.randn(5, 128)
    with torch.no_grad():
        q = attn.q_proj(x)
        k = attn.k_proj(y)  # another input: its own product, the first product still waits
        v = attn.v_proj(x)  # the first product's columns
        x.add_(1.0)  # changed in place since the product: k computes its own
        k2 = attn.k_proj(x)
        q2 = attn.q_proj(x)  # not waiting: a new product
    assert calls == [0, 0]
    torch.testing.assert_close(q, x.sub(1.0) @ attn.q_proj.weight.T)
    torch.testing.assert_close(k, y @ attn.k_proj.weight.T)
    torch.testing.assert_close(v, x.sub(1.0) @ attn.v_proj.weight.T)
    torch.testing.assert_close(k2, x @ attn.k_proj.weight.T)
    torch.testing.assert_close(q2, x @ attn.q_proj.weight.T)
    # Under autograd the gradient reaches the layer's own parameter.
    attn.v_proj(torch.randn(3, 128)).sum().backward()
    assert attn.v_proj.weight.grad is not None and calls == [0, 0]


def test_weights_loaded_write_through_and_a_group_whose_weights_moved_is_left():
    model = _llama()
    fusion.fuse(model, lambda m: True)
    ids = torch.randint(0, TINY["vocab_size"], (1, 5))
    state = model.state_dict()
    state = {k: v * 2 if "q_proj" in k else v for k, v in state.items()}
    model.load_state_dict(state)
    mlp, attn = model.model.layers[1].mlp, model.model.layers[1].self_attn
    assert mlp.gate_proj.tuner_group.intact() and attn.q_proj.tuner_group.intact()
    assert torch.equal(attn.q_proj.tuner_group.linear.weight[:128], state["model.layers.1.self_attn.q_proj.weight"])
    plain = copy.deepcopy(model)
    fusion.unfuse(plain)
    # New parameters (a dtype change) are no view of the buffer: each layer computes its own.
    model.to(torch.float64)
    plain.to(torch.float64)
    assert not attn.q_proj.tuner_group.intact()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, plain(ids).logits)


def test_a_fused_model_pickles_fused_and_deep_copies_apart_until_fused_again():
    """torch.save keeps the views of one storage; copy.deepcopy clones each
    parameter on its own, so the copy's siblings compute apart (correctly)
    until it is fused again."""
    model = _llama()
    fusion.fuse(model, lambda m: True)
    ids = torch.randint(0, TINY["vocab_size"], (1, 5))
    with torch.no_grad():
        want = model(ids).logits
    buf = io.BytesIO()
    torch.save(model, buf)
    buf.seek(0)
    loaded, twin = torch.load(buf, weights_only=False), copy.deepcopy(model)
    assert all(g.intact() for g in fusion.groups(loaded))
    assert not any(g.intact() for g in fusion.groups(twin))
    assert len(fusion.fuse(twin, lambda m: True)) == 4 and all(g.intact() for g in fusion.groups(twin))
    for copied in (loaded, twin):
        assert fusion.groups(copied)[0].linear.weight.data_ptr() != fusion.groups(model)[0].linear.weight.data_ptr()
        with torch.no_grad():
            torch.testing.assert_close(copied(ids).logits, want)


def test_siblings_with_a_bias_each_fuse_their_biases_too():
    """Qwen2's q, k and v have a bias each: the group's product adds them all."""
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(
        transformers.AutoConfig.for_model("qwen2", **TINY)).eval()
    ids = torch.randint(0, TINY["vocab_size"], (2, 7))
    with torch.no_grad():
        want = model(ids).logits
        groups = fusion.fuse(model, lambda m: True)
        assert [g.linear.bias is not None for g in groups] == [True, False, True, False]
        attn = model.model.layers[0].self_attn
        assert attn.v_proj.bias.data_ptr() == groups[0].linear.bias[128 + 64:].data_ptr()
        calls = _products(groups)
        torch.testing.assert_close(model(ids).logits, want)
    assert calls == [0, 1, 2, 3]
    # A bias replaced (not written in place) leaves the group: each layer computes its own.
    attn.k_proj.bias = nn.Parameter(attn.k_proj.bias.detach().clone())
    assert not groups[0].intact()


def test_only_eligible_siblings_of_one_width_and_bias_are_fused():
    class Attn(nn.Module):
        def __init__(self, bias=False, k_width=32):
            super().__init__()
            self.q_proj, self.k_proj = nn.Linear(32, 32, bias=bias), nn.Linear(k_width, 16, bias=False)
            self.v_proj = nn.Linear(32, 16, bias=False)

    model = nn.ModuleList([Attn(), Attn(bias=True), Attn(k_width=64), Attn()])
    model[3].v_proj.weight.requires_grad_(False)
    assert [g.layers[0] for g in fusion.fuse(model, lambda m: m is not model[3].k_proj)] == [model[0].q_proj]


def test_a_compiled_forward_computes_each_sibling_apart():
    model = _llama()
    fusion.fuse(model, lambda m: True)
    layer = model.model.layers[0]
    calls = _products(fusion.groups(model)[:2])
    h = torch.randn(2, 8, TINY["hidden_size"])
    with torch.no_grad():
        pe = model.model.rotary_emb(h, torch.arange(8)[None].expand(2, -1))
        want = layer(h, position_embeddings=pe, attention_mask=None)
        got = torch.compile(layer, fullgraph=True, backend="eager")(h, position_embeddings=pe, attention_mask=None)
    want, got = (t[0] if isinstance(t, tuple) else t for t in (want, got))
    torch.testing.assert_close(got, want)
    assert calls == [0, 1]  # the eager call's products only


def test_siblings_fused_inside_inference_mode_run_outside_it():
    model = _llama()
    ids = torch.randint(0, TINY["vocab_size"], (1, 5))
    with torch.no_grad():
        want = model(ids).logits
    with torch.inference_mode():
        fusion.fuse(model, lambda m: True)
    assert not model.model.layers[0].self_attn.q_proj.weight.is_inference()
    with torch.no_grad():
        torch.testing.assert_close(model(ids).logits, want)
