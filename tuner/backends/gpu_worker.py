"""The GPU measurement worker: one process, one CUDA context, JSON lines over pipes.

A kernel that faults poisons the CUDA context of its process, so measurements
run here and not in the tuner. The parent (`tuner.backends.gpu`) writes one request per
line to stdin and reads one reply per line; a reply with `fatal` set means the
context is gone and the worker exits after sending it. Anything else printed
(compilers, warnings) goes to stderr: stdout carries the protocol only.

Requests: {"op": "hello"}, {"op": "probe"} (`tuner.backends.probe`),
{"op": "measure", "problem": {...}, "config": {...} | null, "check": bool},
{"op": "remeasure", "problem": {...}, "configs": [...], "check": [bool, ...],
"rounds": int}. A null config is the cuBLAS baseline; "cublas_loop" times an
MoE problem as one cuBLAS call per group.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import sys
import time
import traceback
from dataclasses import dataclass
from typing import Callable, Sequence

from tuner.backends import probe
from tuner.backends.measure import trimmed_mean

# A 16-bit-input GEMM accumulated in fp32 and rounded to a 16-bit output lands
# near 1e-3..1e-2 relative Frobenius error against an fp32 reference (bf16
# keeps 8 mantissa bits: one rounding of the output alone is ~2e-3); a wrong
# tile, a missed K-block or an unwritten (NaN) tile is far above 2e-2.
REL_ERR_LIMIT = {"bf16": 2e-2, "fp16": 2e-2}
# Bytes a rotation must cover, as a multiple of L2, before a buffer set comes
# round again: its operands are then out of the cache.
ROTATION_L2_FACTOR = 2
MAX_BUFFER_SETS = 256
# Share of free device memory the rotation buffers may take.
ROTATION_MEMORY_SHARE = 0.5
# Timing plan: one graph replay (or event pair) spans at least this long, and
# a measurement aims at TIMED_MS of replays, within [MIN_REPLAYS, MAX_REPLAYS].
REPLAY_MS = 1.0
TIMED_MS = 30.0
MIN_REPLAYS = 5
MAX_REPLAYS = 100
MAX_LAUNCHES_PER_REPLAY = 256
# An interleaved measurement stops after about ROUND_CAP_MS of calls once it
# has MIN_ROUNDS rounds (`capped_rounds`): a call of milliseconds times
# within a fraction of a per cent in a few rounds, and 25 cold rounds of the
# candidates of a map point made validation the longest stage of a budgeted
# tune (H200, Llama 3.1 8B's lm_head under a 165 s budget: 138 points whose
# candidates' calls take 3.8 s a round, so about 96 s; the tune's family
# took 198 s and left the other four families on cuBLAS: bench/results/logs/
# nvidia-h200-cold-tune-llama-3.1-8b-seeds-first.json).
ROUND_CAP_MS = 250.0
MIN_ROUNDS = 7
# Replays of a cold-protocol measurement (one call each) when no rounds are
# given, and how many operand sets they take turns over (`_Timer`).
COLD_REPLAYS = 25
COLD_PLACEMENTS = 5
WARMUP_LAUNCHES = 3
# A GPU's first calls after a pause (a compile, the host's work between
# points) run slow: on an H100 a process's first point timed a 16.3 us cuBLAS
# call at 21.6 us, and after 0.3-20 s idle the first 30 replays of a 16.1 us
# kernel averaged 17.8 us, a ramp that interleaving does not cancel. After an
# idle spell of IDLE_S, untimed rounds run for WARMUP_S first.
IDLE_S = 0.1
WARMUP_S = 0.05
# L2 of an H100, when the device does not report it.
DEFAULT_L2_BYTES = 50 * 1024 * 1024

_DTYPE_BYTES = {"bf16": 2, "fp16": 2, "fp32": 4}
# In a config list: one cuBLAS call per group of an MoE problem (a reference
# for benchmarks; null is the baseline the tuner compares against).
CUBLAS_LOOP = "cublas_loop"


def set_bytes(problem: dict) -> int:
    """Bytes of one set of operands (A, B, out) of `problem`."""
    m, n, k, g = problem["m"], problem["n"], problem["k"], problem["groups"]
    elem_in = _DTYPE_BYTES[problem["dtype_in"]]
    elem_out = _DTYPE_BYTES[problem["dtype_out"]]
    if problem.get("group_k"):
        ks = sum(problem["group_k"])
        return (m * ks + n * ks) * elem_in + g * m * n * elem_out
    return (m * k + g * n * k) * elem_in + m * n * elem_out


def rotation_count(bytes_per_set: int, l2_bytes: int, memory_bytes: int) -> int:
    """Buffer sets to rotate through so that each launch finds its operands out of L2.

    The smallest count whose total is ROTATION_L2_FACTOR x L2, at least 2 and
    at most what `memory_bytes` holds (never fewer than 1).
    """
    if bytes_per_set <= 0:
        raise ValueError("a buffer set has a positive size")
    want = max(2, math.ceil(ROTATION_L2_FACTOR * l2_bytes / bytes_per_set))
    fits = max(1, memory_bytes // bytes_per_set)
    return min(want, fits, MAX_BUFFER_SETS)


def plan(estimate_ms: float) -> tuple[int, int]:
    """(launches per replay, replays) for a kernel that takes about `estimate_ms`."""
    estimate_ms = max(estimate_ms, 1e-4)
    launches = min(MAX_LAUNCHES_PER_REPLAY, max(1, math.ceil(REPLAY_MS / estimate_ms)))
    replays = round(TIMED_MS / (launches * estimate_ms))
    return launches, min(MAX_REPLAYS, max(MIN_REPLAYS, replays))


def capped_rounds(rounds: int, estimates_ms: list[float]) -> int:
    """`rounds` of interleaved replays of candidates that take about
    `estimates_ms` a replay, fewer where they would take more than
    ROUND_CAP_MS (never fewer than MIN_ROUNDS)."""
    cap = max(MIN_ROUNDS, math.ceil(ROUND_CAP_MS / max(sum(estimates_ms), 1e-4)))
    return min(rounds, cap)


def rel_error(out, ref) -> float:
    """Relative Frobenius error; NaN or inf anywhere in `out` gives inf."""
    import torch

    out = out.float()
    if not torch.isfinite(out).all():
        return math.inf
    denom = torch.linalg.vector_norm(ref).item()
    return torch.linalg.vector_norm(out - ref).item() / max(denom, 1e-30)


# ---------------------------------------------------------------- operands


@dataclass
class _Operands:
    """One buffer set; `args` is what a launch function receives."""

    args: tuple
    out: object  # the tensor a pool kernel writes (NaN-filled before a check)


def _torch_dtype(name: str):
    import torch

    return {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[name]


# MoE routing skew drawn for grouped problems when a request names none: the
# Zipf exponent of expert popularity (0 = equal split). With 1.0 the busiest
# of 64 experts gets about a fifth of the tokens and some get none.
DEFAULT_GROUP_SKEW = 1.0
_ROUTING_SEED = 0


def group_bounds(m: int, groups: int, skew: float = DEFAULT_GROUP_SKEW, seed: int = _ROUTING_SEED) -> list[int]:
    """Row bounds [0, ..., m] of `groups` MoE groups of m rows in all.

    skew 0: equal splits (the last group takes the remainder). Otherwise
    expert e of a seeded random order gets a share proportional to
    1 / (rank + 1) ** skew, rounded by largest remainders: uneven, with
    empty groups when m is small, and the same for the same arguments.
    """
    if skew <= 0:
        size = m // groups
        return [size * i for i in range(groups)] + [m]
    rng = random.Random(seed)
    ranks = list(range(groups))
    rng.shuffle(ranks)
    weights = [1.0 / (r + 1) ** skew for r in ranks]
    total = sum(weights)
    exact = [m * w / total for w in weights]
    sizes = [int(x) for x in exact]
    by_remainder = sorted(range(groups), key=lambda i: exact[i] - sizes[i], reverse=True)
    for i in by_remainder[: m - sum(sizes)]:
        sizes[i] += 1
    return [0] + list(itertools.accumulate(sizes))


def _bounds(p: dict) -> list[int]:
    """MoE row bounds of a grouped problem dict (its "skew", else the default)."""
    return group_bounds(p["m"], p["groups"], p.get("skew", DEFAULT_GROUP_SKEW))


def _k_slices(p: dict) -> list[tuple[int, int]]:
    """Packed K range of every group of a mixed-K problem dict."""
    ends = list(itertools.accumulate(p["group_k"]))
    return list(zip([0] + ends[:-1], ends))


def _make_operands(p: dict, gen) -> _Operands:
    """Random operands scaled so that outputs are O(1): no 16-bit overflow."""
    import torch

    din, dout = _torch_dtype(p["dtype_in"]), _torch_dtype(p["dtype_out"])
    m, n, g = p["m"], p["n"], p["groups"]

    def rand(*shape, k):
        t = torch.randn(*shape, device="cuda", generator=gen, dtype=torch.float32)
        return t.mul_(k ** -0.25).to(din)

    if p.get("group_k"):
        # Packed along K (the grouped kernels' "k" form): one A, one B.
        a = torch.cat([rand(m, kg, k=kg) for kg in p["group_k"]], dim=1)
        parts = [rand(n, kg, k=kg) for kg in p["group_k"]]
        b = torch.cat(parts, dim=1) if p["layout"] == "tn" else torch.cat([x.t() for x in parts]).contiguous()
        offs = torch.tensor(list(itertools.accumulate(p["group_k"])), device="cuda", dtype=torch.int32)
        out = torch.empty(g, m, n, device="cuda", dtype=dout)
        return _Operands((a, b, offs, out), out)
    k = p["k"]
    a = rand(m, k, k=k)
    if g > 1:
        b = rand(g, n, k, k=k) if p["layout"] == "tn" else rand(g, k, n, k=k)
        offs = torch.tensor(_bounds(p)[1:], device="cuda", dtype=torch.int32)
        out = torch.empty(m, n, device="cuda", dtype=dout)
        return _Operands((a, b, offs, out), out)
    b = rand(n, k, k=k) if p["layout"] == "tn" else rand(k, n, k=k)
    out = torch.empty(m, n, device="cuda", dtype=dout)
    return _Operands((a, b, out), out)


def _reference(p: dict, ops: _Operands):
    """The fp32 product of `ops`, shaped like the output."""
    import torch

    def mm(a, b):
        return a.float() @ (b.float().t() if p["layout"] == "tn" else b.float())

    if p.get("group_k"):
        a, b, _, _ = ops.args
        tn = p["layout"] == "tn"
        return torch.stack([mm(a[:, s:e], b[:, s:e] if tn else b[s:e]) for s, e in _k_slices(p)])
    if p["groups"] > 1:
        a, b, _, _ = ops.args
        bounds = _bounds(p)
        return torch.cat([mm(a[s:e], b[i]) for i, (s, e) in enumerate(zip(bounds, bounds[1:]))])
    a, b, _ = ops.args
    return mm(a, b)


def _baseline_launch(p: dict, per_group: bool = False) -> Callable:
    """The cuBLAS path (through torch) for `p`: a function of one operand set;
    with `per_group`, an MoE problem as one cuBLAS call per group."""
    import torch
    import torch.nn.functional as F

    din, dout = _torch_dtype(p["dtype_in"]), _torch_dtype(p["dtype_out"])
    tn = p["layout"] == "tn"

    def dense(a, b):
        if dout == din:
            return F.linear(a, b) if tn else torch.matmul(a, b)
        return torch.mm(a, b.t() if tn else b, out_dtype=dout)

    if p.get("group_k"):
        slices = _k_slices(p)

        def per_group_k(a, b, offs, out):
            for i, (s, e) in enumerate(slices):
                out[i].copy_(dense(a[:, s:e], b[:, s:e] if tn else b[s:e]))
            return out
        return per_group_k
    if p["groups"] > 1 and per_group:
        bounds = _bounds(p)

        def loop(a, b, offs, out):
            for i, (s, e) in enumerate(zip(bounds, bounds[1:])):
                if e > s:
                    out[s:e].copy_(dense(a[s:e], b[i]))
            return out
        return loop
    if p["groups"] > 1:
        def grouped(a, b, offs, out):
            return torch._grouped_mm(a, b.transpose(-2, -1) if tn else b, offs=offs, out_dtype=dout)
        return grouped

    def plain(a, b, out):
        return dense(a, b)
    return plain


# ---------------------------------------------------------------- kernels


_runners: dict[tuple, object] = {}


def grouped_form(p: dict) -> str:
    """The `kernels.grouped` form of a problem dict ("" when not grouped)."""
    if p["groups"] == 1:
        return ""
    return "k" if p.get("group_k") else "rows"


def _pool_launch(cfg_dict: dict, p: dict) -> Callable:
    from kernels.compile import get_kernel
    from kernels.space import GemmConfig

    cfg = GemmConfig.from_dict(cfg_dict)
    grouped = grouped_form(p)
    cache_key = (cfg, p["dtype_in"], p["dtype_out"], p["layout"], grouped)
    if cache_key not in _runners:
        _runners[cache_key] = get_kernel(cfg, dtype_in=p["dtype_in"], dtype_out=p["dtype_out"],
                                         layout=p["layout"], grouped=grouped)
    runner = _runners[cache_key]
    if grouped:
        def launch_grouped(a, b, offs, out):
            runner(a, b, offs, out)
            return out
        return launch_grouped

    def launch(a, b, out):
        runner(a, b, out)
        return out
    return launch


# ---------------------------------------------------------------- timing


class _Session:
    """Operands of one problem: rotation sets and a cached correctness case."""

    def __init__(self, p: dict, l2_bytes: int):
        import torch

        self.problem = p
        free, _ = torch.cuda.mem_get_info()
        self.count = rotation_count(set_bytes(p), l2_bytes, int(free * ROTATION_MEMORY_SHARE))
        gen = torch.Generator(device="cuda")
        gen.manual_seed(int.from_bytes(os.urandom(4), "little"))
        self.sets = [_make_operands(p, gen) for _ in range(self.count)]
        self._ref = None

    def check(self, launch: Callable) -> float:
        """Relative error of `launch` on set 0 (fresh random data, NaN-filled output)."""
        import torch

        ops = self.sets[0]
        if self._ref is None:
            self._ref = _reference(self.problem, ops)
        ops.out.fill_(float("nan"))
        got = launch(*ops.args)
        torch.cuda.synchronize()
        return rel_error(got, self._ref)


class _Timer:
    """A candidate ready to replay: a CUDA graph of `launches` calls, or plain launches.

    With `flush` (the cold protocol), a replay is one call after a write of
    `flush` evicts L2: the latency a model's forward sees, where other kernels
    run between two calls of one GEMM, rather than back-to-back throughput.
    Small products rank differently under the two (launch ramp, dirty L2).
    Cold replays take turns over graphs of up to `COLD_PLACEMENTS` operand
    sets: at a few microseconds a product's time depends on where its
    operands lie (on an H100, cuBLAS / our kernel read 0.96 on one pair of
    a 3072 x 3072 weight and its 5-row input out of 16, 1.04-1.05 on the
    other 15), so one placement can decide wrongly for every other.
    """

    def __init__(self, launch: Callable, sets: list[_Operands], flush=None):
        import torch

        self._launch, self._sets, self._flush = launch, sets, flush
        self._next = 0
        for _ in range(WARMUP_LAUNCHES):
            self._one()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        n = max(WARMUP_LAUNCHES, len(sets))
        start.record()
        for _ in range(n):
            self._one()
        end.record()
        end.synchronize()
        self.estimate_ms = start.elapsed_time(end) / n
        self.launches, self.replays = (1, COLD_REPLAYS) if flush is not None else plan(self.estimate_ms)
        placements = min(len(sets), COLD_PLACEMENTS) if flush is not None else 1
        self._graphs = []
        while len(self._graphs) < placements and (graph := self._capture()) is not None:
            self._graphs.append(graph)
        self._turn = 0
        self.mode = "graph" if self._graphs else "events"

    def _one(self) -> None:
        self._launch(*self._sets[self._next % len(self._sets)].args)
        self._next += 1

    def _capture(self):
        import torch

        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                for _ in range(self.launches):
                    self._one()
        except Exception as exc:  # a launcher that cannot be captured: time plain launches
            print(f"graph capture failed, timing with events: {exc}", file=sys.stderr)
            torch.cuda.synchronize()
            return None
        graph.replay()
        torch.cuda.synchronize()
        return graph

    def sample(self) -> tuple:
        """Enqueue one timed replay; returns its (start, end) events."""
        import torch

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        self.flush()
        start.record()
        self.replay()
        end.record()
        return start, end

    def flush(self) -> None:
        """Evict L2 (the cold protocol; nothing otherwise)."""
        if self._flush is not None:
            self._flush.add_(1)

    def replay(self) -> None:
        """Enqueue one replay of `launches` calls."""
        if self._graphs:
            self._graphs[self._turn % len(self._graphs)].replay()
            self._turn += 1
        else:
            for _ in range(self.launches):
                self._one()

    def per_launch(self, events: tuple) -> float:
        return events[0].elapsed_time(events[1]) / self.launches


def _held(p: dict):
    from contextlib import nullcontext

    if not p.get("carveout"):
        return nullcontext({})
    from tuner.backends.carveout import hold_sms

    return hold_sms(p["carveout"])


_idle_since = 0.0


def _time_interleaved(timers: list[_Timer], rounds: int, p: dict) -> tuple[list[list[float]], dict]:
    import torch

    global _idle_since
    samples: list[list[tuple]] = [[] for _ in timers]
    # Before the SM hold, whose spinning CTAs last only so long.
    if time.perf_counter() - _idle_since > IDLE_S:
        started = time.perf_counter()
        while time.perf_counter() - started < WARMUP_S:
            for t in timers:
                t.sample()
            torch.cuda.synchronize()
    with _held(p) as hold:
        for r in range(rounds):
            # Rotate who goes first: what ran just before a call sets its clocks.
            for i in [(r + j) % len(timers) for j in range(len(timers))]:
                samples[i].append(timers[i].sample())
    torch.cuda.synchronize()
    _idle_since = time.perf_counter()
    times = [[t.per_launch(ev) for ev in evs] for t, evs in zip(timers, samples, strict=True)]
    return times, dict(hold)


def _time_beside(timers: list[_Timer], rounds: int, nbytes: int, group) -> list[list[float]]:
    """Makespans (ms) of each timer's call beside an all-reduce of `nbytes`
    over `group`, `rounds` rounds with positions rotated: all ranks aligned
    and idle, the all-reduce launched first on a stream of its own so that
    its kernels hold SMs when the GEMM starts, as a serving engine's do;
    from before the first launch until both are done."""
    import torch

    main, comm = torch.cuda.current_stream(), torch.cuda.Stream()
    buf = group.begin(rounds * len(timers), nbytes)
    times: list[list[float]] = [[] for _ in timers]
    for r in range(rounds):
        for i in [(r + j) % len(timers) for j in range(len(timers))]:
            group.align()
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            timers[i].flush()
            start.record()
            comm.wait_stream(main)
            with torch.cuda.stream(comm):
                group.all_reduce(buf)
            timers[i].replay()
            main.wait_stream(comm)
            end.record()
            end.synchronize()
            times[i].append(start.elapsed_time(end))
    return times


# ---------------------------------------------------------------- requests


class Worker:
    def __init__(self, device: int, overlap_devices: Sequence[int] = ()):
        """`overlap_devices`: the other GPUs an overlap key's all-reduce spans
        (`tuner.backends.collective`); without them overlap keys are refused."""
        import torch

        torch.cuda.set_device(device)
        self.device = device
        self.overlap_devices = tuple(overlap_devices)
        self._group = None
        props = torch.cuda.get_device_properties(device)
        self.props = props
        self.l2_bytes = int(getattr(props, "L2_cache_size", 0) or DEFAULT_L2_BYTES)
        self._session: _Session | None = None

    def session(self, p: dict) -> _Session:
        # Held SMs change the timing, not the operands: keep the buffers.
        if self._session is None or _operands_of(self._session.problem) != _operands_of(p):
            import torch

            self._session = None  # free the previous problem's buffers first
            torch.cuda.empty_cache()
            self._session = _Session(p, self.l2_bytes)
        return self._session

    def hello(self, _req: dict) -> dict:
        import torch

        p = self.props
        return {
            "ok": True, "device_name": p.name, "capability": [p.major, p.minor],
            "sm_count": p.multi_processor_count, "l2_bytes": self.l2_bytes,
            "device_count": torch.cuda.device_count(),
            "versions": versions(p.name), "torch_cuda": torch.version.cuda, "facts": probe.facts(self.device),
        }

    def probe(self, _req: dict) -> dict:
        return {"ok": True, **probe.measure()}

    def _launch(self, cfg: dict | str | None, p: dict) -> Callable:
        if cfg is None or cfg == CUBLAS_LOOP:
            return _baseline_launch(p, per_group=cfg == CUBLAS_LOOP)
        return _pool_launch(cfg, p)

    def measure(self, req: dict) -> dict:
        return self._run(req["problem"], [req["config"]], [req.get("check", True)], rounds=None)[0]

    def remeasure(self, req: dict) -> dict:
        checks = req.get("check") or [True] * len(req["configs"])
        return {"ok": True, "results": self._run(req["problem"], req["configs"], checks,
                                                  rounds=req.get("rounds", 5), cold=req.get("cold", False))}

    def _flush_buffer(self):
        """Twice L2 of fp32, written before every cold-protocol call."""
        import torch

        if getattr(self, "_flush", None) is None:
            self._flush = torch.empty(2 * self.l2_bytes // 4, dtype=torch.float32, device="cuda")
        return self._flush

    def close(self) -> None:
        """End the all-reduce group's partners, if any were started."""
        if self._group is not None:
            self._group.close()
            self._group = None

    def group(self):
        """The all-reduce group of this GPU and `overlap_devices`, started on first use."""
        if self._group is None:
            from tuner.backends.collective import Group

            if not self.overlap_devices:
                raise RuntimeError("an overlap key needs the GPUs its all-reduce spans (tuner tune --tp)")
            self._group = Group([self.device, *self.overlap_devices])
        return self._group

    def _run(self, p: dict, cfgs: list, checks: list[bool], rounds: int | None, cold: bool = False) -> list[dict]:
        """Check, then time `cfgs` on `p`; a failure of one candidate leaves the others.
        An overlap key's candidates are timed by their makespans beside its
        all-reduce, one call each after an L2 flush (`_time_beside`)."""
        s = self.session(p)
        overlap = p.get("overlap", 0)
        cold = cold or bool(overlap)
        flush = self._flush_buffer() if cold else None
        results: list[dict | None] = [None] * len(cfgs)
        timers: list[tuple[int, _Timer]] = []
        for i, (cfg, check) in enumerate(zip(cfgs, checks, strict=True)):
            detail: dict = {}
            try:
                started = time.perf_counter()
                launch = self._launch(cfg, p)
                detail["prepare_s"] = round(time.perf_counter() - started, 3)
                err = None
                if check:
                    err = s.check(launch)
                    limit = REL_ERR_LIMIT[p["dtype_in"]]
                    if not err <= limit:
                        results[i] = _reply(False, error=f"wrong result: relative error {err:.3g} > {limit}",
                                            rel_err=_finite(err), detail=detail)
                        continue
                timers.append((i, _Timer(launch, s.sets, flush)))
                results[i] = _reply(True, rel_err=_finite(err), detail=detail)
            except Exception as exc:
                _raise_if_poisoned(exc)
                results[i] = _reply(False, error=_describe(exc), detail=detail)
        if timers:
            n = capped_rounds(rounds or max(t.replays for _, t in timers),
                              [t.estimate_ms * t.launches for _, t in timers])
            if overlap:
                times, hold = _time_beside([t for _, t in timers], n, overlap, self.group()), {}
            else:
                times, hold = _time_interleaved([t for _, t in timers], n, p)
            lapse = _hold_lapse(hold, p)
            for (i, t), ts in zip(timers, times, strict=True):
                if lapse:
                    results[i].update(ok=False, error=lapse)
                ms = trimmed_mean(ts) if cold else statistics.median(ts)
                results[i]["ms"] = ms
                results[i]["detail"].update(
                    timing=t.mode + (" cold" if cold else "") + (" beside an all-reduce" if overlap else ""),
                    launches=t.launches, replays=len(ts),
                    buffer_sets=s.count,
                    min_ms=min(ts), tflops=_flops(p) / ms / 1e9, **hold,
                )
        return results


