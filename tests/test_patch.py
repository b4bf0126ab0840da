"""`tuner.patch(model)`: a model's linear layers through the tuned dispatch."""

import copy
import importlib
import io
import math
import random
import warnings

import pytest
import torch
from torch import nn

from db.store import Store
from kernels import space
from tuner import check, patched, unpatch
from tuner.runtime import dispatch, fusion
from tuner import patch
from tuner.backends.gpu_worker import versions
from tuner.key import Key, Problem
from tuner.runtime.lookup import Span, kernel_spans

patch_module = importlib.import_module("tuner.runtime.patch")
TunedLinear, PatchWarning = patch_module.TunedLinear, patch_module.PatchWarning


class _OwnLinear(nn.Linear):
    """A subclass with its own forward: patch must leave it alone."""

    def forward(self, x):
        return super().forward(x) * 2


def _net(device="cpu", dtype=torch.bfloat16):
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 128), nn.LayerNorm(128), nn.Linear(128, 32, bias=False), _OwnLinear(32, 32),
    ).to(device, dtype)


@pytest.fixture
def spy(monkeypatch):
    """Patch layers of CPU weights as if they were CUDA ones, with the kernel
    spans given, and count the calls that reach `gemm`."""
    calls = []
    spans = {}

    def gemm(a, b, out=None, *, offs=None):
        # The overlap hint in effect joins the call only where there is one
        # (compiled graphs, which TorchDynamo traces here, carry none).
        beside = 0 if torch.compiler.is_compiling() else dispatch._OVERLAP.get()
        calls.append((a.shape[0], b.shape[1], beside) if beside else (a.shape[0], b.shape[1]))
        return torch.mm(a, b)

    def kernel_spans(dev, dtype, n, k, overlap=0):
        # (lo, hi) spans save more than any host cost; (lo, hi, us) say how much.
        found = spans.get((n, k, overlap) if overlap else (n, k), ())
        return tuple(Span(*s) if len(s) == 3 else Span(*s, math.inf) for s in found), None

    monkeypatch.setattr(patch_module, "_eligible", lambda m: type(m) in (nn.Linear, TunedLinear))
    monkeypatch.setattr(dispatch, "kernel_spans", kernel_spans)
    monkeypatch.setattr(dispatch, "gemm", gemm)
    monkeypatch.setattr(patch_module, "_host_costs", {})
    monkeypatch.setattr(patch_module, "_measure_host_costs", lambda layer, m: (0.0, 0.0))
    monkeypatch.setattr(patch_module, "_gather_costs", {})
    monkeypatch.setattr(patch_module, "_measure_gather_cost", lambda device, dtype: 0.0)
    return calls, spans


# ---------------------------------------------------------------- CPU


def test_a_model_without_cuda_tensors_is_left_as_it_is_with_a_warning():
    net = _net()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    want = net(x)
    with pytest.warns(PatchWarning, match=r"no nn.Linear .* bf16/fp16 CUDA weight \(bfloat16 on cpu\)"):
        assert patch(net) is net
    assert [type(m) for m in net] == [nn.Linear, nn.LayerNorm, nn.Linear, _OwnLinear]
    assert torch.equal(net(x), want)
    with pytest.warns(PatchWarning, match="it has no nn.Linear"):
        patch(nn.Sequential(nn.ReLU()))


def test_a_layer_turns_calls_away_by_bounds_that_follow_its_intervals(spy):
    calls, spans = spy
    spans[(128, 64)] = ((4, 8),)
    net = _net()
    patch(net, bias=True)
    layer = net[0]
    with torch.no_grad():
        for m in (3, 4, 9):
            layer(torch.randn(m, 64, dtype=torch.bfloat16))
        assert calls == [(4, 128)]
        layer.tuner_compiled_spans = ()
        layer.tuner_spans = ((16, 32),)  # as check or a bench leaves them
        layer(torch.randn(4, 64, dtype=torch.bfloat16))
        layer(torch.randn(20, 64, dtype=torch.bfloat16))
    assert calls == [(4, 128), (20, 128)]
    unpatch(net)
    assert type(layer) is nn.Linear and not hasattr(layer, "tuner_spans")
    left = {"_tuner_spans", "_tuner_compiled_spans", "_tuner_bounds", "_tuner_eager", "tuner_launchers"}
    assert not left & set(vars(layer))


def test_a_call_outside_the_intervals_is_the_plain_linear_of_the_layers_current_weight(spy):
    calls, spans = spy
    spans[(128, 64)] = ((4, 8),)
    layer = patch(_net(), bias=True)[0]
    layer.weight = nn.Parameter(torch.randn(128, 64, dtype=torch.bfloat16))  # reassigned after patching
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    want = torch.nn.functional.linear(x, layer.weight, layer.bias)
    with torch.no_grad():
        assert torch.equal(layer(x), want)
        assert torch.equal(torch.compile(layer, backend="eager", fullgraph=True)(x), want)
        with pytest.raises(RuntimeError, match="cannot be multiplied"):
            layer(torch.randn(2, 128, dtype=torch.bfloat16))  # numel / 64 = 4: inside, but the wrong width
    assert calls == []


def test_patch_swaps_only_plain_linears_and_unpatch_restores_them(spy):
    _, spans = spy
    spans.update({(128, 64): ((1, 8),), (32, 128): ((1, 8),), (32, 32): ((1, 8),)})
    net = _net()
    params = {name: p for name, p in net.named_parameters()}
    seen = []
    net[0].register_forward_hook(lambda mod, inp, out: seen.append(out.shape))
    patch(net, bias=True)
    assert [type(m) for m in net] == [TunedLinear, nn.LayerNorm, TunedLinear, _OwnLinear]
    assert isinstance(net[0], nn.Linear)
    # Same parameters (the very tensors), same state dict names, hooks kept.
    assert all(p is params[name] for name, p in net.named_parameters())
    net(torch.randn(3, 64, dtype=torch.bfloat16))
    assert seen == [torch.Size([3, 128])]
    unpatch(net)
    assert [type(m) for m in net] == [nn.Linear, nn.LayerNorm, nn.Linear, _OwnLinear]
    assert not hasattr(net[0], "tuner_spans") and "tuner_spans" not in net[0].__dict__


