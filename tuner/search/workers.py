"""`tuner tune --devices 0,1,...`: one tuning process per GPU of this host.

Each worker is a `tuner tune` process of its own with `CUDA_VISIBLE_DEVICES`
set to its GPU, against the same database: the family leases share the
shape file's families out among them (and among workers on other hosts),
so this module only starts them and shows what each is doing. A worker
reports on its stdout, one JSON object a line (`Events`); the parent turns
those into one progress line per worker and a line per finished family,
which reads the same in a terminal and piped.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from typing import IO, Callable

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


def parse_devices(text: str) -> list[str]:
    """"0,1,3" -> ["0", "1", "3"]; ValueError naming the problem otherwise."""
    items = [t.strip() for t in text.split(",")]
    if not all(t.isdigit() for t in items):
        raise ValueError(f"--devices takes GPU indices separated by commas (e.g. 0,1), got {text!r}")
    if len(set(items)) != len(items):
        raise ValueError(f"--devices lists a GPU twice: {text!r}")
    return items


class Events:
    """What a worker tells its parent, one JSON line each on `stream`."""

    def __init__(self, stream: IO[str] = sys.stdout) -> None:
        self._stream = stream
        self._lock = threading.Lock()

    def emit(self, event: str, **fields) -> None:
        with self._lock:
            self._stream.write(json.dumps({"event": event, **fields}) + "\n")
            self._stream.flush()


@dataclass
class Worker:
    """One worker process and what it last reported."""

    device: str
    proc: subprocess.Popen
    started: float
    owner: str = ""
    device_name: str = ""
    arch: str = ""
    families: list[str] = field(default_factory=list)
    lost: list[str] = field(default_factory=list)
    rungs: int = 0
    rc: int | None = None
    wall_s: float | None = None

    def summary(self) -> dict:
        return {
            "device": self.device, "pid": self.proc.pid, "owner": self.owner, "device_name": self.device_name,
            "families": self.families, "lost": self.lost, "rungs": self.rungs, "exit_code": self.rc,
            "wall_s": None if self.wall_s is None else round(self.wall_s, 3),
        }


def run(devices: list[str], tune_args: list[str], console: Console) -> list[Worker]:
    """Start `tuner tune *tune_args` once per device, show their progress on
    `console` until every one has exited, and return them."""
    events: queue.Queue = queue.Queue()
    workers = []
    for i, device in enumerate(devices):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=device)
        proc = subprocess.Popen(
            [sys.executable, "-m", "tuner.cli", "tune", *tune_args, "--worker-events"],
            stdout=subprocess.PIPE, text=True, env=env,
        )
        workers.append(Worker(device, proc, time.monotonic()))
        threading.Thread(target=_pump, args=(i, proc.stdout, events), daemon=True).start()
    columns = (TextColumn("{task.description}"), BarColumn(bar_width=12), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, console=console, transient=False) as progress:
        tasks = [progress.add_task(f"gpu{w.device} starting", total=None) for w in workers]
        running = len(workers)
        while running:
            i, message = events.get()
            w = workers[i]
            if message is None:  # its stdout closed: the process is ending
                w.rc = w.proc.wait()
                w.wall_s = time.monotonic() - w.started
                state = "finished" if w.rc == 0 else f"FAILED (exit code {w.rc})"
                progress.update(tasks[i], description=f"gpu{w.device} {state}")
                progress.stop_task(tasks[i])
                progress.console.print(f"gpu{w.device} {state}: {len(w.families)} families, "
                                       f"{w.rungs} rungs tuned, {w.wall_s:.0f} s", highlight=False)
                running -= 1
                continue
            _apply(w, message, lambda **kw: progress.update(tasks[i], **kw), progress.console)
    return workers


def _pump(index: int, stream: IO[str], events: queue.Queue) -> None:
    for line in stream:
        try:
            message = json.loads(line)
        except ValueError:
            continue  # not ours (a library printing to stdout): nothing to show
        if isinstance(message, dict):
            events.put((index, message))
    events.put((index, None))


def _apply(w: Worker, message: dict, update: Callable, console: Console) -> None:
    kind = message.get("event")
    tag = f"gpu{w.device}"
    if kind == "start":
        w.owner, w.device_name, w.arch = message["owner"], message["device_name"], message["arch"]
    elif kind == "rung":
        rung = "" if message["listed"] else " (rung)"
        update(description=f"{tag} {message['label']}{rung}", completed=message["done"], total=message["total"])
    elif kind == "family":
        name, state = message["name"], message["state"]
        if state == "wait":
            update(description=f"{tag} waiting: the rest is held by others", completed=0, total=None)
        elif state == "done":
            w.families.append(name)
            w.rungs += message["rungs"]
            console.print(f"{tag} tuned {name}: {message['rungs']} rungs "
                          f"({time.monotonic() - w.started:.0f} s)", highlight=False)
        elif state == "lost":
            w.lost.append(name)
            console.print(f"{tag} lost its lease on {name}: another worker finishes it", highlight=False)
