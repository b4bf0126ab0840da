"""Compiling pool kernels: one compile per (config, dtypes, layout), cached.

- `get_kernel(cfg, dtype_in=, dtype_out=, layout=)` returns a runner,
  ``runner(a, b, out)`` on torch CUDA tensors, launched on torch's current
  stream. M, N and K are symbolic in the compiled kernel, so one compile
  serves every problem size.
- Compiled kernels are kept in memory and on disk (an object file per
  (config, dtypes, layout, arch, DSL version), loaded through TVM-FFI in a
  few milliseconds), so a new process does not recompile.
- `compile_many` fills the disk cache from worker processes in parallel.
- `compile_offline` compiles for any arch without a GPU and returns the PTX,
  registers per thread and shared memory (what CI checks).

CuTe DSL reads its target arch from CUTE_DSL_ARCH when it is first imported,
so cutlass is imported lazily: offline and parallel compiles run in worker
processes that set the target first.
"""

from __future__ import annotations

import functools
import hashlib
import importlib
import json
import multiprocessing
import os
import struct
import tempfile
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, replace
from pathlib import Path

from kernels.space import (
    SPLIT_K_COUNTERS,
    GemmConfig,
    InvalidConfig,
    check_operands,
    check_output,
    split_k_partials_offset,
    split_k_scratch_words,
    split_k_tiles,
)

# Kernel class per arch, as "module:Class" so that importing this module stays
# free of cutlass. Another arch registers itself with `register_kernel`.
_KERNEL_CLASSES = {"sm90": "kernels.sm90.gemm:Sm90GemmKernel", "sm100": "kernels.sm100.gemm:Sm100GemmKernel"}
_TARGETS = {"sm90": "sm_90a", "sm100": "sm_100a"}
# Grouped kernel class per arch (`kernels.grouped` forms: "rows", "k").
_GROUPED_CLASSES = {
    "sm90": "kernels.sm90.grouped:Sm90GroupedGemmKernel",
    "sm100": "kernels.sm100.grouped:Sm100GroupedGemmKernel",
}
_EXPORT_NAME = "gemm"
_CACHE_ENV = "KERNELS_CACHE_DIR"
# ELF .nv.info attributes: registers per thread, stack frame bytes (spills).
_EIATTR_REGCOUNT = 0x2F
_EIATTR_FRAME_SIZE = 0x11


def register_kernel(arch: str, class_path: str) -> None:
    """Make `class_path` ("module:Class") the kernel class of `arch`."""
    _KERNEL_CLASSES[arch] = class_path


def _kernel_class(arch: str, grouped: str = ""):
    classes = _GROUPED_CLASSES if grouped else _KERNEL_CLASSES
    if arch not in classes:
        raise InvalidConfig(f"no {'grouped ' if grouped else ''}kernel class registered for {arch}")
    module, name = classes[arch].split(":")
    return getattr(importlib.import_module(module), name)


@dataclass(frozen=True)
class Variant:
    """What one compile is specialised for: a config, dtypes, B's layout and grouped form.

    `grouped` is "" for a plain GEMM, else a `kernels.grouped` form ("rows":
    MoE offsets over A's rows, "k": problems packed along K). `trace` builds
    the kernel that records every tile (`kernels.trace`): its runner takes
    the record buffer last.
    """

    cfg: GemmConfig
    dtype_in: str = "bf16"
    dtype_out: str = "bf16"
    layout: str = "tn"
    grouped: str = ""
    trace: bool = False

    def __post_init__(self) -> None:
        # An SM budget sizes the launch (`_Runner`), not the code: every
        # budget shares the one compile.
        if self.cfg.sm_budget:
            object.__setattr__(self, "cfg", replace(self.cfg, sm_budget=0))
        # Sizes 8 satisfy every alignment rule; this checks dtypes and layout.
        check_operands(8, 8, 8 * self.cfg.split_k, 1, self.dtype_in, self.dtype_out, self.layout)
        check_output(self.cfg, self.dtype_out)

    @property
    def workspace(self) -> bool:
        """Split-K writes fp32 partials (S, M, N) instead of `out`."""
        return self.cfg.split_k > 1 and not self.cfg.split_k_in_kernel

    @property
    def scratch(self) -> bool:
        """Split-K or stream-K reduces in the kernel through a per-problem scratch buffer.

        Stream-K does on every arch: its units end anywhere in K, so there
        are no whole slices for a runner to sum."""
        return self.cfg.stream_k or self.cfg.split_k_in_kernel

    def key(self) -> str:
        key = f"{self.cfg.name()}-{self.dtype_in}-{self.dtype_out}-{self.layout}"
        key = f"{key}-grouped_{self.grouped}" if self.grouped else key
        return f"{key}-trace" if self.trace else key


