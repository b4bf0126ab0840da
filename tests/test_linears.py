"""Shape files from a model's linear layers (`tuner shapes --from-model`,
`tuner tune --model`): models built from configs by transformers on the meta
device, or named as package.module:attr."""

import collections
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from torch import nn

from tuner.runtime.linears import ModelSourceError, build_model, linear_shapes, shapes_from_model, shipped_models
from tuner.shapes import parse_shapes, parse_text

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[1]
# A small Qwen2 (biased q/k/v, separate gate and up): fast to build and to tune.
SMALL = {"_name_or_path": "small qwen", "model_type": "qwen2", "hidden_size": 512, "intermediate_size": 1024,
         "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 2, "vocab_size": 2048}


def small_model():
    """A module:attr source: a callable returning an nn.Module."""
    return nn.Sequential(nn.Linear(256, 1024), nn.GELU(), nn.Linear(1024, 256), nn.Linear(256, 1024))


def conv_model():
    """A 3-D weight that is no expert's: a convolution (as a Mamba layer has)."""
    return nn.Sequential(nn.Conv1d(256, 256, 4, groups=256), nn.Linear(256, 1024))


def _cli(*args):
    env = {**os.environ, "COLUMNS": "200"}
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args], capture_output=True, text=True, cwd=ROOT,
                          env=env)


def test_shipped_configs_give_every_distinct_linear_as_the_model_runs_it():
    assert shipped_models() == ["gemma-3-27b", "llama-3.1-8b", "qwen2.5-7b"]
    want = {
        # q, k/v (one shape), o, gate/up (one shape), down, lm_head: unfused, as transformers runs them
        "gemma-3-27b": {(4096, 5376), (2048, 5376), (5376, 4096), (21504, 5376), (5376, 21504), (262208, 5376)},
        "llama-3.1-8b": {(4096, 4096), (1024, 4096), (14336, 4096), (4096, 14336), (128256, 4096)},
        "qwen2.5-7b": {(3584, 3584), (512, 3584), (18944, 3584), (3584, 18944), (152064, 3584)},
    }
    for name, shapes in want.items():
        entries = parse_text(shapes_from_model(name, [1, 64]), name)
        assert {(e.problem.n, e.problem.k) for e in entries} == shapes
        assert {e.problem.m for e in entries} == {1, 64}
        assert all(e.problem.dtype_in == "bf16" and e.problem.layout == "tn" for e in entries)
    names = {e.name for e in parse_text(shapes_from_model("llama-3.1-8b", [1]), "-")}
    assert names == {"llama-3.1-8b.q_proj+o_proj", "llama-3.1-8b.k_proj+v_proj", "llama-3.1-8b.gate_proj+up_proj",
                     "llama-3.1-8b.down_proj", "llama-3.1-8b.lm_head"}


def test_a_config_builds_on_the_meta_device_and_truncates():
    model = build_model("gemma-3-27b", num_layers=2)
    assert len(model.model.layers) == 2
    assert all(p.is_meta for p in model.parameters())


def test_a_config_with_one_entry_a_layer_truncates_them_too(tmp_path):
    config = tmp_path / "config.json"
    layer_types = ["sliding_attention", "full_attention"] * 4
    config.write_text(json.dumps({**SMALL, "model_type": "qwen3", "num_hidden_layers": 8, "head_dim": 64,
                                  "layer_types": layer_types, "max_window_layers": 8}))
    model = build_model(config, num_layers=3)
    assert len(model.model.layers) == 3 and model.config.layer_types == layer_types[:3]
    assert len(build_model(config).model.layers) == 8