class _Attention(nn.Module):
    """q, k and v of one input, then o: the siblings `patch(fuse=True)` fuses."""

    def __init__(self):
        super().__init__()
        self.q_proj = nn.Linear(64, 64, bias=False)
        self.k_proj, self.v_proj = nn.Linear(64, 32, bias=False), nn.Linear(64, 32, bias=False)
        self.o_proj = nn.Linear(128, 64, bias=False)

    def forward(self, x):
        return self.o_proj(torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], -1))


def test_fused_siblings_run_one_product_on_the_fused_shapes_map_and_unpatch_unfuses(spy):
    from tuner.runtime import fusion

    calls, spans = spy
    spans.update({(128, 64): ((1, 8),), (64, 32): ((1, 8),)})
    torch.manual_seed(0)
    block = _Attention().to(torch.bfloat16)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = block(x)
        patch(block, fuse=True)
        [group] = fusion.groups(block)
        assert type(group.linear) is TunedLinear and type(block.q_proj) is fusion.FusedSibling
        # o_proj's shape has no interval: a plain layer; the siblings' own shapes are not looked up.
        assert type(block.o_proj) is nn.Linear
        got = block(x)
        assert calls == [(3, 128)]
        torch.testing.assert_close(got, want)
        # Outside the fused shape's intervals the group's product is F.linear's.
        block(torch.randn(9, 64, dtype=torch.bfloat16))
        assert calls == [(3, 128)]
        patch(block)  # without fuse: apart again
        assert not fusion.groups(block) and type(block.q_proj) is nn.Linear
        patch(block, fuse=True)
        unpatch(block)
    assert not fusion.groups(block) and all(type(m) is nn.Linear for m in block.children())
    with torch.no_grad():
        torch.testing.assert_close(block(x), want)


def test_a_plain_call_skips_the_module_call_and_any_hook_or_tracer_takes_it(spy, monkeypatch):
    """A patched call with nothing to honour goes straight to forward; hooks
    (the layer's or global) and the JIT tracer still see nn.Module's call."""
    calls, spans = spy
    spans[(128, 64)] = ((1, 8),)
    net = patch(_net(), bias=True)
    layer = net[0]
    module_calls = []
    call_impl = nn.Module._call_impl

    def counted(self, *args, **kwargs):
        module_calls.append(self)
        return call_impl(self, *args, **kwargs)

    monkeypatch.setattr(nn.Module, "_call_impl", counted)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = layer(x)
        assert module_calls == [] and calls == [(3, 128)]
        layer.register_forward_pre_hook(lambda mod, args: (args[0] * 2,))
        assert torch.allclose(layer(x), nn.functional.linear(x * 2, layer.weight, layer.bias), rtol=2e-2, atol=2e-2)
        assert module_calls == [layer]
        layer._forward_pre_hooks.clear()
        seen = []
        handle = nn.modules.module.register_module_forward_hook(lambda mod, inp, out: seen.append(type(mod)))
        try:
            net(x)
        finally:
            handle.remove()
        assert seen == [TunedLinear, nn.LayerNorm, nn.Linear, _OwnLinear, nn.Sequential]
        module_calls.clear()
        traced = torch.jit.trace(layer, (x,), check_trace=False)
        assert module_calls == [layer] and torch.equal(traced(x), want)


def test_a_plain_call_runs_f_linear_from_its_own_frame_outside_the_intervals(spy, monkeypatch):
    """Outside the bounds, and inside them at a size forward found in no
    eager interval, a plain call runs F.linear without entering forward;
    a size inside an interval, or one not seen yet, goes to forward."""
    calls, spans = spy
    spans[(128, 64)] = ((2, 2), (32, 64))
    net = patch(_net(), bias=True)
    layer = net[0]
    forwards = []
    forward = TunedLinear.forward
    monkeypatch.setattr(TunedLinear, "forward", lambda self, input: (forwards.append(input.shape[0]), forward(self, input))[1])
    with torch.no_grad():
        for m in (1, 16, 16, 40, 40, 100):
            x = torch.randn(m, 64, dtype=torch.bfloat16)
            assert torch.allclose(layer(x), nn.functional.linear(x, layer.weight, layer.bias), rtol=2e-2, atol=2e-2)
    assert forwards == [16, 40, 40]  # 1 and 100: out of bounds; 16: no interval, known after its first call
    assert calls == [(40, 128), (40, 128)]


def test_a_layer_patched_beside_an_all_reduce_takes_that_maps_spans_and_keys(spy):
    calls, spans = spy
    net = _net()
    spans[(128, 64)] = ((100, 200),)            # the plain map: not at M = 4
    spans[(128, 64, 1 << 20)] = ((2, 8),)       # the map tuned beside the all-reduce
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad(), patched(net, bias=True, overlap=1 << 20):
        got = net(x)
        assert not net[0].tuner_compiled_spans  # compiled graphs cannot carry the hint
    with torch.no_grad():
        torch.testing.assert_close(got, net(x), rtol=2e-2, atol=2e-2)
    assert calls == [(4, 128, 1 << 20)]


def test_only_m_inside_the_kernel_spans_goes_to_gemm_and_outputs_match(spy):
    calls, spans = spy
    net = _net()
    spans[(128, 64)] = ((2, 8), (100, 200))
    x = torch.randn(5, 3, 64, dtype=torch.bfloat16)  # M = 15: outside
    want = net(x)
    with torch.no_grad(), patched(net, bias=True):
        assert torch.equal(net(x), want) and calls == []
        x2 = x[:2, :2].contiguous()  # M = 4: inside, with a bias to add after
        got = net(x2)
    assert calls == [(4, 128)]
    assert got.shape == (2, 2, 32)
    torch.testing.assert_close(got, net(x2), rtol=2e-2, atol=2e-2)
    assert type(net[0]) is nn.Linear  # the context restored it


def test_autograd_runs_f_linear(spy):
    calls, spans = spy
    net = _net()
    spans[(128, 64)] = ((1, 1 << 20),)
    patch(net, bias=True)
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    net(x).float().sum().backward()  # grad enabled and weights that need it: F.linear
    assert calls == [] and net[0].weight.grad is not None
    with torch.no_grad():
        net(x)
    assert calls == [(4, 128)]