# ---------------------------------------------------------------- compiling


def _dsl_version() -> str:
    from importlib.metadata import version

    return version("nvidia-cutlass-dsl")


def _fake_args(v: Variant):
    """Fake tensors and scalars of the kernel's signature (symbolic M, N, K)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    dtypes = {"bf16": cutlass.BFloat16, "fp16": cutlass.Float16, "fp32": cutlass.Float32}
    s = v.cfg.split_k
    # Divisibility is a contract the call checks: 16-byte rows for TMA, and
    # K slices that start on 16 bytes.
    n_div = 8 if v.layout == "nn" or v.dtype_out != "fp32" and not v.workspace else 4
    m, n, k = cute.sym_int(), cute.sym_int(divisibility=n_div), cute.sym_int(divisibility=8 * s)

    def row_major(dtype, shape):
        order = tuple(range(len(shape) - 1, -1, -1))
        return make_fake_compact_tensor(dtype, shape, stride_order=order, assumed_align=16)

    a = row_major(dtypes[v.dtype_in], (m, k))
    if v.grouped:
        return (a, *_fake_grouped(v, row_major, dtypes, m, n, k))
    b = row_major(dtypes[v.dtype_in], (n, k) if v.layout == "tn" else (k, n))
    out = row_major(cutlass.Float32, (s, m, n)) if v.workspace else row_major(dtypes[v.dtype_out], (m, n))
    if v.scratch:
        sched_buf = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=16)
    else:
        sched_buf = make_fake_compact_tensor(cutlass.Int32, (SPLIT_K_COUNTERS,), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    if v.trace:
        return a, b, out, sched_buf, cutlass.Int32(1), _fake_records(), stream
    return a, b, out, sched_buf, cutlass.Int32(1), stream


def _fake_grouped(v: Variant, row_major, dtypes, m, n, k):
    """The grouped kernels' arguments after A: b, out, offs, sched_buf, max_clusters, stream."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor, make_fake_stream

    g = cute.sym_int()
    din, dout = dtypes[v.dtype_in], dtypes[v.dtype_out]
    if v.grouped == "rows":
        b = row_major(din, (g, n, k) if v.layout == "tn" else (g, k, n))
        out = row_major(dout, (m, n))
    else:
        b = row_major(din, (n, k) if v.layout == "tn" else (k, n))
        out = row_major(dout, (g, m, n))
    offs = make_fake_compact_tensor(cutlass.Int32, (g,), assumed_align=4)
    if v.scratch:
        sched_buf = make_fake_compact_tensor(cutlass.Int32, (cute.sym_int(),), assumed_align=16)
    else:
        sched_buf = make_fake_compact_tensor(cutlass.Int32, (2,), assumed_align=4)
    stream = make_fake_stream(use_tvm_ffi_env_stream=True)
    if v.trace:
        return b, out, offs, sched_buf, cutlass.Int32(1), _fake_records(), stream
    return b, out, offs, sched_buf, cutlass.Int32(1), stream


def _fake_records():
    """The int64 record buffer of a traced build (`kernels.trace`)."""
    import cutlass
    import cutlass.cute as cute
    from cutlass.cute.runtime import make_fake_compact_tensor

    return make_fake_compact_tensor(cutlass.Int64, (cute.sym_int(),), assumed_align=8)


