"""M ladders: tune a family at every scale of M, then measure where each winner holds.

A family is a key without M. Its ladder is the M values a shape file lists
plus every power of two up to the largest, so no two rungs are more than 2x
apart and M = 1 is always covered. Listed rungs get the full budget; the
others are cheap: they measure their tuned neighbours' winners (compiled
already, since one compiled kernel serves every M) and the model's best
shapes for their own M. Where a rung's winner beat cuBLAS, the gaps next to
it get a cheaper rung still at their geometric midpoints (`_fill_rungs`): a
winning tile fits its own M's waves, not the M between. Under a deadline
(`tuner tune --budget-s`) a family goes breadth first from the fewest rows
up: listed keys measure their seeds, rungs their picks while time is left,
and the listed keys sample only with the time the rungs left (`tune_family`).

Then validation: at every rung and at `PROBES_PER_OCTAVE - 1` points between
each pair of rungs (geometrically spaced), cuBLAS and the winners of the
neighbouring rungs (each also under the stream-K scheduler and under the
other L2 hint) are re-measured interleaved, each call alone after an L2
flush (the latency a model's forward sees, not back-to-back throughput); a
range a kernel takes is measured again at the first M of every tile row
inside it and, where its lead is thin, between its measured points; a
stretch the map would give cuBLAS next to a point a kernel took is bisected
(`_refine`; under a deadline from the fewest rows up, past the family's
time only where cuBLAS takes under a millisecond).
A point measured while the GPU ran slow for a spell (cuBLAS slower there
than at a larger M) is measured again (`_steady`). From those measurements
`build_map` makes the family's M map:

- at a measured M, the fastest candidate, a kernel only if it beats cuBLAS
  there by `HOLD_MARGIN` (1 %: a tie within noise goes to cuBLAS); but a
  point whose fastest kernel would stand alone between other choices goes
  to a neighbouring range's kernel that beats cuBLAS there and is within
  `HOLD_MARGIN` of the fastest (`_without_islands`);
- between two measured M, the kernel that beats cuBLAS so at both ends (the
  best by its speedups there), else cuBLAS.

`tuner.lookup` serves calls from that map; nothing there is a guess.
"""

from __future__ import annotations

import math
import os
import socket
import threading
import time
from dataclasses import dataclass, replace
from typing import Callable, Sequence

from db.store import Store
from kernels.space import GemmConfig, InvalidConfig
from tuner.key import Key
from tuner.runtime.lookup import BASELINE, family_id, family_of
from tuner.backends.measure import Backend, slow_spell
from tuner.search.study import (
    Budget, Outcome, Tick, compile_ahead, drawable, few_row_seeds, first_configs, hint_variant, is_current,
    model_picks, scheduler_variant, tune_key,
)

# Measured points per doubling of M (rungs included): 3 puts a point every 26 %.
PROBES_PER_OCTAVE = 3
# A kernel takes a point only if cuBLAS is at least this much slower there:
# a tie within measurement noise goes to cuBLAS.
HOLD_MARGIN = 1.01
# A family's lease lasts this long past its holder's last heartbeat: a worker
# that died (on another host: nothing else can tell) is taken over after it.
# `tuner tune --lease-ttl` (or $TUNER_LEASE_TTL_S) overrides it.
LEASE_TTL_S = 600.0
# How long a process with nothing free to tune waits before looking again.
WAIT_S = 0.5
# Rounds of measuring kernel ranges again where they may lose (`_refine`).
REFINE_ROUNDS = 4
# Under a deadline a refinement point is measured however late while
# cuBLAS takes less than this (ms) at the measured M below it: its calls
# cost a fraction of a second to time, and at few rows a tile row a kernel
# barely fills is a large share of its time.
REFINE_ALWAYS_MS = 1.0
# A kernel range is measured between two of its points while its lead over
# cuBLAS at either is under THIN_MARGIN and they lie more than DENSE_RATIO apart.
THIN_MARGIN = 1.04
DENSE_RATIO = 1.05
# A validation point measured in a slow spell (`tuner.backends.measure.slow_spell`)
# is measured again, up to STEADY_TRIES times, keeping the round whose
# cuBLAS ran fastest.
STEADY_TRIES = 2
# Configs a rung between listed ones measures beside its neighbours' winners:
# the model's best shapes for that M.
RUNG_MODEL_PICKS = 2
# A rung whose neighbours' common winner beat cuBLAS by at least this much at
# both is settled: measured against cuBLAS, not searched (`_settled`).
SETTLED_MARGIN = 1.03
# A family tuned under a deadline (`Budget.until`) keeps this share of its
# time for validation: on an H100, validation took 15-56 % (median 38 %) of
# the time of the families of Gemma 3 27B and Llama 3.1 8B tuned in 150-168 s.
MAP_SHARE = 0.35
# Under a deadline a family starts only with this share of an equal share
# of the whole budget left (`tune_families`).
MIN_FAMILY_SHARE = 0.5