def test_strided_rows_are_gathered_only_where_the_saving_covers_the_copy(spy, monkeypatch):
    calls, spans = spy
    monkeypatch.setattr(patch_module, "_measure_host_costs", lambda layer, m: (10.0, 7.5))
    monkeypatch.setattr(patch_module, "_measure_gather_cost", lambda device, dtype: 15.0)
    spans[(128, 64)] = ((1, 3, 40.0), (4, 8, 50.0), (9, 16, 44.0), (17, 1 << 20, 1e6))
    net = _net()
    patch(net, bias=True)
    # The slower host cost (compiled: 7.5 us in a loop, 30 inside a forward)
    # and the copy (15 us) are covered from 45 us.
    assert net[0].tuner_gather == ((4, 8), (17, 1 << 20))
    with torch.no_grad():
        seqs = torch.randn(20, 3, 64, dtype=torch.bfloat16)
        for m in (2, 6, 12):
            last = seqs[:m, -1]  # rows 3 x 64 apart: the logits' input
            unpatch(net)
            want = net(last)
            patch(net, bias=True)
            torch.testing.assert_close(net(last), want, rtol=2e-2, atol=2e-2)
        assert calls == [(6, 128)]  # M = 2 and 12 save too little to gather
        big = torch.randn(4 * 1024, 3, 64, dtype=torch.bfloat16)[:, -1]  # 512 KiB of rows: too big a copy
        assert big.numel() * big.element_size() > patch_module._GATHER_MAX_BYTES
        net(big)
        assert calls == [(6, 128)]
        net(seqs[:, -1].contiguous())  # contiguous rows never need the copy
    assert calls == [(6, 128), (20, 128)]
    unpatch(net)
    assert "tuner_gather" not in vars(net[0])


def test_layers_with_a_bias_are_left_to_cublas_unless_asked(spy):
    calls, spans = spy
    spans.update({(128, 64): ((1, 8),), (32, 128): ((1, 8),)})
    net = _net()
    patch(net)
    assert [type(m) for m in net][:3] == [nn.Linear, nn.LayerNorm, TunedLinear]  # net[0] has a bias
    patch(net, bias=True)
    assert type(net[0]) is TunedLinear
    patch(net)  # and a later patch without it gives it back to cuBLAS
    assert type(net[0]) is nn.Linear


def test_a_layer_without_kernel_spans_stays_a_plain_linear(spy):
    _, spans = spy
    net = _net()
    spans[(128, 64)] = ((1, 8),)
    patch(net, bias=True)
    assert [type(m) for m in net][:3] == [TunedLinear, nn.LayerNorm, nn.Linear]
    spans.clear()  # retuned: cuBLAS everywhere; patching again reads that
    patch(net, bias=True)
    assert type(net[0]) is nn.Linear and "tuner_spans" not in net[0].__dict__


@pytest.mark.parametrize("lead", [(), (1,)], ids=["rows", "batch-seq"])
def test_a_kernel_runner_is_kept_per_m_and_used_for_aligned_inputs(spy, monkeypatch, lead):
    calls, spans = spy
    launched = []

    def runner(a, stored, out):  # the weight as stored, (N, K), and an output to fill
        launched.append((a.shape, stored.shape, out.shape))
        torch.mm(a, stored.t(), out=out)

    kept = dispatch._Launch(runner, tn=True)
    monkeypatch.setattr(dispatch, "launcher", lambda a, b: kept if a.shape[0] == 2 else None)
    net = _net()
    spans[(128, 64)] = ((1, 8),)
    x = torch.randn(*lead, 2, 64, dtype=torch.bfloat16)
    with torch.no_grad(), patched(net, bias=True):
        first = net(x)  # gemm decides; the layer keeps the runner
        again = net(x)
        net(torch.randn(2 * 64 + 1, dtype=torch.bfloat16)[1:].view(2, 64))  # 2-byte offset: not aligned
        net(torch.randn(3, 64, dtype=torch.bfloat16))  # another M: no runner kept for it
        assert net[0].tuner_launchers == {2: runner}
    assert calls == [(2, 128), (2, 128), (3, 128)] and launched == [((2, 64), (128, 64), (2, 128))]
    assert torch.equal(first, again) and again.shape == (*x.shape[:-1], 32)


def test_a_patched_model_copies_and_pickles_without_its_kept_runners(spy):
    """Kept runners hold compiled code that cannot be copied: a deepcopy or a
    torch.save of a patched model that has run kernels starts without them."""

    class Runner:  # as uncopyable as a compiled kernel
        def __call__(self, x, w, y):
            torch.mm(x, w.t(), out=y)

        def __reduce_ex__(self, protocol):
            raise TypeError("cannot pickle 'Module' object")

    calls, spans = spy
    spans[(128, 64)] = ((1, 8),)
    net = patch(_net(), bias=True)
    net[0].tuner_launchers[4] = Runner()
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        want = net(x)
    twin = copy.deepcopy(net)
    buf = io.BytesIO()
    torch.save(net, buf)
    buf.seek(0)
    loaded = torch.load(buf, weights_only=False)
    for other in (twin, loaded):
        assert type(other[0]) is TunedLinear and other[0].tuner_launchers == {}
        assert other[0].tuner_spans == net[0].tuner_spans and other[0].weight is not net[0].weight
        with torch.no_grad():
            assert torch.equal(other(x), want)
    assert list(net[0].tuner_launchers) == [4]  # the original keeps its own


def test_a_launch_of_another_layout_is_not_kept(spy, monkeypatch):
    """A runner takes B as stored: only a "tn" one takes the weight itself."""
    calls, spans = spy
    monkeypatch.setattr(dispatch, "launcher", lambda a, b: dispatch._Launch(lambda *args: None, tn=False))
    net = _net()
    spans[(128, 64)] = ((1, 8),)
    with torch.no_grad(), patched(net, bias=True):
        net(torch.randn(2, 64, dtype=torch.bfloat16))
        net(torch.randn(2, 64, dtype=torch.bfloat16))
        assert net[0].tuner_launchers == {}
    assert calls == [(2, 128), (2, 128)]


def test_traced_calls_take_the_compiled_spans_and_eager_calls_the_eager_ones(spy):
    calls, spans = spy
    net = _net()
    spans[(128, 64)] = ((1, 16),)
    patch(net, bias=True)
    net[0].tuner_spans = ()  # as `check` leaves a layer whose forwards did not win
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    with torch.no_grad():
        net(x)
        assert calls == []
        torch.compile(net[0], backend="eager", fullgraph=True)(x)
    assert calls == [(4, 128)]