def _compile(v: Variant, options: str = ""):
    """(compiled function, kernel object) for the arch this process targets."""
    import cutlass.cute as cute

    cls = _kernel_class(v.cfg.arch, v.grouped)
    kernel = cls(v.cfg, v.layout, v.grouped) if v.grouped else cls(v.cfg, v.layout)
    entry = kernel.traced if v.trace else kernel
    compiled = cute.compile(entry, *_fake_args(v), options=f"--enable-tvm-ffi {options}".strip())
    return compiled, kernel


def _set_target(arch: str) -> None:
    if arch not in _TARGETS:
        raise InvalidConfig(f"no compile target for {arch}")
    os.environ["CUTE_DSL_ARCH"] = _TARGETS[arch]


def _spawn_pool(workers: int, arch: str) -> ProcessPoolExecutor:
    return ProcessPoolExecutor(
        max_workers=workers,
        mp_context=multiprocessing.get_context("spawn"),
        initializer=_set_target,
        initargs=(arch,),
    )


# ---------------------------------------------------------------- offline (CI)


@dataclass(frozen=True)
class OfflineKernel:
    """What an offline compile reports about one variant."""

    ptx: str
    registers: int | None  # per thread at launch, from the cubin
    stack_bytes: int  # per-thread stack frame: above zero means register spills
    smem_bytes: int  # dynamic shared memory per CTA
    seconds: float


def _offline_job(v: Variant) -> OfflineKernel:
    started = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        compiled, kernel = _compile(v, f"--keep-ptx --keep-cubin --dump-dir {tmp}")
        ptx, cubin = compiled.artifacts.PTX, compiled.artifacts.CUBIN
        # Some releases give the dumped files' paths instead of their contents.
        if "\n" not in ptx:
            ptx = Path(ptx).read_text()
        if isinstance(cubin, str):
            cubin = Path(cubin).read_bytes()
    attrs = _cubin_attrs(cubin)
    return OfflineKernel(
        ptx=ptx,
        registers=attrs.get(_EIATTR_REGCOUNT),
        stack_bytes=attrs.get(_EIATTR_FRAME_SIZE, 0),
        smem_bytes=kernel.shared_storage.size_in_bytes(),
        seconds=time.perf_counter() - started,
    )


def compile_offline(variants: list[Variant], *, workers: int = 1) -> list[OfflineKernel]:
    """Compile each variant for its config's arch, no GPU needed (worker processes)."""
    results: list[OfflineKernel] = [None] * len(variants)  # type: ignore[list-item]
    for arch in sorted({v.cfg.arch for v in variants}):
        idx = [i for i, v in enumerate(variants) if v.cfg.arch == arch]
        with _spawn_pool(max(1, min(workers, len(idx))), arch) as pool:
            for i, res in zip(idx, pool.map(_offline_job, [variants[i] for i in idx])):
                results[i] = res
    return results


