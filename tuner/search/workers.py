"""`tuner tune --devices 0,1,...`: one tuning process per GPU of this host.

Each worker is a `tuner tune` process of its own with `CUDA_VISIBLE_DEVICES`
set to its GPU, against the same database: the family leases share the
shape file's families out among them (and among workers on other hosts),
so this module only starts them and shows what each is doing. A worker
reports on its stdout, one JSON object a line (`Events`); the parent turns
those into one live progress line per worker (in a terminal only), a line
per finished family, a line per worker when it exits and a totals line.

What a person reads of any tune, one process or many, is made here too
(`Report`, `FamilyRecord`, `Tracker`): in a terminal, a live line per
family being tuned (its M, trials, best speedup so far) that collapses to a
summary line when the family is done; piped, the summary lines alone, plain
text without redraws, then the totals line.
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import IO, Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

# A summary line past this wraps its figures onto an indented line of their own.
WIDTH = 80
# Piped, a process waiting on families held by others says so once it has
# waited this long (a short wait, on a rerun, is no news).
WAIT_NOTE_S = 10.0
# Which of two reports of one family counts: another process found current
# what this one tuned, and what a lost lease left another finished.
_RANK = {"current": 0, "lost": 1, "remapped": 2, "tuned": 2}


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


def family_label(name: str, key) -> str:
    """A family as a person reads it: its keys' name, else its key with M
    left as "M" (e.g. "Mx4096x4096")."""
    return name or "Mx" + key.problem.label().split("x", 1)[1]


def count(n: int, word: str, plural: str | None = None) -> str:
    """"1 family", "3 families": a number with its noun."""
    return f"{n} {word if n == 1 else plural or word + 's'}"


def _seconds(s: float) -> str:
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


@dataclass
class FamilyRecord:
    """One family of a tune: its summary line and its `--json` entry."""

    name: str
    # "tuned" (rungs measured, map built), "remapped" (its rungs current, its
    # map measured again), "current" (nothing to do) or "lost" (its lease
    # expired mid-tune: another process finishes it).
    state: str
    rungs: int = 0                  # its listed keys and ladder rungs
    tuned_m: list[int] = field(default_factory=list)  # the M measured anew
    spans: int | None = None        # the stored map's ranges, when this tune built it
    best_speedup: float | None = None  # the best winner's, over cuBLAS
    seconds: float = 0.0
    worker: str | None = None       # `--devices`: the GPU whose worker took it

    @classmethod
    def from_outcome(cls, name: str, state: str, outcome, seconds: float) -> FamilyRecord:
        """From `tune_families`' `on_family(name, state, outcome)`; a lost
        family has no outcome."""
        if outcome is None:
            return cls(name, "lost", seconds=round(seconds, 2))
        winners = [o.winner for o in outcome.rungs.values() if o.winner is not None]
        tuned = sorted(m for m, o in outcome.rungs.items() if not o.skipped)
        return cls(
            name, "current" if state == "current" else "tuned" if tuned else "remapped",
            rungs=len(outcome.rungs), tuned_m=tuned, spans=len(outcome.ranges) if outcome.validated else None,
            best_speedup=round(max(w.speedup for w in winners), 4) if winners else None,
            seconds=round(seconds, 2),
        )

    @classmethod
    def from_json(cls, data: dict) -> FamilyRecord:
        return cls(**{f.name: data[f.name] for f in fields(cls) if f.name in data})

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        if self.worker is None:
            del data["worker"]
        return data

    def line(self, tag: str = "") -> str:
        """E.g. "gemma3-27b.qkv  31 rungs tuned, map 7 spans, best 1.21x, 12 s"
        (`tag`, e.g. "gpu0 ", before the name); past `WIDTH` columns the
        figures go on an indented line of their own."""
        if self.state == "lost":
            body = f"lost its lease after {_seconds(self.seconds)}: another process finishes it"
        elif self.state == "current":
            body = f"current ({count(self.rungs, 'rung')})"
        else:
            n = len(self.tuned_m)
            spans = "kept" if self.spans is None else count(self.spans, "span")
            if not n:
                parts = [f"map measured again: {spans}"]
            else:
                parts = [count(n, "rung") + " tuned" if n == self.rungs else f"{n} of {self.rungs} rungs tuned",
                         f"map {spans}"]
            if self.best_speedup is not None:
                parts.append(f"best {self.best_speedup:.2f}x")
            body = ", ".join(parts + [_seconds(self.seconds)])
        text = f"{tag}{self.name}  {body}"
        return text if len(text) <= WIDTH else f"{tag}{self.name}\n    {body}"


class Report:
    """What a tune shows a person on `console` (stderr).

    In a terminal, live lines ("lanes": a family being tuned, or a worker)
    under the lines printed so far; piped, no live lines at all: only the
    printed lines, plain text flushed one by one (no redraws, no escapes)."""

    def __init__(self, console: Console) -> None:
        self.console = console
        self.live = console.is_terminal
        self._records: dict[str, FamilyRecord] = {}
        self.started = time.monotonic()
        self._progress: Progress | None = None
        self._waiting: dict[str, float | None] = {}  # since when; None: said

    def __enter__(self) -> Report:
        if self.live:
            self._progress = Progress(
                TextColumn("{task.description}"), BarColumn(bar_width=10), MofNCompleteColumn(),
                TextColumn("{task.fields[best]}"), TimeElapsedColumn(), console=self.console, transient=True,
            )
            self._progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self._progress is not None:
            self._progress.stop()
            self._progress = None

    def lane(self, description: str) -> int | None:
        if self._progress is None:
            return None
        return self._progress.add_task(description, total=None, best="")

    def show(self, lane: int | None, description: str | None = None, *, done: int | None = None,
             total: int | None = None, best: float | None = None, restart: bool = False) -> None:
        if self._progress is None or lane is None:
            return
        update: dict[str, Any] = {}
        if restart:  # a new key or rung: its trials from 0 (the clock runs on: the family's)
            update.update(completed=0, best="")
        if description is not None:
            update["description"] = description
        if done is not None:
            update.update(completed=done, total=total)
        if best is not None:
            update["best"] = f"best {best:.2f}x"
        self._progress.update(lane, **update)

    def drop(self, lane: int | None) -> None:
        if self._progress is not None and lane is not None:
            self._progress.remove_task(lane)
            self._progress.refresh()  # else the next line printed redraws the lane's last state

    def say(self, text: str) -> None:
        """A line that stays."""
        if self._progress is not None:
            self._progress.console.print(text, highlight=False, markup=False, soft_wrap=True)
        else:
            print(text, file=self.console.file, flush=True)

    @property
    def records(self) -> list[FamilyRecord]:
        """One per family, whichever process reported it (`_RANK`)."""
        return list(self._records.values())

    def family(self, record: FamilyRecord, tag: str = "") -> None:
        """A family ended: its summary line (none for a current one: the
        totals line counts those)."""
        known = self._records.get(record.name)
        if known is None or _RANK[record.state] > _RANK[known.state]:
            self._records[record.name] = record
        self._waiting.pop(tag, None)
        if record.state != "current":
            self.say(record.line(tag))

    def wait(self, tag: str, lane: int | None) -> None:
        """Nothing free to take: every family left is held by another process.
        In a terminal at once; piped, once the wait has lasted `WAIT_NOTE_S`;
        once until the waiter takes a family again."""
        now = time.monotonic()
        since = self._waiting.setdefault(tag, now)
        if since is None or not self.live and now - since < WAIT_NOTE_S:
            return
        text = f"{tag}waiting: the families left are held by other processes"
        if self.live:
            self.show(lane, text, restart=True)
        else:
            self.say(text)
        self._waiting[tag] = None

    def took(self, tag: str) -> None:
        self._waiting.pop(tag, None)

    def totals(self, keys: int) -> str:
        """The last line: keys and families, how many tuned, current and lost, seconds."""
        n = len(self.records)
        states = Counter(r.state for r in self.records)
        seconds = time.monotonic() - self.started
        if n and states["current"] == n:
            text = f"nothing to do: {count(n, 'family', 'families')} current ({count(keys, 'key')})"
        else:
            told = ", ".join(f"{states[s]} {s}" for s in ("tuned", "remapped", "current", "lost") if states[s])
            rungs = sum(len(r.tuned_m) for r in self.records)
            text = (f"{count(keys, 'key')}, {count(n, 'family', 'families')}" + (f" ({told})" if told else "")
                    + f", {count(rungs, 'rung')} tuned, {_seconds(seconds)}")
        self.say(text)
        return text

    def to_json(self, keys: int) -> dict[str, Any]:
        states = Counter(r.state for r in self.records)
        return {
            "families": [r.to_json() for r in self.records],
            "totals": {"keys": keys, "families": len(self.records),
                       **{s: states[s] for s in ("tuned", "remapped", "current", "lost")},
                       "rungs_tuned": sum(len(r.tuned_m) for r in self.records),
                       "seconds": round(time.monotonic() - self.started, 2)},
        }


class Tracker:
    """`tune_families`' callbacks (`on_rung`, `on_family`) turned into what a
    `sink` shows: `rung(label, m, listed)` when a key or rung starts,
    `tick(done, total, best)` after each of its trials, `family(record)`
    when a family ends, `take()` and `wait()`."""

    def __init__(self, sink) -> None:
        self.sink = sink
        self._name = ""
        self._label: str | None = None
        self._started = time.monotonic()

    def on_rung(self, key, listed: bool):
        if self._label is None:
            self._label = family_label(self._name, key)
        self.sink.rung(self._label, key.problem.m, listed)

        def tick(t) -> None:
            self.sink.tick(t.done, t.total, t.best_speedup)
        return tick

    def on_family(self, name: str, state: str, outcome) -> None:
        if state == "take":
            self._name, self._label, self._started = name, None, time.monotonic()
            self.sink.take()
        elif state == "wait":
            self.sink.wait()
        elif state in ("done", "current", "lost"):
            label = self._label
            if label is None:
                label = family_label(name, next(iter(outcome.rungs.values())).key) if outcome else name or "-"
            self.sink.family(FamilyRecord.from_outcome(label, state, outcome, time.monotonic() - self._started))
            self._label = None


def rung_text(tag: str, label: str, m: int, listed: bool) -> str:
    """A live line's head: who, which family, which M."""
    return f"{tag}{label}  M={m}" + ("" if listed else " (rung)")


class ReportSink:
    """A `Tracker` sink of one process tuning: a live line per family, a
    summary line when it ends."""

    def __init__(self, report: Report) -> None:
        self.report = report
        self._lane: int | None = None

    def take(self) -> None:
        self.report.took("")

    def rung(self, label: str, m: int, listed: bool) -> None:
        if self._lane is None:
            self._lane = self.report.lane(label)
        self.report.show(self._lane, rung_text("", label, m, listed), restart=True)

    def tick(self, done: int, total: int, best: float | None) -> None:
        self.report.show(self._lane, done=done, total=total, best=best)

    def family(self, record: FamilyRecord) -> None:
        self.report.drop(self._lane)
        self._lane = None
        self.report.family(record)

    def wait(self) -> None:
        if self._lane is None:
            self._lane = self.report.lane("")
        self.report.wait("", self._lane)


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
    for i, device in enumerate(devices):
        env = dict(os.environ, CUDA_VISIBLE_DEVICES=device)
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
                       f"{count(w.rungs, 'rung')} tuned, {_seconds(w.wall_s)}")
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
