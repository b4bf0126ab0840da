"""Calibration of the analytic model to a device's measured trials.

The datasheets leave some of the model's rates and costs to estimate
(`tuner.backends.model.CALIBRATION_BOUNDS`). `calibrate` fits those to the trials a
database holds for one device, using a fixed part of the device's families
(a family is a key without M: its keys share shapes, so holding out whole
families keeps near-copies of the held-out keys out of the fit), and scores
the model before and after on the families held out:

- per key, the Spearman rank correlation of predicted against measured time
  over the key's measured configs (the median over keys is reported);
- per key, how much slower the measured config the model ranks first is than
  the best measured config (the mean over keys);
- the mean relative error of the predicted times, and the largest factor by
  which the modelled cuBLAS misses the measured one.

The rank metrics count every key with at least MIN_CONFIGS measured configs.
They are also reported over a subset, by one stated rule: keys whose measured
times fall into at least MIN_CONFIGS levels more than NOISE (1 %) apart
(`levels`). The rule is there because many keys of a ladder hold one tile
under two or three schedulers, whose times agree to well under 1 % (the
same work; one config on the decode keys M = 1, 2, 4, 8 of a family, which
move the same bytes, agrees about as well), plus one or two
other tiles: the order inside such a tie is measurement noise, and a key
with fewer than three distinguishable levels has almost no order to
predict. The subset is a second row, never a replacement: the headline
numbers are over all keys, and the count of keys the rule leaves out is
printed beside them.

The fit is a bounded pattern search on the logarithms of the constants
(moves of one constant, or of two where none of one gains; no gradients:
the model has maxima, ceilings and a simulation in it) that
minimises the squared log error of the predicted times, centred per key (the
part that orders a key's configs) plus a smaller uncentred share (the
absolute level), plus two order terms: configs predicted ahead of the
measured best (by how much, times how much slower they are), and every pair
of a key's configs measured more than NOISE apart but predicted in the
other order (likewise weighted). A few parameters, each inside its stated
range, the whole families held out, and the held-out score keep it honest.
"""

from __future__ import annotations

import hashlib
import json
import math
import multiprocessing
import os
import tempfile
from dataclasses import asdict, dataclass, replace
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from kernels.space import GemmConfig, InvalidConfig
from tuner.key import Key
from tuner.backends.model import (
    CALIBRATION_BOUNDS, CALIBRATION_FORMAT, CALIBRATION_VERSION, DEVICES, MODEL_VERSION, DeviceModel,
    baseline_ms, device_model, predict_ms, read_calibrations,
)

BASELINE = "cublas"
# Every HOLDOUT_EVERY-th family (in an order fixed by a hash of its fields)
# is held out of the fit.
HOLDOUT_EVERY = 3
# Weight of the uncentred log error against the per-key centred one.
ABSOLUTE_WEIGHT = 0.25
# Weight of the pick term (a config predicted ahead of the measured best).
PICK_WEIGHT = 4.0
# Weight of the pair term: every two configs of a key whose measured times
# differ by more than NOISE, predicted in the wrong order.
PAIR_WEIGHT = 4.0
# Measured times closer than this (relative) are not told apart by the
# measurement (on the H100, one tile under different schedulers, and one
# config on decode keys that move the same bytes, agree to about 1 %).
NOISE = 0.01
# Coordinate search: the first step multiplies a constant by e^0.7 (about 2x),
# steps halve when no move of one or two constants improves, and stop below
# e^0.02 (2 %).
FIRST_STEP, LAST_STEP = 0.7, 0.02
MAX_EVALUATIONS = 6000
# Most processes a fit evaluates moves in (`fit_workers`).
FIT_WORKERS = 16
# Rank metrics need a key with at least this many measured configs.
MIN_CONFIGS = 3


@dataclass(frozen=True)
class KeySample:
    """The measured configs of one key (and cuBLAS's time, if measured)."""

    key: Key
    name: str
    configs: tuple[GemmConfig, ...]
    ms: np.ndarray
    cublas_ms: float | None


@dataclass(frozen=True)
class Score:
    keys: int                   # keys with enough configs for the rank metrics
    trials: int
    median_spearman: float
    mean_pick_slowdown: float   # fraction: 0.05 is 5 % slower than the best
    mean_abs_error: float       # mean |predicted / measured - 1| over trials
    cublas_max_ratio: float | None
    # The rank metrics again over the keys whose measured times fall into at
    # least MIN_CONFIGS levels more than NOISE apart (`levels`): a key whose
    # configs mostly tie within the measurement's noise has little order to
    # predict. `distinct_keys` says how many keys that leaves.
    distinct_keys: int = 0
    distinct_median_spearman: float = math.nan
    distinct_mean_pick_slowdown: float = math.nan