@dataclass(frozen=True)
class FamilyOutcome:
    rungs: dict[int, Outcome]
    ranges: list[dict]
    validated: bool
    # Wall seconds per stage: "listed" keys, "ladder" rungs (under a deadline
    # the listed keys' seeds too), "fill" rungs, "deepen" (the listed keys'
    # sampling under a deadline), "map" validation.
    seconds: dict[str, float]
    # Rungs a deadline left out (`Budget.until`): validation covers their M
    # with the winners of the rungs around them.
    unreached: tuple[int, ...] = ()

    @property
    def tuned(self) -> int:
        """Rungs measured anew (not current in the store already)."""
        return sum(not o.skipped for o in self.rungs.values())


def rungs(listed: Sequence[int]) -> list[int]:
    """The ladder over `listed` M values: them and every power of two up to the largest."""
    top = max(listed)
    powers = {1 << i for i in range(top.bit_length()) if 1 << i <= top}
    return sorted(powers | set(listed))


def probes(lo: int, hi: int) -> list[int]:
    """Integer M strictly between two rungs, `PROBES_PER_OCTAVE` per doubling, geometric."""
    count = math.ceil(math.log2(hi / lo) * PROBES_PER_OCTAVE)
    points = {round(lo * (hi / lo) ** (i / count)) for i in range(1, count)}
    return sorted(p for p in points if lo < p < hi)


