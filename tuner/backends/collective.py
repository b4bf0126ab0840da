"""The all-reduce beside an overlap key's GEMM: a tensor-parallel group of processes.

A worker timing an overlap key (`overlap=allreduce:BYTES`) is rank 0 of a
process group over the GPUs the all-reduce spans; every other rank is a
partner process on a GPU of its own that only runs the all-reduces rank 0
asks for. Before a measurement rank 0 broadcasts how many it will launch
and of how many bytes (`Group.begin`); each launch is preceded by a barrier
and a device synchronization on every rank (`Group.align`), so that all
ranks start it together, as a serving engine's ranks reach the same layer
together. A count of -1 ends the partners.

With `device` None the group runs on the CPU (gloo): the lockstep alone,
which the tests check without a GPU.
"""

from __future__ import annotations

import os
import socket
from datetime import timedelta
from typing import Sequence

# An all-reduce of this many bytes at start-up builds NCCL's communicators
# before the first timed launch.
WARMUP_BYTES = 4096
# A rank waits this long on a collective before it fails: a partner whose
# rank 0 died ends instead of holding its GPU.
TIMEOUT_S = 600
_STOP = -1


def _bind(device: int | None):
    """(torch device, process-group backend) for a rank on `device` (None: CPU)."""
    import torch

    if device is None:
        return torch.device("cpu"), "gloo"
    torch.cuda.set_device(device)
    return torch.device("cuda", device), "nccl"


def init_rank(rank: int, world: int, port: int, device: int | None):
    """Join a process group of `world` ranks meeting on this host's `port`,
    as `rank` on GPU `device` (NCCL) or on the CPU (None: gloo); returns
    the rank's torch device."""
    import torch.distributed as dist

    where, backend = _bind(device)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    kwargs = {"device_id": where} if backend == "nccl" else {}
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=TIMEOUT_S), **kwargs)
    return where


def _buffer(nbytes: int, where):
    import torch

    return torch.ones(max(1, nbytes // 2), dtype=torch.bfloat16, device=where)


def _sync(where) -> None:
    import torch

    if where.type == "cuda":
        torch.cuda.synchronize(where)


def partner(rank: int, world: int, port: int, device: int | None) -> None:
    """A partner rank's life: all-reduces as rank 0's commands ask, until told to stop."""
    import torch
    import torch.distributed as dist

    where = init_rank(rank, world, port, device)
    command = torch.zeros(2, dtype=torch.int64, device=where)
    dist.all_reduce(_buffer(WARMUP_BYTES, where))
    while True:
        dist.broadcast(command, src=0)
        count, nbytes = (int(v) for v in command.tolist())
        if count == _STOP:
            break
        buf = _buffer(nbytes, where)
        for _ in range(count):
            dist.barrier()
            _sync(where)
            dist.all_reduce(buf)
            _sync(where)
    dist.destroy_process_group()


class Group:
    """Rank 0 of an all-reduce group over `devices` (this process takes the
    first; None entries: CPU ranks), its partners started here."""

    def __init__(self, devices: Sequence[int | None]):
        import multiprocessing as mp

        import torch

        if len(devices) < 2:
            raise ValueError(f"an all-reduce group spans at least 2 devices, got {list(devices)}")
        self.world = len(devices)
        port = free_port()
        spawn = mp.get_context("spawn")
        self._partners = [spawn.Process(target=partner, args=(r, self.world, port, devices[r]), daemon=True)
                          for r in range(1, self.world)]
        for p in self._partners:
            p.start()
        self.where = init_rank(0, self.world, port, devices[0])
        self._command = torch.zeros(2, dtype=torch.int64, device=self.where)
        self.all_reduce(_buffer(WARMUP_BYTES, self.where))
        self._left = 0

    def begin(self, count: int, nbytes: int):
        """Tell the partners that `count` aligned all-reduces of `nbytes` follow;
        returns this rank's buffer for them."""
        import torch.distributed as dist

        if count < 0 or nbytes < 1:
            raise ValueError(f"count {count} and bytes {nbytes}: need count >= 0 and bytes >= 1")
        if self._left:
            raise RuntimeError(f"{self._left} all-reduces of the last measurement were not launched")
        self._command.copy_(self._command.new_tensor([count, nbytes]))
        dist.broadcast(self._command, src=0)
        self._left = count
        return _buffer(nbytes, self.where)

    def align(self) -> None:
        """Before each of the announced all-reduces: every rank here, idle."""
        import torch.distributed as dist

        if self._left <= 0:
            raise RuntimeError("align() past the all-reduces begin() announced")
        self._left -= 1
        dist.barrier()
        _sync(self.where)

    @staticmethod
    def all_reduce(buf) -> None:
        import torch.distributed as dist

        dist.all_reduce(buf)

    def close(self) -> None:
        import torch.distributed as dist

        self._command.copy_(self._command.new_tensor([_STOP, 0]))
        dist.broadcast(self._command, src=0)
        dist.destroy_process_group()
        for p in self._partners:
            p.join(timeout=30)

    @property
    def exitcodes(self) -> list[int | None]:
        return [p.exitcode for p in self._partners]


def free_port() -> int:
    """A TCP port of this host free now, for a process group's rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
