"""End to end: Hugging Face models with their linear layers as they are and
patched (`tuner.patch`), eager and under torch.compile.

    python -m bench.e2e --db DB [--tune gpu|model|none] [--tune-only] [--trials N]
                        [--models gemma-3-27b,llama-3.1-8b,qwen2.5-7b] [--layers 2]
                        [--prefill 1x512,4x1024|none] [--decode 1,16] [--steps 64] [--prompt 128]
                        [--rounds 300] [--decode-rounds 20] [--check-rounds 30]
                        [--modes eager,compiled] [--graphs] [--pdl] [--fuse] [--fused-baseline]
                        [--out bench/results]

Each model is built by `transformers` from its shipped config
(`tuner/data/models/`) truncated to `--layers` decoder layers, with random
bf16 weights on the GPU (transformers' own init, seed 0; nothing is
downloaded).

1. Keys: a shape file of every distinct linear (N, K) of the models at the M
   the runs below call (decoder layers: batch x seq of each prefill and the
   batch of each decode; lm_head: the batches only, as the logits are those of
   the last position) is tuned into DB with `tuner tune --backend B`, ladders
   on (a rerun skips what is current); a mixture of experts' grouped products
   too (`groups=E`, top-k rows a token), which `patch` routes through the
   grouped dispatch (the record's `experts_blocks`). `--tune-only` stops there.
2. Check: each model's patched copy is checked (`tuner.check`) on one forward
   of each prefill case and one decode step at each batch, `--check-rounds`
   rounds, as a user checks on their own workload: kernel intervals whose
   kernel did not win inside the forward go back to cuBLAS (its doc).
3. Runs, per model: prefill at each batch x seq (one forward of the prompt,
   no cache, logits of the last position; tokens/s = batch x seq / time) and
   decode at each batch (`--steps` greedy one-token steps into a static KV
   cache after a `--prompt`-token prefill that is not timed; tokens/s =
   batch x steps / time), each unpatched and patched, eager and under
   `torch.compile` (compiled anew for each case, so for its static shapes).
   Compiled, the variants are two copies of the model with the same
   weights, one patched, as a user patches once and then runs: toggling one
   model between the variants would time the first call after each `patch`
   (a dynamo guard miss, the layers' launch caches refilled) instead. Each
   copy plays each variant for half the rounds, with its own KV cache, and
   each variant leads half the rounds (`_both_ways`), so that what sets one
   copy or one place in the order apart cancels. Eager, the variants are
   one model, patched as an eager-only user patches it
   (`patch(compiled=False)`, with the intervals the check left), in two
   roles (`_Role`): before each call its patched layers take the role's
   class, `TunedLinear` or `nn.Linear` (an assignment per layer, made in
   both roles alike; the layers keep their intervals and kept launches), so
   that the weights, the code around the layers and where the forward's
   tensors land are the same in both: two copies that made no kernel call
   read 0.989-1.000 apart, with both halves of a case on the same side.
   Layers with a bias (Qwen's q, k, v) stay with cuBLAS, as `patch` does by
   default. The two variants alternate, timed on the host clock after a
   sync (the host's cost is part of what a user waits for): prefill one
   forward each per round; decode one step each, `--steps` pairs per round,
   each variant on its own KV cache (pairing step by step cancels drift over
   a loop, which pairing whole loops left in: a patched model that ran no
   kernel measured 0.96-1.04x). The speedup is patched over unpatched
   tokens/s from the paired log ratios, the pairs where patched ran first
   and those where it ran second averaged apart (`paired_speedup`), with
   its standard error (or half the log distance between the two halves'
   estimates, where that is larger: `_speed`).
4. Outputs (untimed, after each case's timed rounds): patched logits
   against the unpatched copy's in the same mode, compiled against
   compiled, since Inductor's own fusions move a compiled model's logits by
   up to 2 % from its eager ones with no kernel of ours in it. Prefill: the
   relative Frobenius error (`_rel_err`) of the last position's logits.
   Decode: both variants are fed the same tokens, teacher-forced: the
   unpatched copy decodes `--steps` greedy steps after the prompt
   (`_greedy`), the patched one is fed that run's tokens step by step
   (`_forced`), and `rel_err` is the largest over the steps of each step's
   logits' error. Free-running greedy sequences of random weights part
   after a few steps (11 % of the tokens agreed), and then compare logits
   of different tokens. `token_agreement` is the share of steps and rows
   whose argmax agrees under that forcing: information only, as random
   weights leave near-ties that bf16 rounding flips. `rel_err` of every
   case within `REL_ERR_LIMIT` (2e-2) is the summary's
   `outputs_within_limit`.

With `--graphs` the models run as a serving engine runs its decode steps:
the patched copy is patched with `patch(graphs=True)` (every kernel interval
of the maps, judged by `check` on its calls' device time alone), and every
case's callable, eager or compiled, is captured in a CUDA graph on its first
call (after a warm-up call) and replayed after, its inputs copied into the
captured ones (`_Graphed`). A replay runs no host code of the model, so
this is where the kernels' device time reaches the tokens per second.
`--pdl` patches with the winners' pdl builds (`patch(pdl=True)`: each
kernel's weight loads start while the kernel before it drains), to tell
what that is worth inside a step against a run without it. `--fuse`
patches with `patch(fuse=True)`: q, k and v, and gate and up, each one
product over their weights together (`tuner.runtime.fusion`), looked up in
the fused shapes' families, which `--tune gpu` then tunes too. Part of
what that gains is the fusing itself, which a serving engine already does
(it stores these weights fused): `--fused-baseline` fuses the unpatched
copy's siblings too, on cuBLAS, so the ratio is the kernels' alone.
Decode at the DRAM floor (8 decoder layers, batches 1, 4 and 16, no prefill
case; `--models` one at a time fits the GPU machine's limit per command):

    python -m bench.e2e --db DB --tune none --graphs --layers 8 --prefill none --decode 1,4,16

`--tune none` takes DB as it is (a family's map covers every M between
those it was tuned at, batch 4 among them; a family DB lacks runs cuBLAS in
both variants); `--tune gpu` (the default) first tunes those keys into it.

Writes `<out>/<device-slug>-e2e[-MODELS][-MODES][-graphs][-Nlayers][-pdl][-fuse][-fusedbase].json` (`$OUT`
instead of `--out` when set; the suffixes name a subset of models or modes, a
layer count other than 2, pdl builds, fused siblings, a fused baseline; the file
is rewritten after every case, so a run cut short keeps what it measured):
per model what the check measured, and per case the tokens/s of each
variant, the speedup, the errors, and how many linear calls of a forward may
run a tuned kernel (their M inside their family's kernel intervals).
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

import torch

from bench.dynamic_m import compile_choices
from bench.kernels_sm90 import device_slug
from bench.record import save
from tuner import check, unpatch
from tuner.runtime import dispatch, experts, fusion
from tuner import patch
from tuner.runtime.linears import build_model, config_path, expert_keys, linear_shapes, load_config
from tuner.backends.measure import gc_paused, paired_speedup, trimmed_mean
from tuner.runtime.patch import PatchWarning, TunedLinear, host_costs

MODELS = ("gemma-3-27b", "llama-3.1-8b", "qwen2.5-7b")
DEVICE = "cuda"
VARIANTS = ("unpatched", "patched")
_MODES = ("eager", "compiled")
REL_ERR_LIMIT = 2e-2  # bf16 over a few layers, as the tuner's own gate
_WARMUPS = 3  # untimed calls before a graph capture


def _pairs(text: str) -> list[tuple[int, int]]:
    """batch x seq pairs, comma-separated; "none" (or nothing) for none."""
    if text.strip().lower() in ("", "none"):
        return []
    return [tuple(int(v) for v in part.split("x")) for part in text.split(",")]


def _batches(text: str) -> list[int]:
    """Decode batches, comma-separated; "none" (or nothing) for none."""
    if text.strip().lower() in ("", "none"):
        return []
    return [int(v) for v in text.split(",")]


def shape_file(models: list[str], layers: int, prefill: list[tuple[int, int]], decode: list[int],
               fuse: bool = False) -> str:
    """The shape file of the keys the runs call (module doc, step 1); with
    `fuse`, those of the fused siblings' products too."""
    layer_ms = sorted({b * s for b, s in prefill} | set(decode))
    head_ms = sorted({b for b, _ in prefill} | set(decode))
    lines = []
    for name in models:
        model = build_model(name, num_layers=layers)
        for s in linear_shapes(model):
            ms = head_ms if s.names == ("lm_head",) else layer_ms
            lines.append(f"{','.join(map(str, ms))} {s.n} {s.k} name={name}.{s.label}")
        for label, n, k in fusion.sibling_shapes(model) if fuse else ():
            lines.append(f"{','.join(map(str, layer_ms))} {n} {k} name={name}.fused.{label}")
        # A mixture of experts' grouped products: top-k rows a token.
        path = config_path(name)
        top_k, grouped, _ = expert_keys(model, load_config(path) if path else {})
        for label, e, n, k in grouped:
            lines.append(f"{','.join(str(m * top_k) for m in layer_ms)} {n} {k} groups={e} name={name}.{label}")
    return "\n".join(lines) + "\n"


