"""The `gpu` backend: time kernels of the pool and cuBLAS on the local GPU.

Every measurement runs in a worker process (`tuner.backends.gpu_worker`) that owns the
CUDA context. A kernel that faults poisons that context and a kernel that
hangs never returns, so this side never touches CUDA: it sends JSON requests,
waits at most `timeout_s` for each reply, and on a crash, a lost context or a
timeout records the measurement as failed, kills the worker and starts a new
one for the next request. The tuning run goes on.

The worker checks a config once per (config, problem) against an fp32
reference (relative Frobenius error, limit 2e-2 for 16-bit inputs: see
`tuner.backends.gpu_worker.REL_ERR_LIMIT`), then times it: warm-up, a CUDA graph of
back-to-back launches replayed many times (CUDA events around plain launches
when a launcher cannot be captured), operands rotated through buffer sets
twice the size of L2 so that every launch reads from DRAM, median per launch.
With `problem.carveout` set, a spinning kernel holds that many SMs while the
timed replays run (`tuner.backends.carveout`).
"""

from __future__ import annotations

import collections
import json
import os
import selectors
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

from kernels.grouped import MAX_GROUPS
from kernels.space import TILE_K, GemmConfig, InvalidConfig
from tuner.backends.gpu_worker import CUBLAS_LOOP, grouped_form
from tuner.key import Key, Problem
from tuner.backends.measure import Measurement
from tuner.backends.model import register_facts

# A request's reply must come within this many seconds (compile + check +
# timing of one config take a few seconds; a hung kernel never replies).
DEFAULT_TIMEOUT_S = 60.0
# Compiler processes of one tune (`compile_workers`); `tune --devices` shares
# the host's among its workers through it.
COMPILE_WORKERS_ENV = "TUNER_COMPILE_WORKERS"
# The quick calibration's probe takes a few seconds.
PROBE_TIMEOUT_S = 120.0
# Starting a worker imports torch and creates a CUDA context.
START_TIMEOUT_S = 180.0
# Interleaved rounds of `remeasure`: each round replays every candidate once.
REMEASURE_ROUNDS = 15
# Rounds of a cold-protocol `remeasure`: one call per replay, so more of them.
COLD_ROUNDS = 25
# Compute capability each arch's kernels need.
_CAPABILITY = {"sm90": (9, 0), "sm100": (10, 0)}
_STDERR_LINES = 40
GROUPED_NOT_IN_POOL = "grouped GEMM not in the pool yet"

# Archs whose pool has grouped kernels (`kernels.compile` grouped classes).
_GROUPED_ARCHS = ("sm90",)


class GpuUnavailable(RuntimeError):
    """No usable GPU of the requested arch here."""


class WorkerLost(RuntimeError):
    """The worker died, lost its CUDA context, or missed its deadline."""


def problem_to_json(p: Problem) -> dict:
    d = asdict(p)
    d["group_k"] = list(p.group_k)
    return d


def measurement_from_json(reply: dict) -> Measurement:
    return Measurement(
        ms=reply.get("ms"), ok=bool(reply.get("ok")) and reply.get("ms") is not None,
        error=reply.get("error"), rel_err=reply.get("rel_err"), detail=reply.get("detail") or {},
    )


def _failed(error: str) -> Measurement:
    return Measurement(ms=None, ok=False, error=error)


