"""M ladders and maps on the model backend: rungs, validation, the map rule,
the old-database upgrade, and the CLI views of it."""

import json
import math
import os
import sqlite3
from dataclasses import replace
from types import SimpleNamespace
import subprocess
import sys
from pathlib import Path

import pytest
from alembic import command
from sqlalchemy import create_engine

from db.migrate import alembic_config
from db.store import Store
from tuner.key import Key, Problem
from tuner.search.ladder import build_map, probes, rungs, tune_family
from tuner.runtime.lookup import BASELINE, EXACT, NEAREST, RANGE, lookup, speedup_at
from tuner.backends.model import ModelBackend
from tuner.search.study import Budget, hint_variant, scheduler_variant
from kernels.space import GemmConfig
from tests.test_search import MeasuredBackend

ROOT = Path(__file__).resolve().parents[1]


def test_ladder_covers_one_to_the_largest_m_with_no_gap_over_2x():
    for listed in ([8192], [1, 16, 128, 512, 2048, 8192], [3000], [5, 700, 6000], [1]):
        ladder = rungs(listed)
        assert ladder[0] == 1 and ladder[-1] == max(listed) and set(listed) <= set(ladder)
        assert all(b <= 2 * a for a, b in zip(ladder, ladder[1:]))
    assert rungs([1, 16, 128]) == [1, 2, 4, 8, 16, 32, 64, 128]
    assert probes(512, 1024) == [645, 813] and probes(1, 2) == [] and probes(2, 4) == [3]
    assert probes(2048, 3000) == [2479]  # the geometric midpoint


def _point(m, cublas, **kernels):
    return (m, {BASELINE: cublas, **kernels}, {})


def test_a_kernel_holds_between_points_only_where_measured_at_least_as_fast_at_both_ends():
    points = [
        _point(100, 1.0, a=0.9, b=1.2),
        _point(130, 1.0, a=0.95, b=0.99),
        _point(170, 1.0, a=1.01, b=0.98),   # a loses here: the gap before it is b's
        _point(220, 1.0, a=1.0, b=1.1),     # a tie goes to cuBLAS at a point
        _point(280, 1.0, b=1.05),
    ]
    ranges = build_map(points)
    spans = [(r["m_lo"], r["m_hi"], r["config_name"]) for r in ranges]
    assert spans == [
        (100, 130, "a"),        # point 100 a, gap a (0.9/0.95), point 130 a
        (131, 170, "b"),        # gap: only b is <= cuBLAS at 130 and 170; point 170 b
        (171, 280, BASELINE),   # gap 170-220: b loses at 220; a loses at 170
    ]
    # Every boundary carries the measurements that decided it.
    assert [p["m"] for p in ranges[1]["evidence"]] == [130, 170]
    assert ranges[2]["config"] is None and ranges[2]["scheduler"] == BASELINE


def test_a_point_goes_to_a_neighbouring_kernel_that_ties_the_fastest_there():
    def spans(points):
        return [(r["m_lo"], r["m_hi"], r["config_name"]) for r in build_map(points)]

    # b leads a by 0.1 % at 15 only: one measurement within noise would make
    # an island of b inside a's M; a takes 15 too.
    assert spans([_point(14, 1.0, a=0.96), _point(15, 1.0, a=0.962, b=0.961), _point(16, 1.0, a=0.963)]) == [
        (14, 16, "a")]
    # The same between two stretches a holds.
    assert spans([_point(10, 1.0, a=0.95), _point(15, 1.0, a=0.962, b=0.961), _point(20, 1.0, a=0.96)]) == [
        (10, 20, "a")]
    # b's lead beyond HOLD_MARGIN, or a no faster than cuBLAS there: b keeps its point.
    for at_15 in (dict(a=0.975, b=0.96), dict(a=0.995, b=0.96)):
        assert spans([_point(14, 1.0, a=0.96), _point(15, 1.0, **at_15), _point(16, 1.0, a=0.963)]) == [
            (14, 14, "a"), (15, 15, "b"), (16, 16, "a")]
    # A point that continues a neighbour's choice is no island.
    assert spans([_point(14, 1.0, a=0.96), _point(15, 1.0, a=0.962, b=0.961), _point(16, 1.0, b=0.963)]) == [
        (14, 14, "a"), (15, 16, "b")]


@pytest.fixture(scope="module")
def tuned(tmp_path_factory):
    path = tmp_path_factory.mktemp("ladder") / "t.db"
    store = Store(str(path))
    model = ModelBackend("sm90")
    keys = [Key("sm90", model.device_name, Problem(m, 5376, 4096)) for m in (16, 700)]
    out = tune_family(keys, model, store, Budget(trials=6), name="o")
    return path, store, model, out


