"""The Optuna search: model-guided warm start, ahead-of-time compiles, winners against the baseline."""

from kernels import space
from kernels.space import GemmConfig
from db.store import Store
from tuner.key import Key, Problem
from tuner.model import ModelBackend
from tuner.search import Budget, model_picks, tune_key


class MeasuredBackend(ModelBackend):
    """The model's times behind a backend that is not the model (as the gpu one is),
    recording what the search asks it to compile ahead and to measure."""

    name = "measured"

    def __init__(self, arch):
        super().__init__(arch)
        self.prepared: list[GemmConfig] = []
        self.measured: list[GemmConfig] = []

    def prepare(self, cfgs):
        self.prepared.extend(cfgs)

    def measure(self, key, cfg):
        self.measured.append(cfg)
        return super().measure(key, cfg)


def test_model_picks_are_distinct_runnable_shapes_best_first():
    from tuner.model import predict_ms

    for arch in ("sm90", "sm100"):
        key = Key(arch, "dev", Problem(512, 5376, 21504))
        picks = model_picks(key, count=5)
        assert len(picks) == 5
        shapes = {(c.tile_m, c.tile_n, c.split_k, c.cta_group) for c in picks}
        assert len(shapes) == 5
        times = [predict_ms(key, c) for c in picks]
        assert times == sorted(times)
        for cfg in picks:
            space.check_problem(cfg, 512, 5376, 21504)


def test_winner_and_scheduler_bests_come_from_one_interleaved_run(tmp_path):
    backend = MeasuredBackend("sm90")
    rounds = []
    backend.remeasure = lambda key, cfgs: rounds.append(cfgs) or ModelBackend.remeasure(backend, key, cfgs)
    key = Key("sm90", backend.device_name, Problem(4096, 4096, 4096))
    w = tune_key(key, backend, Store(str(tmp_path / "t.db")), Budget(trials=8)).winner
    (finalists,) = rounds
    assert None in finalists
    assert sorted(c.scheduler for c in finalists if c) == sorted(space.knobs("sm90")["scheduler"])
    assert set(w.best_by_scheduler) == {"cublas", *space.knobs("sm90")["scheduler"]}
    assert w.ms == min(w.best_by_scheduler.values())
    assert w.baseline_ms == w.best_by_scheduler["cublas"]


def test_measured_study_starts_from_model_picks_compiled_ahead(tmp_path):
    backend = MeasuredBackend("sm90")
    key = Key("sm90", backend.device_name, Problem(2048, 5376, 4096))
    store = Store(str(tmp_path / "t.db"))
    outcome = tune_key(key, backend, store, Budget(trials=10))
    picks = model_picks(key)
    assert set(picks) <= set(backend.prepared)
    # Enqueued trials run first: the model's picks are among the first measured.
    assert set(picks) <= set(backend.measured[: len(backend.prepared)])
    assert outcome.winner.ms <= outcome.winner.baseline_ms
    assert outcome.winner.speedup >= 1.0


def test_a_config_is_recorded_once_per_key_across_reruns(tmp_path):
    backend = MeasuredBackend("sm90")
    key = Key("sm90", backend.device_name, Problem(128, 4096, 4096))
    store = Store(str(tmp_path / "t.db"))
    tune_key(key, backend, store, Budget(trials=8))
    tune_key(key, backend, store, Budget(trials=12), force=True)
    env = store.environment(backend.name, "sm90", backend.device_name, backend.versions())
    names = [t.config_name for t in store.trials(store.key_id(key.to_dict()), env)]
    assert len(names) == len(set(names)) >= 12