def test_shapes_from_model_cli_writes_a_shape_file_from_a_config_or_a_module(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    out = tmp_path / "small.txt"
    proc = _cli("shapes", "--from-model", str(config), "--m", "1,16", "-o", str(out))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    entries = parse_shapes(out)
    assert {(e.problem.n, e.problem.k) for e in entries} == {(512, 512), (128, 512), (1024, 512), (512, 1024),
                                                            (2048, 512)}
    assert len(entries) == 10 and entries[0].name == "small_qwen.q_proj+o_proj"
    proc = _cli("shapes", "--from-model", "tests.test_linears:small_model", "--m", "8")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert [line for line in proc.stdout.splitlines() if not line.startswith("#")] == [
        "8 1024 256 dtype=bf16 name=small_model.0+3", "8 256 1024 dtype=bf16 name=small_model.2"]


def test_shapes_no_kernel_takes_are_comments_and_expert_weights_grouped_keys(tmp_path):
    # A Qwen2-MoE: a shared-expert gate of one output (N = 1: no 16-byte
    # output rows) and experts stored as 3-D weights (E, N, K), not nn.Linear.
    config = tmp_path / "moe.json"
    config.write_text(json.dumps({**SMALL, "model_type": "qwen2_moe", "moe_intermediate_size": 256,
                                  "shared_expert_intermediate_size": 512, "num_experts": 4,
                                  "num_experts_per_tok": 2, "num_hidden_layers": 1}))
    text = shapes_from_model(config, [1, 16])
    entries = parse_text(text, "moe.json")
    assert {(e.problem.n, e.problem.k) for e in entries if e.problem.groups == 1} == {(512, 512), (128, 512),
                                                                                      (2048, 512)}
    # The experts: 4 groups, top-2 x tokens rows.
    assert {(e.problem.m, e.problem.n, e.problem.k, e.problem.groups) for e in entries if e.problem.groups > 1} == {
        (2, 512, 512, 4), (32, 512, 512, 4), (2, 512, 256, 4), (32, 512, 256, 4)}
    assert ("# 1,16 1 512 dtype=bf16 name=small_qwen.shared_expert_gate: runs cuBLAS, "
            "N=1 must be a multiple of 8 for a bf16 output") in text.splitlines()
    assert "2,32 512 256 groups=4 dtype=bf16 name=small_qwen.experts.down_proj" in text.splitlines()
    proc = _cli("tune", "--model", str(config), "--m", "16", "--only", "small_qwen.shared*", "--db", str(tmp_path / "t.db"))
    assert proc.returncode == 2 and "no key of" in proc.stdout, proc.stdout + proc.stderr
    assert "not listed" not in shapes_from_model("tests.test_linears:conv_model", [1])


@pytest.mark.parametrize("source, message", [
    ("missing/config.json", "missing/config.json: no such config file, shipped model config (gemma-3-27b, "),
    ("tests.test_linears:nothing", "tests.test_linears:nothing: module 'tests.test_linears' has no attribute"),
    ("tests.test_linears:SMALL", "tests.test_linears:SMALL: is dict, not an nn.Module"),
])
def test_a_bad_model_source_is_a_one_line_error_naming_it(source, message):
    proc = _cli("shapes", "--from-model", source)
    assert proc.returncode == 2
    assert message in proc.stdout and len(proc.stdout.strip().splitlines()) == 1, proc.stdout


def test_a_config_transformers_cannot_build_names_the_file(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model_type": "no-such-model"}))
    with pytest.raises(ModelSourceError, match=rf"{bad}: model_type 'no-such-model' is not one transformers"):
        shapes_from_model(bad, [1])
    bad.write_text("{not json")
    with pytest.raises(ModelSourceError, match=rf"{bad}: not JSON"):
        shapes_from_model(bad, [1])
    # transformers' own validators raise types of their own, over several lines.
    bad.write_text(json.dumps({**SMALL, "model_type": "qwen3", "layer_types": ["full_attention"]}))
    proc = _cli("shapes", "--from-model", str(bad))
    assert proc.returncode == 2 and len(proc.stdout.strip().splitlines()) == 1, proc.stdout
    assert f"{bad}: transformers cannot build it:" in proc.stdout and "layer_types" in proc.stdout
    proc = _cli("shapes", "--from-model", "llama-3.1-8b", "--from-config", str(bad))
    assert proc.returncode == 2 and "give one of --from-config" in proc.stdout


def test_linear_shapes_dedupe_and_keep_module_order():
    shapes = linear_shapes(small_model())
    assert [(s.n, s.k, s.names) for s in shapes] == [(1024, 256, ("0", "3")), (256, 1024, ("2",))]


def test_a_leaf_name_of_two_shapes_is_qualified_by_the_modules_above_it():
    """DeepSeek-V3's dense MLP and its shared experts both have a gate_proj,
    of different widths: each family's name says which."""

    class Mlp(nn.Module):
        def __init__(self, width):
            super().__init__()
            self.gate_proj, self.up_proj = nn.Linear(64, width), nn.Linear(64, width)

    class Moe(nn.Module):
        def __init__(self):
            super().__init__()
            self.shared_experts = Mlp(32)

    layers = nn.ModuleList([nn.ModuleDict({"mlp": Mlp(128)}), nn.ModuleDict({"mlp": Moe()})])
    shapes = linear_shapes(nn.ModuleDict({"layers": layers, "lm_head": nn.Linear(64, 1000)}))
    assert [(s.n, s.names, s.label) for s in shapes] == [
        (128, ("mlp.gate_proj", "mlp.up_proj"), "mlp.gate_proj+up_proj"),
        (32, ("shared_experts.gate_proj", "shared_experts.up_proj"), "shared_experts.gate_proj+up_proj"),
        (1000, ("lm_head",), "lm_head"),
    ]


def test_tune_model_tunes_every_linear_shape_in_one_step(tmp_path):
    config = tmp_path / "config.json"
    config.write_text(json.dumps(SMALL))
    db = tmp_path / "t.db"
    proc = _cli("tune", "--model", str(config), "--m", "16", "--no-ladder", "--trials", "2", "--backend", "model",
                "--db", str(db))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    proc = _cli("show", "--json", "--db", str(db))
    winners = json.loads(proc.stdout)["items"]
    assert {(w["key"]["m"], w["key"]["n"], w["key"]["k"]) for w in winners} == {
        (16, 512, 512), (16, 128, 512), (16, 1024, 512), (16, 512, 1024), (16, 2048, 512)}
    assert _cli("tune", "--db", str(db)).returncode == 2


def test_tune_model_fuse_also_tunes_the_fused_siblings_products(tmp_path):
    """Llama's q, k, v and gate, up: two fused shapes; Qwen2's fused gate
    and up have its lm_head's shape, which the file names once."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**SMALL, "model_type": "llama", "vocab_size": 3000}))
    db = tmp_path / "t.db"
    proc = _cli("tune", "--model", str(config), "--fuse", "--m", "16", "--no-ladder", "--trials", "2",
                "--backend", "model", "--db", str(db))
    assert proc.returncode == 0, proc.stdout + proc.stderr
    winners = json.loads(_cli("show", "--json", "--db", str(db)).stdout)["items"]
    assert {(w["key"]["n"], w["key"]["k"]) for w in winners} >= {(512 + 2 * 128, 512), (2 * 1024, 512)}
    qwen = tmp_path / "qwen.json"
    qwen.write_text(json.dumps(SMALL))
    text = shapes_from_model(qwen, [16], fuse=True)
    assert "16 768 512 dtype=bf16 name=small_qwen.fused.q_proj+k_proj+v_proj" in text.splitlines()
    assert "# fused.gate_proj+up_proj: 2048 512, as lm_head above" in text.splitlines()
    proc = _cli("shapes", "--from-config", str(config), "--fuse")
    assert proc.returncode == 2 and "--fuse goes with --from-model" in proc.stdout


def test_the_e2e_bench_tunes_the_m_its_runs_call():
    from bench.e2e import shape_file

    entries = parse_text(shape_file(["llama-3.1-8b"], 2, [(1, 512), (4, 256)], [1, 16]), "e2e")
    ms = {}
    for e in entries:
        ms.setdefault(e.name, set()).add(e.problem.m)
    assert ms["llama-3.1-8b.lm_head"] == {1, 4, 16}  # the last position's logits: one row per sequence
    assert ms["llama-3.1-8b.down_proj"] == {1, 16, 512, 1024}
    # With fused siblings, their products' shapes too, at the layers' M.
    fused = {e.name: (e.problem.n, e.problem.k) for e in parse_text(
        shape_file(["llama-3.1-8b"], 2, [(1, 512)], [1], fuse=True), "e2e") if ".fused." in e.name}
    assert fused == {"llama-3.1-8b.fused.q_proj+k_proj+v_proj": (6144, 4096),
                     "llama-3.1-8b.fused.gate_proj+up_proj": (28672, 4096)}


def test_the_e2e_speedup_keeps_the_order_effect_out():
    """Whichever variant runs second runs 10 % faster here, and patched is
    truly 1 % faster: the estimate is 1.01, the order effect 10 %, and the
    standard error that of the noise alone, not of the order's two modes."""
    import random

    from tuner.backends.measure import paired_speedup

    rng = random.Random(0)
    pairs = []
    for i in range(400):
        patched_first = i % 2 == 0
        u, p = 1.0, 1 / 1.01
        if patched_first:
            u /= 1.1
        else:
            p /= 1.1
        pairs.append((u * math.exp(rng.gauss(0, 0.005)), p * math.exp(rng.gauss(0, 0.005)), patched_first))
    got = paired_speedup(pairs)
    assert got["speedup"] == pytest.approx(1.01, abs=1e-3)
    assert got["order_effect"] == pytest.approx(math.log(1.1), abs=1e-3)
    assert got["log_se"] < 1e-3 < got["spread"]
    with pytest.raises(ValueError, match="two pairs of each order"):
        paired_speedup(pairs[:1] + pairs[1::2])


@pytest.mark.parametrize("tail", [0.0, 0.08])
def test_the_speedup_standard_error_is_the_trimmed_estimates_own(tail):
    """Over many simulated runs of 100 pairs, the standard error
    `paired_speedup` reports matches how much its estimate really varies,
    with Gaussian noise and with a heavy tail (a share `tail` of the pairs
    off by up to 30 %, as host-timed forwards are): the plain mean's error
    counted the outliers the trimmed mean drops and read 6x too large here."""
    import random
    import statistics

    from tuner.backends.measure import paired_speedup

    rng = random.Random(1)

    def noise() -> float:
        return rng.gauss(0, 0.3) if rng.random() < tail else rng.gauss(0, 0.01)

    estimates, errors = [], []
    for _ in range(300):
        pairs = [(math.exp(noise()), math.exp(noise()) / 1.01, i % 2 == 0) for i in range(100)]
        got = paired_speedup(pairs)
        estimates.append(math.log(got["speedup"]))
        errors.append(got["log_se"])
    assert statistics.mean(estimates) == pytest.approx(math.log(1.01), abs=2e-3)
    assert statistics.mean(errors) == pytest.approx(statistics.stdev(estimates), rel=0.2)


def test_the_e2e_eager_copy_is_patched_as_an_eager_only_user_patches(monkeypatch):
    """`_patch_like(..., compiled=False, pdl=True)`: the checked copy's eager intervals,
    no compiled ones, and a layer the check left none is an nn.Linear."""
    import copy
    import importlib

    from bench.e2e import _patch_like
    from tuner.runtime import dispatch
    from tuner import patch
    from tuner.runtime.lookup import Span

    patch_module = importlib.import_module("tuner.runtime.patch")
    monkeypatch.setattr(patch_module, "_eligible", lambda m: type(m) in (nn.Linear, patch_module.TunedLinear))
    monkeypatch.setattr(dispatch, "kernel_spans", lambda dev, dtype, n, k, overlap=0: ((Span(1, 64, math.inf),), None))
    plain = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)).to(torch.bfloat16)
    checked = patch(copy.deepcopy(plain))
    checked[0].tuner_spans = ((1, 3),)  # as a check leaves them
    checked[1].tuner_spans = ()  # compiled only
    eager = copy.deepcopy(plain)
    _patch_like(eager, checked, graphs=False, compiled=False, pdl=True, fuse=False)
    assert (eager[0].tuner_spans, eager[0].tuner_compiled_spans) == (((1, 3),), ())
    assert eager[0].tuner_pdl
    assert type(eager[1]) is nn.Linear