def test_family_is_tuned_at_every_rung_and_validated(tuned):
    path, store, model, out = tuned
    # The ladder, plus the midpoints of gaps next to rungs whose winner beat cuBLAS.
    assert set(rungs([16, 700])) <= set(out.rungs) <= set(range(1, 701)) and out.validated
    ranges = store.ranges(n=5376, k=4096)
    assert ranges[0].m_lo == 1 and ranges[-1].m_hi == 700
    assert all(a.m_hi + 1 == b.m_lo for a, b in zip(ranges, ranges[1:]))
    for r in ranges:
        assert r.source == "ladder" and r.evidence
        if r.config is not None:
            # A kernel serves only where it measured at least as fast as cuBLAS.
            assert all(speedup_at(p, r.config_name) >= 1.0 for p in r.evidence)
    # Listed rungs get the full budget; the others measure few configs.
    listed = store.winner(Key("sm90", model.device_name, Problem(700, 5376, 4096)).to_dict())
    rung = store.winner(Key("sm90", model.device_name, Problem(256, 5376, 4096)).to_dict())
    assert listed.trials >= 6 and rung.trials < listed.trials


def test_map_decides_every_m_up_to_the_largest_and_nothing_beyond(tuned):
    path, store, model, _ = tuned
    for m in (1, 3, 16, 17, 100, 400, 699, 700):
        d = lookup(store, Key("sm90", model.device_name, Problem(m, 5376, 4096)))
        assert d.how == RANGE and d.interval[0] <= m <= d.interval[1]
        assert d.m == m and d.tuned_m in [p["m"] for p in d.evidence]
    assert lookup(store, Key("sm90", model.device_name, Problem(701, 5376, 4096))) is None


def test_rerun_skips_tuned_rungs_and_keeps_the_map(tuned):
    path, store, model, _ = tuned
    before = store.ranges(n=5376, k=4096)
    keys = [Key("sm90", model.device_name, Problem(m, 5376, 4096)) for m in (16, 700)]
    again = tune_family(keys, model, store, Budget(trials=6), name="o")
    assert all(o.skipped for o in again.rungs.values()) and not again.validated
    assert store.ranges(n=5376, k=4096) == before
    # Without a ladder the map spans the listed M; a rerun leaves it alone too.
    keys = [Key("sm90", model.device_name, Problem(m, 1024, 4096)) for m in (64, 300)]
    first = tune_family(keys, model, store, Budget(trials=4), name="x", ladder=False)
    assert first.validated and store.ranges(n=1024, k=4096)[0].m_lo == 64
    assert not tune_family(keys, model, store, Budget(trials=4), name="x", ladder=False).validated


def test_database_of_the_previous_schema_upgrades_with_every_winner_kept(tmp_path):
    path = tmp_path / "old.db"
    engine = create_engine(f"sqlite:///{path}")
    cfg = alembic_config(f"sqlite:///{path}")
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0002")
    con = sqlite3.connect(path)
    con.execute("insert into tuner_environments values (1, 'fp', 'gpu', 'sm90', 'H', '{}', '2026-01-01')")
    for i, m in enumerate((128, 512, 2048), start=1):
        con.execute("insert into tuner_keys values (?, 'sm90', 'H', 'bf16', 'bf16', 'tn', ?, 4096, 4096, 1, '', 0, 'x')",
                    (i, m))
        con.execute("insert into tuner_winners values (?, ?, 1, 'cfg', 'static_persistent', null, 1.0, 1.1, 1.1,"
                    " '{}', 3, '2026-01-01')", (i, i))
    con.commit()
    con.close()
    store = Store(str(path))
    assert store.count_winners() == 3 and store.ranges() == []
    key = Key("sm90", "H", Problem(600, 4096, 4096))
    assert lookup(store, key).how == NEAREST and lookup(store, key.with_m(512)).how == EXACT
    assert lookup(store, key.with_m(1000)) is None  # over sqrt(2) from 512 and 2048


def _cli(*args, db):
    env = {k: v for k, v in os.environ.items() if k != "COLUMNS"}
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args, "--db", str(db)], cwd=ROOT, env=env,
                          capture_output=True, text=True, check=True)