@dataclass(frozen=True)
class Calibration:
    device: str
    arch: str
    constants: dict[str, float]        # the fitted values
    before_constants: dict[str, float]
    train_families: list[str]
    heldout_families: list[str]
    before: dict[str, Score]           # "train" and "heldout"
    after: dict[str, Score]
    evaluations: int

    def to_json(self) -> dict:
        out = asdict(self)
        for which in ("before", "after"):
            out[which] = {part: asdict(s) for part, s in getattr(self, which).items()}
        return out


def devices(store) -> list[tuple[str, str]]:
    """(arch, device) of every device with trials, the model's own devices
    left out (fitting the model to its own output changes nothing)."""
    own = {d.name for d in DEVICES.values()}
    found = {(kt.key["arch"], kt.key["device"]) for kt in store.key_trials()}
    return sorted(d for d in found if d[1] not in own)


def samples(store, arch: str, device: str) -> list[KeySample]:
    """Every key of `device` with a measured config, its verified trials
    (but those under an L2 hint: the model does not price the hint, so they
    would count one kernel twice or fit constants to what it leaves out)."""
    out = []
    for kt in store.key_trials(arch=arch, device=device):
        configs, times, cublas = [], [], None
        for t in kt.trials:
            if not t.ok or t.ms is None or t.ms <= 0:
                continue
            if t.config is None:
                cublas = t.ms
                continue
            try:
                cfg = GemmConfig.from_dict(t.config)
            except (InvalidConfig, TypeError):  # a config of an older space
                continue
            if cfg.l2_hint != "normal":
                continue
            configs.append(cfg)
            times.append(t.ms)
        if configs:
            out.append(KeySample(Key.from_dict(kt.key), kt.name, tuple(configs), np.array(times), cublas))
    return out


def split(data: list[KeySample], every: int = HOLDOUT_EVERY) -> tuple[list[KeySample], list[KeySample]]:
    """(train, held out): whole families, every `every`-th of them held out."""
    families: dict[str, list[KeySample]] = {}
    for s in data:
        families.setdefault(_family_label(s), []).append(s)
    if len(families) < 2:
        raise ValueError(f"{len(families)} families measured: calibration needs at least 2 "
                         "(one to fit, one held out to check the fit)")
    order = sorted(families, key=lambda f: hashlib.sha256(f.encode()).hexdigest())
    held = set(order[::every])
    train = [s for f in order if f not in held for s in families[f]]
    heldout = [s for f in order if f in held for s in families[f]]
    return train, heldout


def predictions(sample: KeySample, device: DeviceModel) -> np.ndarray:
    """Predicted ms of each config of `sample` (NaN where the model cannot run it)."""
    out = np.empty(len(sample.configs))
    for i, cfg in enumerate(sample.configs):
        try:
            out[i] = predict_ms(sample.key.problem, cfg, device)
        except InvalidConfig:
            out[i] = math.nan
    return out


def spearman(x: np.ndarray, y: np.ndarray) -> float:
    """Spearman's rank correlation (ties get their average rank); NaN when
    either side is constant."""
    rx, ry = _ranks(x), _ranks(y)
    rx, ry = rx - rx.mean(), ry - ry.mean()
    denom = math.sqrt(float((rx * rx).sum() * (ry * ry).sum()))
    return float((rx * ry).sum() / denom) if denom else math.nan


def levels(ms: np.ndarray, noise: float = NOISE) -> int:
    """How many levels the measured times fall into, from the fastest up, a
    new level starting at the first time more than `noise` above the
    current level's first."""
    ordered = np.sort(ms)
    count, base = (1, ordered[0]) if len(ordered) else (0, 0.0)
    for v in ordered[1:]:
        if v > base * (1 + noise):
            count, base = count + 1, v
    return count