def test_timed_pairs_run_with_the_garbage_collector_paused_and_restored():
    import gc

    from tuner.backends.measure import gc_paused

    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()  # a caller that had it off keeps it off
    try:
        with pytest.raises(RuntimeError), gc_paused():
            raise RuntimeError
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_the_e2e_swap_gives_the_patched_copys_intervals_to_the_other(monkeypatch):
    """`_swap` (run twice per case) puts each copy in each role, with the
    intervals `patch` and `check` left, and twice is where it started."""
    import copy
    import importlib

    from bench.e2e import _swap
    from tuner.runtime import dispatch
    from tuner import patch
    from tuner.runtime.lookup import Span

    patch_module = importlib.import_module("tuner.runtime.patch")
    monkeypatch.setattr(patch_module, "_eligible", lambda m: type(m) in (nn.Linear, patch_module.TunedLinear))
    monkeypatch.setattr(dispatch, "kernel_spans", lambda dev, dtype, n, k, overlap=0: ((Span(1, 64, math.inf),), None))
    net = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)).to(torch.bfloat16)
    models = {"unpatched": net, "patched": patch(copy.deepcopy(net))}
    first = models["patched"]
    first[0].tuner_spans = ((1, 3),)  # as a check leaves them
    patch_module.unpatch(first[1])
    _swap(models)
    assert models["patched"] is net and models["unpatched"] is first
    assert all(type(m) is nn.Linear for m in first)
    assert (type(net[0]), net[0].tuner_spans, net[0].tuner_compiled_spans) == (
        patch_module.TunedLinear, ((1, 3),), ((1, 64),))
    assert type(net[1]) is nn.Linear
    _swap(models)
    assert models["patched"] is first and first[0].tuner_spans == ((1, 3),) and type(first[1]) is nn.Linear
    assert all(type(m) is nn.Linear for m in net)
    assert not first[0].tuner_graphs
    # A copy patched for CUDA graphs hands its role on as it is.
    models["patched"] = patch(copy.deepcopy(net), graphs=True)
    _swap(models)
    assert models["patched"][0].tuner_graphs and models["patched"][1].tuner_graphs


