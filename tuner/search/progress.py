"""What a person reads of a tune, one process or many: in a terminal, a
live line per family being tuned (its M, trials, best speedup so far) that
collapses to a summary line when the family is done; piped, the summary
lines alone, plain text without redraws, then the totals line.

`Tracker` turns `tune_families`' callbacks into calls on a sink: `ReportSink`
shows them on a `Report` (one process), `tuner.search.workers.EventSink`
sends them to the parent of a `--devices` worker, which shows them on its own
`Report`.
"""

from __future__ import annotations

import time
from collections import Counter
from dataclasses import asdict, dataclass, field, fields
from typing import Any

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


def family_label(name: str, key) -> str:
    """A family as a person reads it: its keys' name, else its key with M
    left as "M" (e.g. "Mx4096x4096")."""
    return name or "Mx" + key.problem.label().split("x", 1)[1]


def count(n: int, word: str, plural: str | None = None) -> str:
    """"1 family", "3 families": a number with its noun."""
    return f"{n} {word if n == 1 else plural or word + 's'}"


def seconds_text(s: float) -> str:
    """A duration as a line shows it: "0.4 s", "12 s"."""
    return f"{s:.1f} s" if s < 10 else f"{s:.0f} s"


STATES = ("tuned", "remapped", "current", "lost", "unreached")


@dataclass
class FamilyRecord:
    """One family of a tune: its summary line and its `--json` entry."""

    name: str
    # "tuned" (rungs measured, map built), "remapped" (its rungs current, its
    # map measured again), "current" (nothing to do) or "lost" (its lease
    # expired mid-tune: another process finishes it) or "unreached" (the
    # tune's time budget ran out first: it stays on cuBLAS).
    state: str
    rungs: int = 0                  # its listed keys and ladder rungs
    tuned_m: list[int] = field(default_factory=list)  # the M measured anew
    spans: int | None = None        # the stored map's ranges, when this tune built it
    best_speedup: float | None = None  # the best winner's, over cuBLAS
    seconds: float = 0.0
    worker: str | None = None       # `--devices`: the GPU whose worker took it
    unreached_m: list[int] = field(default_factory=list)  # rungs the time budget left out
    # Wall seconds per stage of `tune_family` ("listed", "ladder", "fill", "deepen", "map").
    stages: dict[str, float] = field(default_factory=dict)

    @classmethod
    def from_outcome(cls, name: str, state: str, outcome, seconds: float) -> FamilyRecord:
        """From `tune_families`' `on_family(name, state, outcome)`; a lost
        family has no outcome."""
        if outcome is None:
            return cls(name, state, seconds=round(seconds, 2))
        winners = [o.winner for o in outcome.rungs.values() if o.winner is not None]
        tuned = sorted(m for m, o in outcome.rungs.items() if not o.skipped)
        return cls(
            name, "current" if state == "current" else "tuned" if tuned else "remapped",
            rungs=len(outcome.rungs), tuned_m=tuned, spans=len(outcome.ranges) if outcome.validated else None,
            best_speedup=round(max(w.speedup for w in winners), 4) if winners else None,
            seconds=round(seconds, 2), unreached_m=list(outcome.unreached), stages=dict(outcome.seconds),
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
            body = f"lost its lease after {seconds_text(self.seconds)}: another process finishes it"
        elif self.state == "unreached":
            body = "not reached in the time budget: left on cuBLAS"
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
            if self.unreached_m:
                parts.append(f"{count(len(self.unreached_m), 'rung')} out of time")
            if self.best_speedup is not None:
                parts.append(f"best {self.best_speedup:.2f}x")
            body = ", ".join(parts + [seconds_text(self.seconds)])
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

    def _tally(self) -> tuple[Counter, int, float]:
        """Families by state, rungs tuned, seconds so far."""
        states = Counter(r.state for r in self.records)
        return states, sum(len(r.tuned_m) for r in self.records), time.monotonic() - self.started

    def totals(self, keys: int) -> str:
        """The last line: keys and families, how many tuned, current and lost, seconds."""
        n = len(self.records)
        states, rungs, seconds = self._tally()
        if n and states["current"] == n:
            text = f"nothing to do: {count(n, 'family', 'families')} current ({count(keys, 'key')})"
        else:
            told = ", ".join(f"{states[s]} {s}" for s in STATES if states[s])
            text = (f"{count(keys, 'key')}, {count(n, 'family', 'families')}" + (f" ({told})" if told else "")
                    + f", {count(rungs, 'rung')} tuned, {seconds_text(seconds)}")
        self.say(text)
        return text

    def to_json(self, keys: int) -> dict[str, Any]:
        states, rungs, seconds = self._tally()
        return {
            "families": [r.to_json() for r in self.records],
            "totals": {"keys": keys, "families": len(self.records),
                       **{s: states[s] for s in STATES},
                       "rungs_tuned": rungs, "seconds": round(seconds, 2)},
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
        elif state in ("done", "current", "lost", "unreached"):
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
