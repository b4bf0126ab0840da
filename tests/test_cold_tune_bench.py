"""bench.cold_tune's check of its reference database (CPU)."""

from bench.cold_tune import reference_problem
from db.store import Store
from tuner.backends.model import ModelBackend
from tuner.key import Key, Problem
from tuner.search.ladder import tune_family
from tuner.search.study import Budget


def test_a_reference_must_hold_maps_of_the_device_it_is_benched_on(tmp_path):
    backend = ModelBackend("sm90")
    db = str(tmp_path / "ref.db")
    tune_family([Key("sm90", backend.device_name, Problem(m, 4096, 4096)) for m in (1, 64)], backend, Store(db),
                Budget(trials=4))
    assert reference_problem(db, backend.device_name) is None
    why = reference_problem(db, "NVIDIA H200")
    assert why == f"{db} holds no M map of NVIDIA H200 (its maps are of: {backend.device_name})"
    assert "no database at" in reference_problem(str(tmp_path / "missing.db"), "NVIDIA H200")