def test_the_e2e_eager_roles_run_one_model_as_each_variant_and_trade_them(monkeypatch):
    """Eager, one patched model plays both variants: a role's call gives its
    patched layers the variant's class (and no other layer), and `_swap`
    trades the roles' variants, twice back to where they started."""
    import importlib

    from bench.e2e import _roles, _swap
    from tuner.runtime import dispatch
    from tuner import patch
    from tuner.runtime.lookup import Span

    patch_module = importlib.import_module("tuner.runtime.patch")
    TunedLinear = patch_module.TunedLinear
    monkeypatch.setattr(patch_module, "_eligible", lambda m: type(m) in (nn.Linear, TunedLinear))
    monkeypatch.setattr(dispatch, "kernel_spans", lambda dev, dtype, n, k, overlap=0: ((Span(1, 64, math.inf),), None))

    class Net(nn.Sequential):
        def forward(self, x):
            return super().forward(x), [type(m) for m in self]

    net = patch(Net(nn.Linear(8, 16, bias=False), nn.Linear(16, 8, bias=False)).to(torch.bfloat16))
    patch_module.unpatch(net[1])  # as a check leaves a layer whose kernels lost
    x = torch.randn(2, 8, dtype=torch.bfloat16)
    models = _roles(net)
    first = models["patched"]
    assert models["unpatched"](x=x)[1] == [nn.Linear, nn.Linear]
    assert models["patched"](x=x)[1] == [TunedLinear, nn.Linear] and net[0].tuner_spans == ((1, 64),)
    assert torch.equal(models["patched"](x=x)[0], models["unpatched"](x=x)[0])
    _swap(models)
    assert models["unpatched"] is first and not first.patched and models["patched"].patched
    assert type(net[0]) is TunedLinear  # the model is left patched, for the runs after
    _swap(models)
    assert models["patched"] is first and first.patched


