"""`tuner tune --devices 0,1,...`: one tuning process per GPU of this host.

Each worker is a `tuner tune` process of its own with `CUDA_VISIBLE_DEVICES`
set to its GPU, against the same database: the family leases share the
shape file's families out among them (and among workers on other hosts),
so this module only starts them and shows what each is doing. A worker
reports on its stdout, one JSON object a line (`Events`); the parent turns
those into one live progress line per worker (in a terminal only), a line
per finished family, a line per worker when it exits and a totals line, on
a `tuner.search.progress.Report`.
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
from typing import IO

from tuner.backends.gpu import COMPILE_WORKERS_ENV, compile_workers
from tuner.search.progress import FamilyRecord, Report, count, rung_text, seconds_text


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


class EventSink:
    """A `Tracker` sink of a `--devices` worker: events for its parent."""

    def __init__(self, events: Events) -> None:
        self.events = events

    def take(self) -> None:
        self.events.emit("take")

    def rung(self, label: str, m: int, listed: bool) -> None:
        self.events.emit("rung", label=label, m=m, listed=listed)

    def tick(self, done: int, total: int, best: float | None) -> None:
        self.events.emit("tick", done=done, total=total, best=best)

    def family(self, record: FamilyRecord) -> None:
        self.events.emit("family", **record.to_json())

    def wait(self) -> None:
        self.events.emit("wait")


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


def run(devices: list[str], tune_args: list[str], report: Report) -> list[Worker]:
    """Start `tuner tune *tune_args` once per device, show their progress on
    `report` until every one has exited, and return them."""
    events: queue.Queue = queue.Queue()
    workers = []
    # The host's compiler processes are shared out among the workers.
    compilers = str(max(1, compile_workers() // len(devices)))
    for i, device in enumerate(devices):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=device, **{COMPILE_WORKERS_ENV: compilers})
        proc = subprocess.Popen(
            [sys.executable, "-m", "tuner.cli", "tune", *tune_args, "--worker-events"],
            stdout=subprocess.PIPE, text=True, env=env,
        )
        workers.append(Worker(device, proc, time.monotonic()))
        threading.Thread(target=_pump, args=(i, proc.stdout, events), daemon=True).start()
    lanes = [report.lane(f"gpu{w.device} starting") for w in workers]
    running = len(workers)
    while running:
        i, message = events.get()
        w = workers[i]
        if message is None:  # its stdout closed: the process is ending
            w.rc = w.proc.wait()
            w.wall_s = time.monotonic() - w.started
            report.drop(lanes[i])
            state = "finished" if w.rc == 0 else f"FAILED (exit code {w.rc})"
            report.say(f"gpu{w.device} {state}: {count(len(w.families), 'family', 'families')}, "
                       f"{count(w.rungs, 'rung')} tuned, {seconds_text(w.wall_s)}")
            running -= 1
            continue
        _apply(w, message, report, lanes[i])
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


def _apply(w: Worker, message: dict, report: Report, lane: int | None) -> None:
    kind = message.get("event")
    tag = f"gpu{w.device} "
    if kind == "start":
        w.owner, w.device_name, w.arch = message["owner"], message["device_name"], message["arch"]
    elif kind == "take":
        report.took(tag)
    elif kind == "rung":
        report.show(lane, rung_text(tag, message["label"], message["m"], message["listed"]), restart=True)
    elif kind == "tick":
        report.show(lane, done=message["done"], total=message["total"], best=message["best"])
    elif kind == "wait":
        report.wait(tag, lane)
    elif kind == "family":
        record = FamilyRecord.from_json(message)
        record.worker = w.device
        if record.state in ("tuned", "remapped"):
            w.families.append(record.name)
            w.rungs += len(record.tuned_m)
        elif record.state == "lost":
            w.lost.append(record.name)
        report.family(record, tag)
