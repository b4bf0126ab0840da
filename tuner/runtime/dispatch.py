"""In-process dispatch: `gemm(a, b)` runs the stored winner for its key.

Convention: `gemm(a, b)` computes y = a @ b with a (M, K) row-major and b the
(K, N) matrix of the product. How b is stored gives the layout of the key:

- b a transposed view of a contiguous (N, K) weight (`W.t()`, stride (1, K)),
  as `nn.Linear` keeps W: layout "tn", and `gemm(x, W.t())` equals
  `F.linear(x, W)`;
- b contiguous (K, N): layout "nn".

Grouped (MoE) form: `offs` holds the cumulative row ends of G groups of a
(int32 on a's device, as `torch._grouped_mm` takes them; the last is M) and b
is (G, K, N), by the same two conventions per group. The key is (total M, N,
K, G), and the winner runs the pool's grouped kernel (`kernels.grouped`,
"rows" form); torch's fallback is `torch._grouped_mm`.

The choice for a key comes from its family's M map (`tuner.lookup`: a kernel
runs at an M only inside an interval where it was measured faster than cuBLAS). cuBLAS (through torch) runs instead when the tensors are on the CPU,
their dtypes or strides are not the pool's, a pointer is not 16-byte aligned,
the shape breaks the pool's operand rules, no measurement covers the M,
cuBLAS was measured fastest, or the choice is stale (measured under other
software versions). Every fallback but a measured cuBLAS choice warns once
per reason and key. With online tuning on (`configure(online=True)` or
TUNER_ONLINE=1, `tuner.runtime.online`), an M no measurement covers is measured on its
first call and the result stored.

A decision is made once per key and kept in the process: later calls cost a
few attribute checks and a dict lookup, never a database query. Winners
stored after a decision are seen after `configure()`. The winner's kernel is
built on the first `gemm` call of its key (`explain` builds nothing); one
that fails to build falls back like the cases above. A key first met during
CUDA graph capture runs cuBLAS for that call (the database is not read while
capturing): call once before capturing, as capture needs a warm-up anyway.

Forward only: the op has no autograd formula.

Under `with overlap(nbytes):` calls look up the keys of GEMMs that run beside
an all-reduce of `nbytes` (`overlap=allreduce:BYTES` in a shape file), tuned
for the time both take, instead of the plain keys.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import math
import threading
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Iterator

import torch

from kernels.space import DTYPES_IN, DTYPES_OUT, MAX_DIM, InvalidConfig

# Compute capability major -> pool arch.
_ARCHS = {9: "sm90", 10: "sm100"}
_DTYPE_NAMES = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}
_ALIGN = 16

KERNEL = "kernel"
TORCH = "torch"


class FallbackWarning(UserWarning):
    """gemm ran torch instead of the tuned choice; the message says why."""


@dataclass(frozen=True)
class Explanation:
    """Which path `gemm` takes for a call, and why.

    `path` is "kernel" (a tuned kernel of the pool) or "torch" (cuBLAS on
    CUDA). `fallback` is True when torch runs although no measurement chose
    it. `exact` is None when nothing stored was consulted; `tuned_m` is the
    measured M nearest to the call's behind the choice; `interval` the M
    interval of the family's map that covers the call (None without a map),
    and `evidence` a line on the measurements behind it.
    """

    path: str
    reason: str
    fallback: bool = True
    key: str | None = None
    config_name: str | None = None
    exact: bool | None = None
    tuned_m: int | None = None
    stale: bool = False
    interval: tuple[int, int] | None = None
    evidence: str | None = None


@dataclass(frozen=True)
class _Decision:
    explanation: Explanation
    config: object = None  # the winner's GemmConfig on the kernel path
    runner: Callable | None = None  # built on the first call, not by explain


class _State:
    def __init__(self) -> None:
        self.url: str | None = None
        self.store = None
        self.decisions: dict[tuple, _Decision] = {}
        # Launchers by call signature (`_signature`), for calls already seen
        # to go to a kernel: a repeat call then skips every rule check but
        # pointer alignment.
        self.launchers: dict[tuple, _Launch] = {}
        # The same for calls whose B is a constant weight (`weight_launcher`).
        self.weight_launchers: dict[tuple, _Launch] = {}
        self.warned: set[tuple[str, str]] = set()
        self.lock = threading.Lock()
        self.online: bool | None = None  # None: $TUNER_ONLINE decides
        self.writer = None  # the store online tuning writes to, opened on first use


_state = _State()
# Bytes of the all-reduce the calls run beside (`overlap`); 0: none.
_OVERLAP: contextvars.ContextVar[int] = contextvars.ContextVar("gemm_tuner_overlap", default=0)


@contextlib.contextmanager
def overlap(nbytes: int) -> Iterator[None]:
    """Within the block, `gemm` looks up the keys of GEMMs that run beside an
    all-reduce of `nbytes` bytes (0: the plain keys)."""
    from kernels.space import MAX_OVERLAP

    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or not 0 <= nbytes <= MAX_OVERLAP:
        raise ValueError(f"overlap takes the all-reduce's bytes, 0 to {MAX_OVERLAP}, not {nbytes!r}")
    token = _OVERLAP.set(nbytes)
    try:
        yield
    finally:
        _OVERLAP.reset(token)


def configure(db: str | None = None, *, online: bool | None = None) -> None:
    """Read choices from `db` (URL or SQLite path; None: $TUNER_DB, else the
    default file) and forget every decision made so far. `online=True` measures
    an M no interval covers on its first call (`tuner.runtime.online`); None leaves it
    to $TUNER_ONLINE."""
    with _state.lock:
        for store in (_state.store, _state.writer):
            if store is not None:
                store.close()
        _state.url, _state.store, _state.writer, _state.online = db, None, None, online
        _state.decisions.clear()
        _state.launchers.clear()
        _state.warned.clear()


def gemm(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *,
         offs: torch.Tensor | None = None) -> torch.Tensor:
    """y = a @ b by the tuned kernel for the key (see the module doc for the
    layout convention), into `out` when given (its dtype is then the output
    dtype; otherwise a's)."""
    # Eager calls skip the op dispatcher (several microseconds per call);
    # compiled graphs see the registered op.
    if torch.compiler.is_compiling():
        if out is None:
            return torch.ops.gemm_tuner.gemm(a, b, offs)
        torch.ops.gemm_tuner.gemm_out(a, b, out, offs)
        return out
    return _run(a, b, out, offs)


def explain(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None, *,
            offs: torch.Tensor | None = None) -> Explanation:
    """What `gemm(a, b, out, offs=offs)` runs, without running (or building) it."""
    _check_shapes(a, b, out, offs)
    return _decision(a, b, out, offs, _layout(b), build=False).explanation


def explain_key(key) -> Explanation:
    """What `gemm` runs for a `tuner.key.Key` on a device of that arch and
    name, under this process's software versions. Reads the store every time."""
    return _choose(key)[0]


def kernel_spans(device_index: int, dtype: torch.dtype, n: int, k: int, groups: int = 1,
                 overlap: int = 0) -> tuple[tuple, str | None]:
    """Where `gemm(x, W.t())` may run a kernel for a contiguous (n, k) weight
    W of `dtype` on that CUDA device (with `groups`, `gemm(x, W.mT, offs=)`
    for `groups` such weights, M the rows over all of them; with `overlap`,
    beside an all-reduce of that many bytes): the M intervals (`tuner.lookup.Span`,
    with the least device time the kernel saved there; outside them it runs
    cuBLAS, so a caller may call torch there directly), and why there are
    none to be had (None when the family is tuned). Stale choices are left
    out (gemm would not run them). With online tuning on, every M may be
    measured, so the one span is every M, its saving unknown (infinite).
    Reads the store every time."""
    from tuner.key import Key, Problem
    from tuner.runtime.lookup import Span
    from tuner.runtime.lookup import kernel_spans as family_spans

    din = _DTYPE_NAMES.get(dtype)
    if din not in DTYPES_IN:
        return (), f"dtype {dtype}: the pool takes one of {DTYPES_IN}"
    major, minor = torch.cuda.get_device_capability(device_index)
    arch = _ARCHS.get(major)
    if arch is None:
        return (), f"compute capability {major}.{minor}: no kernel pool for it"
    try:
        problem = Problem(1, n, k, groups, din, din, "tn", overlap=overlap)
    except InvalidConfig as exc:
        return (), f"shape outside the pool's operand rules: {exc}"
    if _online() and not overlap:
        return (Span(1, MAX_DIM, math.inf),), None
    store = _store()
    if store is None:
        return (), f"no readable winners database at {_db_where()}"
    key = Key(arch, torch.cuda.get_device_name(device_index), problem)
    spans = family_spans(store, key, _versions(key.device))
    if spans is None:
        return (), "not tuned on this device (`tuner tune`)"
    if not spans and family_spans(store, key):
        return (), "its kernel choices were measured under other software versions: retune (`tuner tune`)"
    return spans, None


def launcher(a: torch.Tensor, b: torch.Tensor) -> _Launch | None:
    """The kernel launch `gemm(a, b)` takes for operands of this signature
    (shapes, strides, dtypes, device), once a call has decided and built it;
    None when such a call runs cuBLAS or has not run yet. `launch(a, b, None,
    None)` skips every check but needs a and b 16-byte aligned: a caller that
    keeps it (a patched layer per M) checks a's pointer itself. Its `runner`
    is the kernel alone: `launch.runner(a, stored, out)` takes B as stored
    (`b.mT` where `launch.tn`) and an output, and makes no tensor op."""
    return _state.launchers.get(_signature(a, b, None, None))


def weight_launcher(a: torch.Tensor, b: torch.Tensor) -> _Launch | None:
    """`launcher(a, b)` for a caller whose b is a constant weight (an
    nn.Linear's, which `patch` passes): the launch of the decided config's
    programmatic-dependent build (`GemmConfig.pdl`: the weight's first
    stages are requested while the kernel before it drains), where the pool
    has one (sm90 dense kernels), else `launcher`'s. Builds it on first use,
    never during CUDA graph capture (the plain launch answers there)."""
    launch = launcher(a, b)
    variant = getattr(launch.runner, "variant", None) if launch is not None else None
    if variant is None or variant.grouped or variant.cfg.arch != "sm90" or variant.cfg.pdl:
        return launch
    signature = _signature(a, b, None, None)
    twin = _state.weight_launchers.get(signature)
    if twin is None and torch.cuda.is_current_stream_capturing():
        return launch
    if twin is None:
        from kernels.compile import get_kernel

        try:
            with torch.cuda.device(a.device.index):
                runner = get_kernel(replace(variant.cfg, pdl=True), dtype_in=variant.dtype_in,
                                    dtype_out=variant.dtype_out, layout=variant.layout)
            twin = _Launch(runner, launch.tn)
        except Exception:  # the plain build ran and stays right: keep it
            twin = launch
        _state.weight_launchers[signature] = twin
    return twin


# ---------------------------------------------------------------- the call


def _run(a, b, out, offs):
    signature = _signature(a, b, out, offs)
    launch = _state.launchers.get(signature)
    if launch is not None and not (a.data_ptr() | b.data_ptr() | (0 if out is None else out.data_ptr())) % _ALIGN:
        return launch(a, b, out, offs)
    _check_shapes(a, b, out, offs)
    layout = _layout(b)
    decision = _decision(a, b, out, offs, layout)
    if decision.runner is None:
        if decision.explanation.fallback:
            _warn_once(decision.explanation.reason, _label(a, b, out, offs, layout))
        return _torch_gemm(a, b, out, offs)
    launch = _Launch(decision.runner, layout == "tn")
    # Everything the checks read is in the signature except the pointers.
    _state.launchers[signature] = launch
    return launch(a, b, out, offs)


def _signature(a, b, out, offs) -> tuple:
    """What decides a call's path, pointers aside: shapes, strides, dtypes,
    device and the overlap in effect."""
    return (
        a.shape, a.stride(), b.shape, b.stride(), a.dtype, b.dtype, a.device,
        None if out is None else (out.shape, out.stride(), out.dtype),
        None if offs is None else (offs.shape, offs.stride(), offs.dtype),
        _OVERLAP.get(),
    )


class _Launch:
    """`launch(a, b, out, offs)`: a decided kernel's runner on `gemm`'s
    operands. The runners take B as stored: (.., N, K) for "tn" (`tn`)."""

    __slots__ = ("runner", "tn")

    def __init__(self, runner: Callable, tn: bool) -> None:
        self.runner, self.tn = runner, tn

    def __call__(self, a, b, out, offs):
        if out is None:
            out = torch.empty((a.shape[0], b.shape[-1]), dtype=a.dtype, device=a.device)
        stored = b.mT if self.tn else b
        if offs is None:
            self.runner(a, stored, out)
        else:
            self.runner(a, stored, offs, out)
        return out


def _decision(a, b, out, offs, layout, build: bool = True) -> _Decision:
    """The cached decision for this call's key; `build` compiles a kernel winner's runner."""
    dtype_out = a.dtype if out is None else out.dtype
    din, dout = _DTYPE_NAMES.get(a.dtype), _DTYPE_NAMES.get(dtype_out)
    reason = _tensor_reason(a, b, out, offs, layout, din, dout)
    if reason is not None:
        return _Decision(Explanation(TORCH, reason))
    groups = 1 if offs is None else b.shape[0]
    key_fields = (a.device.index, din, dout, layout, a.shape[0], b.shape[-1], a.shape[1], groups, _OVERLAP.get())
    # A one-group grouped call shares the dense key but takes the grouped runner.
    cache_key = (*key_fields, offs is not None)
    decision = _state.decisions.get(cache_key)
    if decision is not None and (decision.runner is not None or decision.config is None or not build):
        return decision
    if torch.cuda.is_current_stream_capturing():
        return _Decision(Explanation(
            TORCH, "first call for this key came during CUDA graph capture: call once before capturing"))
    with _state.lock:
        decision = _state.decisions.get(cache_key)
        if decision is None:
            # Online tuning times a call alone: never an overlap key's choice.
            live = build and _online() and not key_fields[-1]
            measure = _live_measure(a, b, offs, layout, din, dout) if live else None
            decision = _Decision(*_choose_on_device(*key_fields, measure=measure))
        if build and decision.config is not None and decision.runner is None:
            decision = _build(decision, a.device.index, din, dout, layout, grouped=offs is not None)
        _state.decisions[cache_key] = decision
    return decision


def _layout(b: torch.Tensor) -> str | None:
    """"tn" for b a transposed view of contiguous (.., N, K) storage, "nn" for a
    contiguous (.., K, N) b, None for other strides."""
    k, n = b.shape[-2:]
    strides = b.stride()
    if strides[-2:] == (1, k) and (b.dim() == 2 or strides[0] == n * k):
        return "tn"
    if b.is_contiguous():
        return "nn"
    return None


def _tensor_reason(a, b, out, offs, layout, din, dout) -> str | None:
    """Why these tensors cannot go to a pool kernel, or None."""
    if any(t is not None and t.device != a.device for t in (b, out, offs)):
        return "operands on different devices"  # torch then raises its own error
    if not a.is_cuda:
        return f"tensors on {a.device.type}: the pool runs on CUDA devices"
    if din not in DTYPES_IN or b.dtype != a.dtype:
        return f"input dtypes {a.dtype}, {b.dtype}: the pool takes one of {DTYPES_IN} for both"
    if dout not in DTYPES_OUT:
        return f"output dtype {out.dtype}: the pool writes one of {DTYPES_OUT}"
    if layout is None:
        return f"b has strides {tuple(b.stride())}: neither a (K, N) nor a transposed (N, K) contiguous matrix"
    if not a.is_contiguous() or out is not None and not out.is_contiguous():
        return "a or out is not contiguous"
    if offs is not None and (offs.dtype != torch.int32 or not offs.is_contiguous()):
        return f"offs is {offs.dtype}{'' if offs.is_contiguous() else ', strided'}: the grouped kernel reads contiguous int32"
    for name, t in (("a", a), ("b", b), ("out", out)):
        if t is not None and t.data_ptr() % _ALIGN:
            return f"{name} is not {_ALIGN}-byte aligned (TMA needs {_ALIGN}-byte aligned operands)"
    return None


def _choose_on_device(device_index, din, dout, layout, m, n, k, groups, overlap,
                      measure=None) -> tuple[Explanation, object]:
    from tuner.key import Key, Problem

    major, minor = torch.cuda.get_device_capability(device_index)
    arch = _ARCHS.get(major)
    if arch is None:
        return Explanation(TORCH, f"compute capability {major}.{minor}: no kernel pool for it"), None
    try:
        problem = Problem(m, n, k, groups, din, dout, layout, overlap=overlap)
    except InvalidConfig as exc:
        return Explanation(TORCH, f"shape outside the pool's operand rules: {exc}"), None
    return _choose(Key(arch, torch.cuda.get_device_name(device_index), problem), measure)


def _choose(key, measure=None) -> tuple[Explanation, object]:
    """The rule of `tuner.lookup` over the store; with `measure` (online
    tuning) an M no measured interval covers is measured now. Returns the
    explanation and, on the kernel path, the config."""
    from kernels.space import GemmConfig
    from tuner.runtime.lookup import RANGE, lookup

    from kernels.grouped import MAX_GROUPS

    name, p = key.study_name(), key.problem
    if p.groups > MAX_GROUPS:
        return Explanation(TORCH, f"{p.groups} groups: the grouped kernel takes at most {MAX_GROUPS}", key=name), None
    store = _store()
    if store is None:
        return Explanation(TORCH, f"no readable winners database at {_db_where()}", key=name), None
    current = _versions(key.device)
    found = lookup(store, key)
    if found is None and measure is not None:
        from tuner.runtime import online

        found = online.tune(_writer(), key, measure, "gpu", current)
        if found is None:
            return Explanation(TORCH, (
                f"online tuning at M={p.m} decided nothing (no cuBLAS time, or the GPU ran in a slow "
                f"spell): cuBLAS runs, and a later process measures again"), key=name), None
    if found is None:
        return Explanation(TORCH, (
            f"no measured choice covers M={p.m} for this (N, K): tune the family with a ladder "
            f"(`tuner tune`), or opt in to online tuning (TUNER_ONLINE=1)"), key=name), None
    seen = dict(key=name, config_name=found.config_name, exact=found.exact, tuned_m=found.tuned_m,
                stale=found.stale(current), interval=found.interval, evidence=found.describe())
    if found.config is None:
        how = "measured fastest" if found.how == RANGE else "won the tuning for this key"
        return Explanation(TORCH, f"cuBLAS {how}: {found.describe()}", fallback=False, **seen), None
    if seen["stale"]:
        changed = sorted(f for f in set(found.versions) | set(current) if found.versions.get(f) != current.get(f))
        return Explanation(TORCH, f"choice is stale: measured under other {', '.join(changed)} versions", **seen), None
    try:
        cfg = GemmConfig.from_dict(found.config)
        p.check(cfg)
    except (InvalidConfig, TypeError) as exc:
        return Explanation(TORCH, f"choice {found.config_name} cannot run this shape: {exc}", **seen), None
    return Explanation(KERNEL, f"tuned kernel: {found.describe()}", fallback=False, **seen), cfg


def _build(decision: _Decision, device_index: int, din: str, dout: str, layout: str, grouped: bool) -> _Decision:
    """`decision` with its runner, or a torch decision saying why the kernel did not build."""
    try:
        from kernels.compile import get_kernel

        # get_kernel builds for the current device: make it the tensors' one.
        with torch.cuda.device(device_index):
            runner = get_kernel(decision.config, dtype_in=din, dtype_out=dout, layout=layout,
                                grouped="rows" if grouped else "")
    except Exception as exc:  # a kernel that fails to build must not break the caller: torch runs
        why = f"winner {decision.explanation.config_name} failed to build: {type(exc).__name__}: {exc}"
        return _Decision(replace(decision.explanation, path=TORCH, reason=why, fallback=True))
    return replace(decision, runner=runner)


def _db_where() -> str:
    from db.engine import resolve_url

    return resolve_url(_state.url)


def _online() -> bool:
    if _state.online is None:
        from tuner.runtime.online import enabled_by_env

        return enabled_by_env()
    return _state.online


def _writer():
    """The store online tuning writes to (the readers' database, opened for writing)."""
    if _state.writer is None:
        from db.engine import resolve_url
        from db.store import Store

        _state.writer = Store(resolve_url(_state.url))
    return _state.writer


def _live_measure(a, b, offs, layout, din, dout) -> Callable:
    """Online tuning's `measure` on this call's operands: each kernel is checked
    against cuBLAS's result first (a wrong one is left out), then all are
    timed interleaved (`tuner.runtime.online.time_interleaved`)."""
    from kernels.compile import get_kernel
    from tuner.backends.gpu_worker import REL_ERR_LIMIT, rel_error
    from tuner.runtime.online import time_interleaved

    dtype_out = {v: k for k, v in _DTYPE_NAMES.items()}[dout]
    scratch = torch.empty((a.shape[0], b.shape[-1]), dtype=dtype_out, device=a.device)

    def measure(cands):
        reference = _torch_gemm(a, b, scratch, offs).float()
        launches, slots = [], []
        for i, cfg in enumerate(cands):
            if cfg is None:
                launches.append(lambda: _torch_gemm(a, b, scratch, offs))
                slots.append(i)
                continue
            try:
                with torch.cuda.device(a.device):
                    runner = get_kernel(cfg, dtype_in=din, dtype_out=dout, layout=layout,
                                        grouped="rows" if offs is not None else "")
                launch = _Launch(runner, layout == "tn")
                if rel_error(launch(a, b, scratch, offs), reference) > REL_ERR_LIMIT[din]:
                    continue
            except Exception:  # a candidate that fails is left out; cuBLAS still runs
                continue
            launches.append(lambda launch=launch: launch(a, b, scratch, offs))
            slots.append(i)
        times = time_interleaved(launches)
        out: list[float | None] = [None] * len(cands)
        for i, t in zip(slots, times, strict=True):
            out[i] = t
        return out
    return measure


def _store():
    """The reader store, opened on first use; None when its SQLite file does not exist
    (opening would create an empty one)."""
    if _state.store is None:
        from db.engine import resolve_url, sqlite_path
        from db.store import Store, StoreError

        path = sqlite_path(resolve_url(_state.url))
        if path is not None and not path.exists():
            return None
        try:
            _state.store = Store(resolve_url(_state.url), writer=False)
        except StoreError:  # not a database, or unreadable: torch runs, the caller is not broken
            return None
    return _state.store


@functools.cache
def _versions(device_name: str) -> dict[str, str]:
    from tuner.backends.gpu_worker import versions

    return versions(device_name)


def _warn_once(reason: str, label: str) -> None:
    if (reason, label) in _state.warned:
        return
    _state.warned.add((reason, label))
    warnings.warn(f"gemm {label}: torch runs instead of a tuned kernel: {reason}", FallbackWarning, stacklevel=4)


def _label(a, b, out, offs, layout) -> str:
    dtype_out = a.dtype if out is None else out.dtype
    names = [str(t).removeprefix("torch.") for t in (a.dtype, b.dtype, dtype_out)]
    groups = "" if offs is None else f" g{b.shape[0]}"
    return (f"{a.shape[0]}x{b.shape[-1]}x{a.shape[1]}{groups} {names[0]},{names[1]}>{names[2]} "
            f"{layout or 'strided'} on {a.device}")


def _check_shapes(a, b, out, offs) -> None:
    dims = 2 if offs is None else 3
    if a.dim() != 2 or b.dim() != dims:
        raise ValueError(f"gemm takes a 2-D a and a {dims}-D b, got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.shape[1] != b.shape[-2]:
        raise ValueError(f"a {tuple(a.shape)} and b {tuple(b.shape)}: inner dimensions differ")
    if offs is not None and offs.shape != (b.shape[0],):
        raise ValueError(f"offs {tuple(offs.shape)} must hold one row end per group of b ({b.shape[0]})")
    if out is not None and out.shape != (a.shape[0], b.shape[-1]):
        raise ValueError(f"out {tuple(out.shape)} must be {(a.shape[0], b.shape[-1])}")


# ---------------------------------------------------------------- cuBLAS


def _torch_gemm(a, b, out, offs):
    if out is None:
        return _torch_product(a, b, offs, a.dtype)
    if offs is None and out.dtype == a.dtype:
        return torch.mm(a, b, out=out)
    return out.copy_(_torch_product(a, b, offs, out.dtype))


def _torch_product(a, b, offs, dtype_out):
    if offs is not None:
        # torch's grouped product takes bf16 and writes its input dtype only.
        return torch._grouped_mm(a, b, offs=offs).to(dtype_out)
    if dtype_out == a.dtype:
        return torch.mm(a, b)
    if a.is_cuda and dtype_out == torch.float32:
        return torch.mm(a, b, out_dtype=dtype_out)
    # Mixed dtypes torch has no kernel for (and every mixed case on the CPU): in fp32.
    return torch.mm(a.float(), b.float()).to(dtype_out)


# ---------------------------------------------------------------- the op

# Defined through `torch.library.Library`, not `torch.library.custom_op`:
# custom_op wraps every call in Python autograd and aliasing checks, about
# 11 us of host time per call on the H100's host (`bench.dispatch`), which a
# compiled decode step pays on every tuned linear. Forward only, as `gemm`
# is: no autograd kernel (`tuner.patch` sends calls that need one to
# F.linear).
_LIB = torch.library.Library("gemm_tuner", "DEF")
_LIB.define("gemm(Tensor a, Tensor b, Tensor? offs=None) -> Tensor")
_LIB.define("gemm_out(Tensor a, Tensor b, Tensor(a!) out, Tensor? offs=None) -> ()")


def _gemm_op(a, b, offs=None):
    return _run(a, b, None, offs)


def _gemm_out_op(a, b, out, offs=None):
    _run(a, b, out, offs)


for _backend in ("CPU", "CUDA"):
    _LIB.impl("gemm", _gemm_op, _backend)
    _LIB.impl("gemm_out", _gemm_out_op, _backend)


@torch.library.register_fake("gemm_tuner::gemm", lib=_LIB)
def _(a, b, offs=None):
    return a.new_empty((a.shape[0], b.shape[-1]))


@torch.library.register_fake("gemm_tuner::gemm_out", lib=_LIB)
def _(a, b, out, offs=None):
    return None