def score(data: list[KeySample], device: DeviceModel) -> Score:
    rhos, slowdowns, errors, cublas = [], [], [], []
    distinct_rhos, distinct_slowdowns = [], []
    for s in data:
        pred = predictions(s, device)
        ok = np.isfinite(pred)
        meas = s.ms[ok]
        pred = pred[ok]
        errors.extend(np.abs(pred / meas - 1.0))
        if len(meas) >= MIN_CONFIGS:
            rho = spearman(pred, meas)
            slowdown = float(meas[np.argmin(pred)] / meas.min() - 1.0)
            if not math.isnan(rho):
                rhos.append(rho)
            slowdowns.append(slowdown)
            if levels(meas) >= MIN_CONFIGS:
                if not math.isnan(rho):
                    distinct_rhos.append(rho)
                distinct_slowdowns.append(slowdown)
        if s.cublas_ms is not None:
            try:
                ratio = baseline_ms(s.key.problem, device) / s.cublas_ms
            except InvalidConfig:
                continue
            cublas.append(max(ratio, 1.0 / ratio))
    return Score(
        keys=len(slowdowns), trials=len(errors),
        median_spearman=float(np.median(rhos)) if rhos else math.nan,
        mean_pick_slowdown=float(np.mean(slowdowns)) if slowdowns else math.nan,
        mean_abs_error=float(np.mean(errors)) if errors else math.nan,
        cublas_max_ratio=max(cublas) if cublas else None,
        distinct_keys=len(distinct_slowdowns),
        distinct_median_spearman=float(np.median(distinct_rhos)) if distinct_rhos else math.nan,
        distinct_mean_pick_slowdown=float(np.mean(distinct_slowdowns)) if distinct_slowdowns else math.nan,
    )


def fit(data: list[KeySample], base: DeviceModel, workers: int | None = None) -> tuple[DeviceModel, int]:
    """`base` with the calibrated constants fitted to `data`; and how many
    times the model was evaluated over the data (as a search of one process
    would: `workers` processes evaluate the next moves at once and take the
    first in order that gains, so the fit is the same for any number)."""
    x = {name: _clip(name, float(getattr(base, name))) for name in CALIBRATION_BOUNDS}
    names = list(CALIBRATION_BOUNDS)
    singles = [{name: d} for name in names for d in (1.0, -1.0)]
    # Constants that trade off against each other (MMA efficiency against
    # the per-wgmma and per-k-block costs: all scale the mainloop) make
    # diagonal valleys where no single move gains; pairs are tried there.
    pairs = [{a: da, b: db} for i, a in enumerate(names) for b in names[i + 1:]
             for da in (1.0, -1.0) for db in (1.0, -1.0)]
    with _Losses(data, base, workers or fit_workers()) as losses:
        (best,) = losses.evaluate([x])
        evaluations = 1
        step = FIRST_STEP
        while step >= LAST_STEP and evaluations < MAX_EVALUATIONS:
            improved = False
            for moves in (singles, pairs):
                trials = [t for t in ({**x, **{n: _clip(n, x[n] * math.exp(d * step)) for n, d in move.items()}}
                                      for move in moves) if t != x]
                found, evaluations = losses.first_below(trials, best, evaluations)
                if found is not None:
                    x, best = trials[found[0]], found[1]
                    improved = True
                if improved or evaluations >= MAX_EVALUATIONS:
                    break
            if not improved:
                step /= 2
    return replace(base, **x), evaluations


def fit_workers() -> int:
    """Processes a fit evaluates the model in: the host's cores, at most FIT_WORKERS."""
    return max(1, min(os.cpu_count() or 1, FIT_WORKERS))


# What the fit's worker processes evaluate (set before they fork).
_FORKED: tuple[list[KeySample], DeviceModel] | None = None


def _forked_loss(values: dict[str, float]) -> float:
    data, base = _FORKED
    return _loss(data, replace(base, **values))


class _Losses:
    """The fit's loss over `data` for sets of constants, in `workers` forked
    processes (in this one when 1)."""

    def __init__(self, data: list[KeySample], base: DeviceModel, workers: int):
        self.data, self.base, self.workers = data, base, workers
        self.pool = None

    def __enter__(self):
        global _FORKED
        if self.workers > 1:
            _FORKED = (self.data, self.base)
            self.pool = multiprocessing.get_context("fork").Pool(self.workers)
        return self

    def __exit__(self, *exc):
        global _FORKED
        if self.pool is not None:
            self.pool.terminate()
            self.pool.join()
        _FORKED = None

    def evaluate(self, trials: list[dict[str, float]]) -> list[float]:
        if self.pool is None:
            return [_loss(self.data, replace(self.base, **t)) for t in trials]
        return self.pool.map(_forked_loss, trials)

    def first_below(self, trials: list[dict[str, float]], best: float, evaluations: int):
        """((index, loss) of the first of `trials` whose loss is below `best`,
        or None; the evaluation count a one-by-one search would reach)."""
        for start in range(0, len(trials), self.workers):
            for i, value in enumerate(self.evaluate(trials[start:start + self.workers]), start):
                if value < best:
                    return (i, value), evaluations + i + 1
        return None, evaluations + len(trials)


