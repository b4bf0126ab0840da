import sqlite3

import pytest

from db.engine import resolve_url
from db.store import Store
from tuner.key import Key, Problem
from tuner.lookup import lookup, nearest_m

VERSIONS = {"torch": "2.13", "cutlass-dsl": "4.8.1"}


def _key(m, n=4096, k=4096):
    return Key("sm90", "TestGPU", Problem(m, n, k))


def _store_winner(store, key, ms=1.0, baseline=2.0, versions=VERSIONS):
    env = store.environment("gpu", key.arch, key.device, versions)
    kid = store.key_id(key.to_dict(), "t")
    store.set_winner(
        kid, env, config_name=f"cfg{key.problem.m}", scheduler="static_persistent", config={"m": key.problem.m},
        ms=ms, baseline_ms=baseline, best_by_scheduler={"static_persistent": ms}, trials=5,
    )


def test_sqlite_file_is_wal_and_migrated(tmp_path):
    path = tmp_path / "t.db"
    Store(str(path)).close()
    con = sqlite3.connect(path)
    assert con.execute("PRAGMA journal_mode").fetchone()[0] == "wal"
    tables = {r[0] for r in con.execute("select name from sqlite_master where type='table'")}
    assert {"tuner_keys", "tuner_trials", "tuner_winners", "tuner_environments", "tuner_alembic_version"} <= tables


def test_url_resolution(tmp_path, monkeypatch):
    monkeypatch.setenv("TUNER_DB", str(tmp_path / "env.db"))
    assert resolve_url(None) == f"sqlite:///{tmp_path / 'env.db'}"
    assert resolve_url("postgresql://u@h/db") == "postgresql://u@h/db"
    monkeypatch.delenv("TUNER_DB")
    monkeypatch.setenv("XDG_DATA_HOME", str(tmp_path))
    assert resolve_url(None) == f"sqlite:///{tmp_path}/gemm-tuner/tuner.db"


def test_winner_roundtrip_speedup_and_staleness(tmp_path):
    store = Store(str(tmp_path / "t.db"))
    key = _key(128)
    _store_winner(store, key, ms=0.5, baseline=0.6)
    w = store.winner(key.to_dict())
    assert w.speedup == pytest.approx(1.2)
    assert not w.stale(VERSIONS)
    assert w.stale({**VERSIONS, "torch": "2.14"})
    _store_winner(store, key, ms=0.4, baseline=0.6)
    assert store.count_winners() == 1
    assert store.winner(key.to_dict()).ms == 0.4


def test_nearest_m_rule(tmp_path):
    assert nearest_m(100, []) is None
    assert nearest_m(100, [64, 128]) == 128  # log-distance 0.36 vs 0.25
    assert nearest_m(96, [64, 144]) == 144  # equal ratio 1.5: the larger M
    assert nearest_m(1, [16, 128]) == 16
    store = Store(str(tmp_path / "t.db"))
    for m in (16, 512, 8192):
        _store_winner(store, _key(m))
    d = lookup(store, _key(600), VERSIONS)
    assert (d.exact, d.tuned_m, d.stale) == (False, 512, False)
    assert lookup(store, _key(512), {"torch": "other"}).stale
    assert lookup(store, _key(512, n=1024), VERSIONS) is None


def test_export_import_keeps_faster(tmp_path):
    src = Store(str(tmp_path / "a.db"))
    _store_winner(src, _key(16), ms=1.0)
    _store_winner(src, _key(32), ms=2.0)
    records = src.export()
    dst = Store(str(tmp_path / "b.db"))
    _store_winner(dst, _key(16), ms=0.5)
    assert dst.import_records(records) == 1
    assert dst.winner(_key(16).to_dict()).ms == 0.5
    assert dst.winner(_key(32).to_dict()).ms == 2.0
