"""Run a model's linear layers through the tuned dispatch: `patch(model)`.

    import tuner
    tuner.patch(model)          # bf16/fp16 CUDA nn.Linear layers: tuned kernels where they won
    tuner.check(model, lambda: model(x))  # optional: keep them only where they win in this forward
    with tuner.patched(model):  # ... or only inside the block
        model(...)

Every module of exact type `nn.Linear` whose weight is a bf16 or fp16 CUDA
tensor goes through the dispatch's rule. The database is read once, at patch
time: for each distinct (N, K, dtype, device) the M intervals where `gemm`
may run a kernel and the least device time it saved there against cuBLAS
(`dispatch.kernel_spans`). The maps measured device time, but a forward that
waits on the host (a decode step) also pays the kernel path's host cost over
`F.linear`'s: an interval is kept only where the saving covers that cost,
which `patch` measures once per process and device on the layers' own kernel
(host time per call of each path, no sync in between): one cost for eager
calls (the kept launch) and one for compiled graphs (the registered op,
against the `mm` a compiled graph calls otherwise). A forward replayed from
a CUDA graph runs no host code at all: `patch(model, graphs=True)` keeps
every kernel interval for models run that way. A layer with an interval
left becomes a `TunedLinear` (its class is swapped: parameters, hooks, state
dict and `isinstance(m, nn.Linear)` stay as they were); one without any
stays an `nn.Linear`, since `gemm` would run cuBLAS for it at every M: that
costs nothing per call. `unpatch` swaps the class back. Other modules,
and subclasses of `nn.Linear` that bring their own forward, are left alone.
So are layers with a bias unless `patch(model, bias=True)`: `F.linear` adds
the bias in cuBLAS's epilogue, while the pool's kernels would need a second
kernel for it, and the maps measured the product alone.

A `TunedLinear` call whose M (rows of the flattened input) lies outside its
intervals (the eager or the compiled set) runs `F.linear` directly, as the
unpatched layer does, after one comparison of the input's size (or, inside
the bounds, a lookup of it). A call with no hooks to run (the layer's or
global), outside the JIT tracer, skips `nn.Module.__call__`: the layer's own
`__call__` makes that comparison and calls `F.linear` from one Python frame,
where `nn.Linear`'s call runs five (`bench.probes.linear_calls`). Inside its
intervals a call goes to `gemm` (which still falls back to cuBLAS where it
must) and the bias is added after. Once `gemm` has chosen a kernel for an
M, the layer keeps its runner and calls it directly, skipping every check
but the input's alignment (a decode step is launch-bound). Under
`torch.compile` the test is on M at trace time (a guard when M is dynamic),
so a layer's graph holds either the plain `linear` or the `gemm_tuner::gemm`
op, not both; CUDA graph capture works once each key has been called before
capturing. Patch again after retuning or `dispatch.configure` to read the
new choices. A patched model copies (`copy.deepcopy`) and pickles
(`torch.save` of the module) as it is patched; the kept runners, compiled
code that can be neither, stay behind, and the copy keeps its own.

The maps timed each GEMM alone. `check(model, workload)` times the patched
layers inside the model's own forward, kernel against `F.linear`, and takes
back the eager intervals where the kernel did not win there (its doc).

Calls that need autograd (grad enabled and a weight that requires grad) and
inputs of another dtype than the weight (autocast) run `F.linear`: `gemm` is
forward only and takes one input dtype. Inputs whose rows are strided (the
last position of each sequence, taken for the logits) are gathered into a
contiguous copy first, as the maps measured contiguous operands, but only
where the kernel saves more than that copy costs (measured at patch time, for
the largest copy taken: `_GATHER_MAX_BYTES`); elsewhere they run `F.linear`,
which reads strided rows as they are.
"""

from __future__ import annotations

import contextlib
import math
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.modules.module import (
    _global_backward_hooks, _global_backward_pre_hooks, _global_forward_hooks, _global_forward_pre_hooks,
)

from tuner.runtime import dispatch, experts, fusion
from tuner.backends.measure import gc_paused, paired_speedup, trimmed_mean