def tune(args: argparse.Namespace) -> None:
    text = shape_file(args.models, args.layers, args.prefill, args.decode, args.fuse)
    with tempfile.NamedTemporaryFile("w", suffix=".txt", delete=False) as f:
        f.write(text)
    cmd = [sys.executable, "-m", "tuner.cli", "tune", "--shapes", f.name, "--backend", args.tune, "--db", args.db]
    if args.trials:
        cmd += ["--trials", str(args.trials)]
    print(" ".join(cmd), file=sys.stderr)
    started = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=sys.stderr)
    print(f"tuned in {time.perf_counter() - started:.0f} s", file=sys.stderr)
    os.unlink(f.name)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.float(), want.float()
    return (torch.linalg.vector_norm(got - want) / torch.linalg.vector_norm(want)).item()


def _timed(fn) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _paired(trial, rounds: int, lead: tuple[str, str]) -> list[tuple[float, float, bool]]:
    """The pairs (unpatched s, patched s, whether patched ran first) that
    `trial(order)` returns, run `rounds` times after a warm-up, alternating
    the order, `lead` first (and in the warm-up, which compiles)."""
    pairs = []
    for _ in range(2):  # warm-up: compiles, decides and builds
        trial(lead)
    with gc_paused():
        for r in range(rounds):
            pairs += trial(lead if r % 2 == 0 else lead[::-1])
    return pairs