def _hold_lapse(hold: dict, p: dict) -> str | None:
    """Why the SM hold did not cover the timed replays, or None."""
    if not p.get("carveout"):
        return None
    from tuner.backends.carveout import SM_REGISTERS

    if hold["resident"] != p["carveout"] or hold["expired"]:
        return (f"SM hold failed: {hold['resident']} of {p['carveout']} spinning CTAs resident, "
                f"{hold['expired']} ran out of time")
    if hold["registers"] < SM_REGISTERS:
        return f"SM hold not exclusive: a spinning CTA takes {hold['registers']} of {SM_REGISTERS} registers"
    return None


def _operands_of(p: dict) -> dict:
    return {k: v for k, v in p.items() if k != "carveout"}


def _flops(p: dict) -> float:
    ks = sum(p["group_k"]) if p.get("group_k") else p["k"]
    return 2.0 * p["m"] * p["n"] * ks


def _finite(x: float | None) -> float | None:
    return x if x is None or math.isfinite(x) else None


def _reply(ok: bool, *, error: str | None = None, rel_err: float | None = None,
           detail: dict | None = None, ms: float | None = None) -> dict:
    return {"ok": ok, "ms": ms, "error": error, "rel_err": rel_err, "detail": detail or {}}


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}".strip()
    return text[:2000]