def test_remap_rebuilds_a_map_from_its_evidence_under_the_current_rule(tmp_path):
    from tuner.runtime.lookup import family_of

    path = tmp_path / "old.db"
    store = Store(str(path))
    family = family_of(Key("sm90", "H", Problem(16, 4096, 4096)))
    a = GemmConfig(scheduler="single_tile", tile_m=128, tile_n=16, stages=8, swap_ab=True)
    b = GemmConfig(scheduler="single_tile", tile_m=64, tile_n=48, stages=8, swap_ab=True)
    points = {14: {a: 0.96}, 15: {a: 0.962, b: 0.961}, 16: {a: 0.963}}

    def point(m):
        return {"m": m, "ms": {BASELINE: 1.0, **{c.name(): t for c, t in points[m].items()}}}
    # The map an earlier rule built: M = 15 an island of b.
    old = [dict(m_lo=m, m_hi=m, config_name=c.name(), scheduler=c.scheduler, config=c.to_dict(),
                evidence=[point(m)]) for m, c in ((14, a), (15, b), (16, a))]
    store.set_ranges(family, store.environment("gpu", "sm90", "H", {"torch": "x"}), old)
    store.close()

    out = json.loads(_cli("remap", "--json", db=path).stdout)
    assert [(r["m_lo"], r["m_hi"], r["choice"]) for r in out[0]["after"]] == [(14, 16, a.name())]
    assert out[0]["m_changed"] == 1 and len(out[0]["before"]) == 3
    store = Store(str(path))
    (kept,) = store.ranges()
    assert (kept.m_lo, kept.m_hi, kept.config, kept.versions) == (14, 16, a.to_dict(), {"torch": "x"})
    assert [p["m"] for p in kept.evidence] == [14, 15, 16]
    store.close()
    # A map that follows the rule is left as it is.
    assert "already follows" in _cli("remap", db=path).stdout
    # A path with no database is an error, and no database appears there.
    with pytest.raises(subprocess.CalledProcessError) as failed:
        _cli("remap", db=tmp_path / "typo.db")
    assert failed.value.returncode == 2 and "no database" in failed.value.stdout
    assert not (tmp_path / "typo.db").exists()


def test_show_family_fits_80_columns_when_piped_and_has_json(tuned, tmp_path):
    path = tuned[0]
    for args in (("show", "--family"), ("show",)):
        out = _cli(*args, db=path).stdout
        assert out.strip() and "…" not in out
        assert max(map(len, out.splitlines())) <= 80, out
    maps = json.loads(_cli("show", "--family", "--json", db=path).stdout)
    [fm] = [m for m in maps if m["name"] == "o"]
    assert fm["name"] == "o" and fm["ranges"][0]["m_lo"] == 1 and fm["ranges"][0]["evidence"]
    winners = json.loads(_cli("show", "--json", db=path).stdout)["items"]
    assert {w["key"]["m"] for w in winners if w["key"]["n"] == 5376} == set(tuned[3].rungs)
    # A table a family: each row's winner whole on its line, not folded.
    from tuner.cli import short_config

    shown = _cli("show", db=path).stdout
    assert "o: N=5376 K=4096 bf16>bf16 tn sm90" in shown
    assert all(short_config(w["config_name"]) in shown for w in winners)
    png = tmp_path / "o.png"
    _cli("plot", "--family", "o", "-o", str(png), db=path)
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_family_head_stays_whole_on_its_line_when_piped(tmp_path):
    # A table's title wraps at the table's width (some 60 columns here), not at 80.
    shapes = tmp_path / "s.txt"
    shapes.write_text("512 5120 4096 dtype=bf16 name=a-long-model-name-12b.o_proj\n")
    db = tmp_path / "t.db"
    _cli("tune", "--shapes", str(shapes), "--backend", "model", "--trials", "2", "--no-ladder", db=db)
    [w] = json.loads(_cli("show", "--json", db=db).stdout)["items"]
    head = f"a-long-model-name-12b.o_proj: N=5120 K=4096 bf16>bf16 tn sm90 {w['key']['device']}"
    assert 60 < len(head) <= 80
    for args in (("show",), ("show", "--family")):
        lines = [line.rstrip() for line in _cli(*args, db=db).stdout.splitlines()]
        assert head in lines, lines
    # Past 80 columns the device goes on a line of its own, both lines whole.
    longer = "a-longer-model-name-of-size-12b.o_proj"
    shapes.write_text(f"512 5120 4096 dtype=bf16 name={longer}\n")
    db = tmp_path / "t2.db"
    _cli("tune", "--shapes", str(shapes), "--backend", "model", "--trials", "2", "--no-ladder", db=db)
    for args in (("show",), ("show", "--family")):
        lines = [line.rstrip() for line in _cli(*args, db=db).stdout.splitlines()]
        i = lines.index(f"{longer}: N=5120 K=4096 bf16>bf16 tn sm90")
        assert lines[i + 1] == f"  {w['key']['device']}" and all(len(line) <= 80 for line in lines), lines


class _RowStepBackend:
    """Times as functions of M: cuBLAS grows smoothly; the kernel (128-row tiles)
    steps up at every new tile row, beating cuBLAS at a row's end and losing
    just after it starts."""

    name = "synthetic"

    def remeasure(self, key, cfgs, *, cold=False):
        from tuner.backends.measure import Measurement

        m = key.problem.m
        out = []
        for cfg in cfgs:
            if cfg is None:
                out.append(Measurement(ms=1.0 + m / 1000, ok=True))
            else:
                rows = math.ceil(m / cfg.tile_m) * cfg.tile_m
                out.append(Measurement(ms=(1.0 + rows / 1000) * 0.97, ok=True))
        return out