def _speed(halves: list[list[tuple[float, float, bool]]], per_s: int) -> dict:
    """Tokens per second of each variant (`per_s` tokens a sample) and the
    speedup (`paired_speedup`) of the pairs of both halves (`_both_ways`).
    The standard error is the pairs' own, or half the log distance between
    the halves' estimates where that is larger: what the copies' roles set
    apart is noise the pairs inside one half cannot see."""
    pairs = [p for half in halves for p in half]
    est = paired_speedup(pairs)
    split = [paired_speedup(half)["speedup"] for half in halves]
    times = {"unpatched": [u for u, _, _ in pairs], "patched": [p for _, p, _ in pairs]}
    return {"tokens_per_s": {v: per_s / trimmed_mean(t) for v, t in times.items()}, "speedup": est["speedup"],
            "log_se": max(est["log_se"], abs(math.log(split[0] / split[1])) / 2), "halves": split,
            "order_effect": est["order_effect"], "log_spread": est["spread"], "pairs": est["samples"]}


def _both_ways(models: dict, mode: str, measure, graphs: bool) -> list[list[tuple[float, float, bool]]]:
    """The pairs of `measure(fns, lead)` ({variant: callable}, the order to
    run them in first -> pairs; each callable replayed from a CUDA graph
    under `graphs`), run with the variants as they are and again
    with the copies' roles swapped (`_swap`) and the other variant leading,
    so that what sets one copy or one place in the order apart cancels:
    where its tensors and its KV cache lie in memory, which one compiles
    first (copies that ran the same code measured up to 0.6 % apart in a
    decode step). Compiled callables start from an empty dynamo cache, so
    each case compiles for its own static shapes. Returns the two halves'
    pairs; the roles are as they were after."""
    halves = []
    for lead in (VARIANTS, VARIANTS[::-1]):
        if mode == "compiled":
            torch._dynamo.reset()
        fns = {v: torch.compile(m) if mode == "compiled" else m for v, m in models.items()}
        halves.append(measure({v: _Graphed(fn) if graphs else fn for v, fn in fns.items()}, lead))
        _swap(models)
    return halves


class _Graphed:
    """`fn(**kwargs)` captured in a CUDA graph on its first call and replayed
    on every call after: tensor arguments are copied into the captured ones
    (same shapes), the others (a KV cache) must be the very objects of the
    first call, and the output is the captured one, overwritten by the next
    replay. The first call runs `fn` `_WARMUPS` times untimed on a side
    stream before capturing: every key's kernel is decided and built then,
    as capture needs (`tuner.runtime.dispatch`)."""

    def __init__(self, fn) -> None:
        self._fn, self._graph = fn, None

    def __call__(self, **kwargs):
        if self._graph is None:
            self._inputs = {k: v.clone() if torch.is_tensor(v) else v for k, v in kwargs.items()}
            side = torch.cuda.Stream()
            side.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side):
                # A compiled decode step recompiled once its cache's counters
                # had moved, inside the capture (which cannot run the compile).
                for _ in range(_WARMUPS):
                    self._fn(**self._inputs)
            torch.cuda.current_stream().wait_stream(side)
            self._graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(self._graph):
                self._output = self._fn(**self._inputs)
        for k, v in kwargs.items():
            if torch.is_tensor(v):
                self._inputs[k].copy_(v)
            elif v is not self._inputs[k]:
                raise ValueError(f"_Graphed: {k} is not the object the graph was captured with")
        self._graph.replay()
        return self._output