def tune_family(
    keys: Sequence[Key], backend: Backend, store: Store, budget: Budget, *, name: str = "",
    ladder: bool = True, force: bool = False, revalidate: bool = False,
    on_rung: Callable[[Key, bool], Callable[[Tick], None] | None] | None = None,
) -> FamilyOutcome:
    """Tune the keys of one family (listed M values) and, with `ladder`, the
    rungs between them; then validate and store the family's M map (again
    with `revalidate` or `force`, else only when a rung was tuned anew or the
    stored map is stale or does not cover the ladder).

    `on_rung(key, listed)` may return a per-trial progress callback for that rung.
    """
    if len({_family_tuple(k) for k in keys}) != 1:
        raise ValueError("tune_family takes the keys of one family")
    by_m = {k.problem.m: k for k in keys}
    outcomes: dict[int, Outcome] = {}
    seconds: dict[str, float] = {}
    clock = time.monotonic()

    def lap(stage: str) -> None:
        nonlocal clock
        now = time.monotonic()
        seconds[stage] = round(now - clock, 1)
        clock = now

    template = keys[0]
    ladder_ms = [m for m in rungs(list(by_m)) if m not in by_m] if ladder else []
    deadline = budget.until is not None
    # The order the keys are tuned in (why: below).
    order = sorted({*by_m, *ladder_ms}) if deadline else [*sorted(by_m), *ladder_ms]
    if backend.name != "model":
        # Compile the first candidates of every key and rung to be searched
        # on the host's cores, in that order, while the first keys are measured.
        todo = [k for k in [by_m[m] if m in by_m else template.with_m(m) for m in order]
                if force or not is_current(store.winner(k.to_dict()), backend)]
        ahead = [c for k in todo for c in (first_configs(k) if k.problem.m in by_m else _rung_picks(k))]
        compile_ahead(backend, list(dict.fromkeys(ahead)), template)
    # Under a deadline the family goes breadth first, from the fewest rows
    # up: each listed key measures its seeds only and each rung its picks
    # (past the family's time: rungs are left out, listed keys measure a
    # rung's few candidates), then the fill rungs, and only then do the
    # listed keys sample, with the time left. A deep search gains a few per
    # cent at its own M, and at many rows a call costs milliseconds to
    # measure while cuBLAS is hard to beat; a rung left out leaves every M
    # around it to a neighbour's tile that does not fit it (H100, 27B in
    # 170 s, listed keys searched first: rungs 32 and 64 unreached, and at
    # M = 38-100 the map ran 1.00-1.04x cuBLAS where a full search's ran
    # 1.04-1.16x). Validation keeps MAP_SHARE of a deadline's time.
    rung_budget = budget.share(1 - MAP_SHARE)
    unreached: list[int] = []

    def tune_listed(m: int, sample: bool, key_budget: Budget, force_: bool) -> Outcome:
        return tune_key(by_m[m], backend, store, key_budget, name=name, force=force_,
                        on_trial=on_rung and on_rung(by_m[m], True), sample=sample, variants=sample)

    def tune_rung(m: int, variants: bool, left: int) -> Outcome:
        key = by_m.get(m) or template.with_m(m)
        seeds = _neighbour_configs(outcomes, m)
        settled = _settled(outcomes, m)
        if settled:
            # Both neighbours won with one config: the rung checks it against
            # cuBLAS and the few-row seeds, which cost a few microseconds
            # each; validation measures it between the rungs anyway.
            seeds = [settled] + [c for c in few_row_seeds(key) if c != settled]
            variants = False
        elif backend.name != "model":
            seeds += [c for c in _rung_picks(key) if c not in seeds]
        seeds = [c for c in seeds if key.problem.runs(c)]
        return tune_key(
            key, backend, store,
            replace(rung_budget.share(1 / left), trials=max(1, sum(map(drawable, seeds)))),
            name=name, force=force, on_trial=on_rung and on_rung(key, m in by_m), seeds=seeds, explore=False,
            variants=variants,
        )

    def tune_rungs(ms: list[int], variants: bool) -> None:
        for i, m in enumerate(ms):
            late = deadline and rung_budget.left() <= 0
            if m in by_m and not late:
                outcomes[m] = tune_listed(m, not deadline, budget, force)
            elif m in by_m:
                # A listed M is one the user asked for: tuned however late,
                # but as a rung is (its neighbours' winners and few picks).
                outcomes[m] = tune_rung(m, False, left=len(ms) - i)
            elif late:
                unreached.append(m)
            else:
                outcomes[m] = tune_rung(m, variants, left=len(ms) - i)

    if deadline:
        tune_rungs(order, variants=True)
        lap("ladder")
    else:
        tune_rungs(sorted(by_m), variants=True)
        lap("listed")
        tune_rungs(ladder_ms, variants=True)
        lap("ladder")
    if ladder:
        # A fill rung's seeds are the winners of the rungs around it, whose
        # neighbouring variants were measured already.
        tune_rungs(_fill_rungs(outcomes), variants=False)
        lap("fill")
    if deadline:
        fresh_listed = [m for m in sorted(by_m) if m in outcomes and not outcomes[m].skipped]
        for i, m in enumerate(fresh_listed):
            if rung_budget.left() <= 0:
                break
            outcomes[m] = tune_listed(m, True, rung_budget.share(1 / (len(fresh_listed) - i)), True)
        lap("deepen")
    # A fill rung may be a ladder rung the deadline left out.
    left_out = tuple(sorted(set(unreached) - set(outcomes)))
    fresh = any(not o.skipped for o in outcomes.values())
    family = family_of(template)
    versions = backend.versions()
    current = [r for r in store.ranges(**family) if r.source == "ladder" and not r.stale(versions)]
    covered = current and min(r.m_lo for r in current) <= min(outcomes) and max(r.m_hi for r in current) >= max(outcomes)
    if covered and not fresh and not force and not revalidate:
        return FamilyOutcome(outcomes, [], validated=False, seconds=seconds, unreached=left_out)
    points = _steady(template, _measure_points(template, outcomes, backend), backend)
    ranges = build_map(_steady(template, _refine(template, points, backend, budget), backend))
    env_id = store.environment(backend.name, template.arch, template.device, versions)
    store.set_ranges(family, env_id, ranges)
    lap("map")
    return FamilyOutcome(outcomes, ranges, validated=True, seconds=seconds, unreached=left_out)


def remap(store: Store) -> list[tuple[dict, list, list[dict]]]:
    """Build every family's M map again from the measurements stored with it,
    under this release's rule (`build_map`): a map an earlier release made
    stays current for `tune_family`, which measures nothing anew without a
    reason. Nothing is measured here. Online points stay as they are.

    Returns (family, spans before, spans after) for each map that changed,
    a span being (m_lo, m_hi, config_name)."""
    from db.store import LADDER

    maps: dict[tuple, list] = {}
    for r in store.ranges():
        if r.source == LADDER:
            maps.setdefault(family_id(r.family), []).append(r)
    changed = []
    for before in maps.values():
        after = build_map(_stored_points(before))
        old = [(r.m_lo, r.m_hi, r.config_name) for r in before]
        new = [(r["m_lo"], r["m_hi"], r["config_name"]) for r in after]
        if new != old:
            family, first = before[0].family, before[0]
            env_id = store.environment(first.backend, family["arch"], family["device"], first.versions)
            store.set_ranges(family, env_id, after)
            changed.append((family, old, new))
    return changed