class WorkerProcess:
    """A subprocess speaking one JSON object per line on stdin / stdout.

    `call` never raises for a worker failure: a crash, a reply marked `fatal`
    or a missed deadline kills the process and raises WorkerLost once; the
    next call starts a fresh process (counted in `restarts`).
    """

    def __init__(self, argv: list[str], *, env: dict[str, str] | None = None,
                 start_timeout_s: float = START_TIMEOUT_S):
        self.argv = list(argv)
        self.env = env
        self.start_timeout_s = start_timeout_s
        self.restarts = 0
        self.hello: dict | None = None
        self._proc: subprocess.Popen | None = None
        self._buf = b""
        self._stderr: collections.deque[str] = collections.deque(maxlen=_STDERR_LINES)
        self._started_once = False
        self._stderr_thread: threading.Thread | None = None

    @property
    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def start(self) -> dict:
        """Start the process if needed; returns its reply to `hello`."""
        if self.alive and self.hello is not None:
            return self.hello
        self.kill()
        if self._started_once:
            self.restarts += 1
        self._started_once = True
        self._buf = b""
        self._stderr.clear()
        self._proc = subprocess.Popen(
            self.argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
            env=self.env, close_fds=True,
        )
        self._stderr_thread = threading.Thread(target=self._drain_stderr, args=(self._proc,), daemon=True)
        self._stderr_thread.start()
        reply = self._exchange({"op": "hello"}, self.start_timeout_s)
        if not reply.get("ok"):
            self.kill()
            raise WorkerLost(f"worker did not start: {reply.get('error')}")
        self.hello = reply
        return reply

    def call(self, msg: dict, timeout_s: float) -> dict:
        """Send `msg`, return the reply; raise WorkerLost if the worker is gone."""
        self.start()
        return self._exchange(msg, timeout_s)

    def _exchange(self, msg: dict, timeout_s: float) -> dict:
        proc = self._proc
        assert proc is not None and proc.stdin is not None
        try:
            proc.stdin.write((json.dumps(msg) + "\n").encode())
            proc.stdin.flush()
        except (BrokenPipeError, OSError):
            self._lose("the worker exited")
        line = self._read_line(timeout_s)
        try:
            reply = json.loads(line)
        except json.JSONDecodeError:
            self._lose(f"unreadable reply {line[:200]!r}")
        if reply.get("fatal"):
            self._lose(reply.get("error") or "the worker lost its CUDA context", wait=True)
        return reply

    def _read_line(self, timeout_s: float) -> bytes:
        proc = self._proc
        assert proc is not None and proc.stdout is not None
        fd = proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        with selectors.DefaultSelector() as sel:
            sel.register(fd, selectors.EVENT_READ)
            while b"\n" not in self._buf:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._lose(f"no reply within {timeout_s:.0f} s (hung kernel?)")
                if not sel.select(left):
                    continue
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    self._lose("the worker exited", wait=True)
                self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line

    def _lose(self, reason: str, wait: bool = False) -> None:
        proc = self._proc
        if wait and proc is not None:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                pass
        code = proc.poll() if proc is not None else None
        self.kill()
        if self._stderr_thread is not None:
            self._stderr_thread.join(timeout=2)
        tail = self.stderr_tail()
        text = reason + (f" (exit code {code})" if code not in (None, 0) else "")
        raise WorkerLost(text + (f"; stderr: {tail}" if tail else ""))

    def stderr_tail(self, lines: int = 6) -> str:
        return " | ".join(list(self._stderr)[-lines:])

    def _drain_stderr(self, proc: subprocess.Popen) -> None:
        # Reading stderr keeps the pipe from filling (compilers are chatty);
        # the last lines explain a crash.
        assert proc.stderr is not None
        for raw in proc.stderr:
            text = raw.decode(errors="replace").rstrip()
            if text:
                self._stderr.append(text)

    def kill(self) -> None:
        proc, self._proc = self._proc, None
        self.hello = None
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                try:
                    stream.close()
                except OSError:
                    pass


def compile_workers() -> int:
    """Processes compiling ahead: $TUNER_COMPILE_WORKERS, else the host's
    cores but the two that measure (this process and the worker)."""
    given = os.environ.get(COMPILE_WORKERS_ENV, "")
    return int(given) if given.isdigit() and int(given) > 0 else max(1, (os.cpu_count() or 1) - 2)


def worker_argv(device_index: int, overlap_devices: tuple[int, ...] = ()) -> list[str]:
    argv = [sys.executable, "-m", "tuner.backends.gpu_worker", "--device", str(device_index)]
    return argv + (["--overlap-devices", ",".join(map(str, overlap_devices))] if overlap_devices else [])


def _worker_env() -> dict[str, str]:
    # The worker imports this project as the parent does, installed or not.
    root = str(Path(__file__).resolve().parents[2])
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, env.get("PYTHONPATH")]))
    return env


