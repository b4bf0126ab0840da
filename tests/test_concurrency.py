"""Several `tuner tune` processes on one fresh SQLite file (model backend):
every process finishes, every family is measured by one process only, and
every stored winner is the best verified trial of its key. The 20-repetition
run is `python -m bench.concurrency`."""

import sqlite3

import pytest

from bench.concurrency import SHAPES, race, violations


@pytest.mark.parametrize("rep", range(3))
def test_four_tuners_on_a_fresh_file(tmp_path, rep):
    shapes = tmp_path / "s.txt"
    shapes.write_text(SHAPES)
    db = tmp_path / "fresh.db"
    for r in race(shapes, db, 4):
        assert r.returncode == 0, r.stderr[-3000:]
        assert "Traceback" not in r.stderr
    assert violations(db) == []
    con = sqlite3.connect(db)
    families = con.execute("select count(distinct n) from tuner_m_ranges").fetchone()[0]
    con.close()
    assert families == 3


def test_violations_sees_a_config_measured_twice_and_a_slow_winner(tmp_path):
    shapes = tmp_path / "s.txt"
    shapes.write_text(SHAPES)
    db = tmp_path / "t.db"
    assert all(r.returncode == 0 for r in race(shapes, db, 1))
    con = sqlite3.connect(db)
    con.execute("insert into tuner_trials (key_id, env_id, config_name, scheduler, config, ok, ms, detail,"
                " created_at) select key_id, env_id, config_name, scheduler, config, ok, ms, detail, created_at"
                " from tuner_trials limit 1")
    con.execute("update tuner_winners set ms = ms * 2 where id = (select min(id) from tuner_winners)")
    con.commit()
    con.close()
    found = violations(db)
    assert any("measured 2 times" in v for v in found) and any("best trial" in v for v in found)