class _Role:
    """One patched model playing one variant of the eager runs: a call sets
    its patched layers' class for the variant (`patched`) and runs the
    model. It owns a KV cache of its own (keyed by the role, as a copy's is),
    and the roles trade variants like copies (`_swap`)."""

    def __init__(self, model: torch.nn.Module, layers: list, patched: bool, fused_baseline: bool = False) -> None:
        self.model, self._layers, self.patched = model, layers, patched
        self._siblings = [m for m in model.modules() if type(m) is fusion.FusedSibling]
        # The fused groups' products, patched apart from the model's modules.
        self._products = [g.linear for g in fusion.groups(model) if type(g.linear) is TunedLinear]
        self._fused_baseline = fused_baseline
        # Experts blocks `patch` switched to the grouped dispatch.
        self._experts = [b for b in experts.grouped_blocks(model)
                         if b.config._experts_implementation == experts.IMPLEMENTATION]

    @property
    def config(self):
        return self.model.config

    def apply(self) -> None:
        cls = TunedLinear if self.patched else torch.nn.Linear
        for layer in self._layers:
            layer.__class__ = cls
        for layer in self._siblings:
            layer.__class__ = fusion.FusedSibling if self.patched or self._fused_baseline else torch.nn.Linear
        for layer in self._products:
            layer.__class__ = cls
        for block in self._experts:
            experts.use(block, experts.IMPLEMENTATION if self.patched else experts.GROUPED)

    def __call__(self, **kwargs):
        self.apply()
        return self.model(**kwargs)


def _roles(model: torch.nn.Module, fused_baseline: bool = False) -> dict:
    """{variant: _Role} of a patched model; with `fused_baseline` the
    unpatched variant keeps the siblings fused, on cuBLAS."""
    layers = [m for m in model.modules() if type(m) is TunedLinear]
    return {v: _Role(model, layers, v == "patched", fused_baseline) for v in VARIANTS}


def _fuse_plain(model: torch.nn.Module) -> None:
    """`model`'s sibling projections fused and left on cuBLAS, as a serving
    engine stores them: the baseline of `--fused-baseline`."""
    fusion.fuse(model, lambda m: type(m) is torch.nn.Linear)


def _swap(models: dict) -> None:
    """The unpatched copy takes the patched one's layers as they are (the
    intervals `patch` and `check` left them), and the patched copy is
    unpatched; roles (`_Role`) trade their variants."""
    if isinstance(models["patched"], _Role):
        done, fresh = models["patched"], models["unpatched"]
        done.patched, fresh.patched = False, True
        models["unpatched"], models["patched"] = done, fresh
        fresh.apply()
        return
    done, fresh = models["patched"], models["unpatched"]
    graphs = any(getattr(layer, "tuner_graphs", False) for layer in done.modules())
    pdl = any(getattr(layer, "tuner_pdl", False) for layer in done.modules())
    fused_baseline = bool(fusion.groups(fresh))
    _patch_like(fresh, done, graphs=graphs, compiled=True, pdl=pdl, fuse=bool(fusion.groups(done)))
    unpatch(done)
    if fused_baseline:
        _fuse_plain(done)
    models["unpatched"], models["patched"] = done, fresh