def test_refine_measures_tile_row_starts_so_no_kernel_range_loses_inside():
    from kernels import space
    from tuner.search.ladder import _measure, _refine

    cfg = space.defaults("sm90")["static_persistent"]
    assert cfg.tile_m == 128
    template = Key("sm90", "synthetic", Problem(512, 4096, 4096))
    backend = _RowStepBackend()
    points = [_measure(template, m, [cfg], backend) for m in (512, 640, 768, 1024)]
    # Ends of rows only: the kernel wins at all four, so one range would take it all.
    assert [(r["m_lo"], r["m_hi"], r["config"] is not None) for r in build_map(points)] == [(512, 1024, True)]
    ranges = build_map(_refine(template, points, backend))
    cublas = lambda m: 1.0 + m / 1000  # noqa: E731
    kernel = lambda m: (1.0 + math.ceil(m / 128) * 128 / 1000) * 0.97  # noqa: E731
    for r in ranges:
        if r["config"] is not None:
            assert all(kernel(m) <= cublas(m) for m in range(r["m_lo"], r["m_hi"] + 1)), r
    assert any(r["config"] is not None for r in ranges)


def test_refine_under_a_deadline_measures_from_the_fewest_rows_up_until_it_passes(monkeypatch):
    """Each timing takes a second of a fake clock: a deadline 3 s away lets
    the first round's 3 points of fewest rows be measured and no more; one
    already passed, none; but points whose cuBLAS calls take under
    REFINE_ALWAYS_MS are measured however late."""
    from kernels import space
    from tuner.search import ladder
    from tuner.search.ladder import _measure, _refine
    from tuner.search.study import Budget

    now = [0.0]
    monkeypatch.setattr(ladder.time, "monotonic", lambda: now[0])

    class Timed(_RowStepBackend):
        def remeasure(self, key, cfgs, *, cold=False):
            now[0] += 1.0
            return super().remeasure(key, cfgs, cold=cold)

    cfg = space.defaults("sm90")["static_persistent"]
    template = Key("sm90", "synthetic", Problem(512, 4096, 4096))
    points = [_measure(template, m, [cfg], Timed()) for m in (512, 640, 768, 1024)]
    monkeypatch.setattr(ladder, "REFINE_ROUNDS", 1)
    extra = sorted({p[0] for p in _refine(template, points, Timed())} - {512, 640, 768, 1024})
    assert len(extra) > 3
    monkeypatch.setattr(ladder, "REFINE_ROUNDS", 4)
    now[0] = 0.0
    bounded = _refine(template, points, Timed(), Budget(until=3.0))
    assert [p[0] for p in bounded] == sorted([512, 640, 768, 1024, *extra[:3]])
    assert now[0] == 3.0
    assert [p[0] for p in _refine(template, points, Timed(), Budget(until=now[0]))] == [512, 640, 768, 1024]

    class Cheap(Timed):
        def remeasure(self, key, cfgs, *, cold=False):
            return [replace(r, ms=r.ms / 10) for r in super().remeasure(key, cfgs, cold=cold)]

    cheap = [_measure(template, m, [cfg], Cheap()) for m in (512, 640, 768, 1024)]
    assert cheap[-1][1]["cublas"] < ladder.REFINE_ALWAYS_MS
    assert ([p[0] for p in _refine(template, cheap, Cheap(), Budget(until=now[0]))]
            == [p[0] for p in _refine(template, cheap, Cheap())])


class _DipBackend:
    """cuBLAS switches to a faster kernel for M in 66-74 only; our kernel's
    time is flat and 2 % under cuBLAS's elsewhere."""

    name = "synthetic"

    def remeasure(self, key, cfgs, *, cold=False):
        from tuner.backends.measure import Measurement

        m = key.problem.m
        return [Measurement(ms=(0.95 if 66 <= m <= 74 else 1.0) if c is None else 0.98, ok=True) for c in cfgs]


def test_refine_bisects_thin_leads_where_cublas_changes_kernel_between_points():
    from kernels import space
    from tuner.search.ladder import DENSE_RATIO, THIN_MARGIN, _measure, _refine

    cfg = space.defaults("sm90")["single_tile"]
    template = Key("sm90", "synthetic", Problem(64, 4096, 4096))
    backend = _DipBackend()
    points = [_measure(template, m, [cfg], backend) for m in (64, 81, 102, 128)]
    # A 2 % lead at every measured point: one kernel range over the dip.
    assert [r["config"] is not None for r in build_map(points)] == [True]
    assert 1.0 / 0.98 < THIN_MARGIN
    refined = _refine(template, points, backend)
    for r in build_map(refined):
        if r["config"] is not None:
            assert not set(range(r["m_lo"], r["m_hi"] + 1)) & set(range(66, 75)), r
    # Kernel ranges end up measured at most DENSE_RATIO apart where the lead is thin.
    kernel_ms = sorted(m for m, times, _ in refined if times["cublas"] > times[cfg.name()])
    assert max(b / a for a, b in zip(kernel_ms, kernel_ms[1:]) if a >= 75) <= DENSE_RATIO


