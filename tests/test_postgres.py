"""The database shared by several tuners, on a real PostgreSQL server
(`tests/postgres.py`; skipped without one, never in CI): migrations, workers
sharing a shape file's families (`tune --devices`, model backend), a worker
killed mid-key, and `tuner serve` reading what they stored."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import httpx
import optuna
import pytest
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, text

from bench.concurrency import violations
from db.engine import resolve_url
from db.migrate import alembic_config
from db.models import Lease
from db.store import Store
from tests.test_service import _Server
from tuner.backends.model import PER_TRIAL_ENV
from tuner.key import Key, Problem
from tuner.search.ladder import _died_here
from tuner.runtime.lookup import EXACT, NEAREST, lookup

ROOT = Path(__file__).resolve().parents[1]
# Six families (one of them two listed M): enough that every worker gets some.
SHAPES = "".join(f"{m} {n} {k} name=f{i}\n" for i, (m, n, k) in enumerate([
    ("16,128", 1024, 1024), ("64", 2048, 1024), ("8", 512, 2048), ("32", 4096, 1024),
    ("128", 1536, 2048), ("16", 3072, 512),
]))


def _tune(*args: str, db: str, **popen) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "tuner.cli", "tune", "--backend", "model", *args, "--db", db]
    return subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **popen)


def _sql(url: str, query: str, **params):
    engine = create_engine(resolve_url(url))
    try:
        with engine.connect() as con:
            return con.execute(text(query), params).all()
    finally:
        engine.dispose()


def test_fresh_database_is_migrated_to_head_once(pg_url):
    head = ScriptDirectory.from_config(alembic_config(resolve_url(pg_url))).get_current_head()
    Store(pg_url).optuna_storage()
    Store(pg_url).close()  # a second writer finds it current
    assert _sql(pg_url, "select version_num from tuner_alembic_version") == [(head,)]
    tables = {r[0] for r in _sql(pg_url, "select tablename from pg_tables where schemaname = 'public'")}
    assert {"tuner_keys", "tuner_trials", "tuner_winners", "tuner_m_ranges", "tuner_leases",
            "tuner_lease_events", "studies", "trials"} <= tables


def test_database_of_an_old_schema_upgrades_with_every_winner_kept(pg_url):
    url = resolve_url(pg_url)
    engine = create_engine(url)
    cfg = alembic_config(url)
    with engine.begin() as conn:
        cfg.attributes["connection"] = conn
        command.upgrade(cfg, "0002")
        conn.execute(text("insert into tuner_environments (id, fingerprint, backend, arch, device, versions,"
                          " created_at) values (1, 'fp', 'gpu', 'sm90', 'H', '{}', now())"))
        for i, m in enumerate((128, 512, 2048), start=1):
            conn.execute(text(
                "insert into tuner_keys (id, arch, device, dtype_in, dtype_out, layout, m, n, k, groups, group_k,"
                " carveout, name) values (:i, 'sm90', 'H', 'bf16', 'bf16', 'tn', :m, 4096, 4096, 1, '', 0, 'x')"),
                {"i": i, "m": m})
            conn.execute(text(
                "insert into tuner_winners (id, key_id, env_id, config_name, scheduler, config, ms, baseline_ms,"
                " speedup, best_by_scheduler, trials, updated_at) values (:i, :i, 1, 'cfg', 'static_persistent',"
                " null, 1.0, 1.1, 1.1, '{}', 3, now())"), {"i": i})
    engine.dispose()
    store = Store(pg_url)
    assert store.count_winners() == 3 and store.ranges() == [] and store.lease_events() == []
    key = Key("sm90", "H", Problem(600, 4096, 4096))
    assert lookup(store, key).how == NEAREST and lookup(store, key.with_m(512)).how == EXACT
    store.close()


def test_a_lease_of_another_host_is_taken_over_only_after_it_expires(pg_url):
    store = Store(pg_url)
    other = "another-host:1"  # no process of this host: only the expiry can tell
    assert store.acquire("family:x", other, 600)
    assert not _died_here(other)
    assert not store.acquire("family:x", "me:2", 600, dead=_died_here)
    with store.session() as s, s.begin():
        s.get(Lease, "family:x").expires_at = datetime.now(timezone.utc) - timedelta(seconds=1)
    assert store.acquire("family:x", "me:2", 600, dead=_died_here)
    assert not store.renew("family:x", other, 600)  # the old holder finds it lost
    assert [(e.owner, e.event, e.previous) for e in store.lease_events("family:x")] == [
        (other, "take", None), ("me:2", "takeover", other), (other, "lost", None)]
    store.close()


@pytest.mark.parametrize("workers", [2, 4])
def test_workers_share_the_families_and_tune_none_twice(pg_url, tmp_path, workers):
    shapes = tmp_path / "s.txt"
    shapes.write_text(SHAPES)
    devices = ",".join(map(str, range(workers)))
    proc = _tune("--shapes", str(shapes), "--trials", "4", "--devices", devices, "--json", db=pg_url)
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    assert "Traceback" not in err
    summary = json.loads(out)
    tuned = [name for w in summary["workers"] for name in w["families"]]
    # Every family tuned, each by one worker, and the work spread out.
    assert sorted(tuned) == [f"f{i}" for i in range(6)]
    assert sum(bool(w["families"]) for w in summary["workers"]) >= 2
    assert {w["exit_code"] for w in summary["workers"]} == {0}
    assert {m["name"] for m in summary["maps"]} == set(tuned)
    # From the stored data: no config measured twice for a key, every winner
    # its key's best trial, and no lease ever held by two workers at once.
    assert violations(pg_url) == []
    owners = {r[0] for r in _sql(pg_url, "select distinct owner from tuner_lease_events where event = 'take'")}
    assert owners == {w["owner"] for w in summary["workers"]}
    # Progress for people: a line per tuned family, every line within 80 columns.
    lines = err.splitlines()
    assert all(any(line.startswith("gpu") and f" {name}  " in line and "tuned" in line for line in lines)
               for name in tuned), err
    assert max(map(len, err.splitlines())) <= 80


def test_a_worker_killed_mid_key_is_taken_over_and_nothing_it_measured_is_lost(pg_url, tmp_path, monkeypatch):
    # The model searched as the GPU backend is: one Optuna trial at a time in
    # the database (a bulk model search stores a key only once it is done).
    monkeypatch.setenv(PER_TRIAL_ENV, "1")
    shapes = tmp_path / "s.txt"
    shapes.write_text("512 4096 4096 name=big\n")
    args = ("--shapes", str(shapes), "--trials", "60", "--no-ladder", "--lease-ttl", "2")
    Store(pg_url).close()  # the schema, so that the polling below can count trials
    first = _tune(*args, db=pg_url, start_new_session=True)
    deadline = time.monotonic() + 300
    while True:
        assert first.poll() is None, first.communicate()[1][-3000:]
        assert time.monotonic() < deadline, "the first worker measured nothing"
        if _sql(pg_url, "select count(*) from tuner_trials")[0][0] >= 8:
            break
        time.sleep(0.2)
    os.killpg(first.pid, signal.SIGKILL)
    first.wait()
    before = {r[0] for r in _sql(pg_url, "select config_name from tuner_trials")}
    assert _sql(pg_url, "select count(*) from tuner_winners") == [(0,)]  # killed mid-key

    second = _tune(*args, db=pg_url)
    _, err = second.communicate(timeout=600)
    assert second.returncode == 0, err[-3000:]
    after = {r[0] for r in _sql(pg_url, "select config_name from tuner_trials")}
    assert before <= after and len(after) > len(before)
    assert violations(pg_url) == []  # nothing the first measured was measured again
    store = Store(pg_url)
    events = [(e.event, e.owner, e.previous) for e in store.lease_events()]
    dead = f"{socket.gethostname()}:{first.pid}"
    assert events[0] == ("take", dead, None)
    assert events[1][0] == "takeover" and events[1][2] == dead and events[1][1] != dead
    assert events[-1][0] == "release"
    [study] = optuna.get_all_study_summaries(store.optuna_storage())
    trials = optuna.load_study(study_name=study.study_name, storage=store.optuna_storage()).trials
    assert not [t for t in trials if t.state == optuna.trial.TrialState.RUNNING]
    store.close()


def test_serve_reads_the_winners_from_postgres(pg_url, tmp_path):
    shapes = tmp_path / "s.txt"
    shapes.write_text("128,2048 2560 2048 name=o\n")
    proc = _tune("--shapes", str(shapes), "--trials", "4", db=pg_url)
    _, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-3000:]
    store = Store(pg_url, writer=False)
    device = store.winners(limit=1)[0].key["device"]
    expected = {m: lookup(store, Key("sm90", device, Problem(m, 2560, 2048))) for m in (100, 128, 2048)}
    total = store.count_winners(n=2560)
    store.close()
    server = _Server(pg_url, None)
    try:
        for m, decision in expected.items():
            r = httpx.get(server.url + "/v1/best", params={"m": m, "n": 2560, "k": 2048}, timeout=30)
            assert r.status_code == 200, r.text
            body = r.json()
            assert (body["how"], body["config_name"], body["tuned_m"]) == (
                decision.how, decision.config_name, decision.tuned_m)
            assert body["stale"] is False and body["versions"] == decision.versions
        r = httpx.get(server.url + "/v1/results", params={"n": 2560}, timeout=30)
        assert r.status_code == 200 and r.json()["total"] == total > 2  # the listed M and the rungs
    finally:
        server.stop()