def calibrate(stores: list, arch: str, device: str, every: int = HOLDOUT_EVERY) -> Calibration:
    """Fit `device`'s constants on its training families (the trials of
    every store together); score before and after."""
    data = [s for store in stores for s in samples(store, arch, device)]
    if not data:
        raise ValueError(f"no measured trials of {device} ({arch}) in the database")
    train, heldout = split(data, every)
    base = DEVICES[arch]
    fitted, evaluations = fit(train, base)
    parts = {"train": train, "heldout": heldout}
    return Calibration(
        device=device, arch=arch,
        constants={n: _round(getattr(fitted, n)) for n in CALIBRATION_BOUNDS},
        before_constants={n: float(getattr(base, n)) for n in CALIBRATION_BOUNDS},
        train_families=sorted({_family_label(s) for s in train}),
        heldout_families=sorted({_family_label(s) for s in heldout}),
        before={p: score(d, base) for p, d in parts.items()},
        after={p: score(d, fitted) for p, d in parts.items()},
        evaluations=evaluations,
    )


def save(path: Path, cal: Calibration) -> None:
    """Store `cal` as its device's entry of the calibration file at `path`
    (other devices' entries are kept; so are the device's quick-probe
    figures, which other devices scale from), atomically."""
    old = read_calibrations(path).get(cal.device, {})
    save_entry(path, cal.device, {
        "arch": cal.arch,
        "constants": cal.constants,
        "model_version": MODEL_VERSION,
        "fitted_at": _now(),
        "heldout_families": cal.heldout_families,
        "before": {p: asdict(s) for p, s in cal.before.items()},
        "after": {p: asdict(s) for p, s in cal.after.items()},
        **{k: old[k] for k in ("probe", "driver") if k in old},
    })


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


def quick_entry(arch: str, driver: dict, probe: dict, calibrations: dict[str, dict]) -> tuple[dict, str]:
    """The calibration entry `tuner calibrate --quick` stores for the device
    the driver figures `driver` and the probe figures `probe` describe
    (`tuner.backends.probe`), and how it was made.

    A device with a fitted entry keeps its constants; the probe figures are
    added to it, so that other devices of its arch can scale from it. Any
    other device takes the constants of such a reference (how the pool's
    kernels behave on the arch: pipeline overheads, exposed shares) and the
    rates scaled by what the probe measured on both: DRAM bandwidth by the
    DRAM's peak the drivers report (the copies' bandwidth where a driver
    gives none), the clock by the tensor-core rate per SM, L2 bandwidth with
    the clock, launch cost by the launches'. Without a reference: the arch's
    datasheet constants, with the driver's DRAM peak (else the copies') and
    the measured tensor-core rate taken as the rates the model's
    efficiencies reach.

    The DRAM peak rather than the copy because a GEMM reads: on the H200
    against the H100 the copies ran 1.12x as fast, the pool's few-row
    configs 1.37x and cuBLAS's 1.50x (medians over the same keys and
    configs), the drivers' peaks being 1.44x apart.
    """
    name = driver["name"]
    mine = calibrations.get(name)
    common = {"probe": probe, "driver": driver}
    if mine is not None and mine.get("source") != "quick" and mine.get("model_version") == MODEL_VERSION:
        return mine | common, "kept the fitted constants; added the probe figures"
    refs = [(n, e) for n, e in calibrations.items()
            if n != name and e.get("arch") == arch and e.get("source") != "quick" and "probe" in e
            and e.get("model_version") == MODEL_VERSION]
    base = DEVICES[arch]
    sms = int(driver.get("sms") or base.sms)
    facts = {"sms": sms, "l2_bytes": int(driver.get("l2_bytes") or base.l2_bytes),
             "smem_per_sm": int(driver.get("smem_per_sm") or base.smem_per_sm)}
    if refs:
        ref_name, ref = refs[0]
        ref_model = device_model(arch, ref_name)
        rp = ref["probe"]
        clock = ref_model.clock_hz * (probe["mma_tflops"] / sms) / (rp["mma_tflops"] / ref_model.sms)
        ref_peak = ref.get("driver", {}).get("hbm_bw")
        dram = (driver["hbm_bw"] / ref_peak if driver.get("hbm_bw") and ref_peak
                else probe["copy_gbps"] / rp["copy_gbps"])
        facts |= {"hbm_bw": ref_model.hbm_bw * dram, "clock_hz": clock}
        constants = dict(ref["constants"])
        constants["l2_bw"] = ref_model.l2_bw * clock / ref_model.clock_hz
        constants["launch_us"] = ref_model.launch_us * probe["launch_us"] / rp["launch_us"]
        how = f"scaled from {ref_name}"
    else:
        facts |= {"hbm_bw": driver.get("hbm_bw") or probe["copy_gbps"] * 1e9 / base.hbm_efficiency,
                  "clock_hz": probe["mma_tflops"] * 1e12 / (sms * base.flops_per_clk_sm) / base.mma_efficiency}
        constants = {"launch_us": probe["launch_us"]}
        how = f"the {arch} datasheet model at the measured rates (no calibrated {arch} device)"
    for field, value in constants.items():
        lo, hi = CALIBRATION_BOUNDS[field]
        constants[field] = min(hi, max(lo, value))
    return {"arch": arch, "source": "quick", "facts": facts, "constants": constants,
            "model_version": MODEL_VERSION, "fitted_at": _now(), "based_on": how, **common}, how


