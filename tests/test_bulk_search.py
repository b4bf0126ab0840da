"""The model backend's bulk search: a key's study in memory, its trials stored
together when it is done. The same trials and winners as the per-trial search
a measuring backend runs, stored once, resumable, and a rerun does nothing."""

import pytest
from sqlalchemy import inspect, text

from bench.concurrency import violations
from db.store import Store
from tuner.backends.model import ModelBackend
from tuner.key import Key
from tuner.runtime.lookup import family_of
from tuner.search.ladder import tune_families
from tuner.search.study import Budget
from tuner.shapes import parse_shapes

SHAPES = "1,128 4096 4096 name=a\n512 2048 1024 name=b\n"
BUDGET = Budget(trials=6)


def _families(path, backend) -> list[tuple[str, list[Key]]]:
    """The shape file's families, as `tuner tune` groups them."""
    families: dict[tuple, list] = {}
    for entry in parse_shapes(path):
        key = Key(backend.arch, backend.device_name, entry.problem)
        families.setdefault(tuple(map(str, family_of(key).values())), []).append((entry.name, key))
    return [(members[0][0], [k for _, k in members]) for members in families.values()]


def _tune(db, backend, shapes) -> Store:
    store = Store(str(db))
    tune_families(_families(shapes, backend), backend, store, BUDGET)
    return store


def _stored(store: Store) -> dict:
    """Everything a tune leaves that does not depend on when it ran: per key
    the winner and the trials (in the order measured), and the M maps."""
    winners = {(w.key["n"], w.key["k"], w.key["m"]): (w.config_name, w.ms, w.baseline_ms, w.trials)
               for w in store.winners(limit=10_000)}
    trials = {(kt.key["n"], kt.key["k"], kt.key["m"]): [(t.config_name, t.ok, t.ms) for t in kt.trials]
              for kt in store.key_trials()}
    maps = [(r.family["n"], r.family["k"], r.m_lo, r.m_hi, r.config_name, r.evidence) for r in store.ranges()]
    return {"winners": winners, "trials": trials, "maps": maps}


def _studies(store: Store) -> int:
    if "studies" not in inspect(store.engine).get_table_names():
        return 0
    with store.engine.connect() as con:
        return con.execute(text("select count(*) from studies")).scalar()


@pytest.fixture
def shapes(tmp_path):
    path = tmp_path / "s.txt"
    path.write_text(SHAPES)
    return path


def test_bulk_search_stores_what_the_per_trial_search_does_without_optuna_in_the_database(tmp_path, shapes):
    bulk = _tune(tmp_path / "bulk.db", ModelBackend("sm90"), shapes)
    per_trial = _tune(tmp_path / "per-trial.db", ModelBackend("sm90", bulk=False), shapes)
    got, want = _stored(bulk), _stored(per_trial)
    # Every rung of both ladders, each with its trials: the same configs, times and winners.
    assert len(got["winners"]) > 10 and set(got["trials"]) == set(got["winners"])
    assert got == want
    # A measuring backend's search keeps one Optuna study per key in the
    # database; the model's keeps none there.
    assert _studies(per_trial) == len(want["winners"])
    assert _studies(bulk) == 0
    assert violations(bulk.url) == []


def test_a_rerun_of_a_model_tune_measures_and_stores_nothing(tmp_path, shapes):
    backend = ModelBackend("sm90")
    store = _tune(tmp_path / "t.db", backend, shapes)
    before = _stored(store)
    stamps = {w.config_name: w.updated_at for w in store.winners(limit=10_000)}
    calls = []
    backend.measure = lambda key, cfg: calls.append(cfg)
    backend.baseline = lambda key: calls.append(None)
    tune_families(_families(shapes, backend), backend, store, BUDGET)
    assert calls == []
    assert _stored(store) == before
    assert {w.config_name: w.updated_at for w in store.winners(limit=10_000)} == stamps


class _Interrupted(Exception):
    pass


class _Dying(ModelBackend):
    """The model, interrupted (as by Ctrl-C or a kill) at its `after`-th measurement."""

    def __init__(self, after: int):
        super().__init__("sm90")
        self.left = after

    def measure(self, key, cfg):
        self.left -= 1
        if self.left < 0:
            raise _Interrupted
        return super().measure(key, cfg)


def test_an_interrupted_model_tune_resumes_to_what_an_uninterrupted_one_stores(tmp_path, shapes):
    whole = _stored(_tune(tmp_path / "whole.db", ModelBackend("sm90"), shapes))
    store = Store(str(tmp_path / "t.db"))
    dying = _Dying(after=40)
    with pytest.raises(_Interrupted):
        tune_families(_families(shapes, dying), dying, store, BUDGET)
    # Interrupted inside a key: the keys done before it are stored whole, the
    # interrupted one not at all (a key's trials are stored with its winner).
    done = _stored(store)
    assert 0 < len(done["winners"]) < len(whole["winners"])
    assert set(done["trials"]) == set(done["winners"])
    assert all(done["trials"][k] == whole["trials"][k] for k in done["winners"])
    with store.engine.connect() as con:
        assert con.execute(text("select count(*) from tuner_keys")).scalar() == len(done["winners"]) + 1
    # The rerun searches the interrupted key again and goes on from there.
    backend = ModelBackend("sm90")
    tune_families(_families(shapes, backend), backend, store, BUDGET)
    assert _stored(store) == whole
    assert violations(store.url) == []