class _SpellBackend:
    """cuBLAS and a 16-row swap_ab kernel on a few rows: the kernel leads up
    to M = 16 and takes twice the time past it (two activation tiles). The
    first time M = 19 is measured the GPU is in a slow spell: every call
    takes 8x, and the kernel reads 2 % ahead."""

    name = "synthetic"

    def __init__(self):
        self.rounds = {}

    def remeasure(self, key, cfgs, *, cold=False):
        from tuner.backends.measure import Measurement

        m = key.problem.m
        self.rounds[m] = self.rounds.get(m, 0) + 1
        if m == 19 and self.rounds[m] == 1:
            return [Measurement(ms=0.123 if c is None else 0.1205, ok=True) for c in cfgs]
        return [Measurement(ms=0.015 if c is None else 0.013 if m <= 16 else 0.021, ok=True) for c in cfgs]


def test_a_point_measured_in_a_slow_spell_is_measured_again_before_it_decides():
    from tuner.search.ladder import _measure, _steady
    from tuner.backends.measure import slow_spell

    cfg = GemmConfig(scheduler="single_tile", tile_m=64, tile_n=16, stages=8, split_k=2, swap_ab=True)
    template = Key("sm90", "synthetic", Problem(16, 3072, 3072))
    backend = _SpellBackend()
    points = [_measure(template, m, [cfg], backend) for m in (16, 17, 19, 23, 32)]
    assert slow_spell(points[2][1]["cublas"], points[3][1]["cublas"])
    # Taken as measured, the spell grants the kernel M = 19 (1.4x cuBLAS's time there).
    assert [(r["m_lo"], r["m_hi"]) for r in build_map(points) if r["config"]] == [(16, 16), (19, 19)]
    steady = _steady(template, points, backend)
    assert backend.rounds[19] == 2 and all(n == 1 for m, n in backend.rounds.items() if m != 19)
    assert [(r["m_lo"], r["m_hi"]) for r in build_map(steady) if r["config"]] == [(16, 16)]
    # A point no larger M undercuts is left as measured.
    assert _steady(template, steady, backend) == steady and backend.rounds[19] == 2


def test_refine_measures_a_range_that_starts_between_points():
    """A range can begin right after a point another kernel took (64-row
    tiles: M = 64 is one row, 65 is two). Its first M is measured, and so
    is the thin stretch between that point and the next."""
    from tuner.search.ladder import _measure, _refine
    from tuner.backends.measure import Measurement

    one_row = GemmConfig(scheduler="single_tile", tile_m=64, tile_n=64, stages=8)
    two_rows = GemmConfig(scheduler="single_tile", tile_m=64, tile_n=128, stages=8)

    class Backend:
        name = "synthetic"

        def remeasure(self, key, cfgs, *, cold=False):
            m = key.problem.m
            ms = {None: 1.0, one_row: 0.9 if m <= 64 else 2.0,
                  two_rows: 0.95 if m <= 64 else 1.05 if m <= 72 else 0.97}
            return [Measurement(ms=ms[c], ok=True) for c in cfgs]

    template = Key("sm90", "synthetic", Problem(64, 4096, 4096))
    points = [_measure(template, m, [one_row, two_rows], Backend()) for m in (64, 76, 91, 128)]
    before = build_map(points)
    assert [(r["m_lo"], r["config_name"]) for r in before] == [(64, one_row.name()), (65, two_rows.name())]
    refined = _refine(template, points, Backend())
    assert {65, 70} <= {m for m, _, _ in refined}
    for r in build_map(refined):
        if r["config_name"] == two_rows.name():
            assert r["m_lo"] > 72, r


def test_refine_bisects_a_stretch_between_two_kernels_winning_points():
    """One kernel wins up to M = 64 (one 64-row tile), another from 65 (its
    wider tile loses at 64); measured at 64 and 76 only, neither holds at
    both, so 65-75 would go to cuBLAS untimed. Bisected, the second kernel
    takes the stretch from within DENSE_RATIO of 64, and nothing takes an M
    where it loses."""
    from tuner.search.ladder import DENSE_RATIO, _measure, _refine
    from tuner.backends.measure import Measurement

    narrow = GemmConfig(scheduler="single_tile", tile_m=64, tile_n=64, stages=8)
    wide = GemmConfig(scheduler="single_tile", tile_m=64, tile_n=96, stages=8)
    ms = lambda c, m: {None: 1.0, narrow: 0.9 if m <= 64 else 2.0, wide: 1.2 if m <= 64 else 0.95}[c]  # noqa: E731

    class Backend:
        name = "synthetic"

        def remeasure(self, key, cfgs, *, cold=False):
            return [Measurement(ms=ms(c, key.problem.m), ok=True) for c in cfgs]

    template = Key("sm90", "synthetic", Problem(64, 4096, 4096))
    points = [_measure(template, m, [narrow, wide], Backend()) for m in (64, 76, 91, 128)]
    assert [(r["m_lo"], r["m_hi"], r["config_name"]) for r in build_map(points)] == [
        (64, 64, narrow.name()), (65, 75, "cublas"), (76, 128, wide.name())]
    ranges = build_map(_refine(template, points, Backend()))
    assert ranges[0]["config_name"] == narrow.name() and ranges[-1]["config_name"] == wide.name()
    assert ranges[-1]["m_lo"] <= 64 * DENSE_RATIO
    for r in ranges:
        if r["config"] is not None:
            cfg = GemmConfig.from_dict(r["config"])
            assert all(ms(cfg, m) < 1.0 for m in range(r["m_lo"], r["m_hi"] + 1)), r


