"""`tuner calibrate`: a database measured by a model whose constants were moved
must give them back; the model then predicts that device with them."""

import json
import math
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from bench.probes.model_bias import errors, table
from db.store import Store
from kernels.space import GemmConfig
from tuner.backends.calibration import spearman
from tuner.key import Key, Problem
from tuner.backends.model import CALIBRATION_ENV, H100, ModelBackend, predict_ms, read_calibrations
from tuner.search.study import Budget, tune_key

ROOT = Path(__file__).resolve().parents[1]
# The "real" device: constants the datasheet model does not have.
TRUTH = dict(mma_efficiency=0.72, hbm_efficiency=0.78, kblock_overhead_clk=160, load_latency_us=1.0,
             launch_us=3.5, atomic_claim_us=2.0, epilogue_exposed=0.85)
DEVICE = "H100-perturbed"
FAMILIES = ((4096, 4096), (2048, 1024), (8192, 5376), (1024, 512), (3072, 3072), (5376, 21504))


def _measure(db: Path, families, ms, trials: int) -> Path:
    backend = ModelBackend("sm90", device=replace(H100, name=DEVICE, **TRUTH))
    store = Store(str(db))
    for n, k in families:
        for m in ms:
            tune_key(Key("sm90", DEVICE, Problem(m, n, k)), backend, store, Budget(trials=trials), name=f"f{n}x{k}")
    store.close()
    return db


@pytest.fixture(scope="module")
def measured_db(tmp_path_factory):
    return _measure(tmp_path_factory.mktemp("cal") / "t.db", FAMILIES, (16, 2048), 20)


@pytest.fixture(scope="module")
def small_db(tmp_path_factory):
    """Enough for a fit to run and print (a fit's time grows with the trials)."""
    return _measure(tmp_path_factory.mktemp("cal") / "s.db", FAMILIES[:3], (2048,), 8)


def calibrate(db, cal_file, *args):
    proc = subprocess.run(
        [sys.executable, "-m", "tuner.cli", "calibrate", "--db", str(db), *args], capture_output=True, text=True,
        cwd=ROOT, env={**os.environ, CALIBRATION_ENV: str(cal_file), "COLUMNS": "100"},
    )
    return proc