def test_a_model_patched_for_eager_only_keeps_no_compiled_interval(spy, monkeypatch):
    """`compiled=False`: a layer whose kernels would pay only in compiled
    graphs stays an nn.Linear; the others keep their eager intervals alone."""
    calls, spans = spy
    monkeypatch.setattr(patch_module, "_measure_host_costs", lambda layer, m: (30.0, 2.5))
    spans[(128, 64)] = ((1, 8, 50.0), (9, 16, 20.0))
    spans[(32, 128)] = ((1, 8, 20.0),)
    net = patch(_net(), bias=True)
    assert (net[0].tuner_spans, net[0].tuner_compiled_spans) == (((1, 8),), ((1, 8), (9, 16)))
    assert type(net[2]) is TunedLinear and net[2].tuner_spans == ()
    with patched(_net(), bias=True, compiled=False) as eager:
        assert (eager[0].tuner_spans, eager[0].tuner_compiled_spans) == (((1, 8),), ())
        assert type(eager[2]) is nn.Linear
        x = torch.randn(12, 64, dtype=torch.bfloat16)
        with torch.no_grad():
            torch.compile(eager[0], backend="eager", fullgraph=True)(x)
    assert calls == []


def test_a_symbolic_size_takes_the_eager_intervals_without_a_lookup(spy):
    """Non-strict export runs the eager forward with a symbolic M: no
    dictionary key, so the layer tests its intervals on it."""
    calls, spans = spy
    spans[(128, 64)] = ((1, 16),)
    layer = patch(_net(), bias=True)[0].requires_grad_(False)  # (autograd calls run F.linear)
    rows = torch.export.Dim("rows", min=2, max=16)
    torch.export.export(layer, (torch.randn(4, 64, dtype=torch.bfloat16),), dynamic_shapes=({0: rows},),
                        strict=False)
    assert calls and layer._tuner_eager == {}


def test_spans_are_kept_only_where_the_saving_covers_the_host_cost(spy, monkeypatch):
    calls, spans = spy
    monkeypatch.setattr(patch_module, "_measure_host_costs", lambda layer, m: (10.0, 7.5))
    spans[(128, 64)] = ((1, 8, 5.0), (9, 16, 20.0), (100, 200, 50.0))
    spans[(32, 128)] = ((1, 8, 5.0),)
    net = _net()
    patch(net, bias=True)
    assert net[0].tuner_spans == ((9, 16), (100, 200))  # eager: saves >= 10 us
    assert net[0].tuner_compiled_spans == ((100, 200),)  # compiled: >= 4 x 7.5 us
    assert type(net[2]) is nn.Linear  # saves less than either: no kernel anywhere
    with torch.no_grad():
        net(torch.randn(4, 64, dtype=torch.bfloat16))
        net(torch.randn(12, 64, dtype=torch.bfloat16))
    assert calls == [(12, 128)]


def test_under_graphs_every_kernel_span_is_kept_and_no_host_cost_is_measured(spy, monkeypatch):
    calls, spans = spy

    def no_measuring(layer, m):
        raise AssertionError("a replayed forward pays no host cost: nothing to measure")

    monkeypatch.setattr(patch_module, "_measure_host_costs", no_measuring)
    spans[(128, 64)] = ((1, 8, 5.0), (9, 16, 20.0), (100, 200, 50.0))
    spans[(32, 128)] = ((1, 8, 0.5),)
    net = _net()
    patch(net, bias=True, graphs=True)
    assert net[0].tuner_spans == net[0].tuner_compiled_spans == ((1, 8), (9, 16), (100, 200))
    assert net[2].tuner_spans == ((1, 8),) and net[0].tuner_graphs and net[2].tuner_graphs
    with torch.no_grad():
        net(torch.randn(4, 64, dtype=torch.bfloat16))
    assert calls == [(4, 128), (4, 32)]
    monkeypatch.setattr(patch_module, "_measure_host_costs", lambda layer, m: (10.0, 30.0))
    patch(net, bias=True)  # patched again without graphs: the host costs count again
    assert net[0].tuner_spans == ((9, 16), (100, 200)) and not net[0].tuner_graphs
    unpatch(net)
    assert "tuner_graphs" not in vars(net[0])


def test_patched_context_unpatches_when_the_block_raises(spy):
    _, spans = spy
    spans[(128, 64)] = ((1, 8),)
    net = _net()
    with pytest.raises(RuntimeError), patched(net, bias=True):
        assert type(net[0]) is TunedLinear
        raise RuntimeError("boom")
    assert type(net[0]) is nn.Linear


def test_untuned_shapes_are_named_in_one_warning(monkeypatch):
    monkeypatch.setattr(patch_module, "_eligible", lambda m: type(m) in (nn.Linear, TunedLinear))
    monkeypatch.setattr(dispatch, "kernel_spans", lambda dev, dtype, n, k, overlap=0: ((), "not tuned on this device"))
    match = r"2 of 2 linear shapes .* not tuned on this device: 128x64 bf16, 32x128 bf16"
    with pytest.warns(PatchWarning, match=match):
        patch(_net(), bias=True)


_CALL_S = 1e-3  # what a linear call takes on either path before its extra sleep


class _Clock:
    """A clock only `sleep` moves: `check`'s timings on CPU weights come out
    exact, however loaded the machine running the tests is."""

    def __init__(self):
        self.now = 0.0

    def perf_counter(self):
        return self.now

    def sleep(self, seconds):
        self.now += seconds


class _ClockEvent:
    """A `torch.cuda.Event` on a `_Clock`."""

    clock: _Clock

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self, stream=None):
        self.at = self.clock.perf_counter()

    def elapsed_time(self, end):
        return 1e3 * (end.at - self.at)