def _stored_points(ranges: list) -> list[tuple]:
    """The measured points behind a stored map, as `_measure` returns them;
    a candidate whose name no longer names a valid config is left out."""
    configs: dict[str, GemmConfig | None] = {}
    points: dict[int, dict[str, float]] = {}
    for r in ranges:
        for p in r.evidence:
            points[p["m"]] = p["ms"]
    for times in points.values():
        for name in times:
            if name != BASELINE and name not in configs:
                try:
                    configs[name] = GemmConfig.from_name(name)
                except InvalidConfig:
                    configs[name] = None
    out = []
    for m in sorted(points):
        times = {n: ms for n, ms in points[m].items() if n == BASELINE or configs[n] is not None}
        out.append((m, times, {n: configs[n] for n in times if n != BASELINE}))
    return out


class LeaseLost(RuntimeError):
    """This process's lease on a family expired and another process took the
    family over: it stops there (the other finishes it)."""


def tune_families(
    families: Sequence[tuple[str, Sequence[Key]]], backend: Backend, store: Store, budget: Budget, *,
    ladder: bool = True, force: bool = False, revalidate: bool = False, lease_ttl_s: float | None = None,
    on_rung: Callable[[Key, bool], Callable[[Tick], None] | None] | None = None,
    on_family: Callable[[str, str, FamilyOutcome | None], None] | None = None,
) -> None:
    """`tune_family` for each (name, keys) family, shared with every other
    process tuning against the same database: a family is tuned only under
    its lease (`db.store.Store.acquire`), so no two processes measure it at
    once; one taken by another process is done after the free ones, when its
    lease is released (then its rungs are current and nothing is measured
    again), has expired, or its holder is a process of this host that died.

    A heartbeat thread renews the lease every third of `lease_ttl_s` (default
    `LEASE_TTL_S`) while the family is tuned, whatever the tuning is doing (a
    long compile or validation included), so only a holder that died or hangs
    loses it; one that finds it lost stops the family (`LeaseLost`) and goes on.
    `on_family(name, event, outcome)` hears "take", "done" (with the family's
    outcome), "current" (another process had done it all), "lost", "wait"
    (nothing free: every pending family is held by others) and "unreached"
    (`budget.until` passed before it was taken); the outcome is None but for
    "done" and "current"."""
    owner = owner_id()
    ttl = lease_ttl_s or LEASE_TTL_S
    deadline = budget.until is not None
    # (name, keys, modelled GEMM ms): the order and start rule under a deadline.
    pending = [(name, keys, _gemm_ms(keys) if deadline else 0.0) for name, keys in families]
    if deadline:
        # The families holding the least GEMM time first: they need less than
        # an equal share and leave the rest to the costlier ones, whose seeds
        # and validation would otherwise eat the small ones' time (H100,
        # largest first in 150-168 s: Gemma 3 27B's o and Llama 3.1 8B's
        # q+o and k+v projections, the families that gain most, left on
        # cuBLAS with 10-20 s of the budget unspent).
        pending.sort(key=lambda item: item[2])
    # A family's seeds and validation are measured however late it is, so
    # under a deadline one starts only with MIN_FAMILY_SHARE of an equal
    # share of the whole budget left, and only if the validation the
    # families done so far predict for it fits: the tune ends near its
    # deadline.
    least = MIN_FAMILY_SHARE * budget.left() / max(1, len(pending))
    validated: list[tuple[float, float]] = []
    while pending:
        took = False
        for item in list(pending):
            name, keys, gemm_ms = item
            if deadline and budget.left() < max(least, expected_validation(validated, gemm_ms)):
                # Out of time: the families not started stay on cuBLAS.
                if on_family:
                    on_family(name, "unreached", None)
                pending.remove(item)
                continue
            lease = f"family:{backend.name}:{backend.versions()}:{_family_tuple(keys[0])}"[:512]
            if not store.acquire(lease, owner, ttl, dead=_died_here):
                continue
            took = True
            if on_family:
                on_family(name, "take", None)
            beat = _Heartbeat(store, lease, owner, ttl)
            try:
                # Each family not yet started gets an equal share of the time left.
                outcome = tune_family(keys, backend, store, budget.share(1 / len(pending)), name=name,
                                      ladder=ladder, force=force,
                                      revalidate=revalidate, on_rung=beat.watching(on_rung))
            except LeaseLost:
                if on_family:
                    on_family(name, "lost", None)
            else:
                if deadline and outcome.validated:
                    validated.append((outcome.seconds["map"], gemm_ms))
                if on_family:
                    on_family(name, "done" if outcome.tuned or outcome.validated else "current", outcome)
            finally:
                beat.stop()
                store.release(lease, owner)
            pending.remove(item)
        if pending and not took:
            if on_family:
                on_family(pending[0][0], "wait", None)
            time.sleep(WAIT_S)