def test_refine_leaves_wide_leads_alone():
    from tuner.search.ladder import _measure, _refine

    class Wide(_DipBackend):
        def remeasure(self, key, cfgs, *, cold=False):
            from tuner.backends.measure import Measurement

            return [Measurement(ms=1.0 if c is None else 0.8, ok=True) for c in cfgs]

    from kernels import space

    cfg = space.defaults("sm90")["single_tile"]
    template = Key("sm90", "synthetic", Problem(64, 4096, 4096))
    points = [_measure(template, m, [cfg], Wide()) for m in (64, 81, 102, 128)]
    assert [p[0] for p in _refine(template, points, Wide())] == [64, 81, 102, 128]


def test_validation_also_times_the_winners_under_stream_k_and_the_other_l2_hint():
    """Between rungs a winner's tiles leave a partial wave its rungs did not
    have, and the L2 hint's worth changes with M: every point times each
    neighbouring winner under stream-K and under the other hint too."""
    from tuner.search.ladder import _measure_points

    class Recording(ModelBackend):
        def __init__(self):
            super().__init__("sm90")
            self.at: dict[int, list] = {}

        def remeasure(self, key, cfgs, *, cold=False):
            self.at[key.problem.m] = list(cfgs)
            return super().remeasure(key, cfgs, cold=cold)

    backend = Recording()
    template = Key("sm90", backend.device_name, Problem(4096, 5376, 4096))
    rung_winners = {
        4096: GemmConfig(scheduler="dynamic_persistent", tile_m=128, tile_n=224, cluster_n=2, stages=4),
        8192: GemmConfig(scheduler="static_persistent", tile_m=128, tile_n=256, stages=4),
    }
    outcomes = {m: SimpleNamespace(winner=SimpleNamespace(config=c.to_dict())) for m, c in rung_winners.items()}
    points = _measure_points(template, outcomes, backend)
    winners = set(rung_winners.values())
    variants = {scheduler_variant(c, "stream_k") for c in winners} | {hint_variant(c) for c in winners}
    assert None not in variants and not variants & winners and len(variants) == 4
    assert [m for m, _, _ in points] == [4096, *probes(4096, 8192), 8192]
    for m, _, named in points:
        timed = set(named.values())
        assert timed == winners | variants
        assert backend.at[m][0] is None  # cuBLAS, in the same interleaved run


def test_gaps_next_to_a_winning_rung_get_a_rung_at_their_midpoint(tmp_path):
    """A winner's tile fits its own M: a gap beside a rung that beat cuBLAS
    gets a rung at its geometric midpoint; gaps between cuBLAS rungs do not."""
    model = ModelBackend("sm90")
    keys = [Key("sm90", model.device_name, Problem(m, 5376, 4096)) for m in (128, 512)]
    out = tune_family(keys, model, Store(str(tmp_path / "t.db")), Budget(trials=8), name="o")
    ladder = rungs([128, 512])
    won = {m for m in ladder if out.rungs[m].winner.config and out.rungs[m].winner.speedup >= 1.01}
    assert won and set(ladder) - won  # the model's 27B o family has both kinds of rung
    filled = set(out.rungs) - set(ladder)
    want = {round(math.sqrt(lo * hi)) for lo, hi in zip(ladder, ladder[1:]) if {lo, hi} & won}
    assert filled == want - set(ladder) and filled
    assert set(out.seconds) == {"listed", "ladder", "fill", "map"} and out.tuned == len(out.rungs)
    # Validation runs over the denser ladder: every rung is a measured point.
    points = {p["m"] for r in out.ranges for p in r["evidence"]}
    assert set(out.rungs) <= points