class _Poisoned(Exception):
    """The CUDA context is unusable: reply, then exit so the parent restarts us."""

    def __init__(self, cause: BaseException):
        super().__init__(_describe(cause))


def _raise_if_poisoned(exc: BaseException) -> None:
    """After a failure, see whether the context still works; a fault makes every later call fail."""
    import torch

    try:
        torch.cuda.synchronize()
        torch.ones(1, device="cuda").add_(1).item()
    except Exception:
        raise _Poisoned(exc) from exc


def versions(device_name: str) -> dict[str, str]:
    import torch
    from importlib import metadata

    try:
        dsl = metadata.version("nvidia-cutlass-dsl")
    except metadata.PackageNotFoundError:
        dsl = "absent"
    return {
        "cutlass-dsl": dsl, "torch": torch.__version__, "cuda": torch.version.cuda or "none",
        "driver": _driver_version(), "device": device_name,
    }


def _driver_version() -> str:
    import ctypes

    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
        buf = ctypes.create_string_buffer(96)
        if nvml.nvmlInit_v2() == 0 and nvml.nvmlSystemGetDriverVersion(buf, len(buf)) == 0:
            return buf.value.decode()
    except OSError:
        pass
    try:
        cuda = ctypes.CDLL("libcuda.so.1")
        v = ctypes.c_int()
        if cuda.cuDriverGetVersion(ctypes.byref(v)) == 0:
            return f"cuda-{v.value // 1000}.{v.value % 1000 // 10}"
    except OSError:
        pass
    return "unknown"