def expected_validation(validated: Sequence[tuple[float, float]], gemm_ms: float) -> float:
    """Seconds the validation of a family of `gemm_ms` modelled GEMM time
    (`_gemm_ms`) is expected to take, from (validation seconds, modelled
    GEMM ms) of the families validated before it in the run: their median
    seconds per modelled ms (the upper middle one of an even count), times
    `gemm_ms` (0 before any). Validation times cuBLAS and a few candidates
    at some 40 points, so it scales with the family's GEMM time: on an H100,
    2-8 s per modelled ms (Llama 3.1 8B's lm_head: 50 s of the 88 s it took
    when it was given 32 s)."""
    if not validated:
        return 0.0
    rates = sorted(seconds / max(ms, 1e-6) for seconds, ms in validated)
    return rates[len(rates) // 2] * gemm_ms


def _gemm_ms(keys: Sequence[Key]) -> float:
    """The modelled cuBLAS time of a family's listed keys: under a deadline
    the families that hold the least GEMM time are tuned first."""
    from tuner.backends.model import baseline_ms

    return sum(baseline_ms(k) for k in keys)


def owner_id() -> str:
    """This process as a lease owner: "host:pid"."""
    return f"{socket.gethostname()}:{os.getpid()}"


def _died_here(owner: str) -> bool:
    """Whether a lease owner ("host:pid") was a process of this host that is
    gone: its lease need not run out (a rerun after a kill starts at once).
    An owner on another host is judged by its lease's expiry alone."""
    host, _, pid = owner.rpartition(":")
    if host != socket.gethostname() or not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return True
    except PermissionError:
        return False
    return False


class _Heartbeat:
    """Renews a lease from a thread of its own until stopped; remembers a loss."""

    def __init__(self, store: Store, lease: str, owner: str, ttl_s: float) -> None:
        self._stop = threading.Event()
        self.lost = False

        def run() -> None:
            while not self._stop.wait(ttl_s / 3):
                if not store.renew(lease, owner, ttl_s):
                    self.lost = True
                    return
        self._thread = threading.Thread(target=run, name=f"lease {lease[:40]}", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()

    def watching(self, on_rung):
        """`on_rung` whose per-trial callbacks raise `LeaseLost` once the lease is lost."""
        def per_rung(key: Key, listed: bool):
            inner = on_rung(key, listed) if on_rung else None

            def tick(progress: Tick) -> None:
                if self.lost:
                    raise LeaseLost(key.study_name())
                if inner:
                    inner(progress)
            return tick
        return per_rung


def _family_tuple(key: Key) -> tuple:
    return tuple(sorted((f, str(v)) for f, v in family_of(key).items()))


def _fill_rungs(outcomes: dict[int, Outcome]) -> list[int]:
    """The geometric midpoint of every gap between rungs next to a rung whose
    winner beat cuBLAS: where the pool can win, a winner's tile fits its own
    M's waves, and the M between two rungs fill them differently (27B o: the
    4096 and 8192 winner lost 4-9 % to cuBLAS at the probes between them),
    so the gap gets a winner of its own. One rung a gap, not one a probe:
    validation measures every winner at the probes on either side anyway,
    and each rung costs the tune a round of measurements."""
    ms = sorted(outcomes)
    wins = {m for m in ms if outcomes[m].winner.config and outcomes[m].winner.speedup >= HOLD_MARGIN}
    gaps = [(lo, hi) for lo, hi in zip(ms, ms[1:]) if lo in wins or hi in wins]
    return [mid for lo, hi in gaps if lo < (mid := round(math.sqrt(lo * hi))) < hi]


def _rung_picks(key: Key) -> list[GemmConfig]:
    """What a rung measures beside its neighbours' winners."""
    return model_picks(key, RUNG_MODEL_PICKS) + few_row_seeds(key)


def _nearest(outcomes: dict[int, Outcome], m: int) -> tuple[int | None, int | None]:
    """The nearest tuned M below and above `m` (None where there is none)."""
    return max((t for t in outcomes if t < m), default=None), min((t for t in outcomes if t > m), default=None)


def _settled(outcomes: dict[int, Outcome], m: int) -> GemmConfig | None:
    """The config that won at the nearest tuned M on both sides of `m` by
    SETTLED_MARGIN or more over cuBLAS, if one did."""
    below, above = _nearest(outcomes, m)
    if below is None or above is None:
        return None
    lo, hi = outcomes[below].winner, outcomes[above].winner
    if lo.config is None or lo.config_name != hi.config_name:
        return None
    if min(lo.speedup, hi.speedup) < SETTLED_MARGIN:
        return None
    return GemmConfig.from_dict(lo.config)


def _neighbour_configs(outcomes: dict[int, Outcome], m: int) -> list[GemmConfig]:
    """The kernel winners of the nearest tuned M below and above `m`."""
    out = []
    for t in (t for t in _nearest(outcomes, m) if t is not None):
        cfg = outcomes[t].winner.config
        if cfg is not None and GemmConfig.from_dict(cfg) not in out:
            out.append(GemmConfig.from_dict(cfg))
    return out


def _measure_points(template: Key, outcomes: dict[int, Outcome], backend: Backend) -> list[tuple]:
    """Interleaved cold-call times of cuBLAS and the neighbouring rungs' winners
    at every rung and probe: [(M, {name: ms}, {name: config})], by M, cuBLAS
    first in each dict. Every point also times those winners under the
    stream-K scheduler: between rungs their tiles leave a partial last wave
    that their own rungs did not, and stream-K spreads that wave over every
    SM; at the rungs too, so that a gap next to a rung can be its. And under
    the other L2 hint (`hint_variant`), whose worth changes with M."""
    ladder_ms = sorted(outcomes)
    winners = [GemmConfig.from_dict(outcomes[m].winner.config) if outcomes[m].winner.config else None
               for m in ladder_ms]

    def with_variants(cfgs: list[GemmConfig | None]) -> list[GemmConfig]:
        near = [c for c in cfgs if c]
        extra = [v for c in near for v in (scheduler_variant(c, "stream_k"), hint_variant(c)) if v]
        return near + [v for v in dict.fromkeys(extra) if v not in near]

    plan: list[tuple[int, list[GemmConfig]]] = []
    for i, m in enumerate(ladder_ms):
        plan.append((m, with_variants(winners[max(0, i - 1): i + 2])))
        if i + 1 < len(ladder_ms):
            plan += [(p, with_variants(winners[i: i + 2])) for p in probes(m, ladder_ms[i + 1])]
    compile_ahead(backend, list(dict.fromkeys(c for _, cfgs in plan for c in cfgs)), template)
    return [_measure(template, m, cfgs, backend) for m, cfgs in plan]


def _measure(template: Key, m: int, cfgs: list[GemmConfig], backend: Backend) -> tuple:
    """One validation point: cuBLAS and `cfgs` (those that can run M) timed
    interleaved, each call alone after an L2 flush, as a model's forward runs them."""
    key = template.with_m(m)
    cands: list[GemmConfig | None] = [None]
    cands += [c for i, c in enumerate(cfgs) if c not in cfgs[:i] and key.problem.runs(c)]
    measured = backend.remeasure(key, cands, cold=True)
    times = {(c.name() if c else BASELINE): r.ms for c, r in zip(cands, measured, strict=True) if r.ok}
    if BASELINE not in times:
        raise RuntimeError(f"{key.study_name()}: the cuBLAS baseline failed when validating")
    return m, times, {c.name(): c for c in cands if c is not None}


def _steady(template: Key, points: list[tuple], backend: Backend) -> list[tuple]:
    """`points` (by M) with each disturbed one (`_disturbed`) measured again,
    the round whose cuBLAS call ran fastest kept: a slow spell slows every
    candidate of a point, so their ratios there say nothing."""
    points = list(points)
    for _ in range(STEADY_TRIES):
        suspects = _disturbed(points)
        if not suspects:
            break
        for i in suspects:
            m, times, named = points[i]
            again = _measure(template, m, list(named.values()), backend)
            if again[1][BASELINE] < times[BASELINE]:
                points[i] = again
    return points


def _disturbed(points: list[tuple]) -> list[int]:
    """Indices of the points (by M) measured in a slow spell: cuBLAS there
    `slow_spell` against a point of larger M."""
    out = []
    fastest_above = math.inf
    for i in reversed(range(len(points))):
        base = points[i][1][BASELINE]
        if slow_spell(base, fastest_above):
            out.append(i)
        fastest_above = min(fastest_above, base)
    return out


def _refine(template: Key, points: list[tuple], backend: Backend, budget: Budget = Budget()) -> list[tuple]:
    """Measure each kernel range again where it may lose inside.

    - At the first M of every tile row inside it: a kernel starting a new row
      (and, past a full wave, a new wave) pays for rows it barely fills, so a
      range whose two ends hold can lose right after a row starts.
    - Between two of its measured points, at their geometric midpoint, while
      the kernel's lead at either is under `THIN_MARGIN` and they are more
      than `DENSE_RATIO` apart: neither time is monotonic in M within a row.
      cuBLAS picks its tile per M (on a 5120 x 4096 weight, 64x72 tiles at
      M = 65-72, 64x80 at 73-80, 64x88 at 81-95), and a 64x80 kernel of ours
      ran 16 % faster at M = 112 than at 65, in the same tile row.

    And between two points where a kernel beats cuBLAS at one end only, at
    their midpoint (`_seams`).

    Repeats while the map changes, `REFINE_ROUNDS` times at most. Under a
    deadline (`budget.until`) the points are measured from the fewest rows
    up, and once it has passed only while cuBLAS takes under
    `REFINE_ALWAYS_MS` below them: the map then stands on the points
    measured, whose intervals each had cuBLAS timed at their ends. Most of
    these points lie at many rows, where a call costs milliseconds and the
    leads are thin (H100, Llama 3.1 8B's lm_head under a 155 s budget: 61
    refined points, 55 of them above M = 512, in a 50 s validation), while
    a family the budget leaves out runs cuBLAS at every M.
    """
    for _ in range(REFINE_ROUNDS):
        seen = {m for m, _, _ in points}
        extra: dict[int, list[GemmConfig]] = {}
        for r in build_map(points):
            if r["config"] is None:
                continue
            cfg = GemmConfig.from_dict(r["config"])
            # The points the range stands on: those inside it and the ones just
            # outside, which its first and last stretch were granted between.
            inside = [p for p in points if r["m_lo"] - 1 <= p[0] <= r["m_hi"] + 1]
            cands = [cfg, *dict.fromkeys(c for p in inside for c in p[2].values() if c != cfg)]
            step = cfg.m_rows
            rows = range(r["m_lo"] // step, r["m_hi"] // step + 1)
            wanted = [q * step + 1 for q in rows if r["m_lo"] <= q * step + 1 <= r["m_hi"]]
            thin = [(a[0], b[0]) for a, b in zip(inside, inside[1:]) if b[0] > a[0] * DENSE_RATIO
                    and min(_lead(a[1], r["config_name"]), _lead(b[1], r["config_name"])) < THIN_MARGIN]
            wanted += [mid for lo, hi in thin if lo < (mid := round(math.sqrt(lo * hi))) < hi]
            for m in wanted:
                if m not in seen:
                    extra.setdefault(m, cands)
        for m, cands in _seams(points).items():
            if m not in seen:
                extra.setdefault(m, cands)
        if not extra:
            break
        measured = []
        for m, cfgs in sorted(extra.items()):
            below = max((p for p in points if p[0] < m), key=lambda p: p[0], default=points[0])
            if budget.left() <= 0 and below[1][BASELINE] >= REFINE_ALWAYS_MS:
                break
            measured.append(_measure(template, m, cfgs, backend))
        points = sorted(points + measured, key=lambda p: p[0])
        if len(measured) < len(extra):
            break
    return points


def _seams(points: list[tuple]) -> dict[int, list[GemmConfig]]:
    """The geometric midpoint of every stretch between two measured points
    (more than `DENSE_RATIO` apart) that the map gives cuBLAS although a
    kernel beats it at one end, with the kernels that beat it at either end.

    Where one kernel's winning M end and another's begin (27B down: 64-row
    swap_ab tiles of 64 activation rows up to M = 64, of 96 from 76), no
    kernel holds at both ends and the stretch between would go to cuBLAS
    unmeasured; bisecting it finds where each kernel stops winning.
    """
    out: dict[int, list[GemmConfig]] = {}
    for (lo, first, named_lo), (hi, second, named_hi) in zip(points, points[1:]):
        if hi <= lo * DENSE_RATIO or _holds_across(first, second) != BASELINE:
            continue
        named = named_lo | named_hi
        winners = [named[n] for n in dict.fromkeys([*first, *second])
                   if _beats(first, n) or _beats(second, n)]
        if winners and lo < (mid := round(math.sqrt(lo * hi))) < hi:
            out[mid] = winners
    return out


def build_map(points: list[tuple[int, dict[str, float], dict[str, GemmConfig]]]) -> list[dict]:
    """A family's M map from measured points (module doc): a list of ranges
    (m_lo, m_hi, config_name, scheduler, config, evidence), by M, adjacent
    ranges of one choice merged."""
    segments: list[tuple[int, int, str, list[int]]] = []
    for i, (m, times, _) in enumerate(points):
        segments.append((m, m, _fastest(times), [i]))
        if i + 1 < len(points) and points[i + 1][0] > m + 1:
            later = points[i + 1][1]
            segments.append((m + 1, points[i + 1][0] - 1, _holds_across(times, later), [i, i + 1]))
    segments = _without_islands(segments, points)
    merged: list[tuple[int, int, str, list[int]]] = []
    for seg in segments:
        if merged and merged[-1][2] == seg[2]:
            lo, _, choice, idx = merged[-1]
            merged[-1] = (lo, seg[1], choice, sorted(set(idx) | set(seg[3])))
        else:
            merged.append(seg)
    configs = {name: cfg for _, _, named in points for name, cfg in named.items()}
    out = []
    for lo, hi, choice, idx in merged:
        cfg = configs.get(choice)
        out.append(dict(
            m_lo=lo, m_hi=hi, config_name=choice, scheduler=cfg.scheduler if cfg else BASELINE,
            config=cfg.to_dict() if cfg else None,
            evidence=[{"m": points[i][0], "ms": points[i][1]} for i in idx],
        ))
    return out


def _without_islands(segments: list[tuple], points: list[tuple]) -> list[tuple]:
    """`segments` with each measured point that would stand alone between
    other choices given to a neighbour's kernel, where that kernel beats
    cuBLAS there and is within `HOLD_MARGIN` of the fastest.

    A point's own choice rests on one measurement, and kernels of similar
    tiles tie within noise at a point: on Qwen2.5 7B's lm_head (H100), M = 15
    went to a 64x48 swap_ab tile 0.1 % ahead of the 128x16 one that held
    M = 9 to 16, and the bench then timed it 9 % behind cuBLAS there."""
    out = list(segments)
    for j, (lo, hi, choice, idx) in enumerate(segments):
        if len(idx) != 1:  # a stretch between two points
            continue
        around = [segments[i][2] for i in (j - 1, j + 1) if 0 <= i < len(segments)]
        if choice == BASELINE or choice in around:
            continue
        times = points[idx[0]][1]
        near = [n for n in around if _beats(times, n) and times[n] <= times[choice] * HOLD_MARGIN]
        if near:
            out[j] = (lo, hi, min(near, key=times.get), idx)
    return out


def _lead(times: dict[str, float], name: str) -> float:
    """cuBLAS time / `name`'s time at one measured point (0 where `name` was not timed)."""
    return times[BASELINE] / times[name] if name in times else 0.0


def _beats(times: dict[str, float], name: str) -> bool:
    """`name` measured faster than cuBLAS by the margin that noise cannot fake."""
    return name != BASELINE and name in times and times[name] * HOLD_MARGIN <= times[BASELINE]


def _fastest(times: dict[str, float]) -> str:
    """The fastest kernel at one M if it beats cuBLAS (`_beats`), else cuBLAS."""
    best = min(times, key=times.get)
    return best if _beats(times, best) else BASELINE


def _holds_across(first: dict[str, float], second: dict[str, float]) -> str:
    """The kernel that beats cuBLAS at both ends, best by the product of its
    speedups there; cuBLAS if none."""
    base1, base2 = first[BASELINE], second[BASELINE]
    holding = [name for name in first if _beats(first, name) and _beats(second, name)]
    if not holding:
        return BASELINE
    return max(holding, key=lambda n: base1 / first[n] * base2 / second[n])
