"""Hold SMs with a spinning kernel while a GEMM runs (seed 003's scenario).

`hold_sms(n)` launches exactly `n` CTAs of a spin kernel on a side stream and
makes the current stream wait until all of them are resident; on exit it
raises a stop flag from the current stream. Each CTA has 1024 threads and is
compiled so that it needs the whole register file of an SM (64 registers x
1024 threads = 65536), so no second CTA of any kernel fits beside it: the `n`
CTAs sit on `n` distinct SMs and those SMs are unavailable to the GEMM, as
when another kernel holds them.

The spin loop also ends on its own after `budget_s` (read from %globaltimer),
so a stop flag that never comes cannot hang the device.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Iterator

import torch

# Threads per spinning CTA: the most one CTA may have.
SPIN_WARPS = 32
# Registers per SM on sm_90 / sm_100 (64K 32-bit registers).
SM_REGISTERS = 65536
# fp32 values each spinning thread keeps live: with 1024 threads ptxas caps a
# thread at 64 registers, so this fills the register file.
_LIVE_PER_THREAD = 64
_DEFAULT_BUDGET_S = 30.0


def check_sms(sms: int, sm_count: int) -> None:
    """A hold must leave at least one SM to the GEMM (and to the arrival wait)."""
    if not 0 < sms < sm_count:
        raise ValueError(f"can hold 1..{sm_count - 1} of {sm_count} SMs, not {sms}")


def expected_slowdown(sms: int, sm_count: int) -> float:
    """Slowdown of a compute-bound GEMM that spreads evenly over the SMs left."""
    check_sms(sms, sm_count)
    return sm_count / (sm_count - sms)


@functools.cache
def _kernels():
    # triton is imported here so that the module (and its pure helpers) load
    # on machines without it.
    import triton
    import triton.language as tl

    @triton.jit
    def _now():
        return tl.inline_asm_elementwise(
            "mov.u64 $0, %globaltimer;", "=l", [], dtype=tl.int64, is_pure=False, pack=1
        )

    # Arguments are not specialised on their values: a new specialisation is
    # a new module, and loading a module while the spinners run waits for
    # them to finish, which would end the hold before the GEMM starts.
    @triton.jit(do_not_specialize=["sink_len"])
    def spin(ctrl_ptr, sink_ptr, sink_len, BUDGET_NS: tl.constexpr, WIDTH: tl.constexpr):
        # ctrl[0]: stop flag, ctrl[1]: CTAs resident so far, ctrl[2]: CTAs
        # that ran out of budget before the flag came.
        offs = tl.arange(0, WIDTH)
        acc = tl.zeros([WIDTH], dtype=tl.float32) + tl.program_id(0).to(tl.float32)
        start = _now()
        tl.atomic_add(ctrl_ptr + 1, 1, sem="relaxed")
        stop = tl.load(ctrl_ptr, volatile=True)
        now = start
        while (stop == 0) & (now - start < BUDGET_NS):
            acc = acc * 0.5 + 1.0
            stop = tl.load(ctrl_ptr, volatile=True)
            now = _now()
        if stop == 0:
            tl.atomic_add(ctrl_ptr + 2, 1, sem="relaxed")
        # sink_len is 0 at run time: the store keeps `acc` (and its registers)
        # alive without writing anything.
        tl.store(sink_ptr + offs, acc, mask=offs < sink_len)

    @triton.jit(do_not_specialize=["want"])
    def wait_resident(ctrl_ptr, want, BUDGET_NS: tl.constexpr):
        start = _now()
        seen = tl.load(ctrl_ptr + 1, volatile=True)
        now = start
        while (seen < want) & (now - start < BUDGET_NS):
            seen = tl.load(ctrl_ptr + 1, volatile=True)
            now = _now()

    return spin, wait_resident


_loaded: set[tuple[torch.device, int]] = set()


@contextmanager
def hold_sms(sms: int, device: torch.device | int | None = None,
             budget_s: float = _DEFAULT_BUDGET_S) -> Iterator[dict]:
    """Hold `sms` SMs of `device` for the body of the `with` block.

    Work enqueued on the current stream inside the block runs on the other
    SMs. Yields a dict that, after the block, holds `resident` (CTAs that
    became resident), `expired` (CTAs that stopped on their time budget before
    the block ended) and `registers` (per CTA): the hold covered the block when
    resident == sms and expired == 0.

    The body must not launch a kernel for the first time in the process:
    loading its module waits for the spinners, so warm everything up first.
    """
    device = torch.device("cuda", torch.cuda.current_device() if device is None else
                          device if isinstance(device, int) else device.index or 0)
    sm_count = torch.cuda.get_device_properties(device).multi_processor_count
    check_sms(sms, sm_count)
    spin, wait_resident = _kernels()
    budget_ns = int(budget_s * 1e9)
    width = SPIN_WARPS * 32 * _LIVE_PER_THREAD

    main = torch.cuda.current_stream(device)
    side = torch.cuda.Stream(device)
    ctrl = torch.zeros(3, dtype=torch.int32, device=device)
    sink = torch.empty(1, dtype=torch.float32, device=device)
    if (device, budget_ns) not in _loaded:
        # Compile and load both kernels before the spinners start (see _kernels).
        ctrl[0] = 1
        spin[(1,)](ctrl, sink, 0, BUDGET_NS=budget_ns, WIDTH=width, num_warps=SPIN_WARPS)
        wait_resident[(1,)](ctrl, 0, BUDGET_NS=budget_ns, num_warps=1)
        torch.cuda.synchronize(device)
        ctrl.zero_()
        _loaded.add((device, budget_ns))
    side.wait_stream(main)
    info: dict = {"sms": sms}
    with torch.cuda.stream(side):
        compiled = spin[(sms,)](ctrl, sink, 0, BUDGET_NS=budget_ns, WIDTH=width, num_warps=SPIN_WARPS)
    info["registers"] = compiled.n_regs * SPIN_WARPS * 32
    wait_resident[(1,)](ctrl, sms, BUDGET_NS=budget_ns, num_warps=1)
    try:
        yield info
    finally:
        ctrl[0].fill_(1)
        main.wait_stream(side)
        ctrl.record_stream(side)
        sink.record_stream(side)
        resident, expired = ctrl[1:].tolist()
        info.update(resident=resident, expired=expired)