def test_the_e2e_fused_baseline_keeps_the_unpatched_copys_siblings_fused_on_cublas(monkeypatch):
    """`--fused-baseline`: whichever copy or role is unpatched computes each
    sibling group as one cuBLAS product; the patched one runs that product
    on its intervals. `_swap` twice is where it started."""
    import copy
    import importlib

    from bench.e2e import _fuse_plain, _roles, _swap
    from tuner.runtime import dispatch, fusion
    from tuner import patch
    from tuner.runtime.lookup import Span

    patch_module = importlib.import_module("tuner.runtime.patch")
    TunedLinear = patch_module.TunedLinear
    monkeypatch.setattr(patch_module, "_eligible", lambda m: type(m) in (nn.Linear, TunedLinear))
    monkeypatch.setattr(dispatch, "kernel_spans", lambda dev, dtype, n, k, overlap=0: ((Span(1, 64, math.inf),), None))

    class Attn(nn.Module):
        def __init__(self):
            super().__init__()
            self.q_proj, self.k_proj, self.v_proj = (nn.Linear(8, w, bias=False) for w in (16, 8, 8))

    def state(model):
        """(sibling classes, the group's product class or None)."""
        [group] = fusion.groups(model) or [None]
        return [type(m) for m in model.children()], group and type(group.linear)

    net = Attn().to(torch.bfloat16)
    base, tuned = copy.deepcopy(net), patch(copy.deepcopy(net), fuse=True)
    _fuse_plain(base)
    fused = [fusion.FusedSibling] * 3
    assert state(base) == (fused, nn.Linear) and state(tuned) == (fused, TunedLinear)
    models = {"unpatched": base, "patched": tuned}
    _swap(models)
    assert models["patched"] is base and state(base) == (fused, TunedLinear)
    assert models["unpatched"] is tuned and state(tuned) == (fused, nn.Linear)
    _swap(models)
    assert models["patched"] is tuned and state(tuned) == (fused, TunedLinear) and state(base) == (fused, nn.Linear)
    roles = _roles(tuned, fused_baseline=True)
    roles["unpatched"].apply()
    assert state(tuned) == (fused, nn.Linear)
    roles["patched"].apply()
    assert state(tuned) == (fused, TunedLinear)
    _roles(tuned)["unpatched"].apply()  # the plain baseline: the siblings apart
    assert state(tuned)[0] == [nn.Linear] * 3