_DTYPES = (torch.bfloat16, torch.float16)
# Looked up once: every patched call asks one (TorchDynamo knows the
# functions themselves, under any name). `_compiling` is also true under
# non-strict export, which runs the eager forward on fake tensors: the kernel
# path asks it before it launches anything.
_compiling = torch.compiler.is_compiling
_dynamo_compiling = torch.compiler.is_dynamo_compiling
_jit_tracing = torch._C._get_tracing_state
_ALIGN = 16  # bytes: what the pool's TMA loads need of a pointer
# Host cost measurement: calls per timed batch, batches (the fastest counts).
_COST_CALLS, _COST_BATCHES = 20, 15
# Per CUDA device: (eager, compiled) host us per call the kernel path adds.
_host_costs: dict[int, tuple[float, float]] = {}
# Strided rows are gathered for the kernel path up to this size (16 rows of
# 8192: the logits' input of a batch of 16), so that one measured copy of
# this size bounds what a gather costs.
_GATHER_MAX_BYTES = 256 << 10
# A compiled graph run from Python calls the registered op from its wrapper
# code; inside a forward that call's host cost is several times what
# `_measure_host_costs` times in a loop (`bench.probes.compiled_op_host`:
# `dispatch`'s path took 56.4 us a call in a compiled SmolLM3 decode step,
# `gemm` 14.3 us in a loop; in `bench.e2e` a kernel whose calls ran 1.12x
# cuBLAS's left those compiled forwards at 0.943-0.971). So a compiled
# interval's saving must cover this many times the loop's cost.
_COMPILED_IN_FORWARD = 4.0
# Per (CUDA device, dtype): us a gather of _GATHER_MAX_BYTES costs a call.
_gather_costs: dict[tuple[int, torch.dtype], float] = {}
# `check`: runs of the workload per path (after a warm-up run of each), and
# how many standard errors above 1.0 a kept kernel's in-model speedup must be.
_CHECK_ROUNDS, _CHECK_SE = 30, 2.0
# `check`: forwards that neither won nor lost by _CHECK_SE standard errors
# around calls that won (a saving below the forwards' noise: 27B's lm_head at
# one row saved 5 % of its calls, about 1 % of a decode step) are measured
# again, as many rounds as so far each time, up to this many times `rounds`
# in all; those later looks ask _CHECK_SE_AGAIN standard errors, so that
# looking again does not let a tie pass much more often than one look does.
_CHECK_MAX_MULTIPLE, _CHECK_SE_AGAIN = 8, 2.5
# `check`: GPU clock cycles (about 100 us on an H100) a timed call of a layer
# replayed from CUDA graphs waits behind, so that the host has enqueued the
# call before the device reaches its start event (`_CallTimer._start`).
_HOLD_CYCLES = 200_000


class PatchWarning(UserWarning):
    """`patch` found nothing to patch, or shapes with nothing tuned: they run cuBLAS."""