def serve(worker: Worker, lines, reply: Callable[[dict], None]) -> None:
    ops = {"hello": worker.hello, "measure": worker.measure, "remeasure": worker.remeasure, "probe": worker.probe}
    for line in lines:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            handler = ops.get(req.get("op"))
            if handler is None:
                reply({"ok": False, "error": f"unknown op {req.get('op')!r}"})
                continue
            reply(handler(req))
        except _Poisoned as exc:
            reply({"ok": False, "error": f"CUDA context lost: {exc}", "fatal": True})
            return
        except Exception as exc:
            traceback.print_exc(file=sys.stderr)
            try:
                _raise_if_poisoned(exc)
            except _Poisoned:
                reply({"ok": False, "error": f"CUDA context lost: {_describe(exc)}", "fatal": True})
                return
            reply({"ok": False, "error": _describe(exc)})


def _protocol_channel():
    """Keep the real stdout for replies; send everything else printed to stderr."""
    fd = os.dup(1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    out = os.fdopen(fd, "w", buffering=1)

    def reply(msg: dict) -> None:
        out.write(json.dumps(msg) + "\n")
        out.flush()
    return reply


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--device", type=int, default=0)
    parser.add_argument("--overlap-devices", default="", help="Comma-separated: the other GPUs of an all-reduce.")
    args = parser.parse_args(argv)
    reply = _protocol_channel()
    worker = Worker(args.device, [int(d) for d in args.overlap_devices.split(",") if d])
    try:
        serve(worker, sys.stdin, reply)
    finally:
        worker.close()


if __name__ == "__main__":
    main()