def test_patch_overhead_wraps_the_bias_free_layers_out_of_every_call_and_back():
    from bench.probes.patch_overhead import _set
    from tuner.runtime.patch import TunedLinear

    net = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Linear(16, 8), nn.Linear(8, 4, bias=False))
    x = torch.randn(3, 8)
    want = net(x)
    assert _set(net, "tuned") == 2
    assert [type(m) for m in net] == [TunedLinear, nn.Linear, TunedLinear]
    assert torch.equal(net(x), want)  # every call outside the intervals: F.linear
    assert _set(net, "plain") == 0 and all(type(m) is nn.Linear for m in net)


def test_linear_calls_variants_compute_what_nn_linear_does_and_the_timers_come_off():
    """bench.probes.linear_calls compares classes of the same layer: each must make
    the same product, and its per-type timers must leave every call as it was."""
    from bench.probes.linear_calls import VARIANTS, _per_type
    from tuner.runtime.patch import TunedLinear

    layer = nn.Linear(8, 16)
    layer.__class__ = TunedLinear
    layer.tuner_launchers, layer.tuner_compiled_spans, layer.tuner_spans = {}, (), ((4096, 4096),)
    x = torch.randn(3, 8)
    want = nn.functional.linear(x, layer.weight, layer.bias)
    calls = {cls: cls.__dict__["__call__"] for cls in (nn.Module, *VARIANTS.values()) if "__call__" in cls.__dict__}
    with torch.no_grad():
        for cls in VARIANTS.values():
            layer.__class__ = cls
            assert torch.equal(layer(x), want), cls
            acc = collections.defaultdict(int)
            with _per_type(acc):
                assert torch.equal(layer(x), want)
            assert set(acc) == {"linear"} and acc["linear"] > 0, cls
    assert calls == {cls: cls.__dict__["__call__"] for cls in calls}


def test_the_e2e_speed_counts_the_halves_disagreement_as_noise():
    from bench.e2e import _speed

    def half(ratio):  # (unpatched s, patched s, patched first), both orders, a little spread
        return [(ratio * (1 + e), 1.0, first) for first in (True, False) for e in (-1e-4, 0.0, 1e-4)]

    agree = _speed([half(1.01), half(1.01)], per_s=100)
    assert agree["speedup"] == pytest.approx(1.01) and agree["log_se"] < 1e-4
    apart = _speed([half(1.00), half(1.02)], per_s=100)
    assert apart["halves"] == [pytest.approx(1.0), pytest.approx(1.02)]
    assert apart["log_se"] == pytest.approx(math.log(1.02) / 2)
    assert apart["tokens_per_s"]["patched"] == pytest.approx(100)