class TunedLinear(nn.Linear):
    """An `nn.Linear` whose forward runs `gemm` at the M where a kernel may win."""

    # M -> the kernel runner `gemm` chose for this weight, kept after the first
    # eager call: a repeat call then skips gemm's checks but a's alignment and
    # launches it on the weight as stored, so that its only tensor ops are the
    # output's allocation and the input's and output's views (a tensor op
    # called from Python costs the host about a microsecond, and a decode
    # step waits on the host).
    tuner_launchers: dict
    # Patched for forwards replayed from CUDA graphs (`patch(graphs=True)`):
    # no host cost to cover, and `check` keeps what won on device time.
    tuner_graphs: bool = False
    # Kept runners are the pdl builds of the winners (`patch(pdl=True)`).
    tuner_pdl: bool = False
    # Bytes of the all-reduce the layer runs beside (`patch(overlap=)`).
    tuner_overlap: int = 0
    # The least and largest M of both kinds of interval, times in_features
    # (bounds on the input's numel): most calls fall outside, and in a forward
    # that waits on the host every call's Python counts
    # (bench.probes.patch_overhead), so one comparison turns them away.
    _tuner_bounds: tuple[int, int] = (1, 0)
    _tuner_spans: tuple[tuple[int, int], ...] = ()
    _tuner_compiled_spans: tuple[tuple[int, int], ...] = ()
    # Input numel -> whether an eager call of that size takes the kernel
    # path, filled as sizes come: inside a forward a call's Python costs
    # about twice what it does in a loop (bench.probes.host_path), and an interval
    # test walks every interval.
    _tuner_eager: dict[int, bool]
    # M intervals (within the others) where a strided input is gathered for
    # the kernel: the kernel saves more there than the host cost and the copy.
    tuner_gather: tuple[tuple[int, int], ...] = ()

    @property
    def tuner_spans(self) -> tuple[tuple[int, int], ...]:
        """M intervals where eager calls run `gemm`: a kernel there saves
        more than the host cost of calling it (from patch time; every kernel
        interval under `graphs`)."""
        return self._tuner_spans

    @tuner_spans.setter
    def tuner_spans(self, spans: tuple[tuple[int, int], ...]) -> None:
        self._tuner_spans = spans
        self._bound()

    @property
    def tuner_compiled_spans(self) -> tuple[tuple[int, int], ...]:
        """The same for calls traced into a compiled graph."""
        return self._tuner_compiled_spans

    @tuner_compiled_spans.setter
    def tuner_compiled_spans(self, spans: tuple[tuple[int, int], ...]) -> None:
        self._tuner_compiled_spans = spans
        self._bound()

    def _bound(self) -> None:
        every = self._tuner_spans + self._tuner_compiled_spans
        k = self.in_features
        self._tuner_bounds = (min(lo for lo, _ in every) * k, max(hi for _, hi in every) * k) if every else (1, 0)
        self._tuner_eager = {}

    def __getstate__(self) -> dict:
        # The kept runners hold compiled code, which can be neither copied nor
        # pickled: a copy (copy.deepcopy, torch.save of the module) starts
        # without them and keeps its own as it is called.
        return {**super().__getstate__(), "tuner_launchers": {}}

    def __call__(self, input: torch.Tensor) -> torch.Tensor:
        # nn.Linear's call runs five Python frames (nn.Module's call, its
        # hook tests, forward, two parameter lookups); in a forward that
        # waits on the host (a decode step) each costs a few tenths of a
        # microsecond, and most calls fall outside the intervals. So a plain
        # call (a plain tensor, no hooks anywhere, no compiled call of the
        # layer's own, no JIT trace) makes the bounds test of `forward` here
        # and runs F.linear from this one frame, with no Python call between;
        # so does one inside the bounds of a size `forward` found in no eager
        # interval (a decode step's M between a layer's kernel intervals:
        # going through forward read 0.3 % slower steps at batch 16). Anything
        # else takes nn.Module's own call. TorchDynamo traces this as it reads
        # (the JIT tracer's state is a constant to it) but must not read the
        # eager sizes, which eager calls change under a compiled graph's
        # guards; FX proxies and fake tensors fail the type test.
        if type(input) is torch.Tensor and not (
                self._forward_pre_hooks or self._forward_hooks or self._backward_pre_hooks or self._backward_hooks
                or _global_forward_pre_hooks or _global_forward_hooks
                or _global_backward_pre_hooks or _global_backward_hooks
                or self._compiled_call_impl is not None or _jit_tracing()):
            lo, hi = self._tuner_bounds
            n = input.numel()
            if lo <= n <= hi and (_dynamo_compiling() or self._tuner_eager.get(n) is not False):
                return self.forward(input)
            p = self._parameters
            return F.linear(input, p["weight"], p["bias"])
        return nn.Module.__call__(self, input)

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        lo, hi = self._tuner_bounds
        n = input.numel()
        if lo <= n <= hi:
            # Dynamo traces the compiled intervals' test into the graph (a
            # guard on M); an eager call looks its size up.
            if _dynamo_compiling():
                if _inside(n // self.in_features, self._tuner_compiled_spans):
                    return self._tuned(input)
            elif type(n) is int:
                kernel = self._tuner_eager.get(n)
                if kernel is None:
                    kernel = self._tuner_eager[n] = _inside(n // self.in_features, self._tuner_spans)
                if kernel:
                    return self._tuned(input)
            elif _inside(n // self.in_features, self._tuner_spans):  # a symbolic size (export): no key
                return self._tuned(input)
        # `self.weight` is found by nn.Module.__getattr__ after the instance
        # lookup fails: reading the parameters' dict skips that, which pays
        # for the test above in a loop (on the CI host such a call took 0.7 us
        # less than nn.Linear's; bench.probes.decode_step counts the calls).
        p = self._parameters
        return F.linear(input, p["weight"], p["bias"])

    def _fits(self, input: torch.Tensor, x: torch.Tensor) -> bool:
        """Whether the kernel path may take `input` (`x`: its rows): a
        strided x (the last position of every sequence, for the logits)
        only where the kernel's saving covers gathering it (`tuner_gather`)."""
        w = self._parameters["weight"]
        return (input.dtype == w.dtype and not (torch.is_grad_enabled() and w.requires_grad)
                and (x.is_contiguous() or x.stride(-1) == 1 and self.tuner_gathers(x.shape[0])))

    def tuner_gathers(self, m: int) -> bool:
        """Whether an input of `m` strided rows is gathered for the kernel path."""
        return m * self.in_features * self.weight.element_size() <= _GATHER_MAX_BYTES and _inside(m, self.tuner_gather)

    def _dispatch(self, x: torch.Tensor, wt: torch.Tensor) -> tuple:
        """`gemm`'s product and, outside compiled graphs, the launch it decided."""
        y = dispatch.gemm(x, wt)
        launch = None if _compiling() else (
            dispatch.weight_launcher(x, wt) if self.tuner_pdl else dispatch.launcher(x, wt))
        return y, launch

    def _tuned(self, input: torch.Tensor) -> torch.Tensor:
        w, b = self._parameters["weight"], self._parameters["bias"]  # as in forward
        if input.shape[-1] != self.in_features:
            return F.linear(input, w, b)  # which names the wrong width
        flat = input.dim() == 2
        x = input if flat else input.reshape(-1, self.in_features)
        if not self._fits(input, x):
            return F.linear(input, w, b)
        x = x.contiguous()
        m = x.shape[0]
        run = None if _compiling() else self.tuner_launchers.get(m)
        if run is not None and not x.data_ptr() % _ALIGN:
            y = x.new_empty((m, self.out_features))  # (fewer arguments to parse than torch.empty's)
            run(x, w, y)
        else:
            if self.tuner_overlap:  # eager only: `patch` keeps no compiled interval for it
                with dispatch.overlap(self.tuner_overlap):
                    y, launch = self._dispatch(x, w.t())
            else:
                y, launch = self._dispatch(x, w.t())
            if launch is not None and launch.tn:  # the runner takes the weight as stored
                self.tuner_launchers[m] = launch.runner
        if b is not None:
            y = y + b
        return y if flat else y.view(*input.shape[:-1], self.out_features)


def patch(model: nn.Module, *, bias: bool = False, graphs: bool = False, compiled: bool = True,
          pdl: bool = False, overlap: int = 0, fuse: bool = False) -> nn.Module:
    """Route every bf16/fp16 CUDA `nn.Linear` of `model` through the tuned
    dispatch (module doc); returns `model`. `bias`: layers with a bias too
    (added after the product). `graphs`: the model's forwards are replayed
    from CUDA graphs (a serving engine's captured decode steps, or
    `torch.compile(mode="reduce-overhead")`): a replay runs no host code, so
    every kernel interval of the maps is kept, eager and compiled, and
    `check` judges them by their calls' device time alone. `compiled=False`:
    the model runs eager only, so no interval is kept for compiled graphs
    and a layer without an eager one stays an `nn.Linear` (eager decode
    steps whose patched layers all ran `F.linear` measured up to 0.4 %
    slower than unpatched ones in `bench.e2e`). `pdl=True`: the kept eager
    runners are the winners' programmatic-dependent builds
    (`dispatch.weight_launcher`), whose weight loads start while the
    kernel before them drains. Off by default: in 8-layer decode steps
    replayed from graphs it moved steps by -0.8 % to +0.7 % against the
    plain builds (`bench.e2e --pdl`), no consistent win. Patching a patched
    model reads the database again. Warns (`PatchWarning`) when no layer
    qualifies, and names the shapes nothing is tuned for. A mixture of
    experts block computed by transformers' grouped products runs them
    through `gemm`'s grouped dispatch where its families are tuned
    (`tuner.runtime.experts`). `overlap=BYTES`: the layers run beside an
    all-reduce of that many bytes (tensor parallelism) and take the maps
    tuned for it (`overlap=allreduce:BYTES` keys) instead of the plain ones,
    in eager calls and graph replays (a compiled graph runs `F.linear`).
    `fuse=True`: sibling projections of one input (q, k and v; gate and
    up) compute one product over their weights stored together
    (`tuner.runtime.fusion`), a layer of the fused shape patched like any
    other (one with biases only under `bias`); their outputs are column
    views of that product. In 8-layer decode steps replayed from graphs
    (`bench.e2e --fuse`, H100) it took Gemma 3 27B from 1.007-1.010x
    unpatched to 1.033-1.053x and Llama 3.1 8B from 1.034-1.044x to
    1.074-1.083x. Off by default: it stores the siblings' weights anew (as
    views of one buffer), and it pays only where the fused families are
    tuned (`tuner shapes --from-model NAME --fuse`)."""
    experts.patch_experts(model)
    if fuse:
        for m in model.modules():
            _restore(m)
        groups = fusion.fuse(model, _eligible)
    else:
        fusion.unfuse(model)
        groups = []
    layers, biased = [], False
    for m in [*model.modules(), *(group.linear for group in groups)]:
        if _eligible(m) and (bias or m.bias is None):
            layers.append(m)
        elif _eligible(m):
            _restore(m)  # patched before with bias=True
            biased = True
    if not layers and biased:
        return model  # every CUDA layer has a bias: left to cuBLAS's fused epilogue, as asked
    if not layers:
        kinds = sorted({_describe(m.weight) for m in model.modules() if type(m) in (nn.Linear, TunedLinear)})
        warnings.warn(
            "tuner.patch: no nn.Linear of this model has a bf16/fp16 CUDA weight "
            f"({', '.join(kinds) or 'it has no nn.Linear'}): the model is left as it is; "
            "move it to the GPU in bf16 or fp16 first", PatchWarning, stacklevel=2)
        return model
    found: dict[tuple, tuple] = {}
    spans_of = {}
    for layer in layers:
        w = layer.weight
        key = (w.device.index, w.dtype, layer.out_features, layer.in_features)
        if key not in found:
            found[key] = dispatch.kernel_spans(*key, overlap=overlap)
        spans_of[layer] = found[key][0]
        if spans_of[layer]:
            layer.__class__ = TunedLinear
            layer.tuner_launchers = {}
            layer.tuner_graphs = graphs
            layer.tuner_pdl = pdl
            layer.tuner_overlap = overlap
            layer.tuner_spans = layer.tuner_compiled_spans = ()
        else:
            _restore(layer)
    for device in {layer.weight.device.index for layer in layers if spans_of[layer]}:
        on_device = [layer for layer in layers if spans_of[layer] and layer.weight.device.index == device]
        eager, compiled_cost = (0.0, 0.0) if graphs else _costs(device, on_device, spans_of)
        compiled_cost *= _COMPILED_IN_FORWARD
        for layer in on_device:
            layer.tuner_spans = tuple((lo, hi) for lo, hi, saving in spans_of[layer] if saving >= eager)
            # A compiled graph calls gemm's op, which no overlap hint reaches.
            layer.tuner_compiled_spans = tuple((lo, hi) for lo, hi, saving in spans_of[layer]
                                               if compiled and not overlap and saving >= compiled_cost)
            gather = max(eager, compiled_cost if compiled else 0.0) + _gather_cost(device, layer.weight.dtype,
                                                                                   spans_of[layer])
            layer.tuner_gather = tuple((lo, hi) for lo, hi, saving in spans_of[layer] if saving >= gather)
            if not layer.tuner_spans and not layer.tuner_compiled_spans:
                _restore(layer)
    untuned = {}
    for (_, dtype, n, k), (_, why) in found.items():
        if why is not None:
            untuned.setdefault(why, []).append(f"{n}x{k} {_DTYPE_NAME[dtype]}")
    for why, shapes in untuned.items():
        warnings.warn(f"tuner.patch: {len(shapes)} of {len(found)} linear shapes (N x K) run cuBLAS: {why}: "
                      f"{', '.join(shapes)}", PatchWarning, stacklevel=2)
    return model


def host_costs(device: int | None = None) -> tuple[float, float] | None:
    """The host us per call (eager, compiled) that `patch` measured the kernel
    path to add on CUDA device `device` (default: the current one); None
    before a patch needed them."""
    return _host_costs.get(torch.cuda.current_device() if device is None else device)


def unpatch(model: nn.Module) -> nn.Module:
    """Undo `patch`: every `TunedLinear` of `model` is an `nn.Linear` again,
    every experts block back on transformers' grouped products."""
    experts.unpatch_experts(model)
    fusion.unfuse(model)
    for layer in model.modules():
        _restore(layer)
    return model


@dataclass(frozen=True)
class Checked:
    """What `check` measured for one weight shape (N x K, dtype) at one M:
    cuBLAS's device time over the kernel path's for its layers' calls in a
    run of the workload (`speedup`, with its standard error in log units),
    the ratio of host time of the model's forward that made those calls
    with the winning calls' kernels and had the least lower bound, with
    its standard error (`forward_speedup`, `forward_log_se`; None when no
    such forward did), whether the calls won (`calls_won`) and whether the
    forwards did too (`kept`: the kernel stays at that M, in eager calls
    and compiled graphs; the calls alone decide for layers patched with
    `graphs`)."""

    n: int
    k: int
    dtype: str
    m: int
    speedup: float
    log_se: float
    forward_speedup: float | None
    forward_log_se: float | None
    calls_won: bool
    kept: bool


def check(model: nn.Module, workload: Callable[[], object], *, rounds: int = _CHECK_ROUNDS) -> list[Checked]:
    """Keep a patched layer's kernel intervals only where the kernel measured
    faster inside the model: `workload()` (a forward of the model, or a few,
    as it will be called) runs `rounds` times with the patched layers'
    kernels and as many with `F.linear`, eager, alternating which goes first.
    CUDA events time every call that would take the kernel path, and the
    host's clock every forward of `model` (synced at both ends).

    The maps measured a GEMM alone; inside a forward, between other kernels,
    it runs at other clocks and cache states, and cuBLAS's kernels may gain
    more from that than the pool's; a forward that waits on the host pays
    the kernel path's host cost instead of its device time. So per weight
    shape and M the kernel stays only when its calls' speedup over cuBLAS
    (summed over the shape's layers in a run, `paired_speedup`) is above 1.0
    by two standard errors, and every forward that made those calls ran
    faster with the kernels than without them, by two of its own standard
    errors (a forward no faster within its noise is a tie, and a tie goes
    to cuBLAS). Forwards that neither won nor lost so, around calls that
    won, are run again, doubling the rounds, up to `_CHECK_MAX_MULTIPLE`
    times `rounds` (then by `_CHECK_SE_AGAIN` standard errors): a saving
    smaller than one forward's noise shows once enough forwards are paired.
    A forward that did not win with several kernels is measured once more
    with only the one that saved it the most device time (`_solos`): a
    forward that waits on the host pays every kernel's host cost, and one
    large saving (a decode step's lm_head) can outweigh its own cost but not
    the others'. Layers patched with `graphs` are replayed from CUDA graphs,
    where no host time is spent on them: their calls alone decide, each
    timed behind a spin of the device that lets the host enqueue it first.
    Else the stretch of the interval that M stands for goes to cuBLAS
    (`_trim`). Compiled intervals are judged by the same forwards, run eager
    with the kernels of both kinds of interval: a graph that torch.compile
    runs from Python calls the registered op from its wrapper code, whose
    host cost inside a forward is several times a loop's
    (`_COMPILED_IN_FORWARD`), so a kernel whose calls won by less lost
    those forwards (0.943 and 0.971 of cuBLAS's). The forwards are
    measured again with the calls that won alone when others lost (a loser
    would take the winners beside it down). Intervals no call of the
    workload fell in stay as the maps made them. Returns what was measured,
    per shape and M."""
    if rounds < 4:
        raise ValueError(f"check: rounds={rounds}: the estimate needs at least 4 (two of each order)")
    layers = [m for m in [*model.modules(), *(group.linear for group in fusion.groups(model))]
              if type(m) is TunedLinear and (m.tuner_spans or m.tuner_compiled_spans)]
    spans = {layer: layer.tuner_spans for layer in layers}
    timed = {layer: _union(layer.tuner_spans, layer.tuner_compiled_spans) for layer in layers}
    call_pairs, forwards = _measure(model, timed, workload, rounds) if layers else ({}, {})
    if not call_pairs:
        why = ("the workload made no call inside a patched layer's kernel intervals" if layers
               else "no layer of the model is patched with kernel intervals")
        warnings.warn(f"tuner.check: {why}: nothing was checked", PatchWarning, stacklevel=2)
    calls = {key: paired_speedup(pairs) for key, pairs in call_pairs.items()}
    wins = {key: _beats(est) for key, est in calls.items()}
    calls_won = {layer: _verdicts(wins, layer) for layer in layers}
    won = {layer: _trim(s, calls_won[layer]) for layer, s in timed.items()}
    if won != timed:
        forwards = _measure(model, won, workload, rounds)[1] if any(won.values()) else {}
    replayed = {_shape(layer) for layer in layers if layer.tuner_graphs}
    judged = [key for key in calls if wins[key] and key[:3] not in replayed]
    least, z = _judge(model, won, workload, rounds, forwards, judged)
    kept = {key: wins[key] and (key[:3] in replayed or key not in least or _beats(least[key], z)) for key in calls}
    solos = _solos(forwards, call_pairs, wins, kept, judged)
    if solos:
        alone = {layer: _trim(s, _verdicts({key: key in solos for key in calls}, layer)) for layer, s in timed.items()}
        solo_least, solo_z = _judge(model, alone, workload, rounds, _measure(model, alone, workload, rounds)[1], solos)
        for key in solos:
            least[key] = solo_least.get(key, least.get(key))
            kept[key] = key in solo_least and _beats(solo_least[key], solo_z)
    found = []
    for key in sorted(calls, key=lambda key: (key[0], key[1], str(key[2]), key[3])):  # dtypes do not order
        (n, k, dtype, m), est, whole = key, calls[key], least.get(key, {})
        found.append(Checked(n, k, _DTYPE_NAME[dtype], m, est["speedup"], est["log_se"],
                             whole.get("speedup"), whole.get("log_se"), wins[key], kept[key]))
    for layer in layers:
        verdicts = _verdicts(kept, layer)
        layer.tuner_spans = _trim(spans[layer], verdicts)
        layer.tuner_compiled_spans = _trim(layer.tuner_compiled_spans, verdicts)
        if not layer.tuner_spans and not layer.tuner_compiled_spans:
            _restore(layer)
    return found


def _measure(model: nn.Module, spans: dict, workload: Callable[[], object], rounds: int) -> tuple[dict, dict]:
    """`check`'s rounds with the kernels of `spans` (layer -> eager
    intervals) against none: the timed pairs (cuBLAS s, kernel s, kernel
    first) of each (N, K, dtype, M) key's calls, and of each forward of the
    model (by its place in a run of the workload) with the keys of its
    timed calls."""
    layers = [layer for layer, s in spans.items() if s]
    saved = {layer: layer.tuner_spans for layer in layers}
    calls, forwards, made = defaultdict(list), defaultdict(list), defaultdict(set)
    try:
        with torch.no_grad(), gc_paused(), _CallTimer(model, {layer: spans[layer] for layer in layers}) as timer:
            for r in range(rounds + 1):
                order = ("kernel", "cublas") if r % 2 == 0 else ("cublas", "kernel")
                runs = {}
                for path in order:
                    for layer in layers:
                        layer.tuner_spans = spans[layer] if path == "kernel" else ()
                    runs[path] = timer.time(workload)
                if not r:  # the first round decides, builds and keeps the launches
                    continue
                (kernel_calls, kernel_forwards), (cublas_calls, cublas_forwards) = runs["kernel"], runs["cublas"]
                for key in kernel_calls.keys() & cublas_calls.keys():
                    calls[key].append((cublas_calls[key], kernel_calls[key], order[0] == "kernel"))
                for i in kernel_forwards.keys() & cublas_forwards.keys():
                    forwards[i].append((cublas_forwards[i][0], kernel_forwards[i][0], order[0] == "kernel"))
                    made[i] |= kernel_forwards[i][1]
    finally:
        for layer, s in saved.items():
            layer.tuner_spans = s
    return dict(calls), {i: (pairs, made[i]) for i, pairs in forwards.items()}


def _judge(model: nn.Module, spans: dict, workload: Callable[[], object], rounds: int, forwards: dict,
           judged: list) -> tuple[dict[tuple, dict], float]:
    """The least forward estimate of each key (`_least_forwards`) from
    `forwards` (measured with `spans` over `rounds` rounds) and the standard
    errors it is judged by: while one of the `judged` keys' is undecided,
    the rounds so far are run again (`_CHECK_MAX_MULTIPLE`, `_CHECK_SE_AGAIN`)."""
    z, done = _CHECK_SE, rounds
    least = _least_forwards(forwards, z)
    while done < _CHECK_MAX_MULTIPLE * rounds and any(_undecided(least.get(key), z) for key in judged):
        more = _measure(model, spans, workload, done)[1]
        forwards = {i: (pairs + more[i][0], keys | more[i][1]) for i, (pairs, keys) in forwards.items() if i in more}
        z, done = _CHECK_SE_AGAIN, 2 * done
        least = _least_forwards(forwards, z)
    return least, z


def _solos(forwards: dict, call_pairs: dict, wins: dict, kept: dict, judged: list) -> set:
    """Per forward that made several winning keys' calls and did not keep
    one of the `judged` ones, the judged key it did not keep that saved the
    most device time in a run of the workload (cuBLAS's calls less the
    kernel's, trimmed mean): the one to measure that forward with alone."""
    saved = {key: trimmed_mean([c - k for c, k, _ in call_pairs[key]]) for key in judged}
    solos = set()
    for _, keys in forwards.values():
        lost = [key for key in keys if key in saved and not kept[key]]
        if lost and sum(wins.get(key, False) for key in keys) > 1:
            solos.add(max(lost, key=saved.get))
    return solos


def _beats(est: dict, z: float = _CHECK_SE) -> bool:
    """A `paired_speedup` estimate above 1.0 by `z` standard errors."""
    return _lower(est, z) > 0


def _undecided(est: dict | None, z: float) -> bool:
    """A forwards' estimate neither above nor below 1.0 by `z` standard errors."""
    return est is not None and _lower(est, z) <= 0 <= math.log(est["speedup"]) + z * est["log_se"]


def _least_forwards(forwards: dict, z: float) -> dict[tuple, dict]:
    """Per key, the estimate with the least lower bound (`z` standard errors)
    among the forwards ({i: (pairs, keys)}) that made its calls."""
    least = {}
    for pairs, keys in forwards.values():
        est = paired_speedup(pairs)
        for key in keys:
            if key not in least or _lower(est, z) < _lower(least[key], z):
                least[key] = est
    return least


def _lower(est: dict, z: float) -> float:
    """The log speedup less `z` standard errors."""
    return math.log(est["speedup"]) - z * est["log_se"]


def _verdicts(kept: dict[tuple, bool], layer: TunedLinear) -> dict[int, bool]:
    """`kept` (per (N, K, dtype, M) key) for `layer`'s shape, by M."""
    return {key[3]: v for key, v in kept.items() if key[:3] == _shape(layer)}


class _CallTimer:
    """Hooks that time, in a run of a workload (`time`), every call of the
    given layers that their `spans` send down the kernel path (whichever
    path the layer takes now: `check` swaps them) with CUDA events, and every
    forward of `model` on the host's clock after a sync."""

    def __init__(self, model: nn.Module, spans: dict[TunedLinear, tuple]) -> None:
        self._model, self._spans = model, spans
        self._devices = {layer.weight.device for layer in spans}
        self._open: dict[TunedLinear, tuple] = {}
        self._calls: list[tuple] = []
        self._forwards: list[list] = []  # [seconds, the keys its timed calls had]
        self._inside = False

    def __enter__(self) -> _CallTimer:
        self._hooks = [self._model.register_forward_pre_hook(self._forward_start),
                       self._model.register_forward_hook(self._forward_stop)]
        self._hooks += [hook for layer in self._spans for hook in
                        (layer.register_forward_pre_hook(self._start), layer.register_forward_hook(self._stop))]
        return self

    def __exit__(self, *exc) -> None:
        for hook in self._hooks:
            hook.remove()

    def _sync(self) -> float:
        for device in self._devices:
            torch.cuda.synchronize(device)
        return time.perf_counter()

    def _forward_start(self, model: nn.Module, args: tuple) -> None:
        self._inside = True
        self._forwards.append([-self._sync(), set()])

    def _forward_stop(self, model: nn.Module, args: tuple, output: object) -> None:
        self._forwards[-1][0] += self._sync()
        self._inside = False

    def _start(self, layer: TunedLinear, args: tuple) -> None:
        if not args:  # the input passed by keyword: the call goes untimed
            return
        x = args[0]
        m = x.numel() // layer.in_features
        if _inside(m, self._spans[layer]) and layer._fits(x, x.reshape(-1, layer.in_features)):
            if layer.tuner_graphs:
                # An eager forward of a small model leaves the device waiting on
                # the host, so the events would time the call's host path too,
                # which a replay does not run: the device is kept busy instead.
                with torch.cuda.stream(torch.cuda.current_stream(x.device)):
                    torch.cuda._sleep(_HOLD_CYCLES)
            self._open[layer] = ((*_shape(layer), m), self._event(x.device))

    def _stop(self, layer: TunedLinear, args: tuple, output: torch.Tensor) -> None:
        if layer in self._open:
            key, start = self._open.pop(layer)
            self._calls.append((key, start, self._event(output.device)))
            if self._inside:
                self._forwards[-1][1].add(key)

    @staticmethod
    def _event(device: torch.device) -> torch.cuda.Event:
        event = torch.cuda.Event(enable_timing=True)
        event.record(torch.cuda.current_stream(device))
        return event

    def time(self, workload: Callable[[], object]) -> tuple[dict[tuple, float], dict[int, tuple[float, set]]]:
        """Run `workload` once: the device seconds of each (N, K, dtype, M)
        key's timed calls, and per forward of the model (by its place in the
        run) its seconds and the keys of its timed calls."""
        self._calls, self._forwards = [], []
        workload()
        self._sync()
        seconds = defaultdict(float)
        for key, start, end in self._calls:
            seconds[key] += start.elapsed_time(end) / 1e3
        return seconds, {i: (s, keys) for i, (s, keys) in enumerate(self._forwards)}


def _trim(spans: tuple[tuple[int, int], ...], verdicts: dict[int, bool]) -> tuple[tuple[int, int], ...]:
    """`spans` less what the checked M that lost stand for: inside a span,
    each checked M stands for the M nearer to it than to the next checked M
    (split at their geometric mean); a span without a checked M stays."""
    kept: list[tuple[int, int]] = []
    for lo, hi in spans:
        points = sorted(m for m in verdicts if lo <= m <= hi)
        if not points:
            kept.append((lo, hi))
            continue
        cuts = [math.isqrt(a * b) for a, b in zip(points, points[1:])]
        for m, last, end in zip(points, [lo - 1] + cuts, cuts + [hi]):
            if not verdicts[m]:
                continue
            if kept and kept[-1][1] == last:
                kept[-1] = (kept[-1][0], end)
            else:
                kept.append((last + 1, end))
    return tuple(kept)


def _union(*groups: tuple[tuple[int, int], ...]) -> tuple[tuple[int, int], ...]:
    """The M that any of the groups of spans covers, as spans."""
    merged: list[tuple[int, int]] = []
    for lo, hi in sorted(span for group in groups for span in group):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1] = (merged[-1][0], max(hi, merged[-1][1]))
        else:
            merged.append((lo, hi))
    return tuple(merged)


def _inside(m: int, spans: tuple[tuple[int, int], ...]) -> bool:
    for lo, hi in spans:
        if lo <= m <= hi:
            return True
    return False


def _shape(layer: nn.Linear) -> tuple[int, int, torch.dtype]:
    return layer.out_features, layer.in_features, layer.weight.dtype


def _restore(layer: nn.Module) -> None:
    if type(layer) is TunedLinear:
        layer.__class__ = nn.Linear
        for name in ("_tuner_spans", "_tuner_compiled_spans", "_tuner_bounds", "_tuner_eager", "tuner_launchers",
                     "tuner_graphs", "tuner_gather"):
            layer.__dict__.pop(name, None)


def _costs(device: int, layers: list[TunedLinear], spans_of: dict) -> tuple[float, float]:
    """The (eager, compiled) host cost on `device` a saving must cover,
    measured on the first call (`_measure_host_costs`). Under online tuning
    every M may be measured and the savings are unknown (infinite): there is
    nothing to measure against."""
    if not any(math.isfinite(saving) for layer in layers for _, _, saving in spans_of[layer]):
        return 0.0, 0.0
    if device not in _host_costs:
        layer = min(layers, key=lambda m: m.weight.numel())
        _host_costs[device] = _measure_host_costs(layer, spans_of[layer][0][0])
    return _host_costs[device]


def _gather_cost(device: int, dtype: torch.dtype, spans: tuple) -> float:
    """What gathering strided rows costs a call on `device` (`_measure_gather_cost`),
    measured once; nothing to measure where every saving is unknown (online)."""
    if not any(math.isfinite(saving) for _, _, saving in spans):
        return 0.0
    if (device, dtype) not in _gather_costs:
        _gather_costs[device, dtype] = _measure_gather_cost(device, dtype)
    return _gather_costs[device, dtype]


def _measure_gather_cost(device: int, dtype: torch.dtype) -> float:
    """us per call of copying `_GATHER_MAX_BYTES` of strided rows into a
    contiguous tensor on `device`: the fastest of batches of copies, synced
    at both ends of each, so the host's launch or the device's copy,
    whichever is slower, counts."""
    k = 8192
    rows = torch.empty(_GATHER_MAX_BYTES // (k * dtype.itemsize), 2, k, device=f"cuda:{device}", dtype=dtype)[:, -1]
    best = math.inf
    for _ in range(_COST_BATCHES):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(_COST_CALLS):
            rows.contiguous()
        torch.cuda.synchronize(device)
        best = min(best, (time.perf_counter() - start) / _COST_CALLS)
    return 1e6 * best


def _measure_host_costs(layer: TunedLinear, m: int) -> tuple[float, float]:
    """Host us per call that the kernel path adds over cuBLAS's, (eager,
    compiled), on `layer` at M = `m`: the launch kept by `TunedLinear`
    against `F.linear` on an input of (batch, sequence, features), as a
    model's layers take it, and the registered op against `torch.mm` into a
    given output (what a compiled graph calls for a linear), each timed by
    `host_us_per_call`; a negative difference is none."""
    w = layer.weight
    x = torch.randn(1, m, layer.in_features, device=w.device, dtype=w.dtype)
    rows, wt, out = x[0], w.t(), torch.empty(m, layer.out_features, device=w.device, dtype=w.dtype)

    paths = {
        "kernel": lambda: layer._tuned(x), "linear": lambda: F.linear(x, w),
        "op": lambda: torch.ops.gemm_tuner.gemm(rows, wt, None), "mm": lambda: torch.mm(rows, wt, out=out),
    }
    with torch.no_grad():
        us = host_us_per_call(paths, w.device)
    return max(0.0, us["kernel"] - us["linear"]), max(0.0, us["op"] - us["mm"])


def host_us_per_call(paths: dict[str, Callable[[], object]], device: torch.device | None = None,
                     batches: int = _COST_BATCHES, calls: int = _COST_CALLS) -> dict[str, float]:
    """Host us per call of each of `paths` on CUDA `device`: each is called
    once first (to decide, build and keep its launch), then in `batches`
    batches of `calls` calls without a sync, so a batch's wall time is
    the host's (the device's queue does not fill); a path's fastest batch
    counts (the host's noise only adds). The paths' batches interleave, so a
    slow spell of the host (another process, a clock change) hits every
    path alike."""
    best = dict.fromkeys(paths, math.inf)
    for fn in paths.values():
        fn()
    for _ in range(batches):
        for name, fn in paths.items():
            torch.cuda.synchronize(device)
            start = time.perf_counter()
            for _ in range(calls):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / calls)
    torch.cuda.synchronize(device)
    return {name: 1e6 * s for name, s in best.items()}


@contextlib.contextmanager
def patched(model: nn.Module, *, bias: bool = False, graphs: bool = False,
            compiled: bool = True, pdl: bool = False, overlap: int = 0, fuse: bool = False) -> Iterator[nn.Module]:
    """`patch(model, ...)` with these options for the block, `unpatch(model)` after it."""
    patch(model, bias=bias, graphs=graphs, compiled=compiled, pdl=pdl, overlap=overlap, fuse=fuse)
    try:
        yield model
    finally:
        unpatch(model)


_DTYPE_NAME = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def _eligible(module: nn.Module) -> bool:
    if type(module) not in (nn.Linear, TunedLinear):
        return False
    w = module.weight
    return w.is_cuda and w.dtype in _DTYPES and w.dim() == 2 and w.is_contiguous()


def _describe(w: torch.Tensor) -> str:
    return f"{str(w.dtype).removeprefix('torch.')} on {w.device.type}"