def _cubin_attrs(cubin: bytes) -> dict[int, int]:
    """Per-function attributes of the .nv.info section of a cubin (attr -> value)."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    entsize, count, names_idx = struct.unpack_from("<HHH", cubin, 0x3A)
    sections = [struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * entsize) for i in range(count)]
    names_off = sections[names_idx][4]
    attrs = {}
    for sec in sections:
        end = cubin.index(b"\0", names_off + sec[0])
        if cubin[names_off + sec[0]:end] != b".nv.info":
            continue
        pos, stop = sec[4], sec[4] + sec[5]
        while pos < stop:
            fmt, attr, size = struct.unpack_from("<BBH", cubin, pos)
            if fmt == 4 and size == 8:  # (function symbol, value)
                attrs[attr] = struct.unpack_from("<I", cubin, pos + 8)[0]
            pos += 4 + (size if fmt == 4 else 0)
    return attrs


# ---------------------------------------------------------------- disk cache


def cache_dir() -> Path:
    root = os.environ.get(_CACHE_ENV) or Path.home() / ".cache" / "gemm-kernels"
    return Path(root) / f"cutlass-dsl-{_dsl_version()}"


def _cache_path(v: Variant) -> Path:
    # The sources of the pool are part of the key: an edit invalidates.
    h = hashlib.sha256(json.dumps([v.key(), v.cfg.to_dict()], sort_keys=True).encode())
    h.update(_sources_digest())
    return cache_dir() / v.cfg.arch / f"{v.key()}-{h.hexdigest()[:16]}.o"


@functools.cache
def _sources_digest() -> bytes:
    h = hashlib.sha256()
    for src in sorted(Path(__file__).parent.rglob("*.py")):
        h.update(src.read_bytes())
    return h.digest()


def _load(path: Path):
    import cutlass.cute as cute

    return cute.runtime.load_module(str(path), enable_tvm_ffi=True)[_EXPORT_NAME]


def _export(compiled, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Export beside, then rename: a reader never sees half a file.
    tmp = path.with_suffix(f".{os.getpid()}.tmp")
    compiled.export_to_c(object_file_path=str(tmp), function_name=_EXPORT_NAME)
    os.replace(tmp, path)


def _compile_to_disk(job: tuple[Variant, Path]) -> str:
    # The parent names the path: a pooled worker outlives changes to its cache dir.
    v, path = job
    if not path.exists():
        _export(_compile(v)[0], path)
    return str(path)


_compiled: dict[tuple, object] = {}


def _function(v: Variant, arch: str):
    """The compiled function of `v`: memory, then disk, then compile."""
    key = (v, arch)
    if key not in _compiled:
        path = _cache_path(v)
        if path.exists():
            fn = _load(path)
        else:
            compiled = _compile(v)[0]
            _export(compiled, path)
            fn = compiled
        _compiled[key] = fn
    return _compiled[key]


def compile_many(
    cfgs: list[GemmConfig],
    workers: int = 1,
    *,
    dtype_in: str = "bf16",
    dtype_out: str = "bf16",
    layouts: tuple[str, ...] = ("tn",),
    grouped: str = "",
) -> int:
    """Compile every (config, layout) missing from the disk cache, `workers` at a time.

    Returns how many were compiled. Runners created afterwards load from disk.
    """
    todo = [
        v for c in cfgs for layout in layouts
        if not _cache_path(v := Variant(c, dtype_in, dtype_out, layout, grouped)).exists()
    ]
    for arch in sorted({v.cfg.arch for v in todo}):
        batch = [v for v in todo if v.cfg.arch == arch]
        pool = _pool(arch, max(1, workers))
        try:
            list(pool.map(_compile_to_disk, [(v, _cache_path(v)) for v in batch]))
        except BrokenProcessPool:
            _pools.pop((arch, max(1, workers))).shutdown(wait=False)
            raise
    return len(todo)


class CompileQueue:
    """Compiles to the disk cache in the background, `workers` at a time,
    in the order asked for, but a config someone waits for goes first: a
    tune queues a family's candidates up front, and the one it is about to
    measure must not wait behind them."""

    def __init__(self, workers: int):
        self.workers = max(1, workers)
        self._waiting: list[tuple[Variant, Path]] = []
        self._running: set[Path] = set()
        self._cond = threading.Condition(threading.RLock())

    def submit(self, cfgs: list[GemmConfig], **variant) -> None:
        """Queue the compiles of `cfgs` (as `Variant(cfg, **variant)`: dtypes,
        layout, grouped form) neither cached nor queued yet."""
        with self._cond:
            queued = self._running | {path for _, path in self._waiting}
            for cfg in cfgs:
                v = Variant(cfg, **variant)
                path = _cache_path(v)
                if path not in queued and not path.exists():
                    self._waiting.append((v, path))
                    queued.add(path)
            self._feed()

    def wait(self, cfg: GemmConfig, **variant) -> None:
        """Return once `cfg` (as `Variant(cfg, **variant)`) is compiled or
        failed to (or was never queued), compiling it next if it is still
        waiting its turn."""
        path = _cache_path(Variant(cfg, **variant))
        with self._cond:
            for i, (_, queued) in enumerate(self._waiting):
                if queued == path:
                    self._waiting.insert(0, self._waiting.pop(i))
                    self._feed(urgent=True)
                    break
            self._cond.wait_for(lambda: path not in self._running and all(p != path for _, p in self._waiting))

    def _feed(self, urgent: bool = False) -> None:
        # `urgent`: the head goes to the pool now, ahead of the worker that
        # frees first (the pool queues it) rather than after it.
        while self._waiting and (urgent or len(self._running) < self.workers):
            urgent = False
            v, path = self._waiting.pop(0)
            try:
                future = _pool(v.cfg.arch, self.workers).submit(_compile_to_disk, (v, path))
            except BrokenProcessPool:
                # A compiler process died: a fresh pool takes the next; this
                # one is left to whoever loads it (and reports its error).
                _pools.pop((v.cfg.arch, self.workers)).shutdown(wait=False)
                continue
            self._running.add(path)
            future.add_done_callback(functools.partial(self._finished, path))

    def _finished(self, path: Path, _future: Future) -> None:
        with self._cond:
            self._running.discard(path)
            self._feed()
            self._cond.notify_all()


def _pool(arch: str, workers: int) -> ProcessPoolExecutor:
    key = (arch, workers)
    if key not in _pools:
        _pools[key] = _spawn_pool(workers, arch)
    return _pools[key]


def cache_path(cfg: GemmConfig, *, dtype_in: str = "bf16", dtype_out: str = "bf16", layout: str = "tn",
               grouped: str = "") -> Path:
    """The disk cache file of one compile of `cfg`."""
    return _cache_path(Variant(cfg, dtype_in, dtype_out, layout, grouped))


# compile_many's worker pools live as long as the process: a spawned worker
# imports the DSL (seconds), too slow to pay again for every tuned key.
_pools: dict[tuple[str, int], ProcessPoolExecutor] = {}


# ---------------------------------------------------------------- runners


def device_arch(device) -> str:
    """The arch of CUDA device `device` as the pool names it (sm90, sm100)."""
    import torch

    major, minor = torch.cuda.get_device_capability(device)
    return f"sm{major}{minor}"


_max_clusters: dict[tuple[int, int], int] = {}


def _launch_clusters(device_index: int, cfg: GemmConfig, sm_budget: int) -> int:
    """Clusters a persistent launch of `cfg` on an SM budget of `sm_budget` covers
    (`GemmConfig.budget_clusters`); the compiled `cfg` itself has none (`Variant`)."""
    return replace(cfg, sm_budget=sm_budget).budget_clusters(_clusters_per_wave(device_index, cfg.cluster_size))


def _clusters_per_wave(device_index: int, cluster_size: int) -> int:
    """Clusters of `cluster_size` CTAs the device runs at once (one CTA per SM).

    Asked of the driver, not SMs // cluster_size: a cluster lives inside one
    GPC, so an H100 with 132 SMs holds 30 clusters of 4, not 33. A persistent
    grid of 33 would leave 3 clusters to start only when others exit, with
    their first tiles a second wave.
    """
    key = (device_index, cluster_size)
    if key not in _max_clusters:
        import torch
        from cutlass.utils import HardwareInfo

        # The driver's occupancy query needs the device's context current.
        torch.zeros(1, device=f"cuda:{device_index}")
        with torch.cuda.device(device_index):
            _max_clusters[key] = max(1, HardwareInfo(device_index).get_max_active_clusters(cluster_size))
    return _max_clusters[key]


# One scheduler buffer (claims, finished clusters) per (device, stream): the
# dynamic scheduler resets it itself, so launches in one stream share it,
# eager or replayed. A stream's first launch may be captured, so the buffer
# is made outside any capture, as the split-K scratch is (its doc).
_sched_bufs: dict[tuple[int, int], object] = {}


def _sched_buf(device_index: int):
    import torch

    stream = torch._C._cuda_getCurrentRawStream(device_index)
    buf = _sched_bufs.get((device_index, stream))
    if buf is None:
        buf = _sched_bufs[(device_index, stream)] = _zeroed_outside_capture(SPLIT_K_COUNTERS, device_index)
    return buf


class _SplitKScratch:
    """The split-K (and stream-K) scratch of one stream.

    Kernels leave the counters and their tile semaphores at zero, but the
    partials start right after the semaphores, so a problem with more tiles
    keeps semaphores where an earlier one parked partials. Eager launches
    share one buffer: `_zero_end` tracks the prefix still known to be zero,
    and a launch that needs more is preceded by clearing the difference.

    A CUDA graph replays its launches with no host code in between, so
    that bookkeeping cannot cover them: a launch captured into a graph gets
    a buffer of its own tile count, which only captured launches of that
    count share (their semaphores and partials coincide). Such a buffer is
    made and cleared once, when the capture needs it, outside the graph
    (`_zeroed_outside_capture`). No buffer a graph may hold is ever freed:
    an outgrown one is kept.
    """

    def __init__(self):
        self.buf = None
        self._zero_end = 0
        self.captured: dict[int, object] = {}
        self._outgrown: list = []  # held only so that no graph's buffer is freed

    def for_problem(self, device_index: int, cfg: GemmConfig, m: int, n: int, clusters: int, groups: int = 1):
        import torch

        words = split_k_scratch_words(cfg, m, n, clusters, groups)
        tiles = split_k_tiles(cfg, m, n, groups)
        if torch.cuda.is_current_stream_capturing():
            buf = self.captured.get(tiles)
            if buf is None or buf.numel() < words:
                if buf is not None:
                    self._outgrown.append(buf)
                buf = self.captured[tiles] = _zeroed_outside_capture(words, device_index)
            return buf
        if self.buf is None or self.buf.numel() < words:
            self.buf = torch.zeros(words, dtype=torch.int32, device=f"cuda:{device_index}")
            self._zero_end = words
        semaphores_end = SPLIT_K_COUNTERS + tiles
        if self._zero_end < semaphores_end:
            self.buf[self._zero_end:semaphores_end].zero_()
        self._zero_end = min(max(self._zero_end, semaphores_end), split_k_partials_offset(tiles))
        return self.buf


def _zeroed_outside_capture(words: int, device_index: int):
    """A zeroed int32 buffer of `words`, made on a stream no capture records.

    The kernels leave the semaphores (and the scheduler's counters) at zero,
    so only the first replay needs them cleared; a clear captured into the
    graph would run before every replay, and at a few microseconds' kernel
    that node cost up to 9 % (`bench.dynamic_m`, the first split-K point of
    a family). Nor may the buffer come from the capture's own memory pool:
    that pool hands out blocks the graph freed earlier in the capture, which
    the graph's earlier kernels then write at every replay before the
    split-K launch reads its semaphores (a Phi-3 decode step's attention
    temporaries under its o projection: 5.5x the product's norm in error).
    The capture may forbid allocating and synchronizing (its default, global
    mode): this thread relaxes that while it makes the buffer."""
    import torch
    from cuda.bindings import driver

    relaxed = driver.CUstreamCaptureMode.CU_STREAM_CAPTURE_MODE_RELAXED
    err, before = driver.cuThreadExchangeStreamCaptureMode(relaxed)
    if err != driver.CUresult.CUDA_SUCCESS:
        raise RuntimeError(f"cuThreadExchangeStreamCaptureMode: {err}")
    try:
        side = _side_stream(torch.device("cuda", device_index))
        with torch.cuda.stream(side):
            buf = torch.zeros(words, dtype=torch.int32, device=f"cuda:{device_index}")
        side.synchronize()
    finally:
        driver.cuThreadExchangeStreamCaptureMode(before)
    return buf


_side_streams: dict = {}


def _side_stream(device):
    """A stream of our own on `device`: one from torch's pool may be the very
    stream a capture is recording on (the pool hands its streams out in turn)."""
    import torch
    from cuda.bindings import driver

    if device.index not in _side_streams:
        with torch.cuda.device(device):
            err, raw = driver.cuStreamCreate(driver.CUstream_flags.CU_STREAM_NON_BLOCKING.value)
        if err != driver.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"cuStreamCreate: {err}")
        _side_streams[device.index] = torch.cuda.ExternalStream(int(raw), device=device)
    return _side_streams[device.index]


_split_k_scratch: dict[tuple[int, int], _SplitKScratch] = {}


def _scratch_buf(device_index: int, cfg: GemmConfig, m: int, n: int, clusters: int, groups: int = 1):
    import torch

    key = (device_index, torch._C._cuda_getCurrentRawStream(device_index))
    return _split_k_scratch.setdefault(key, _SplitKScratch()).for_problem(device_index, cfg, m, n, clusters, groups)


class _Runner:
    """``runner(a, b, out)``: out = a @ b (tn: a @ b.T) on the current stream."""

    def __init__(self, fn, v: Variant, device_index: int, sm_budget: int = 0):
        self._fn = fn
        self._split_k = v.cfg.split_k
        self._scratch = v.scratch
        self._device = device_index
        self._max_clusters = _launch_clusters(device_index, v.cfg, sm_budget)
        self.variant = v

    def __call__(self, a, b, out, *records) -> None:
        """`records`: the int64 record buffer of a traced build (`kernels.trace`)."""
        if len(records) != self.variant.trace:
            raise TypeError("a traced kernel takes a record buffer after out; an untraced one none")
        if self._scratch:
            scratch = _scratch_buf(self._device, self.variant.cfg, out.shape[0], out.shape[1], self._max_clusters)
            self._fn(a, b, out, scratch, self._max_clusters, *records)
            return
        buf = _sched_buf(self._device)
        if self._split_k == 1:
            self._fn(a, b, out, buf, self._max_clusters, *records)
            return
        import torch

        ws = torch.empty((self._split_k, *out.shape), dtype=torch.float32, device=out.device)
        self._fn(a, b, ws, buf, self._max_clusters, *records)
        torch.sum(ws, dim=0, out=out) if out.dtype == torch.float32 else out.copy_(ws.sum(dim=0))


class _GroupedRunner:
    """``runner(a, b, offs, out)``: the grouped product of `kernels.grouped`'s form, current stream.

    "rows": a (total_M, K), b (G, N, K) or (G, K, N), out (total_M, N).
    "k": a (M, sum K), b (N, sum K) or (sum K, N), out (G, M, N); every
    group's K a multiple of 64. `offs` (int32, G) stays on the device.
    """

    def __init__(self, fn, v: Variant, device_index: int, sm_budget: int = 0):
        from kernels.grouped import MAX_GROUPS

        self._fn = fn
        self._device = device_index
        self._max_clusters = _launch_clusters(device_index, v.cfg, sm_budget)
        self._max_groups = MAX_GROUPS
        self._scratch = v.scratch
        self.variant = v

    def __call__(self, a, b, offs, out, *records) -> None:
        """`records`: the int64 record buffer of a traced build (`kernels.trace`)."""
        if len(records) != self.variant.trace:
            raise TypeError("a traced kernel takes a record buffer after out; an untraced one none")
        if not 0 < offs.shape[0] <= self._max_groups:
            raise InvalidConfig(f"{offs.shape[0]} groups; the grouped kernels take 1 to {self._max_groups}")
        if self._scratch:  # split-K of the "k" form: out is (G, M, N)
            buf = _scratch_buf(self._device, self.variant.cfg, out.shape[1], out.shape[2], self._max_clusters,
                               out.shape[0])
        else:
            buf = _sched_buf(self._device)
        self._fn(a, b, out, offs, buf, self._max_clusters, *records)


def get_kernel(cfg: GemmConfig, *, dtype_in: str, dtype_out: str, layout: str, grouped: str = "",
               trace: bool = False):
    """A runner of `cfg` for the current CUDA device (compiled or loaded once).

    `grouped` "" gives a `_Runner`, a `kernels.grouped` form a `_GroupedRunner`;
    `trace` the traced build (`kernels.trace`).
    """
    import torch

    device_index = torch.cuda.current_device()
    arch = device_arch(device_index)
    if cfg.arch != arch:
        raise InvalidConfig(f"{cfg.arch} config on a {arch} device")
    v = Variant(cfg, dtype_in, dtype_out, layout, grouped, trace)
    return (_GroupedRunner if grouped else _Runner)(_function(v, arch), v, device_index, cfg.sm_budget)