def test_rungs_of_a_few_rows_are_seeded_with_swap_ab(tmp_path):
    """A measured backend's rungs start from their neighbours' winners and
    the model's picks, and those of at most 128 rows from `swap_seeds` too."""
    from tuner.search.study import swap_seeds

    class Measured(ModelBackend):
        name = "measured"

        def __init__(self):
            super().__init__("sm90")
            self.measured = []

        def measure(self, key, cfg):
            self.measured.append((key.problem.m, cfg))
            return super().measure(key, cfg)

    backend = Measured()
    keys = [Key("sm90", backend.device_name, Problem(m, 5376, 4096)) for m in (1, 128)]
    out = tune_family(keys, backend, Store(str(tmp_path / "t.db")), Budget(trials=6), name="o")
    # Rungs, not the listed keys (1 and 128: their warm start holds the seeds).
    small = [m for m in out.rungs if 1 < m < 128]
    assert small
    for m in small:
        seeds = swap_seeds(keys[0].with_m(m))
        assert seeds and set(seeds) <= {c for at, c in backend.measured if at == m}


def test_dynamic_m_draws_the_same_untuned_m_every_run():
    from bench.dynamic_m import random_ms

    tuned = set(rungs([1, 16, 128, 512, 2048, 8192]))
    ms = random_ms(64, 0, tuned)
    assert ms == random_ms(64, 0, tuned) != random_ms(64, 1, tuned)
    assert len(ms) == 64 and not tuned & set(ms) and 1 <= min(ms) and max(ms) <= 8192


@pytest.mark.parametrize("m", ["0,3", "a", ""])
def test_dynamic_m_names_a_bad_m_list(m):
    proc = subprocess.run([sys.executable, "-m", "bench.dynamic_m", "--db", "x.db", "--shapes", "x.txt", "--m", m],
                          capture_output=True, text=True, cwd=ROOT)
    assert proc.returncode == 2 and "argument --m: expected comma-separated positive integers" in proc.stderr, proc.stderr


def test_budget_shares_the_time_left_and_a_key_past_it_measures_its_seeds_only(tmp_path):
    import time

    from tuner.search.study import tune_key

    now = time.monotonic()
    budget = Budget(trials=8, until=now + 100)
    assert 49 < budget.share(0.5).left() <= 50 and budget.timeout() <= 100
    assert Budget(trials=8).share(0.5) == Budget(trials=8) and Budget(seconds=3).timeout() == 3
    assert math.isinf(Budget().left())

    backend = MeasuredBackend("sm90")  # a measured backend's search: seeds first, then samples
    key = Key("sm90", backend.device_name, Problem(512, 5376, 4096))
    seeds = [GemmConfig(), GemmConfig(tile_n=256, stages=3)]
    out = tune_key(key, backend, Store(str(tmp_path / "t.db")), Budget(trials=40, until=now - 1), seeds=seeds,
                   explore=False)
    # Out of time: the queued seeds, no sampled trial (40 were allowed) and
    # no neighbour of the best; the final round adds its other L2 hint.
    measured = set(backend.measured)
    assert out.winner.trials == len(seeds) and set(seeds) <= measured and len(measured) <= 3


def test_a_deadline_tunes_every_rung_before_the_listed_keys_sample(tmp_path, monkeypatch):
    """Breadth first under a deadline, from the fewest rows up: the listed
    keys' seeds and the rungs, then the listed keys' sampling with what is
    left. Each measurement costs one second of a fake clock, so the schedule
    is exact."""
    import time

    from tuner.search.ladder import MAP_SHARE

    clock = [1000.0]
    monkeypatch.setattr(time, "monotonic", lambda: clock[0])

    class Ticking(MeasuredBackend):
        def measure(self, key, cfg):
            clock[0] += 1.0
            return super().measure(key, cfg)

    def run(seconds: float, db: str):
        backend = Ticking("sm90")
        keys = [Key("sm90", backend.device_name, Problem(m, 5376, 4096)) for m in (1, 16, 512)]
        return tune_family(keys, backend, Store(str(tmp_path / db)), Budget(trials=40, until=clock[0] + seconds))

    ample = run(1e6, "ample.db")
    assert not ample.unreached and all(ample.rungs[m].winner.trials == 40 for m in (1, 16, 512))
    # Time for the listed keys' seeds and the ladder's rungs, not for sampling.
    tight = run(ample.seconds["ladder"] / (1 - MAP_SHARE) + 10, "tight.db")
    assert not set(tight.unreached) & set(rungs([1, 16, 512]))
    assert all(tight.rungs[m].winner.trials < 40 for m in (1, 16, 512))
    assert tight.validated
    # Less time: the rungs of the most rows are left out, the listed keys are tuned.
    short = run(ample.seconds["ladder"] / 3, "short.db")
    between = [m for m in rungs([1, 16, 512]) if m not in (1, 16, 512)]
    tuned = [m for m in between if m in short.rungs]
    assert tuned == between[:len(tuned)] and set(short.unreached) >= set(between[len(tuned):]) != set()
    assert all(short.rungs[m].winner.trials < 40 for m in (1, 16, 512))
    # Reached past the family's time, the largest listed key measured a rung's few candidates.
    assert short.rungs[512].winner.trials < tight.rungs[512].winner.trials