def _patch_like(model: torch.nn.Module, checked: torch.nn.Module, *, graphs: bool, compiled: bool,
                pdl: bool, fuse: bool) -> None:
    """Patch `model` (`patch(graphs=, compiled=, pdl=, fuse=)`) and give its
    layers the intervals `checked`'s twins were left with (by `patch` and
    `check`): the eager ones, and the compiled ones where `compiled`; a
    layer left with none is an `nn.Linear`. Fused siblings keep what
    `patch` gave their products."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the first patch's warnings are in the record
        patch(model, graphs=graphs, compiled=compiled, pdl=pdl, fuse=fuse)
    for name, layer in checked.named_modules():
        if not isinstance(layer, torch.nn.Linear) or type(layer) is fusion.FusedSibling:
            continue
        twin = model.get_submodule(name)
        if type(twin) is TunedLinear and hasattr(layer, "tuner_spans") and (layer.tuner_spans or compiled):
            twin.tuner_spans = layer.tuner_spans
            twin.tuner_compiled_spans = layer.tuner_compiled_spans if compiled else ()
            twin.tuner_gather = layer.tuner_gather
        else:
            unpatch(twin)


def _kernel_calls(layers: dict[str, torch.nn.Linear], linears: int, m_layers: int, m_head: int, head_strided: bool) -> dict:
    """Per mode, (linear calls of one forward that run a tuned kernel: their
    M inside the patched layer's intervals for that mode, all linear calls);
    with `head_strided`, the logits' input rows are strided, and lm_head
    takes the kernel only where it gathers them too."""
    def hits(mode: int) -> int:
        runs = 0
        for name, layer in layers.items():
            m = m_head if name.endswith("lm_head") else m_layers
            spans = (layer.tuner_spans, layer.tuner_compiled_spans)[mode]
            runs += any(lo <= m <= hi for lo, hi in spans) and not (
                head_strided and name.endswith("lm_head") and not layer.tuner_gathers(m))
        return runs
    return {"eager": (hits(0), linears), "compiled": (hits(1), linears)}


def bench_model(name: str, args: argparse.Namespace, checkpoint) -> dict:
    """The model's cases; `checkpoint(record)` after each (a run cut short keeps what it measured)."""
    torch.manual_seed(0)
    model = build_model(name, num_layers=args.layers, device=DEVICE, dtype=torch.bfloat16)
    tuned = copy.deepcopy(model)
    if args.fused_baseline:
        _fuse_plain(model)
    families = [{"n": s.n, "k": s.k, "names": list(s.names)} for s in linear_shapes(model)]
    print(f"compiled {compile_choices(args.db, [(f['n'], f['k']) for f in families])} kernels", file=sys.stderr)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        patch(tuned, graphs=args.graphs, pdl=args.pdl, fuse=args.fuse)
        checked = check(tuned, _workload(tuned, args), rounds=args.check_rounds) if args.check_rounds else []
    for c in checked:
        print(f"{name:12s} check {c.n}x{c.k} M={c.m}: calls x{c.speedup:.3f} (2 se {2 * c.log_se:.3f}), "
              f"forwards x{c.forward_speedup or math.nan:.3f} (2 se {2 * (c.forward_log_se or math.nan):.3f}): "
              f"{'kept' if c.kept else 'forwards did not win: to cuBLAS' if c.calls_won else 'to cuBLAS'}", file=sys.stderr)
    models = {"unpatched": model, "patched": tuned}
    # Eager runs (not replayed): a third copy, as `patch(compiled=False)` and the check leave it.
    roles = {}
    if "eager" in args.modes and not args.graphs:
        eager = copy.deepcopy(model)
        _patch_like(eager, tuned, graphs=False, compiled=False, pdl=args.pdl, fuse=args.fuse)
        roles = _roles(eager, args.fused_baseline)
    patched_layers = {name: m for name, m in tuned.named_modules() if hasattr(m, "tuner_spans")}
    # A fused group's product is one linear call (named for its siblings' module) in place of theirs.
    for name, m in tuned.named_modules():
        group = m.tuner_group if type(m) is fusion.FusedSibling else None
        if group and m is group.layers[0] and hasattr(group.linear, "tuner_spans"):
            patched_layers[f"{name.rpartition('.')[0]}.fused"] = group.linear
    linears = sum(isinstance(m, torch.nn.Linear) for m in model.modules()) - sum(
        len(group.layers) - 1 for group in fusion.groups(tuned))
    warned = [str(w.message) for w in caught if issubclass(w.category, PatchWarning)]  # not transformers' own
    blocks = experts.grouped_blocks(tuned)
    record = {"model": name, "layers": args.layers, "graphs": args.graphs, "patch_warnings": warned,
              "families": families, "fused_groups": len(fusion.groups(tuned)),
              "check": [dataclasses.asdict(c) for c in checked],
              # Mixture-of-experts blocks, and those `patch` put on the grouped dispatch.
              "experts_blocks": {"all": len(blocks), "on_grouped_dispatch": sum(
                  b.config._experts_implementation == experts.IMPLEMENTATION for b in blocks)},
              "kernel_spans": {name: {kind: [list(span) for span in getattr(m, f"tuner_{spans}")]
                                      for kind, spans in (("eager", "spans"), ("compiled", "compiled_spans"),
                                                          ("gather", "gather"))}
                               for name, m in patched_layers.items()},
              "host_cost_us": dict(zip(_MODES, host_costs() or ())),
              "prefill": [], "decode": []}
    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator(device=DEVICE).manual_seed(0)
    with torch.inference_mode():
        for batch, seq in args.prefill:
            ids = torch.randint(0, vocab, (batch, seq), device=DEVICE, generator=gen)
            # The logits' input of a batch of sequences is their last rows: strided.
            case = {"batch": batch, "seq": seq,
                    "kernel_calls": _kernel_calls(patched_layers, linears, batch * seq, batch, head_strided=batch > 1)}
            def run(fn, ids=ids):
                return fn(input_ids=ids, logits_to_keep=1, use_cache=False).logits

            for mode in _MODES:
                if mode not in args.modes:
                    continue
                errors = []

                def measure(fns, lead):
                    def trial(order):
                        s = {v: _timed(lambda v=v: run(fns[v])) for v in order}
                        return [(s["unpatched"], s["patched"], order[0] == "patched")]
                    pairs = _paired(trial, args.rounds // 2, lead)
                    errors.append(_rel_err(run(fns["patched"]), run(fns["unpatched"])))
                    return pairs

                case[mode] = {**_speed(_both_ways(_cast(models, roles, mode, args.graphs), mode, measure,
                                                  args.graphs), batch * seq), "rel_err": max(errors)}
            _report(name, "prefill", case)
            record["prefill"].append(case)
            checkpoint(record)
        for batch in args.decode:
            record["decode"].append(_decode_case(models, roles, batch, vocab, gen, args))
            record["decode"][-1]["kernel_calls"] = _kernel_calls(patched_layers, linears, batch, batch, head_strided=False)
            _report(name, "decode", record["decode"][-1])
            checkpoint(record)
    del model, tuned, models, roles
    torch._dynamo.reset()
    torch.cuda.empty_cache()
    return record


def _cast(models: dict, roles: dict, mode: str, graphs: bool) -> dict:
    """Who plays the variants: the eager-only copy's roles eager, the two
    copies compiled or replayed from graphs (module doc, step 3)."""
    return roles if mode == "eager" and not graphs else models


def _workload(model, args: argparse.Namespace):
    """`check`'s workload: one forward of each prefill case and one decode
    step at each batch (into a cache of its own, emptied first: transformers
    5's StaticCache counts the positions written, and the check's runs would
    take it past its length), on inputs of their own."""
    from transformers import StaticCache

    vocab = model.config.get_text_config().vocab_size
    gen = torch.Generator(device=DEVICE).manual_seed(1)
    prompts = [torch.randint(0, vocab, (b, s), device=DEVICE, generator=gen) for b, s in args.prefill]
    steps = [(torch.randint(0, vocab, (b, 1), device=DEVICE, generator=gen),
              StaticCache(config=model.config, max_cache_len=args.prompt + 1)) for b in args.decode]
    position = torch.tensor([args.prompt], device=DEVICE)

    def run():
        for ids in prompts:
            model(input_ids=ids, logits_to_keep=1, use_cache=False)
        for token, cache in steps:
            cache.reset()
            model(input_ids=token, past_key_values=cache, cache_position=position)
    return run


def _decode_case(models: dict, roles: dict, batch: int, vocab: int, gen, args) -> dict:
    """Greedy decode steps into one static KV cache per variant; timing pairs
    the variants step by step (one step of each, alternating which goes first,
    each timed alone on the host clock after a sync, as a generate loop that
    checks its stopping rule syncs every step), so that drift of the host's or
    the GPU's clocks over a loop cancels."""
    from transformers import StaticCache

    prompt = torch.randint(0, vocab, (batch, args.prompt), device=DEVICE, generator=gen)
    first = torch.randint(0, vocab, (batch, 1), device=DEVICE, generator=gen)
    # A cache per copy (or role), not per variant: it changes variants with its copy (`_both_ways`).
    caches = {id(m): StaticCache(config=m.config, max_cache_len=args.prompt + args.steps)
              for m in [*models.values(), *roles.values()]}
    positions = [torch.tensor([args.prompt + i], device=DEVICE) for i in range(args.steps)]

    def prefill(v):
        """The prompt into variant `v`'s empty cache, eager, untimed."""
        caches[id(cast[v])].reset()
        cast[v](input_ids=prompt, past_key_values=caches[id(cast[v])],
                cache_position=torch.arange(args.prompt, device=DEVICE), logits_to_keep=1)

    def step(fn, v, token, pos):
        """One decode step of `fn` on variant `v`'s cache: the new position's logits."""
        return fn(input_ids=token, past_key_values=caches[id(cast[v])], cache_position=pos).logits[:, -1]

    def stepper(fn, v):
        """Variant `v`'s steps, untimed, after the prompt into its emptied
        cache: `(token, i) -> step i's logits` (`_greedy`, `_forced`)."""
        prefill(v)
        return lambda token, i: step(fn, v, token, positions[i])

    case = {"batch": batch, "prompt": args.prompt, "steps": args.steps}
    for mode in _MODES:
        if mode not in args.modes:
            continue
        cast = _cast(models, roles, mode, args.graphs)
        errors, agreements = [], []

        def measure(fns, lead):
            # A step replayed from a graph (`_Graphed`) is captured on its first
            # call, which runs the step once more; the cache counts the
            # positions it was written (transformers 5's StaticCache), so a
            # capture inside a trial would run it past its length.
            for v in VARIANTS:
                prefill(v)
                step(fns[v], v, first, positions[0])

            def trial(order):
                for v in VARIANTS:
                    prefill(v)
                token = dict.fromkeys(VARIANTS, first)
                pairs = []
                for i, pos in enumerate(positions):
                    this = order if i % 2 == 0 else order[::-1]
                    s = {}
                    for v in this:
                        def greedy(v=v, pos=pos):
                            token[v] = step(fns[v], v, token[v], pos).argmax(-1, keepdim=True)
                        s[v] = _timed(greedy)
                    pairs.append((s["unpatched"], s["patched"], this[0] == "patched"))
                return pairs
            pairs = _paired(trial, args.decode_rounds // 2, lead)
            # Outputs (module doc, step 4): the patched steps fed the unpatched steps' greedy tokens.
            want, tokens = _greedy(stepper(fns["unpatched"], "unpatched"), first, len(positions))
            error, agreement = _forced(stepper(fns["patched"], "patched"), first, want, tokens)
            errors.append(error)
            agreements.append(agreement)
            return pairs

        case[mode] = {**_speed(_both_ways(cast, mode, measure, args.graphs), batch), "rel_err": max(errors),
                      "token_agreement": min(agreements)}
    return case


def _greedy(step, first: torch.Tensor, steps: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """`steps` greedy decode steps of `step(token, i) -> logits (batch,
    vocab)` from `first` (batch, 1): every step's logits (copies: a graph's
    replay overwrites its output) and the token each step picked (argmax,
    fed to the next)."""
    token, logits, tokens = first, [], []
    for i in range(steps):
        last = step(token, i)
        logits.append(last.clone())
        token = last.argmax(-1, keepdim=True)
        tokens.append(token)
    return logits, tokens


def _forced(step, first: torch.Tensor, want: list[torch.Tensor], tokens: list[torch.Tensor]) -> tuple[float, float]:
    """`step` teacher-forced on a `_greedy` run's tokens (`first`, then the
    run's token of each step), each step's logits against that run's `want`
    on the same inputs: (the largest relative error over the steps
    (`_rel_err`), the share of steps and rows whose argmax agrees)."""
    token, errors, agree = first, [], []
    for i, (reference, fed) in enumerate(zip(want, tokens, strict=True)):
        last = step(token, i)
        errors.append(_rel_err(last, reference))
        agree.append((last.argmax(-1) == reference.argmax(-1)).float().mean().item())
        token = fed
    return max(errors), statistics.fmean(agree)


def _label(kind: str, case: dict) -> str:
    return f"{kind} {case['batch']}x{case['seq']}" if kind == "prefill" else f"{kind} {case['batch']}"


def _report(name: str, kind: str, case: dict) -> None:
    parts = [f"{name:12s} {_label(kind, case):16s}"]
    for mode in _MODES:
        if mode in case:
            c, (hits, calls) = case[mode], case["kernel_calls"][mode]
            parts.append(f"{mode} kernels {hits}/{calls} {c['tokens_per_s']['unpatched']:9.0f} -> "
                         f"{c['tokens_per_s']['patched']:9.0f} tok/s x{c['speedup']:.3f} "
                         f"(2 se {2 * c['log_se']:.3f}) err {c['rel_err']:.1e}")
    print(" | ".join(parts), file=sys.stderr)


def run(args: argparse.Namespace, checkpoint) -> dict:
    torch._dynamo.config.recompile_limit = 64  # a graph per variant, and per step count where an int is specialized
    dispatch.configure(args.db)
    record = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "db": os.path.basename(args.db),
              "rounds": args.rounds, "decode_rounds": args.decode_rounds, "steps": args.steps,
              "rel_err_limit": REL_ERR_LIMIT, "pdl": args.pdl, "fuse": args.fuse,
              "fused_baseline": args.fused_baseline, "models": []}
    import transformers

    record["transformers"] = transformers.__version__
    for name in args.models:
        record["models"].append({})
        bench_model(name, args, lambda model: (record["models"].__setitem__(-1, model), checkpoint(record)))
    record["summary"] = summarize(record["models"])
    return record


def summarize(models: list[dict]) -> dict:
    """Over every case of every model: the speedups' least and geometric
    mean, the cases slower past their noise, those where the patched copy
    made no kernel call, and the outputs' worst error."""
    runs = [(f"{m['model']} {_label(kind, c)} {mode}", c, mode) for m in models
            for kind in ("prefill", "decode") for c in m[kind] for mode in _MODES if mode in c]
    cases = [c[mode] for _, c, mode in runs]
    return {
        "cases": len(cases), "min_speedup": min(c["speedup"] for c in cases),
        "geomean_speedup": math.exp(statistics.fmean(math.log(c["speedup"]) for c in cases)),
        # Slower only where the estimate is below 1.0 by more than its noise.
        "slower_beyond_2se": [label for label, c, mode in runs
                              if math.log(c[mode]["speedup"]) + 2 * c[mode]["log_se"] < 0],
        # The patched copy ran the unpatched code there: its ratio is noise around 1.0.
        "without_kernel_calls": [label for label, c, mode in runs if not c["kernel_calls"][mode][0]],
        "max_rel_err": max(c["rel_err"] for c in cases),
        "outputs_within_limit": all(c["rel_err"] <= REL_ERR_LIMIT for c in cases),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("--tune", choices=("gpu", "model", "none"), default="gpu")
    parser.add_argument("--tune-only", action="store_true")
    parser.add_argument("--trials", type=int, default=None, help="Trials per listed key (tune's default if unset).")
    parser.add_argument("--models", type=lambda t: t.split(","), default=list(MODELS))
    parser.add_argument("--layers", type=int, default=2, help="Decoder layers each model is truncated to.")
    parser.add_argument("--prefill", type=_pairs, default=_pairs("1x512,4x1024"),
                        help="batch x seq, comma-separated; none for no prefill case.")
    parser.add_argument("--decode", type=_batches, default=[1, 16],
                        help="Decode batches, comma-separated; none for no decode case.")
    parser.add_argument("--steps", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=300, help="Paired forwards per prefill case.")
    parser.add_argument("--decode-rounds", type=int, default=20,
                        help="Rounds of --steps paired steps per decode case.")
    parser.add_argument("--check-rounds", type=int, default=30,
                        help="Rounds of tuner.check on one call of each case after patching (0: no check).")
    parser.add_argument("--modes", type=lambda t: t.split(","), default=list(_MODES),
                        help="eager, compiled or both (comma-separated).")
    parser.add_argument("--graphs", action="store_true",
                        help="Patch for CUDA graphs and replay every case from one (module doc).")
    parser.add_argument("--pdl", action="store_true",
                        help="Patch with the winners' pdl builds (`patch(pdl=True)`).")
    parser.add_argument("--fuse", action="store_true",
                        help="Patch with sibling projections fused (`patch(fuse=True)`).")
    parser.add_argument("--fused-baseline", action="store_true",
                        help="The unpatched copy fuses its siblings too, on cuBLAS (implies --fuse).")
    parser.add_argument("--out", default="bench/results")
    args = parser.parse_args()
    args.fuse |= args.fused_baseline
    if not args.prefill and not args.decode:
        parser.error("--prefill none and --decode none leave no case to run")
    if args.tune != "none":
        tune(args)
    if args.tune_only:
        return
    # A run over some of the models or modes (split runs fit the GPU
    # machine's time limit per command) names them.
    which = "" if args.models == list(MODELS) else "-" + "_".join(os.path.basename(m).removesuffix(".json")
                                                                for m in args.models)
    which += "" if sorted(args.modes) == ["compiled", "eager"] else "-" + "_".join(args.modes)
    which += "-graphs" if args.graphs else ""
    which += f"-{args.layers}layers" if args.layers != 2 else ""
    which += "-pdl" if args.pdl else ""
    which += "-fuse" if args.fuse else ""
    which += "-fusedbase" if args.fused_baseline else ""
    path = Path(os.environ.get("OUT") or args.out) / f"{device_slug(torch.cuda.get_device_name())}-e2e{which}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    record = run(args, lambda partial: path.write_text(json.dumps(partial, indent=1) + "\n"))
    save(record, str(path.parent), path.stem)


if __name__ == "__main__":
    main()