class GpuBackend:
    """Measure pool configs and cuBLAS on GPU `device_index` (see the module doc)."""

    name = "gpu"
    # Each trial is stored as it is measured: an interrupted key resumes (`Backend.bulk`).
    bulk = False

    def __init__(self, arch: str = "sm90", device_index: int = 0, *,
                 timeout_s: float = DEFAULT_TIMEOUT_S, argv: list[str] | None = None,
                 group_skew: float | None = None, overlap_devices: tuple[int, ...] = ()):
        """`group_skew`: Zipf exponent of MoE group sizes (None: the worker's
        default, 0: equal). `overlap_devices`: the other GPUs an overlap
        key's all-reduce spans, one partner process each
        (`tuner.backends.collective`); without them overlap keys are refused."""
        if arch not in _CAPABILITY:
            raise GpuUnavailable(f"unknown arch {arch!r}")
        self.arch = arch
        self.timeout_s = timeout_s
        self.group_skew = group_skew
        self.overlap_devices = tuple(overlap_devices)
        self._worker = WorkerProcess(argv or worker_argv(device_index, self.overlap_devices), env=_worker_env())
        try:
            hello = self._worker.start()
        except (WorkerLost, OSError) as exc:
            raise GpuUnavailable(str(exc)) from exc
        capability = tuple(hello["capability"])
        if capability[0] != _CAPABILITY[arch][0]:
            self._worker.kill()
            raise GpuUnavailable(
                f"{hello['device_name']} is sm_{capability[0]}{capability[1]}; it cannot run {arch} kernels"
            )
        visible = hello.get("device_count", 1)
        if any(d >= visible for d in self.overlap_devices):
            self._worker.kill()
            raise GpuUnavailable(f"an all-reduce over GPUs {[device_index, *self.overlap_devices]}: "
                                 f"{visible} are visible")
        self.device_name: str = hello["device_name"]
        self.sm_count: int = hello["sm_count"]
        # The driver's figures model this device where no calibration does.
        self.facts: dict = hello.get("facts") or {}
        register_facts(self.device_name, self.facts)
        self._versions: dict[str, str] = dict(hello["versions"])
        self._verified: set[tuple[str, Problem]] = set()
        self._compiles = None  # a kernels.compile.CompileQueue, from the first `prepare`
        # Wall seconds spent waiting on compiles and on measurements, and
        # how many candidates were timed (a round of several counts each).
        self.seconds = {"compile": 0.0, "measure": 0.0}
        self.timed = 0

    @property
    def restarts(self) -> int:
        return self._worker.restarts

    def versions(self) -> dict[str, str]:
        return dict(self._versions)

    def close(self) -> None:
        self._worker.kill()

    def __enter__(self) -> "GpuBackend":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def prepare(self, cfgs: list[GemmConfig], key: Key) -> None:
        """Queue `cfgs` for compiling, as `key` runs them, in the background
        on the host's cores, so that measuring one config overlaps the
        compiles of the next: a measurement waits only for its own config's
        compile (which jumps the queue). A compile that fails is left to the
        worker, whose measurement then reports it."""
        if self._compiles is None:
            from kernels.compile import CompileQueue

            self._compiles = CompileQueue(compile_workers())
        self._compiles.submit(cfgs, **_variant(key.problem))

    def probe(self) -> dict:
        """The quick calibration's micro-benchmarks (`tuner.backends.probe.measure`)."""
        reply = self._worker.call({"op": "probe"}, PROBE_TIMEOUT_S)
        return {k: v for k, v in reply.items() if k != "ok"}

    def _await_compiles(self, cfgs, p: Problem) -> None:
        """Wait for the background compiles of `cfgs` for `p`; the wait counts as compiling."""
        if self._compiles is None:
            return
        started = time.perf_counter()
        for cfg in cfgs:
            if isinstance(cfg, GemmConfig):
                self._compiles.wait(cfg, **_variant(p))
        self.seconds["compile"] += time.perf_counter() - started

    def _call(self, msg: dict, timeout_s: float) -> dict:
        """A measuring request; its seconds count as measuring, but for the
        compiles the worker did itself (a config not compiled ahead)."""
        started = time.perf_counter()
        try:
            reply = self._worker.call(msg, timeout_s)
        finally:
            self.seconds["measure"] += time.perf_counter() - started
        results = reply.get("results") or [reply]
        self.timed += len(results)
        compiled = sum((r.get("detail") or {}).get("prepare_s", 0.0) for r in results)
        self.seconds["measure"] -= compiled
        self.seconds["compile"] += compiled
        return reply

    def measure(self, key: Key, cfg: GemmConfig) -> Measurement:
        refusal = self._refuse(key, cfg)
        if refusal:
            return _failed(refusal)
        return self._measure_one(key, cfg)

    def baseline(self, key: Key) -> Measurement:
        refusal = self._refuse(key, None)
        if refusal:
            return _failed(refusal)
        return self._measure_one(key, None)

    def remeasure(self, key: Key, cfgs: list[GemmConfig | None | str],
                  rounds: int | None = None, *, cold: bool = False) -> list[Measurement]:
        """Time `cfgs` (None = cuBLAS, CUBLAS_LOOP = cuBLAS per group) round robin,
        `rounds` replays each; medians. `cold`: one call per replay after an L2
        flush (`tuner.backends.gpu_worker._Timer`)."""
        rounds = rounds or (COLD_ROUNDS if cold else REMEASURE_ROUNDS)
        refusals = [self._refuse(key, cfg) for cfg in cfgs]
        runnable = [i for i, r in enumerate(refusals) if not r]
        out = [_failed(r) if r else None for r in refusals]
        if runnable:
            p = key.problem
            msg = {
                "op": "remeasure", "problem": self._problem_json(p), "rounds": rounds, "cold": cold,
                "configs": [_cfg_json(cfgs[i]) for i in runnable],
                "check": [not self._is_verified(cfgs[i], p) for i in runnable],
            }
            self._await_compiles(cfgs, p)
            try:
                reply = self._call(msg, self.timeout_s * len(runnable))
                results = reply.get("results") or [reply] * len(runnable)
                got = [measurement_from_json(r) for r in results]
            except WorkerLost as exc:
                got = [_failed(str(exc))] * len(runnable)
            for i, m in zip(runnable, got, strict=True):
                out[i] = m
                self._note(cfgs[i], p, m)
        return out

    def _measure_one(self, key: Key, cfg: GemmConfig | None) -> Measurement:
        p = key.problem
        msg = {"op": "measure", "problem": self._problem_json(p), "config": _cfg_json(cfg),
               "check": not self._is_verified(cfg, p)}
        self._await_compiles([cfg], p)
        try:
            m = measurement_from_json(self._call(msg, self.timeout_s))
        except WorkerLost as exc:
            m = _failed(str(exc))
        self._note(cfg, p, m)
        return m

    def _refuse(self, key: Key, cfg: GemmConfig | None) -> str | None:
        """Why `cfg` cannot be measured for `key` here, or None."""
        p = key.problem
        if key.arch != self.arch:
            return f"key is for {key.arch}; this backend measures {self.arch}"
        if key.device != self.device_name:
            return f"key is for {key.device!r}; this GPU is {self.device_name!r}"
        if p.carveout >= self.sm_count:
            return f"cannot hold {p.carveout} of {self.sm_count} SMs"
        if p.overlap and not self.overlap_devices:
            return "timing beside an all-reduce (an overlap key) needs the GPUs it spans: tune with --tp"
        if p.overlap and p.carveout:
            return "an overlap key holds no SMs: its all-reduce takes what it needs"
        if cfg is None:
            return None
        if cfg == CUBLAS_LOOP:
            return None if p.groups > 1 and not p.group_k else "a per-group cuBLAS loop needs an MoE problem"
        if cfg.arch != self.arch:
            return f"config is for {cfg.arch}; this backend measures {self.arch}"
        if p.groups > 1:
            refusal = _grouped_refusal(cfg, p)
            if refusal:
                return refusal
        try:
            p.check(cfg)
        except InvalidConfig as exc:
            return f"invalid for this problem: {exc}"
        return None

    def _problem_json(self, p: Problem) -> dict:
        d = problem_to_json(p)
        if p.groups > 1 and self.group_skew is not None:
            d["skew"] = self.group_skew
        return d

    def _is_verified(self, cfg: GemmConfig | None, p: Problem) -> bool:
        return (_cfg_name(cfg), p) in self._verified

    def _note(self, cfg: GemmConfig | None, p: Problem, m: Measurement) -> None:
        if m.ok:
            self._verified.add((_cfg_name(cfg), p))


def _variant(p: Problem) -> dict:
    """What a compile of a config for `p` is specialised for (`kernels.compile.Variant`),
    as the worker builds it."""
    return dict(dtype_in=p.dtype_in, dtype_out=p.dtype_out, layout=p.layout,
                grouped=grouped_form({"groups": p.groups, "group_k": p.group_k}))


def _grouped_refusal(cfg: GemmConfig, p: Problem) -> str | None:
    """Why the grouped kernels cannot run `p` with `cfg`, or None."""
    if cfg.arch not in _GROUPED_ARCHS:
        return f"{GROUPED_NOT_IN_POOL} for {cfg.arch}"
    if p.groups > MAX_GROUPS:
        return f"{p.groups} groups; the grouped kernels take at most {MAX_GROUPS}"
    if any(k % TILE_K for k in p.group_k):
        return f"per-group K must be multiples of {TILE_K} for the packed mixed-K kernel"
    return None


def _cfg_json(cfg: GemmConfig | None | str) -> dict | str | None:
    return cfg if cfg is None or cfg == CUBLAS_LOOP else cfg.to_dict()


def _cfg_name(cfg: GemmConfig | None | str) -> str:
    return "cublas" if cfg is None else cfg if cfg == CUBLAS_LOOP else cfg.name()