def test_a_rung_whose_neighbours_won_with_one_config_is_settled():
    from types import SimpleNamespace as NS

    from tuner.search.ladder import SETTLED_MARGIN, _settled

    cfg = GemmConfig()

    def outcome(name, speedup, config=cfg):
        return NS(winner=NS(config_name=name, speedup=speedup, config=config and config.to_dict()))
    won = {16: outcome("a", SETTLED_MARGIN + 0.01), 64: outcome("a", 1.2)}
    assert _settled(won, 32) == cfg
    assert _settled(won | {64: outcome("b", 1.2)}, 32) is None          # two configs
    assert _settled(won | {64: outcome("a", 1.0)}, 32) is None          # a thin lead at one end
    assert _settled({16: outcome("cublas", 1.0, None), 64: outcome("cublas", 1.0, None)}, 32) is None
    assert _settled(won, 8) is None                                     # a neighbour on one side only


def test_a_deadline_leaves_rungs_and_then_families_out_and_says_so(tmp_path):
    import time

    from tuner.search.ladder import tune_families

    model = ModelBackend("sm90", bulk=False)
    fams = [(f"f{n}", [Key("sm90", model.device_name, Problem(m, n, 4096)) for m in (1, 512)])
            for n in (4096, 8192, 14336)]
    heard = []
    store = Store(str(tmp_path / "t.db"))
    tune_families(fams, model, store, Budget(trials=4, until=time.monotonic() + 1.0),
                  on_family=lambda name, state, outcome: heard.append((name, state, outcome)))
    states = {name: state for name, state, _ in heard if state != "take"}
    assert set(states) == {"f4096", "f8192", "f14336"}
    # The family of least GEMM time goes first.
    assert [name for name, state, _ in heard if state == "take"][0] == "f4096"
    done = [o for _, state, o in heard if state == "done"]
    assert "unreached" in states.values() or any(o.unreached for o in done)
    for o in done:
        assert o.validated and not set(o.unreached) & set(o.rungs)
    # No deadline: every family, every rung.
    heard.clear()
    tune_families(fams, model, Store(str(tmp_path / "u.db")), Budget(trials=4),
                  on_family=lambda name, state, outcome: heard.append((name, state, outcome)))
    assert all(not o.unreached for _, s, o in heard if s == "done") and len([s for _, s, _ in heard if s == "done"]) == 3


def test_a_deadline_does_not_start_a_family_whose_validation_cannot_fit(tmp_path, monkeypatch):
    """The families validated first predict the next one's validation from
    its modelled GEMM time; one whose validation would not fit the time
    left stays on cuBLAS (half an equal share would have started it)."""
    import time

    from tuner.search import ladder
    from tuner.search.ladder import FamilyOutcome, expected_validation, tune_families

    model = ModelBackend("sm90", bulk=False)
    fams = [(f"f{n}", [Key("sm90", model.device_name, Problem(m, n, 4096)) for m in (1, 512)])
            for n in (1024, 2048, 131072)]
    ms = {name: ladder._gemm_ms(keys) for name, keys in fams}

    def validating(keys, *args, **kwargs):
        # 2 s of validation per modelled ms, reported, not spent.
        return FamilyOutcome({}, [], True, {"map": 2.0 * ladder._gemm_ms(keys)})

    monkeypatch.setattr(ladder, "tune_family", validating)
    heard = []
    started = time.monotonic()
    budget_s = 4 * ms["f1024"] + 4 * ms["f2048"] + 1.0
    assert 2.0 * ms["f131072"] > budget_s
    tune_families(fams, model, Store(str(tmp_path / "t.db")), Budget(trials=4, until=started + budget_s),
                  on_family=lambda name, state, outcome: heard.append((name, state)))
    assert [s for n, s in heard if n == "f131072"] == ["unreached"]
    assert ("f1024", "done") in heard and ("f2048", "done") in heard
    assert expected_validation([], ms["f1024"]) == 0.0
    assert expected_validation([(2.0, 1.0), (8.0, 1.0), (4.0, 1.0)], ms["f1024"]) == pytest.approx(4.0 * ms["f1024"])


def test_a_measured_family_compiles_its_keys_candidates_ahead_and_a_rerun_nothing(tmp_path):
    from tuner.search.study import first_configs

    backend = MeasuredBackend("sm90")
    keys = [Key("sm90", backend.device_name, Problem(m, 5376, 4096)) for m in (16, 512)]
    store = Store(str(tmp_path / "t.db"))
    tune_family(keys, backend, store, Budget(trials=6), name="o")
    # The first batch: every listed key's first configs, in key order.
    listed = list(dict.fromkeys(c for k in keys for c in first_configs(k)))
    assert backend.prepared[: len(listed)] == listed
    backend.prepared.clear()
    tune_family(keys, backend, store, Budget(trials=6), name="o")
    assert not backend.prepared
