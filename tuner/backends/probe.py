"""What a GPU is, from its driver, and how fast it streams, multiplies and
launches, from a few seconds of micro-benchmarks (`tuner calibrate --quick`).

Runs in the measurement worker (it needs CUDA); the figures go to
`tuner.backends.calibration.quick_entry`, which turns them into a device
entry of the analytic model.
"""

from __future__ import annotations

import ctypes
import statistics
import time

# Copy of this many bytes per direction: far past any L2, long enough that
# the launch is noise.
COPY_BYTES = 1 << 30
# The tensor-core rate: a bf16 GEMM this large on every side (the size the
# README's hardware limit is quoted at).
MMA_SIZE = 8192
# Launch cost: a graph of this many back-to-back one-element kernels.
LAUNCHES = 200
REPEATS = 15
NVML_CLOCK_SM = 1
NVML_CLOCK_MEM = 2


def facts(device: int = 0) -> dict:
    """The device as its driver describes it: SM count, the SM clock it
    runs at under load (NVML's maximum), L2 bytes, and the DRAM bandwidth
    its memory clock and bus imply (double data rate)."""
    import torch

    p = torch.cuda.get_device_properties(device)
    mem_khz = getattr(p, "memory_clock_rate", 0)
    bus_bits = getattr(p, "memory_bus_width", 0)
    sm_mhz, mem_mhz = _nvml_max_clocks(device)
    return {
        "name": p.name, "sms": p.multi_processor_count, "l2_bytes": int(p.L2_cache_size),
        "smem_per_sm": int(p.shared_memory_per_multiprocessor),
        "clock_hz": sm_mhz * 1e6 if sm_mhz else getattr(p, "clock_rate", 0) * 1e3 or None,
        "hbm_bw": 2 * (mem_mhz * 1e6 if mem_mhz else mem_khz * 1e3) * bus_bits / 8 or None,
        "memory_bytes": int(p.total_memory),
    }


def _nvml_max_clocks(device: int) -> tuple[int, int]:
    """NVML's maximum SM and memory clocks in MHz (0 where NVML is absent)."""
    try:
        nvml = ctypes.CDLL("libnvidia-ml.so.1")
    except OSError:
        return 0, 0
    handle = ctypes.c_void_p()
    if nvml.nvmlInit_v2() != 0 or nvml.nvmlDeviceGetHandleByIndex_v2(device, ctypes.byref(handle)) != 0:
        return 0, 0
    clocks = []
    for kind in (NVML_CLOCK_SM, NVML_CLOCK_MEM):
        mhz = ctypes.c_uint()
        clocks.append(mhz.value if nvml.nvmlDeviceGetMaxClockInfo(handle, kind, ctypes.byref(mhz)) == 0 else 0)
    return clocks[0], clocks[1]


def _graph_ms(fn, repeats: int = REPEATS) -> float:
    """Median milliseconds of one replay of a CUDA graph of `fn`."""
    import torch

    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats + 2):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times[2:])


def measure() -> dict:
    """Streaming bandwidth (a device copy, bytes read and written), the
    bf16 tensor-core rate of cuBLAS at 8192^3, and the cost of one launch
    back to back; with the seconds the probe took."""
    import torch

    started = time.perf_counter()
    figures = {
        "copy_gbps": 2 * COPY_BYTES / _copy_ms() / 1e6,
        "mma_tflops": 2 * MMA_SIZE**3 / _mma_ms() / 1e9,
        "launch_us": _launches_ms() * 1e3 / LAUNCHES,
    }
    torch.cuda.empty_cache()
    return figures | {"seconds": round(time.perf_counter() - started, 2)}


def _copy_ms() -> float:
    import torch

    src = torch.empty(COPY_BYTES, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return _graph_ms(lambda: dst.copy_(src))


def _mma_ms() -> float:
    import torch

    a, b = (torch.randn(MMA_SIZE, MMA_SIZE, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    out = torch.empty_like(a)
    return _graph_ms(lambda: torch.mm(a, b, out=out))


def _launches_ms() -> float:
    import torch

    tiny = torch.zeros(1, device="cuda")

    def launches():
        for _ in range(LAUNCHES):
            tiny.add_(1)

    return _graph_ms(launches)
