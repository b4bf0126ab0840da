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


def test_model_picks_cover_every_scheduler_with_runnable_configs():
    for arch in ("sm90", "sm100"):
        key = Key(arch, "dev", Problem(512, 5376, 21504))
        picks = model_picks(key, per_scheduler=2)
        scheds = space.knobs(arch)["scheduler"]
        assert sorted({c.scheduler for c in picks}) == sorted(scheds)
        assert len(picks) == 2 * len(scheds) == len(set(picks))
        for cfg in picks:
            space.check_problem(cfg, 512, 5376, 21504)


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