def test_calibrate_recovers_moved_constants_and_the_model_uses_them(measured_db, tmp_path, monkeypatch):
    cal_file = tmp_path / "calibration.json"
    proc = calibrate(measured_db, cal_file, "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (result,) = json.loads(proc.stdout)
    assert result["device"] == DEVICE and result["heldout_families"]
    assert not set(result["heldout_families"]) & set(result["train_families"])
    before, after = result["before"]["heldout"], result["after"]["heldout"]
    # The datasheet model is far off this device; the fitted one is not, on
    # families it never saw.
    assert before["mean_abs_error"] > 0.15
    assert after["mean_abs_error"] < 0.05
    # Its ranking holds the 0.97 asked of the model and stays within 0.01 of
    # the datasheet's, a median over four held-out keys that moves with the
    # trials the search draws (0.97538 against 0.97541 on one sample, 0.9729
    # against 0.9786 once swap_ab tiles reached 128 rows); the configs it
    # would pick are no slower than the datasheet's.
    assert after["median_spearman"] >= max(0.97, before["median_spearman"] - 0.01)
    assert after["mean_pick_slowdown"] <= before["mean_pick_slowdown"] + 1e-9
    # Constants the trials pin down come back near the truth.
    fitted = result["constants"]
    for name in ("launch_us", "atomic_claim_us", "load_latency_us"):
        assert abs(math.log(fitted[name] / TRUTH[name])) < math.log(1.35), (name, fitted[name])

    stored = read_calibrations(cal_file)[DEVICE]
    assert stored["constants"] == fitted and stored["arch"] == "sm90"
    monkeypatch.setenv(CALIBRATION_ENV, str(cal_file))
    cfg = GemmConfig(scheduler="dynamic_persistent", tile_m=128, tile_n=128, stages=4)
    p = Problem(512, 2048, 1024)
    truth = predict_ms(p, cfg, replace(H100, **TRUTH))
    calibrated = predict_ms(Key("sm90", DEVICE, p), cfg)
    assert calibrated == predict_ms(p, cfg, replace(H100, **fitted))
    assert abs(calibrated / truth - 1) < 0.05 < abs(predict_ms(p, cfg, H100) / truth - 1)
    # Another device keeps the datasheet constants.
    assert predict_ms(Key("sm90", "some other GPU", p), cfg) == predict_ms(p, cfg, H100)


def test_calibrate_prints_a_table_and_rejects_what_it_cannot_fit(small_db, tmp_path):
    cal_file = tmp_path / "calibration.json"
    proc = calibrate(small_db, cal_file)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "median Spearman" in proc.stdout and "launch_us" in proc.stdout
    assert all(len(line) <= 80 for line in proc.stdout.splitlines() if not line.startswith("wrote "))
    assert DEVICE in read_calibrations(cal_file)
    proc = calibrate(small_db, cal_file, "--device", "no such GPU")
    assert proc.returncode == 2 and "no measured trials of 'no such GPU'" in proc.stdout


def test_calibrate_fits_the_trials_of_several_databases_together(small_db, tmp_path):
    other = _measure(tmp_path / "other.db", FAMILIES[3:5], (2048,), 8)
    proc = calibrate(small_db, tmp_path / "calibration.json", "--also", str(other), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (fit,) = json.loads(proc.stdout)
    families = fit["train_families"] + fit["heldout_families"]
    assert len(families) == 5 and any(f.startswith("1024x512") for f in families)
    proc = calibrate(small_db, tmp_path / "calibration.json", "--also", str(tmp_path / "missing.db"))
    assert proc.returncode == 2 and "missing.db" in proc.stdout


@pytest.mark.parametrize("content, words", [
    ('{"format": "other", "version": 1, "devices": {}}', "format"),
    ('{"format": "gemm-tuner-calibration", "version": 9, "devices": {}}', "version 9"),
    ('{"format": "gemm-tuner-calibration", "version": 1, "devices": {"X": {"arch": "sm90", '
     '"constants": {"sms": 100}}}}', "devices.X.constants.sms"),
    ('{"format": "gemm-tuner-calibration", "version": 1, "devices": {"X": {"arch": "sm90", '
     '"constants": {"launch_us": 1e9}}}}', "devices.X.constants.launch_us"),
    ('{"format": "gemm-tuner-calibration", "version": 1, "devices": {"X": {"arch": "sm90", '
     '"facts": {"sms": -3}, "constants": {}}}}', "devices.X.facts.sms"),
    ('{"format": "gemm-tuner-calibration", "version": 1, "devices": {"X": {"arch": "sm90", '
     '"facts": {"launch_us": 2}, "constants": {}}}}', "devices.X.facts.launch_us"),
    ("not json", "not a calibration file"),
])
def test_a_bad_calibration_file_is_an_error_naming_file_and_field(tmp_path, content, words):
    path = tmp_path / "c.json"
    path.write_text(content)
    with pytest.raises(ValueError, match=words) as info:
        read_calibrations(path)
    assert str(path) in str(info.value)


def test_spearman_matches_the_textbook_on_ties_and_orders():
    assert spearman(np.array([1.0, 2, 3, 4]), np.array([10.0, 20, 30, 40])) == pytest.approx(1.0)
    assert spearman(np.array([1.0, 2, 3, 4]), np.array([4.0, 3, 2, 1])) == pytest.approx(-1.0)
    # ranks with ties averaged: x -> 1, 2.5, 2.5, 4; y -> 1, 2, 3, 4
    assert spearman(np.array([1.0, 2, 2, 3]), np.array([1.0, 2, 3, 4])) == pytest.approx(0.9486833, abs=1e-6)
    assert math.isnan(spearman(np.array([1.0, 1, 1]), np.array([1.0, 2, 3])))


# What `tuner.backends.probe` reports: the driver's figures and the probe's.
DRIVER = {"name": "H100-perturbed", "sms": 132, "l2_bytes": 50 * 2**20, "smem_per_sm": 228 * 1024,
          "clock_hz": 1.98e9, "hbm_bw": 3.35e12, "memory_bytes": 80 * 2**30}
PROBE = {"copy_gbps": 2400.0, "mma_tflops": 790.0, "launch_us": 1.1, "seconds": 0.3}


def test_quick_calibration_keeps_a_fitted_entry_and_scales_another_device_from_it(tmp_path, monkeypatch):
    from tuner.backends.calibration import quick_entry, save_entry
    from tuner.backends.model import MODEL_VERSION, device_model, model_source

    cal_file = tmp_path / "calibration.json"
    monkeypatch.setenv(CALIBRATION_ENV, str(cal_file))
    fitted = {"arch": "sm90", "constants": dict(TRUTH), "model_version": MODEL_VERSION,
              "fitted_at": "2026-11-01T00:00:00+00:00"}
    # The fitted device itself: its constants stay, the probe joins them.
    entry, how = quick_entry("sm90", DRIVER, PROBE, {DEVICE: fitted})
    assert entry["constants"] == TRUTH and entry["probe"] == PROBE and "kept" in how
    save_entry(cal_file, DEVICE, entry)
    ref = device_model("sm90", DEVICE)
    assert "fitted calibration of H100-perturbed" in model_source("sm90", DEVICE)
    # Another device of the arch, twice the DRAM peak (its copies only 1.2x
    # as fast, as HBM3e's are), 10 % more tensor rate per SM on 10 % fewer
    # SMs: the reference's constants, its rates scaled, DRAM by the peaks.
    other = DRIVER | {"name": "Other", "sms": 119, "l2_bytes": 60 * 2**20, "hbm_bw": 6.7e12}
    figures = PROBE | {"copy_gbps": 2880.0, "mma_tflops": 790.0 * 1.1 * 119 / 132}
    without_peak, _ = quick_entry("sm90", other | {"hbm_bw": None}, figures, read_calibrations(cal_file))
    assert without_peak["facts"]["hbm_bw"] == pytest.approx(1.2 * ref.hbm_bw)
    entry, how = quick_entry("sm90", other, figures, read_calibrations(cal_file))
    save_entry(cal_file, "Other", entry)
    dev = device_model("sm90", "Other")
    assert how == f"scaled from {DEVICE}" and entry["source"] == "quick"
    assert dev.sms == 119 and dev.l2_bytes == 60 * 2**20
    assert dev.hbm_bw == pytest.approx(2 * ref.hbm_bw) and dev.clock_hz == pytest.approx(1.1 * ref.clock_hz)
    assert dev.kblock_overhead_clk == ref.kblock_overhead_clk and dev.l2_bw == pytest.approx(1.1 * ref.l2_bw)
    assert "quick calibration of Other" in model_source("sm90", "Other")
    # The same device under another name scales to the same model: a quick
    # entry predicts what its reference predicts.
    entry, _ = quick_entry("sm90", DRIVER | {"name": "Twin"}, PROBE, read_calibrations(cal_file))
    save_entry(cal_file, "Twin", entry)
    key = Key("sm90", "x", Problem(512, 8192, 5376))
    twin = device_model("sm90", "Twin")
    for cfg in (GemmConfig(), GemmConfig(tile_n=256, stages=3, cluster_m=2)):
        assert predict_ms(key, cfg, twin) == pytest.approx(predict_ms(key, cfg, ref), rel=1e-6)
    # The file holds what `tuner calibrate` reads back.
    assert set(read_calibrations(cal_file)) == {DEVICE, "Other", "Twin"}


def test_quick_calibration_without_a_reference_takes_the_measured_rates(tmp_path, monkeypatch):
    from tuner.backends.calibration import quick_entry
    from tuner.backends.model import CALIBRATION_BOUNDS, DEVICES

    entry, how = quick_entry("sm90", DRIVER, PROBE | {"launch_us": 50.0}, {})
    base = DEVICES["sm90"]
    assert "datasheet" in how
    # The DRAM peak is the driver's, as the datasheet model's is the
    # datasheet's; the copy stands in where the driver has none.
    assert entry["facts"]["hbm_bw"] == DRIVER["hbm_bw"]
    bare, _ = quick_entry("sm90", DRIVER | {"hbm_bw": None}, PROBE, {})
    assert bare["facts"]["hbm_bw"] * base.hbm_efficiency == pytest.approx(2400e9)
    # The model's efficiency applied to the tensor rate gives what was measured.
    peak = entry["facts"]["sms"] * base.flops_per_clk_sm * entry["facts"]["clock_hz"]
    assert peak * base.mma_efficiency == pytest.approx(790e12)
    # A probe figure out of the model's range is held at its bound.
    assert entry["constants"]["launch_us"] == CALIBRATION_BOUNDS["launch_us"][1]


def test_an_uncalibrated_device_is_modelled_with_its_driver_figures():
    from tuner.backends.model import DEVICES, device_model, model_source, register_facts

    register_facts("Uncalibrated GPU", DRIVER | {"sms": 114, "hbm_bw": 2.0e12})
    dev = device_model("sm90", "Uncalibrated GPU")
    assert (dev.sms, dev.hbm_bw, dev.clock_hz) == (114, 2.0e12, 1.98e9)
    assert dev.mma_efficiency == DEVICES["sm90"].mma_efficiency
    assert "driver's figures" in model_source("sm90", "Uncalibrated GPU")
    assert "not calibrated" in model_source("sm90", "Never seen")


def test_quick_calibration_rebuilds_an_entry_from_recorded_figures(tmp_path, monkeypatch):
    """`calibrate --quick --figures`: no GPU, the recorded driver and probe
    figures scaled from the fitted reference as a probe's would be."""
    from tuner.backends.calibration import save_entry
    from tuner.backends.model import MODEL_VERSION, device_model

    cal_file = tmp_path / "calibration.json"
    save_entry(cal_file, DEVICE, {"arch": "sm90", "constants": dict(TRUTH), "model_version": MODEL_VERSION,
                                  "fitted_at": "2026-11-01T00:00:00+00:00", "probe": PROBE, "driver": DRIVER})
    recorded = tmp_path / "quick.json"
    recorded.write_text(json.dumps({"device": "Faster", "driver": DRIVER | {"name": "Faster", "hbm_bw": 5.025e12},
                                    "probe": PROBE | {"copy_gbps": 2700.0}}))
    proc = calibrate("unused.db", cal_file, "--quick", "--figures", str(recorded), "--json")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert json.loads(proc.stdout)["how"] == f"scaled from {DEVICE}"
    monkeypatch.setenv(CALIBRATION_ENV, str(cal_file))
    assert device_model("sm90", "Faster").hbm_bw == pytest.approx(1.5 * device_model("sm90", DEVICE).hbm_bw)

    recorded.write_text(json.dumps({"driver": DRIVER, "probe": {"copy_gbps": 1.0}}))
    before = cal_file.read_text()
    proc = calibrate("unused.db", cal_file, "--quick", "--figures", str(recorded))
    assert proc.returncode == 2 and "probe.mma_tflops missing" in proc.stdout
    assert cal_file.read_text() == before
    proc = calibrate("unused.db", cal_file, "--figures", str(recorded))
    assert proc.returncode == 2 and "--figures goes with --quick" in proc.stdout


def test_a_fit_in_several_processes_is_the_fit_of_one(small_db, monkeypatch):
    """Moves are evaluated a batch at a time and the first that gains taken:
    the constants and the evaluation count do not depend on the processes."""
    import tuner.backends.calibration as cal

    monkeypatch.setattr(cal, "MAX_EVALUATIONS", 120)
    store = Store(str(small_db), writer=False)
    data = cal.samples(store, "sm90", DEVICE)
    store.close()
    one, n_one = cal.fit(data, H100, workers=1)
    three, n_three = cal.fit(data, H100, workers=3)
    assert n_one == n_three >= 120
    assert one == three and one != H100


def test_model_bias_names_the_config_kind_a_device_prices_differently(tmp_path):
    # The "device" is the model with one cost moved that only split-K configs
    # pay: against the datasheet model they measure slower than predicted,
    # the configs without a split do not.
    backend = ModelBackend("sm90", device=replace(H100, name=DEVICE, semaphore_us=H100.semaphore_us + 6.0))
    store = Store(str(tmp_path / "b.db"))
    for n, k in ((4096, 14336), (1024, 8192)):
        for m in (1, 16):
            tune_key(Key("sm90", DEVICE, Problem(m, n, k)), backend, store, Budget(trials=24), name=f"f{n}x{k}")
    store.close()
    rows = {r["group"]: r for r in table(errors([str(tmp_path / "b.db")], DEVICE, m_max=128))}
    split = [r for g, r in rows.items() if g.startswith("split_k=") and g != "split_k=1"]
    assert split, rows.keys()
    assert all(r["mean"] < -0.05 for r in split), split
    assert abs(rows["split_k=1"]["mean"]) < 0.03