@pytest.fixture
def slow(spy, monkeypatch):
    """The spy's layers with `check`'s events and forward timings on a
    `_Clock`, which a call on the kernel ('kernel': gemm) or cuBLAS
    ('cublas': F.linear) path moves by `_CALL_S` and the seconds given per
    (path, N, M)."""
    _, spans = spy
    sleeps, clock = {}, _Clock()
    linear = nn.functional.linear

    def gemm(a, b, out=None, *, offs=None):
        clock.sleep(_CALL_S + sleeps.get(("kernel", b.shape[1], a.shape[0]), 0))
        return torch.mm(a, b)

    def slow_linear(x, w, b=None):
        clock.sleep(_CALL_S + sleeps.get(("cublas", w.shape[0], x.numel() // w.shape[1]), 0))
        return linear(x, w, b)

    monkeypatch.setattr(dispatch, "gemm", gemm)
    monkeypatch.setattr(nn.functional, "linear", slow_linear)
    monkeypatch.setattr(_ClockEvent, "clock", clock, raising=False)
    monkeypatch.setattr(torch.cuda, "Event", _ClockEvent)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: None)
    monkeypatch.setattr(patch_module, "time", clock)
    return spans, sleeps, clock


def _leave_host_debt(clock: _Clock, owes, payer: nn.Module, seconds: float = 3e-3) -> None:
    """A kernel call for which `owes(a, b)` holds leaves `seconds` of host
    work that `payer` does before its forward, outside every timed call (the
    `slow` fixture's monkeypatch puts the original `gemm` back)."""
    debt = []
    gemm = dispatch.gemm

    def leaving_debt(a, b, out=None, *, offs=None):
        if owes(a, b):
            debt.append(seconds)
        return gemm(a, b)

    dispatch.gemm = leaving_debt
    payer.register_forward_pre_hook(lambda mod, args: clock.sleep(debt.pop() if debt else 0))


def test_check_keeps_a_kernel_only_where_its_calls_and_their_forwards_won(slow):
    spans, sleeps, clock = slow
    spans.update({(128, 64): ((1, 8), (100, 200)), (32, 128): ((1, 8),)})
    # M = 2: net[0]'s kernel saves 2 ms, net[2]'s loses 1 ms;
    # M = 6: net[0]'s loses 2 ms, net[2]'s saves 1 ms (the forward gains once net[0]'s is gone);
    # M = 150: net[0]'s saves 1 ms but leaves 3 ms to the LayerNorm after it (net[2] has no interval there).
    sleeps.update({("cublas", 128, 2): 2e-3, ("kernel", 32, 2): 1e-3, ("kernel", 128, 6): 2e-3,
                   ("cublas", 32, 6): 1e-3, ("cublas", 128, 150): 1e-3})
    net = _net()
    _leave_host_debt(clock, lambda a, b: a.shape[0] == 150, net[1])
    patch(net, bias=True)
    xs = [torch.randn(m, 64, dtype=torch.bfloat16) for m in (2, 6, 150)]
    found = check(net, lambda: [net(x) for x in xs], rounds=8)
    assert [(c.n, c.m, c.kept) for c in found] == [
        (32, 2, False), (32, 6, True), (128, 2, True), (128, 6, False), (128, 150, False)]
    assert all(c.k == (64 if c.n == 128 else 128) and c.dtype == "bf16" for c in found)
    got = {(c.n, c.m): c for c in found}
    assert got[128, 2].speedup > 2 and got[128, 2].log_se < 0.01 and got[128, 2].forward_speedup > 1
    assert got[32, 6].speedup > 1.5 and got[32, 6].forward_speedup > 1  # measured again without net[0]'s loser
    assert got[128, 150].speedup > 1.5 and got[128, 150].forward_speedup < 1  # what the calls could not see
    # M = 2 stands for 1-3 (the geometric mean of 2 and 6 is 3.5), 6 for 4-8.
    assert net[0].tuner_spans == ((1, 3),) and net[2].tuner_spans == ((4, 8),)
    # Compiled graphs keep what the forwards kept: run from Python, they pay the op's host cost too.
    assert net[0].tuner_compiled_spans == ((1, 3),) and net[2].tuner_compiled_spans == ((4, 8),)
    assert type(net[3]) is not TunedLinear


def test_check_measures_a_losing_forward_again_with_its_largest_saving_alone(slow):
    """Both kernels win their calls at M = 2: net[0]'s saves 2 ms, net[2]'s
    0.1 ms but leaves 3 ms of host work behind it, so the forward with both
    loses. With net[0]'s alone it wins, and only net[0]'s stays eager."""
    spans, sleeps, clock = slow
    spans.update({(128, 64): ((1, 8),), (32, 128): ((1, 8),)})
    sleeps.update({("cublas", 128, 2): 2e-3, ("cublas", 32, 2): 1e-4})
    net = _net()
    _leave_host_debt(clock, lambda a, b: b.shape[1] == 32, net[3])
    patch(net, bias=True)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    found = {c.n: c for c in check(net, lambda: net(x), rounds=8)}
    assert found[128].calls_won and found[32].calls_won
    assert found[128].kept and found[128].forward_speedup > 1  # measured with net[0]'s kernel alone
    assert not found[32].kept
    assert net[0].tuner_spans == ((1, 8),) and net[0].tuner_compiled_spans == ((1, 8),)
    assert type(net[2]) is nn.Linear  # lost its forward: compiled graphs pay the host work too


def test_check_calls_a_forward_faster_only_within_its_noise_a_tie(slow):
    """The calls save 1 % (exactly: the clock has no noise), but the
    forwards around them swing by far more: the kernel goes back to cuBLAS,
    eager and compiled."""
    spans, sleeps, clock = slow
    spans[(128, 64)] = ((1, 8),)
    sleeps[("cublas", 128, 2)] = 1e-5
    net = _net()
    jitter = random.Random(0)
    net[1].register_forward_pre_hook(lambda mod, args: clock.sleep(jitter.uniform(0, 0.02)))
    patch(net, bias=True)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    runs = []
    (found,) = check(net, lambda: (runs.append(1), net(x)), rounds=16)
    assert found.calls_won and found.speedup == pytest.approx(1.01) and found.forward_log_se > 0.02
    assert not found.kept
    assert len(runs) == 2 * (17 + 17 + 33 + 65)  # 16 rounds, then 16, 32 and 64 more: 8 x 16 in all
    assert type(net[0]) is nn.Linear


def test_check_runs_undecided_forwards_again_until_a_saving_below_their_noise_shows(slow, monkeypatch):
    """The calls save 4 % (about 1.3 % of a forward), and the forwards
    swing by a few times that: 16 rounds cannot tell (a single look sends
    the kernel back to cuBLAS), doubling the rounds can, and the kernel
    stays in eager calls."""
    spans, sleeps, clock = slow
    spans[(128, 64)] = ((1, 8),)
    sleeps[("cublas", 128, 2)] = 4e-5
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    for looks in (1, patch_module._CHECK_MAX_MULTIPLE):
        monkeypatch.setattr(patch_module, "_CHECK_MAX_MULTIPLE", looks)
        net = _net()
        jitter = random.Random(3)
        net[1].register_forward_pre_hook(lambda mod, args: clock.sleep(jitter.uniform(0, 3.5e-4)))
        patch(net, bias=True)
        runs = []
        (found,) = check(net, lambda: (runs.append(1), net(x)), rounds=16)
        assert found.calls_won and found.speedup == pytest.approx(1.04)
        assert found.kept == (looks > 1)
        # (rounds + a warm-up) x 2 paths a look; the second looks 16, 32 and 64 rounds more.
        assert len(runs) == 34 if looks == 1 else len(runs) > 34
        assert (net[0].tuner_spans if looks > 1 else type(net[0])) == (((1, 8),) if looks > 1 else nn.Linear)


def test_check_judges_compiled_only_intervals_by_forwards_that_run_them(slow, monkeypatch):
    spans, sleeps, clock = slow
    # Eager calls need 10 us saved, compiled ones nothing: M = 1-8 and 9-16 are compiled-only.
    monkeypatch.setattr(patch_module, "_measure_host_costs", lambda layer, m: (10.0, 0.0))
    spans[(128, 64)] = ((1, 8, 5.0), (9, 16, 5.0), (100, 200, 50.0))
    # M = 4 loses its calls; M = 12 wins them (1 ms) but leaves 3 ms of host
    # work to the forward; M = 150 wins both.
    sleeps.update({("kernel", 128, 4): 2e-3, ("cublas", 128, 12): 1e-3, ("cublas", 128, 150): 2e-3})
    net = _net()
    _leave_host_debt(clock, lambda a, b: a.shape[0] == 12, net[1])
    patch(net, bias=True)
    assert net[0].tuner_spans == ((100, 200),) and net[0].tuner_compiled_spans == ((1, 8), (9, 16), (100, 200))
    xs = [torch.randn(m, 64, dtype=torch.bfloat16) for m in (4, 12, 150)]
    found = check(net, lambda: [net(x) for x in xs], rounds=6)
    assert [(c.m, c.calls_won, c.kept) for c in found] == [(4, False, False), (12, True, False), (150, True, True)]
    assert found[0].forward_speedup is None  # lost its calls: the forwards ran without it
    assert found[1].forward_speedup < 1  # the eager forwards ran the compiled-only kernel
    assert (net[0].tuner_spans, net[0].tuner_compiled_spans) == (((100, 200),), ((100, 200),))


def test_a_compiled_interval_must_save_several_times_the_host_cost_of_a_loop(spy, monkeypatch):
    _, spans = spy
    monkeypatch.setattr(patch_module, "_measure_host_costs", lambda layer, m: (1.0, 5.0))
    spans[(128, 64)] = ((1, 8, 15.0), (100, 200, 25.0))
    net = _net()
    patch(net, bias=True)
    # 5 us in a loop is 20 us inside a forward: only the 25 us saving covers it.
    assert net[0].tuner_spans == ((1, 8), (100, 200)) and net[0].tuner_compiled_spans == ((100, 200),)


def test_check_keeps_what_won_on_device_time_for_layers_replayed_from_graphs(slow):
    """The calls save 1 % and the forwards swing by far more, as in the test
    above; a layer patched for CUDA graphs keeps its kernel in eager calls
    too: a replayed forward does not wait on the host."""
    spans, sleeps, clock = slow
    spans[(128, 64)] = ((1, 8),)
    spans[(32, 128)] = ((1, 8),)
    sleeps.update({("cublas", 128, 2): 1e-5, ("kernel", 32, 2): 1e-3})
    net = _net()
    jitter = random.Random(0)
    net[1].register_forward_pre_hook(lambda mod, args: clock.sleep(jitter.uniform(0, 0.02)))
    patch(net, bias=True, graphs=True)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    found = {c.n: c for c in check(net, lambda: net(x), rounds=16)}
    assert found[128].calls_won and found[128].kept and found[128].speedup == pytest.approx(1.01)
    assert not found[32].calls_won and not found[32].kept  # lost on device time: cuBLAS, graphs or not
    assert (net[0].tuner_spans, net[0].tuner_compiled_spans) == (((1, 8),), ((1, 8),))
    assert type(net[2]) is nn.Linear


def test_check_holds_the_device_before_each_timed_call_of_a_layer_replayed_from_graphs(slow, monkeypatch):
    """An eager forward of a small model leaves the GPU waiting on the host,
    and a call's events would then time its host path, which a replayed
    forward does not run: for `graphs` layers a device spin goes first."""
    spans, _, _ = slow
    spans[(128, 64)] = ((1, 8),)
    log = []
    record = _ClockEvent.record
    monkeypatch.setattr(_ClockEvent, "record", lambda self, stream=None: (log.append("event"), record(self)))
    monkeypatch.setattr(torch.cuda, "_sleep", lambda cycles: log.append(("hold", cycles)))
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    for graphs in (False, True):
        net = _net()
        patch(net, bias=True, graphs=graphs)
        log.clear()
        check(net, lambda: net(x), rounds=4)
        holds = [i for i, e in enumerate(log) if e != "event"]
        if not graphs:
            assert not holds and log
            continue
        # Every call of both paths, warm-up round included: (4 + 1) rounds x 2 paths.
        assert len(holds) == 10 and all(log[i][1] == patch_module._HOLD_CYCLES for i in holds)
        assert all(log[i + 1:i + 3] == ["event", "event"] for i in holds)  # its start, then its end


def test_union_merges_overlapping_and_touching_spans():
    assert patch_module._union(((1, 3), (10, 20)), ((4, 6), (15, 30), (40, 40))) == ((1, 6), (10, 30), (40, 40))
    assert patch_module._union((), ()) == ()


def test_check_without_a_forward_of_the_model_judges_the_calls_alone(slow):
    spans, sleeps, _ = slow
    spans[(128, 64)] = ((1, 8),)
    sleeps[("cublas", 128, 2)] = 2e-3
    net = _net()
    patch(net, bias=True)
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    (found,) = check(net, lambda: net[0](x), rounds=8)  # a layer called alone, not `net`
    assert found.kept and found.forward_speedup is None


def test_check_refuses_too_few_rounds_and_warns_when_nothing_was_checked(slow):
    spans, _, _ = slow
    spans[(128, 64)] = ((1, 8),)
    net = _net()
    patch(net, bias=True)
    with pytest.raises(ValueError, match="rounds=3: the estimate needs at least 4"):
        check(net, lambda: None, rounds=3)
    with pytest.warns(PatchWarning, match="no call inside a patched layer's kernel intervals"):
        assert check(net, lambda: net(torch.randn(20, 64, dtype=torch.bfloat16)), rounds=4) == []
    assert net[0].tuner_spans == ((1, 8),)
    unpatch(net)
    with pytest.warns(PatchWarning, match="no layer of the model is patched with kernel intervals"):
        assert check(net, lambda: pytest.fail("nothing to check: the workload must not run")) == []


@pytest.mark.parametrize("spans, verdicts, want", [
    (((1, 8), (100, 200)), {}, ((1, 8), (100, 200))),  # nothing checked: as they were
    (((1, 8),), {2: True, 6: False}, ((1, 3),)),
    (((1, 8),), {2: False, 6: True}, ((4, 8),)),
    (((1, 64),), {2: True, 8: False, 32: True}, ((1, 4), (17, 64))),  # cuts at 4 and 16
    (((1, 64),), {2: True, 8: True}, ((1, 64),)),  # kept pieces merge
    (((1, 8), (9, 16)), {4: False, 12: True}, ((9, 16),)),
])
def test_trim_gives_a_lost_m_its_stretch_to_the_next_checked_m(spans, verdicts, want):
    assert patch_module._trim(spans, verdicts) == want


def test_kernel_spans_from_a_real_store(tmp_path):
    store = Store(str(tmp_path / "w.db"))
    cfg = space.defaults("sm90")["static_persistent"]
    key = lambda m, n=512: Key("sm90", "TestGPU", Problem(m, n, 1024))  # noqa: E731
    assert kernel_spans(store, key(1)) is None  # nothing stored
    env = store.environment("gpu", "sm90", "TestGPU", versions("TestGPU"))
    for m, c in ((16, None), (256, cfg)):
        store.set_winner(store.key_id(key(m).to_dict()), env, config_name=c.name() if c else "cublas",
                         scheduler=c.scheduler if c else "cublas", config=c.to_dict() if c else None,
                         ms=1.0, baseline_ms=1.1, best_by_scheduler={}, trials=1)
    # A map-less family: the kernel winner's own span [256 / sqrt 2, 256 * sqrt 2],
    # and the winner's saving against cuBLAS.
    assert kernel_spans(store, key(1)) == ((182, 362, pytest.approx(100.0)),)
    point = {"m": 64, "ms": {"cublas": 1.1, cfg.name(): 1.0}}
    closer = {"m": 300, "ms": {"cublas": 1.1, cfg.name(): 1.08}}
    ranges = [
        dict(m_lo=1, m_hi=63, config_name="cublas", scheduler="cublas", config=None, evidence=[point]),
        dict(m_lo=64, m_hi=300, config_name=cfg.name(), scheduler=cfg.scheduler, config=cfg.to_dict(),
             evidence=[point, closer]),
        dict(m_lo=301, m_hi=4096, config_name="cublas", scheduler="cublas", config=None, evidence=[point]),
    ]
    from tuner.runtime.lookup import family_of

    store.set_ranges(family_of(key(1)), env, ranges)
    # A map: its kernel intervals only, with the least saving of their points.
    assert kernel_spans(store, key(1)) == ((64, 300, pytest.approx(20.0)),)
    assert kernel_spans(store, key(1), versions("TestGPU")) == ((64, 300, pytest.approx(20.0)),)
    assert kernel_spans(store, key(1), {**versions("TestGPU"), "torch": "0.0"}) == ()  # stale: left out
    assert kernel_spans(store, key(1, n=1024)) is None
    store.close()


# ---------------------------------------------------------------- GPU

TINY = dict(hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=512)


@pytest.fixture
def tiny(tmp_path):
    """A two-layer Llama in bf16 on the GPU, and a database whose map runs the
    pool's default static kernel for every linear shape of it, and every
    shape of its fused siblings, at every M."""
    transformers = pytest.importorskip("transformers")
    arch = {9: "sm90", 10: "sm100"}[torch.cuda.get_device_capability()[0]]
    device = torch.cuda.get_device_name()
    cfg = space.defaults(arch)["static_persistent"]
    torch.manual_seed(0)
    config = transformers.AutoConfig.for_model("llama", **TINY)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).eval()
    from tuner.runtime.linears import linear_shapes
    from tuner.runtime.lookup import family_of

    store = Store(str(tmp_path / "w.db"))
    env = store.environment("gpu", arch, device, versions(device))
    point = {"m": 1, "ms": {"cublas": 1.5, cfg.name(): 1.0}}
    shapes = {(s.n, s.k) for s in linear_shapes(model)} | {(n, k) for _, n, k in fusion.sibling_shapes(model)}
    for n, k in sorted(shapes):
        store.set_ranges(family_of(Key(arch, device, Problem(1, n, k))), env, [dict(
            m_lo=1, m_hi=1 << 16, config_name=cfg.name(), scheduler=cfg.scheduler, config=cfg.to_dict(),
            evidence=[point])])
    store.close()
    dispatch.configure(str(tmp_path / "w.db"))
    yield model
    dispatch.configure(None)


def _rel_err(got, want):
    return (torch.linalg.vector_norm(got.float() - want.float()) / torch.linalg.vector_norm(want.float())).item()


def _strict():
    """Any fallback to cuBLAS, or a patch finding nothing tuned, fails the test."""
    warnings.simplefilter("error", dispatch.FallbackWarning)
    warnings.simplefilter("error", PatchWarning)


@pytest.mark.gpu
def test_patched_model_matches_unpatched_and_runs_the_kernels(tiny):
    ids = torch.randint(0, TINY["vocab_size"], (2, 64), device="cuda")
    with torch.inference_mode():
        want = tiny(ids).logits
        with warnings.catch_warnings(), patched(tiny):
            _strict()
            assert all(type(m) is TunedLinear and m.tuner_spans == ((1, 1 << 16),)
                       for m in tiny.modules() if isinstance(m, nn.Linear))
            got = tiny(ids).logits
            # Every layer kept its kernel launch for M = 128; the next forward takes them.
            assert all(m.tuner_launchers for m in tiny.model.layers.modules() if type(m) is TunedLinear)
            assert torch.equal(tiny(ids).logits, got)
    x = torch.randn(128, 256, device="cuda", dtype=torch.bfloat16)
    assert dispatch.explain(x, tiny.model.layers[0].self_attn.q_proj.weight.t()).path == "kernel"
    assert _rel_err(got, want) < 2e-2


@pytest.mark.gpu
def test_a_patched_model_that_kept_its_kernels_deep_copies(tiny):
    """The kept runners hold compiled code: the copy starts without them,
    makes the same logits and keeps its own."""

    ids = torch.randint(0, TINY["vocab_size"], (2, 64), device="cuda")
    with warnings.catch_warnings(), patched(tiny):
        _strict()
        with torch.inference_mode():
            got = tiny(ids).logits
        assert all(m.tuner_launchers for m in tiny.model.layers.modules() if type(m) is TunedLinear)
        twin = copy.deepcopy(tiny)
        assert not any(m.tuner_launchers for m in twin.modules() if type(m) is TunedLinear)
        with torch.inference_mode():
            assert torch.equal(twin(ids).logits, got)
        assert all(m.tuner_launchers for m in twin.model.layers.modules() if type(m) is TunedLinear)


@pytest.mark.gpu
def test_the_logits_of_the_last_positions_gather_their_strided_rows(tiny):
    ids = torch.randint(0, TINY["vocab_size"], (4, 64), device="cuda")
    head = tiny.lm_head
    with torch.inference_mode():
        want = tiny(ids, logits_to_keep=1).logits
        with warnings.catch_warnings(), patched(tiny):
            _strict()
            assert head.tuner_gather == head.tuner_spans
            got = tiny(ids, logits_to_keep=1).logits
            # lm_head's input, the last of every 64 positions, took the kernel at M = 4.
            assert list(head.tuner_launchers) == [4]
    assert _rel_err(got, want) < 2e-2


@pytest.mark.gpu
def test_check_times_every_patched_shape_inside_the_forward_and_keeps_its_verdicts(tiny):
    ids = torch.randint(0, TINY["vocab_size"], (2, 64), device="cuda")
    layers = {m: (m.out_features, m.in_features) for m in tiny.modules() if isinstance(m, nn.Linear)}
    with torch.inference_mode():
        want = tiny(ids).logits
        with warnings.catch_warnings(), patched(tiny):
            _strict()
            found = check(tiny, lambda: tiny(ids), rounds=6)
            got = tiny(ids).logits
            # One verdict per shape, at the forward's M = 2 x 64 (the logits of every position too).
            assert sorted((c.n, c.k) for c in found) == sorted(set(layers.values()))
            assert all(c.m == 128 and c.speedup > 0 and c.log_se >= 0 for c in found)
            # Forwards are timed with the winning calls' kernels only: a lost shape has no forward verdict.
            assert all((c.forward_speedup is not None) == c.calls_won for c in found)
            assert all(c.forward_speedup > 0 for c in found if c.calls_won)
            every_m = ((1, 1 << 16),)
            kept = {(c.n, c.k): c.kept for c in found}
            won = {(c.n, c.k): c.calls_won for c in found}
            for layer, shape in layers.items():
                if kept[shape] or won[shape]:
                    assert layer.tuner_spans == (every_m if kept[shape] else ())
                    assert layer.tuner_compiled_spans == layer.tuner_spans  # both kinds follow the forwards
                else:
                    assert type(layer) is nn.Linear
    assert _rel_err(got, want) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("fuse", [False, True])
def test_compile_fullgraph_of_a_patched_decoder_layer(tiny, fuse):
    layer = tiny.model.layers[0]
    h = torch.randn(2, 32, TINY["hidden_size"], device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(32, device="cuda")[None].expand(2, -1)
    with torch.inference_mode():
        pe = tiny.model.rotary_emb(h, pos)
        want = layer(h, position_embeddings=pe, attention_mask=None)
        with warnings.catch_warnings(), patched(tiny, fuse=fuse):
            _strict()
            got = torch.compile(layer, fullgraph=True)(h, position_embeddings=pe, attention_mask=None)
    want, got = (t[0] if isinstance(t, tuple) else t for t in (want, got))
    assert _rel_err(got, want) < 2e-2


@pytest.mark.gpu
@pytest.mark.parametrize("graphs,pdl,fuse", [(False, False, False), (False, True, False), (True, False, False),
                                             (True, True, False), (False, False, True), (True, True, True)])
def test_cuda_graph_capture_of_a_patched_decode_step(tiny, graphs, pdl, fuse):
    from transformers import StaticCache

    batch, prompt = 4, 16
    ids = torch.randint(0, TINY["vocab_size"], (batch, prompt), device="cuda")
    token = torch.randint(0, TINY["vocab_size"], (batch, 1), device="cuda")
    position = torch.tensor([prompt], device="cuda")
    cache = StaticCache(config=tiny.config, max_cache_len=prompt + 1)

    def prefill():
        cache.reset()  # in place: the captured step keeps pointing at the same cache tensors
        tiny(input_ids=ids, past_key_values=cache, cache_position=torch.arange(prompt, device="cuda"))

    def replayed_step():
        """One decode step captured in a CUDA graph (after a warm-up) and replayed on the prompt's cache."""
        step = lambda: tiny(input_ids=token, past_key_values=cache, cache_position=position).logits  # noqa: E731
        prefill()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            step()  # warm-up: every key decided and built before capture
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            logits = step()
        prefill()
        graph.replay()
        torch.cuda.synchronize()
        return logits.clone()

    with torch.inference_mode():
        want = replayed_step()
        with warnings.catch_warnings(), patched(tiny, graphs=graphs, pdl=pdl, fuse=fuse):
            _strict()
            got = replayed_step()
            layers = [m for m in tiny.model.layers.modules() if type(m) is TunedLinear]
            groups = fusion.groups(tiny)
            assert len(groups) == (2 * TINY["num_hidden_layers"] if fuse else 0)
            layers += [group.linear for group in groups]
            # Each layer's o and down, and q, k, v, gate and up either apart or as two fused products.
            assert len(layers) == (4 if fuse else 7) * TINY["num_hidden_layers"]
            assert all(m.tuner_launchers for m in layers)
            assert all(run.variant.cfg.pdl == pdl for m in layers for run in m.tuner_launchers.values())
    assert _rel_err(got, want) < 2e-2