def test_the_e2e_summary_calls_a_case_slower_only_past_its_noise():
    from bench.e2e import summarize

    def mode(speedup, log_se, err=1e-2):
        return {"speedup": speedup, "log_se": log_se, "rel_err": err}

    models = [{"model": "m", "prefill": [{"batch": 1, "seq": 512, "kernel_calls": {"eager": [0, 15], "compiled": [2, 15]},
                                          "eager": mode(0.996, 0.003), "compiled": mode(1.02, 0.004)}],
               "decode": [{"batch": 16, "kernel_calls": {"eager": [1, 15], "compiled": [1, 15]},
                           "eager": mode(0.99, 0.004, 3e-2), "compiled": mode(1.0, 0.0)}]}]
    s = summarize(models)
    assert s["cases"] == 4 and s["min_speedup"] == 0.99
    assert s["geomean_speedup"] == pytest.approx((0.996 * 1.02 * 0.99) ** 0.25)
    # 0.996 is 1.3 se below 1.0 and 0.99 is 2.5 se below: only the second is slower.
    assert s["slower_beyond_2se"] == ["m decode 16 eager"]
    assert s["without_kernel_calls"] == ["m prefill 1x512 eager"]
    assert s["max_rel_err"] == 3e-2 and s["outputs_within_limit"] is False


@pytest.mark.parametrize("args, message", [
    (["--prefill", "1x512,4x1024", "--kernel", "8x8=sm90-static_persistent-t128x128-c1x1-s4-w4m"],
     "--prefill takes one batch x seq"),
    (["--prefill", "1x512", "--kernel", "8x8=sm90-bogus"], "'8x8=sm90-bogus': expected NxK=CONFIG_NAME"),
    (["--prefill", "1x512", "--kernel", "eightxeight=sm90-static_persistent-t128x128-c1x1-s4-w4m"],
     "expected NxK=CONFIG_NAME"),
])
def test_the_e2e_profile_names_bad_arguments(args, message):
    proc = subprocess.run([sys.executable, "-m", "bench.probes.e2e_profile", "--model", "gemma-3-27b", *args],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


@pytest.mark.parametrize("prefill, message", [
    ("abc", "argument --prefill: invalid _pairs value: 'abc'"),
    ("1x512,4x1024", "--prefill takes one batch x seq"),
])
def test_patch_overhead_names_a_bad_prefill(prefill, message):
    proc = subprocess.run([sys.executable, "-m", "bench.probes.patch_overhead", "--prefill", prefill],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_the_e2e_check_workload_runs_as_often_as_a_check_asks(monkeypatch):
    """Its decode steps go into static caches of one position past the
    prompt: run again and again (a check runs it 60 times and more), each
    step must start from an empty cache, or the cache runs past its length."""
    import argparse

    import bench.e2e as e2e

    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(e2e, "DEVICE", "cpu")
    config = transformers.AutoConfig.for_model(
        "llama", hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, head_dim=32, vocab_size=100)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    args = argparse.Namespace(prefill=[(1, 4)], decode=[2], prompt=4)
    run = e2e._workload(model, args)
    with torch.no_grad():
        for _ in range(3 * (args.prompt + 1)):
            run()


def test_the_e2e_counts_a_strided_lm_head_call_only_where_it_is_gathered():
    from types import SimpleNamespace

    from bench.e2e import _kernel_calls

    def layer(spans, gathered):
        return SimpleNamespace(tuner_spans=spans, tuner_compiled_spans=spans, tuner_gathers=gathered.__contains__)

    layers = {"model.layers.0.mlp.down_proj": layer(((1, 8),), set()), "lm_head": layer(((1, 8),), {4})}
    assert _kernel_calls(layers, 3, 4, 4, head_strided=False)["eager"] == (2, 3)
    assert _kernel_calls(layers, 3, 4, 4, head_strided=True)["eager"] == (2, 3)
    # Six strided rows are not gathered: lm_head runs F.linear.
    assert _kernel_calls(layers, 3, 6, 6, head_strided=True) == {"eager": (1, 3), "compiled": (1, 3)}
    assert _kernel_calls(layers, 3, 6, 6, head_strided=False)["compiled"] == (2, 3)