def save_entry(path: Path, device: str, entry: dict) -> None:
    """Store `entry` as `device`'s in the calibration file at `path` (other
    devices' entries are kept), atomically."""
    devices_ = read_calibrations(path)
    devices_[device] = entry
    text = json.dumps({"format": CALIBRATION_FORMAT, "version": CALIBRATION_VERSION,
                       "devices": dict(sorted(devices_.items()))}, indent=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(text + "\n")
    os.replace(tmp, path)


def _loss(data: list[KeySample], device: DeviceModel) -> float:
    centred = absolute = pick = pairs = 0.0
    count = 0
    for s in data:
        pred = predictions(s, device)
        ok = np.isfinite(pred)
        if not ok.any():
            continue
        lp, lm = np.log(pred[ok]), np.log(s.ms[ok])
        r = lp - lm
        centred += float(((r - r.mean()) ** 2).sum())
        absolute += float((r * r).sum())
        # The model's pick: a config predicted faster than the measured best
        # costs what it is slower by, times how far ahead it was predicted.
        best = int(np.argmin(lm))
        pick += float((np.maximum(0.0, lp[best] - lp) * (lm - lm[best])).sum())
        # Every pair the measurement orders, ordered the other way: the gap
        # it is predicted wrong by, times the measured gap; per config.
        gap = lm[None, :] - lm[:, None]          # > 0: i measured faster than j
        wrong = np.maximum(0.0, lp[:, None] - lp[None, :])
        told = gap > math.log1p(NOISE)
        if len(lm) > 1:
            pairs += float((wrong * gap)[told].sum()) / (len(lm) - 1)
        count += int(ok.sum())
    return (centred + ABSOLUTE_WEIGHT * absolute + PICK_WEIGHT * pick + PAIR_WEIGHT * pairs) / max(count, 1)


def _ranks(x: np.ndarray) -> np.ndarray:
    order = np.argsort(x, kind="stable")
    ranks = np.empty(len(x))
    ranks[order] = np.arange(len(x), dtype=float)
    values = x[order]
    i = 0
    while i < len(x):
        j = i
        while j + 1 < len(x) and values[j + 1] == values[i]:
            j += 1
        ranks[order[i:j + 1]] = (i + j) / 2
        i = j + 1
    return ranks


def _family_label(s: KeySample) -> str:
    """The family's shape, readable: N x K (groups, held SMs), dtypes, layout."""
    p = s.key.problem
    return f"{p.label().split('x', 1)[1]} {p.dtype_in}>{p.dtype_out} {p.layout}"


def _clip(name: str, value: float) -> float:
    lo, hi = CALIBRATION_BOUNDS[name]
    return min(hi, max(lo, value))


def _round(value: float) -> float:
    return float(f"{value:.4g}")
