import sqlite3

import pytest

from db.engine import resolve_url
from db.store import Store
from kernels.space import GemmConfig
from tuner.key import Key, Problem
from tuner.runtime.lookup import EXACT, NEAREST, lookup

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
    # A plain PostgreSQL URL is driven by psycopg (the `postgres` extra); a named driver stays.
    assert resolve_url("postgresql://u@h/db") == "postgresql+psycopg://u@h/db"
    assert resolve_url("postgres://u@h/db") == "postgresql+psycopg://u@h/db"
    assert resolve_url("postgresql+psycopg2://u@h/db") == "postgresql+psycopg2://u@h/db"
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


def test_family_without_a_map_serves_a_winner_only_within_its_own_interval(tmp_path):
    store = Store(str(tmp_path / "t.db"))
    for m in (16, 512, 8192):
        _store_winner(store, _key(m))
    d = lookup(store, _key(600))  # 600 / 512 < sqrt(2)
    assert (d.how, d.exact, d.tuned_m, d.stale(VERSIONS)) == (NEAREST, False, 512, False)
    assert lookup(store, _key(512)).how == EXACT
    assert lookup(store, _key(512)).stale({"torch": "other"})
    # 1100 is over sqrt(2) from 512 and from 8192: no measurement, no choice.
    assert lookup(store, _key(1100)) is None
    assert lookup(store, _key(1)) is None
    assert lookup(store, _key(22)).tuned_m == 16  # 22 / 16 < sqrt(2)
    assert lookup(store, _key(512, n=1024)) is None


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


def test_overlap_keys_are_their_own_keys_and_families(tmp_path):
    from tuner.key import Key, Problem
    from tuner.runtime.lookup import family_of, lookup

    store = Store(str(tmp_path / "o.db"))
    plain = Key("sm90", "dev", Problem(16, 5376, 2688))
    beside = Key("sm90", "dev", Problem(16, 5376, 2688, overlap=1 << 20))
    assert store.key_id(plain.to_dict()) != store.key_id(beside.to_dict())
    assert Key.from_dict(beside.to_dict()) == beside
    env = store.environment("gpu", "sm90", "dev", {"torch": "x"})
    for key, name in ((plain, "sm90-single_tile-t64x16-c1x1-s8-w1m-ab"),
                      (beside, "sm90-static_persistent-t128x128-c1x1-s4-w4m-sm116")):
        cfg = GemmConfig.from_name(name).to_dict()
        evidence = [{"m": 16, "ms": {"cublas": 0.02, name: 0.018}}]
        store.set_ranges(family_of(key), env, [dict(m_lo=1, m_hi=64, config=cfg, config_name=name,
                                                    scheduler=cfg["scheduler"], evidence=evidence)])
    # Each family's map answers its own key, and only its own.
    assert lookup(store, plain).config_name.endswith("-ab")
    assert lookup(store, beside).config_name.endswith("-sm116")
    assert lookup(store, Key("sm90", "dev", Problem(16, 5376, 2688, overlap=2 << 20))) is None
    store.close()


def test_a_database_from_before_overlap_keys_keeps_its_keys(tmp_path):
    import sqlite3

    from alembic import command

    from db.migrate import alembic_config
    from tuner.key import Key, Problem

    path = tmp_path / "old.db"
    command.upgrade(alembic_config(f"sqlite:///{path}"), "0005")
    with sqlite3.connect(path) as conn:
        conn.execute(
            "INSERT INTO tuner_keys (arch, device, dtype_in, dtype_out, layout, n, k, groups, group_k, carveout, m, name)"
            " VALUES ('sm90', 'dev', 'bf16', 'bf16', 'tn', 5376, 2688, 1, '', 0, 16, 'old')")
    store = Store(str(path))  # migrates to head
    key = Key("sm90", "dev", Problem(16, 5376, 2688))
    assert store.key_id(key.to_dict()) == 1  # the old row, now with overlap 0
    # A key dict of a caller that predates overlap keys names the same row.
    assert store.key_id({f: v for f, v in key.to_dict().items() if f != "overlap"}) == 1
    assert store.key_id(Key("sm90", "dev", Problem(16, 5376, 2688, overlap=4096)).to_dict()) == 2
    store.close()


def test_a_reader_names_an_older_schema_and_tuner_migrate_upgrades_it(tmp_path):
    import subprocess
    import sys

    from alembic import command

    from db.migrate import alembic_config
    from db.store import StoreError

    path = tmp_path / "old.db"
    command.upgrade(alembic_config(f"sqlite:///{path}"), "0005")
    with pytest.raises(StoreError, match="schema revision 0005, this release reads 0006: `tuner migrate`"):
        Store(str(path), writer=False)
    done = subprocess.run([sys.executable, "-m", "tuner.cli", "migrate", "--db", str(path)],
                          capture_output=True, text=True)
    assert done.returncode == 0 and "schema revision 0006" in done.stdout, done.stderr
    Store(str(path), writer=False).close()
