"""The search: one Optuna study per key, winners into the store.

A measuring backend's study lives in the same database as our tables, named
from the key and the environment it measures under, so an interrupted run
resumes where it stopped and several processes (or hosts, on PostgreSQL) can
share one key's trials. A `bulk` backend's (the model's) is the same seeded
study kept in memory: its measurements cost less than storing them, so the
key's trials are stored together when it is done, and an interrupted key is
searched again (it takes well under a second). Every measured config is also
recorded as a trial row of our own: a config is never timed twice for a key,
and the winner is chosen from verified rows only.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
import math
import time
import warnings
from dataclasses import dataclass, replace
from typing import Callable, Sequence

import optuna

from db.store import Store, TrialView, WinnerView
from kernels import space
from kernels.space import GemmConfig, InvalidConfig
from tuner.key import Key
from tuner.backends.measure import Backend

BASELINE = "cublas"
# Nearest tuned keys whose winners seed a new study.
WARM_START_KEYS = 3
# A measured (not modelled) study starts from the configs the analytic model
# ranks best: this many. The model first ranks every tile, split-K and
# consumer shape (static scheduler, no cluster), then every scheduler and
# cluster of the MODEL_SHORTLIST best shapes (other knobs at sound values).
MODEL_PICKS = 6
MODEL_SHORTLIST = 24
# The warm start's wave-fit tile: the largest tile (no smaller than the
# default 128x128) that fills whole waves within WAVE_FIT_SLACK of the best
# filling tile. Smaller tiles fill waves more easily but lose per-FLOP
# efficiency; finer trade-offs are the model's to weigh. A width of an odd
# number of 8-row atoms that fills better still joins it (`_wave_fit_configs`).
WAVE_FIT_MIN_AREA = 128 * 128
# Cooperative tiles of more fp32 accumulators a consumer thread than this
# hold 3 stages at most and ran behind on the H100 (27B, M = 512 to 8192:
# 256x168 and 256x176 0.49-1.03x cuBLAS, 128-row pingpong tiles of those
# widths 0.87-1.07x), so the wave fit keeps to the others; pingpong twins
# (one tile a warpgroup) join it.
WAVE_FIT_MAX_ACC = 128
WAVE_FIT_SLACK = 0.05
# The search re-times the cluster neighbours of the best config of this many
# tile shapes, and of the wave-fit tiles (the best config's scheduler variants
# too): a tile whose 1x1 trial straggles may lead once multicast halves its
# L2 traffic (H100, 27B at M = 512: 128x176 fills one wave, and its 1x1
# trials took 0.224-0.229 ms on down where 2x1 took 0.164).
NEIGHBOUR_SHAPES = 3
# The final interleaved round times the fastest config of this many shapes
# (tile, swap, K split) beside each scheduler's fastest: one-by-one trials
# drift with the GPU's power state (H100 at its 700 W cap, one session:
# cuBLAS took 2.554 ms alone after an idle spell, 2.684 interleaved with
# our kernels, as sustained GEMMs held the clock at 1.2-1.7 GHz), so the
# shape that led them need not lead the round.
FINAL_SHAPES = 4
# Keys of at most this many rows start from swap_ab configs (`swap_seeds`):
# every M that one swap_ab activation tile holds.
SWAP_SEED_MAX_M = space.SWAP_AB_MAX_ROWS
# Pruned (invalid) samples are cheap but not free: give up on a key after this
# many samples per measured trial of budget.
MAX_SAMPLES_PER_TRIAL = 20
# A searched key whose cuBLAS call takes at least LONG_KEY_MS samples
# LONG_KEY_TRIALS times its budget's trials: such keys hold most of a model's
# GEMM time, and their leads came late in the search (H100, 27B, 24 trials
# against 14: gate_up at M = 8192 went from cuBLAS to 1.031x it with a
# pingpong 128x192 tile, at 2048 from 1.021x to 1.047x), while 24 trials on
# every key took the cold tune past ten minutes.
LONG_KEY_MS = 0.5
LONG_KEY_TRIALS = 12 / 7

# Failed trials are recorded with their errors in our trial table; Optuna's
# per-trial warning with a traceback would only bury the progress bars.
optuna.logging.set_verbosity(optuna.logging.ERROR)
# TPE's `group` option is marked experimental; its warning says nothing to a user.
warnings.filterwarnings("ignore", category=optuna.exceptions.ExperimentalWarning)


@dataclass(frozen=True)
class Budget:
    """Trials per key; optionally seconds per key, and `until`, a
    `time.monotonic()` instant by which the work this budget is given
    should be done (`tuner tune --budget-s`)."""

    trials: int = 40
    seconds: float | None = None
    until: float | None = None

    def timeout(self) -> float | None:
        """Seconds a key's search may take from now (None: no limit)."""
        limits = [t for t in (self.seconds, self.until and max(0.0, self.until - time.monotonic())) if t is not None]
        return min(limits) if limits else None

    def share(self, fraction: float) -> Budget:
        """This budget with `until` moved to `fraction` of the time left (as is, without one)."""
        if self.until is None:
            return self
        now = time.monotonic()
        return replace(self, until=now + max(0.0, self.until - now) * fraction)

    def left(self) -> float:
        """Seconds to `until` (infinite without one)."""
        return math.inf if self.until is None else self.until - time.monotonic()


@dataclass(frozen=True)
class Tick:
    """A key's progress, as `on_trial` hears it: trials done of `total`, and
    the best verified config's speedup over cuBLAS so far (None before one)."""

    done: int
    total: int
    best_speedup: float | None = None


@dataclass(frozen=True)
class Outcome:
    key: Key
    winner: WinnerView
    skipped: bool


class _Failed(Exception):
    """A config that compiled but failed: Optuna records the trial as FAIL."""


def tune_key(
    key: Key, backend: Backend, store: Store, budget: Budget, *, name: str = "",
    force: bool = False, on_trial: Callable[[Tick], None] | None = None,
    seeds: Sequence[GemmConfig] = (), explore: bool = True, variants: bool = True, sample: bool = True,
) -> Outcome:
    """Search the pool for `key`, store and return the winner.

    A new study first measures `seeds`, then (with `explore`) the winners of
    nearby tuned keys and (measured backends) the model's picks, then (with
    `sample`) samples: a key searched again with `force` goes on sampling
    where its study stopped. With `variants`, the best config's neighbours
    are measured before the final round (`_pick_winner`).

    A key whose winner was measured under the backend's current versions is
    skipped unless `force`.

    A `bulk` backend's study runs in memory and the key's new trials are
    stored in one transaction before its winner: on the model, storing each
    trial and the study's round trips to the database took nearly all of a
    tune's time. The study samples the same configs either way (the same
    seeded sampler over the same history), so the winners are the same.
    """
    versions = backend.versions()
    env_id = store.environment(backend.name, key.arch, key.device, versions)
    key_dict = key.to_dict()
    key_id = store.key_id(key_dict, name)
    current = store.winner(key_dict)
    if is_current(current, backend) and not force:
        if on_trial:
            on_trial(Tick(current.trials, current.trials, current.speedup))
        return Outcome(key, current, skipped=True)

    bulk = getattr(backend, "bulk", False)
    measured = {t.config_name: t for t in store.trials(key_id, env_id)}
    unstored: list[dict] = []  # a bulk backend's new trials, stored with the winner

    def measure(cfg: GemmConfig | None) -> TrialView:
        config_name = cfg.name() if cfg else BASELINE
        if config_name not in measured:
            m = backend.measure(key, cfg) if cfg else backend.baseline(key)
            row = dict(
                config_name=config_name, scheduler=cfg.scheduler if cfg else BASELINE,
                config=cfg.to_dict() if cfg else None, ok=m.ok, ms=m.ms, rel_err=m.rel_err, error=m.error,
                detail=m.detail,
            )
            if bulk:
                unstored.append(row)
            else:
                store.record_trials(key_id, env_id, [row])
            measured[config_name] = TrialView(config_name, row["scheduler"], row["config"], m.ok, m.ms, m.error)
        return measured[config_name]

    def best_speedup() -> float | None:
        times = [t.ms for name, t in measured.items() if t.ok and name != BASELINE]
        return baseline.ms / min(times) if times else None

    baseline = measure(None)
    if not baseline.ok:
        raise RuntimeError(f"{key.study_name()}: the cuBLAS baseline failed: {baseline.error}")
    trials = budget.trials
    if explore and baseline.ms >= LONG_KEY_MS:
        trials = round(trials * LONG_KEY_TRIALS)

    # A key's study has one writer at a time (its family's lease), so TPE
    # need not read other processes' running trials as it samples: without
    # the constant liar it reads the study once a trial instead of once per
    # group of parameters, each read a round of queries on the RDB storage
    # (half of a model-backend tune's time on a 2-core host, before the model
    # searched in memory).
    storage = optuna.storages.InMemoryStorage() if bulk else store.optuna_storage()
    study = optuna.create_study(
        study_name=f"{key.study_name()}:{_env_tag(backend.name, versions, key.arch)}",
        storage=storage,
        sampler=optuna.samplers.TPESampler(
            seed=_seed(key.study_name()), multivariate=True, group=True, constant_liar=False,
            n_startup_trials=min(10, trials),
        ),
        direction="minimize",
        load_if_exists=True,
    )
    # A process killed mid-trial leaves it RUNNING for ever; whoever resumes
    # the key (its family lease says nobody else runs it) closes it as failed.
    for stale in study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.RUNNING,)):
        storage.set_trial_state_values(stale._trial_id, optuna.trial.TrialState.FAIL)
    if not study.trials:
        first = list(seeds)
        if explore:
            first += [c for c in _warm_start(key, store, backend.arch) if c not in first]
        if explore and backend.name != "model":
            first += [c for c in model_picks(key) if c not in first]
        for cfg in filter(drawable, first):
            study.enqueue_trial(_params(cfg), skip_if_exists=True)
        compile_ahead(backend, first, key)
        # Seeds the sampler cannot draw are measured as they are, outside the
        # budget, and compete for the win with the study's trials.
        for cfg in itertools.filterfalse(drawable, first):
            measure(cfg)

    def objective(trial: optuna.Trial) -> float:
        try:
            cfg = GemmConfig(**_suggest(trial, key.arch))
            key.problem.check(cfg)
        except InvalidConfig as exc:
            trial.set_user_attr("invalid", str(exc))
            raise optuna.TrialPruned(str(exc)) from None
        row = measure(cfg)
        trial.set_user_attr("config", row.config_name)
        if not row.ok:
            raise _Failed(row.error or "failed")
        return row.ms

    started = time.monotonic()
    timeout = budget.timeout()

    def late() -> bool:
        return timeout is not None and time.monotonic() - started > timeout

    finished = (optuna.trial.TrialState.COMPLETE, optuna.trial.TrialState.FAIL)

    def done() -> int:
        return len(study.get_trials(deepcopy=False, states=finished))

    # Counted here rather than read from the storage after every trial: the
    # key has one writer at a time (its family's lease).
    count = done()
    if not sample:
        trials = count + len(study.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)))

    def stop_when_spent(study_: optuna.Study, trial: optuna.trial.FrozenTrial) -> None:
        nonlocal count
        count += trial.state in finished
        if on_trial:
            on_trial(Tick(min(count, trials), trials, best_speedup()))
        # Out of time, the seeds still queued are measured: they are the
        # candidates the model and the neighbours rank first.
        if count >= trials or late() and not study_.get_trials(deepcopy=False, states=(optuna.trial.TrialState.WAITING,)):
            study_.stop()

    remaining = trials - count
    if remaining > 0:
        study.optimize(
            objective, n_trials=remaining * MAX_SAMPLES_PER_TRIAL,
            catch=(_Failed,), callbacks=[stop_when_spent],
        )
    if on_trial:
        on_trial(Tick(trials, trials, best_speedup()))

    # Every verified trial of the key competes, whichever process measured it.
    measured.update((t.config_name, t) for t in store.trials(key_id, env_id))
    # A key past its time skips its best config's neighbours: each is a
    # compile and a measurement more.
    winner, best, baseline_ms = _pick_winner(key, backend, measured, measure, variants and not late())
    store.record_trials(key_id, env_id, unstored)
    store.set_winner(
        key_id, env_id, config_name=winner.config_name, scheduler=winner.scheduler,
        config=winner.config, ms=winner.ms, baseline_ms=baseline_ms, best_by_scheduler=best,
        trials=done(),
    )
    return Outcome(key, store.winner(key_dict), skipped=False)


def is_current(winner: WinnerView | None, backend: Backend) -> bool:
    """Whether a stored winner was measured under the backend's current
    versions (its key is then not searched again without `force`)."""
    return winner is not None and not winner.stale(backend.versions())


def _pick_winner(
    key, backend, measured, measure, variants: bool = True,
) -> tuple[TrialView, dict[str, float], float]:
    """The winner, each scheduler's best time and the baseline's, all from one
    interleaved run.

    With `variants`, the best config's neighbours (`neighbour_variants`) are
    measured first. Then the best config of each scheduler, the best config's cluster
    neighbours, the best config of each of the `FINAL_SHAPES` fastest shapes,
    the fastest of them under the other L2 hint
    (`hint_variant`) and cuBLAS are re-measured round robin, so that clock
    and thermal drift between trials cannot decide the winner and the
    per-scheduler times compare like with like. That round is timed as the
    M maps are validated and a model's forward calls a GEMM: each call alone
    after an L2 flush.
    """
    ranked = sorted((t for t in measured.values() if t.ok and t.config), key=lambda t: t.ms)
    clusters: list[GemmConfig] = []
    if ranked and variants:
        leaders = _shape_leaders([GemmConfig.from_dict(t.config) for t in ranked], NEIGHBOUR_SHAPES,
                                 tuple((fit.tile_m, fit.tile_n, False) for fit in _wave_fit_configs(key)))
        top = leaders[0]
        families = [(top, neighbour_variants(top))] + [(cfg, cluster_variants(cfg)) for cfg in leaders[1:]]
        variants = [v for _, around in families for v in around if key.problem.runs(v)]
        compile_ahead(backend, [v for v in variants if v.name() not in measured], key)
        for variant in variants:
            measure(variant)
        # A cluster neighbour differs from its config by a few per cent, as
        # much as drift between one-by-one trials: the interleaved run
        # decides between the top's neighbours, and between each other
        # shape's best and its fastest neighbour where that one led.
        def ran(v: GemmConfig) -> bool:
            return v.name() in measured and measured[v.name()].ok

        clusters = [v for v in families[0][1] if v.scheduler == top.scheduler and ran(v)]
        for leader, around in families[1:]:
            best = min(filter(ran, around), key=lambda v: measured[v.name()].ms, default=None)
            if best is not None and measured[best.name()].ms < measured[leader.name()].ms:
                clusters.append(best)
    best_rows: dict[str, TrialView] = {}
    for t in sorted((t for t in measured.values() if t.ok), key=lambda t: t.ms):
        best_rows.setdefault(t.scheduler, t)
    finalists = [GemmConfig.from_dict(t.config) if t.config else None for t in best_rows.values()]
    ranked = sorted((t for t in measured.values() if t.ok and t.config), key=lambda t: t.ms)
    shapes = _shape_leaders([GemmConfig.from_dict(t.config) for t in ranked], FINAL_SHAPES, split=True)
    finalists += [c for c in [*clusters, *shapes] if c not in finalists]
    # The L2 hint shows only in the cold protocol: the fastest kernel runs
    # the round under both hints.
    fastest = min((c for c in finalists if c), key=lambda c: measured[c.name()].ms, default=None)
    if fastest and (flip := hint_variant(fastest)) and flip not in finalists and measure(flip).ok:
        finalists.append(flip)
    again = backend.remeasure(key, finalists, cold=True)
    scored = {
        (cfg.name() if cfg else BASELINE): m.ms
        for m, cfg in zip(again, finalists, strict=True) if m.ok and m.ms is not None
    }
    if BASELINE not in scored:
        raise RuntimeError(f"{key.study_name()}: the cuBLAS baseline failed when re-measured")
    name = min(scored, key=scored.get)
    by_scheduler: dict[str, float] = {}
    for n, ms in sorted(scored.items(), key=lambda item: item[1]):
        by_scheduler.setdefault(measured[n].scheduler, ms)
    return replace(measured[name], ms=scored[name]), dict(sorted(by_scheduler.items())), scored[BASELINE]


def compile_ahead(backend: Backend, cfgs: list[GemmConfig], key: Key) -> None:
    """Let a backend that compiles do so for `cfgs` as `key` runs them, in
    parallel, ahead of the one-by-one measurements."""
    prepare = getattr(backend, "prepare", None)
    if prepare is not None and cfgs:
        prepare(cfgs, key)


def neighbour_variants(cfg: GemmConfig) -> list[GemmConfig]:
    """The configs one step from `cfg` that the model ranks least reliably:
    `cfg` under every other scheduler, under each cluster shape one
    doubling or halving away along M or N, and under the other stage depth
    in K (`tile_k_variants`). Multicast along the cluster
    changes how much L2 traffic each SM carries, a margin the model prices
    within a few per cent of the MMA time; measured on an H100 at 27B's
    M = 512 keys, 128x176 with a 2x1 cluster reached 0.958x cuBLAS where the
    search's 1x1 winner stood at 0.909x."""
    knobs = space.knobs(cfg.arch)
    out = [v for sched in knobs["scheduler"] if sched != cfg.scheduler and (v := scheduler_variant(cfg, sched))]
    return out + cluster_variants(cfg) + tile_k_variants(cfg)


def cluster_variants(cfg: GemmConfig) -> list[GemmConfig]:
    """`cfg` under each valid cluster shape one doubling or halving away along M or N."""
    knobs = space.knobs(cfg.arch)
    fields = cfg.to_dict()
    out = []
    for name in ("cluster_m", "cluster_n"):
        for size in (fields[name] * 2, fields[name] // 2):
            candidate = fields | {name: size}
            if size in knobs[name] and space.is_valid(candidate):
                out.append(GemmConfig(**candidate))
    return out


def _shape_leaders(
    ranked: list[GemmConfig], count: int, also: tuple[tuple[int, int, bool], ...] = (), *, split: bool = False,
) -> list[GemmConfig]:
    """The fastest config of each of the `count` fastest tile shapes (tile_m,
    tile_n, swap_ab; and split_k, with `split`), then those of the shapes
    `also` not among them, from configs ranked fastest first."""
    leaders: dict[tuple, GemmConfig] = {}
    for cfg in ranked:
        shape = (cfg.tile_m, cfg.tile_n, cfg.swap_ab) + ((cfg.split_k,) if split else ())
        if len(leaders) < count or shape in also:
            leaders.setdefault(shape, cfg)
    return list(leaders.values())


def hint_variant(cfg: GemmConfig) -> GemmConfig | None:
    """`cfg` under the other L2 hint (`GemmConfig.l2_hint`), where it has one."""
    other = [h for h in space.L2_HINTS if h != cfg.l2_hint]
    fields = cfg.to_dict() | {"l2_hint": other[0]}
    return GemmConfig(**fields) if len(other) == 1 and space.is_valid(fields) else None


def tile_k_variants(cfg: GemmConfig) -> list[GemmConfig]:
    """`cfg` under each other stage depth in K (`GemmConfig.tile_k`), with
    as many stages as fit: about the same shared memory in runs a row twice
    or half as long, which moves a DRAM-bound kernel by a few per cent, as
    much as one-by-one trials drift."""
    return [v for tk in space.knobs(cfg.arch)["tile_k"] if tk != cfg.tile_k
            and (v := _deepest(cfg.to_dict() | {"tile_k": tk})) is not None]


def scheduler_variant(cfg: GemmConfig, sched: str) -> GemmConfig | None:
    """`cfg` under scheduler `sched` (knobs that do not apply to it neutral), if valid."""
    fields = cfg.to_dict() | {"scheduler": sched, "tail_cancel": False}
    if sched == "single_tile":
        fields["swizzle"] = 1
    if sched not in ("dynamic_persistent", "clc"):
        fields["sched_depth"] = 1
    if sched == "stream_k":
        fields |= {"split_k": 1, "consumer": "cooperative"}
    return GemmConfig(**fields) if space.is_valid(fields) else None


def _suggest(trial: optuna.Trial, arch: str) -> dict:
    """Sample the knobs; those that do not apply to the scheduler or the
    consumers stay neutral.

    Tile and cluster shapes are sampled as one categorical each (every
    combination the space offers): fewer parameters make each trial cheaper
    to sample and store. Pingpong consumers draw their tile from the tiles
    one warpgroup holds ("pingpong_tile") and never split K, so that a
    pingpong sample is not pruned for a tile or a split it cannot have;
    swap_ab tiles ("swap_tile": weight rows x activation rows) likewise;
    stream-K, which splits K itself and reduces the shared tiles in the
    cooperative consumers' registers, draws neither a consumer nor a split.
    """
    knobs = space.knobs(arch)
    choices_ = _choices(arch)
    fields = {"arch": arch}
    sched = fields["scheduler"] = trial.suggest_categorical("scheduler", knobs["scheduler"])
    pingpong = swap = False
    stream_k = sched == "stream_k"
    if "consumer" in choices_ and not stream_k:
        fields["consumer"] = trial.suggest_categorical("consumer", choices_["consumer"])
        pingpong = fields["consumer"] == "pingpong"
    if "swap_ab" in choices_ and not pingpong:
        swap = fields["swap_ab"] = trial.suggest_categorical("swap_ab", choices_["swap_ab"])
    tile = _tile_param(pingpong, swap)
    for name, choices in choices_.items():
        if name in ("consumer", "swap_ab") or name in _TILE_PARAMS and name != tile:
            continue
        if name == "split_k" and (pingpong or stream_k or swap):
            continue
        if name == "sched_depth" and sched not in ("dynamic_persistent", "clc"):
            continue
        if name == "tail_cancel" and sched != "clc":
            continue
        if name == "swizzle" and sched == "single_tile":
            continue
        value = trial.suggest_categorical(name, choices)
        if name in _PAIRS:
            first, second = _PAIRS[name]
            fields[first], fields[second] = (int(v) for v in value.split("x"))
        else:
            fields[name] = value
    return fields


_PINGPONG_TILE = "pingpong_tile"
_SWAP_TILE = "swap_tile"
_TILE_PARAMS = ("tile", _PINGPONG_TILE, _SWAP_TILE)
_PAIRS = {**{name: ("tile_m", "tile_n") for name in _TILE_PARAMS}, "cluster": ("cluster_m", "cluster_n")}


def _tile_param(pingpong: bool, swap: bool) -> str:
    """The parameter a config's tile is drawn as."""
    return _PINGPONG_TILE if pingpong else _SWAP_TILE if swap else "tile"


@functools.cache
def _choices(arch: str) -> dict[str, tuple]:
    """The sampled parameters of `arch` and their values (single-valued knobs
    left out); tile shapes that no config can build (accumulators beyond the
    registers) are not offered, and pingpong and swap_ab tiles are parameters
    of their own where the arch has those modes; cluster shapes are those of
    at most the arch's largest cluster."""
    knobs = space.knobs(arch)
    out = {}
    for pair, (first, second) in _PAIRS.items():
        consumer = "pingpong" if pair == _PINGPONG_TILE else "cooperative"
        swap = pair == _SWAP_TILE
        if consumer not in knobs["consumer"] or swap not in knobs["swap_ab"]:
            continue
        out[pair] = tuple(
            f"{a}x{b}" for a in knobs[first] for b in knobs[second]
            if (a * b <= space.MAX_CLUSTER[arch] if pair == "cluster" else _buildable_tile(arch, a, b, consumer, swap))
        )
    for name, choices in knobs.items():
        paired = any(name in names for names in _PAIRS.values())
        if name != "scheduler" and not paired and len(choices) > 1:
            out[name] = choices
    return out


def _buildable_tile(arch: str, tile_m: int, tile_n: int, consumer: str = "cooperative", swap: bool = False) -> bool:
    """Whether some config of `arch` with `consumer`s (and `swap` of A and B)
    has this MMA tile (at its fewest stages)."""
    knobs = space.knobs(arch)
    fewest = min(knobs["stages"])
    for cta_group in knobs["cta_group"]:
        fields = dict(arch=arch, tile_m=tile_m, tile_n=tile_n, stages=fewest, cta_group=cta_group,
                      cluster_m=cta_group, consumer=consumer, swap_ab=swap)
        if space.is_valid(fields):
            return True
    return False


def _params(cfg: GemmConfig) -> dict:
    params = {"scheduler": cfg.scheduler}
    tile = _tile_param(cfg.pingpong, cfg.swap_ab)
    for name in _choices(cfg.arch):
        if name in _TILE_PARAMS and name != tile:
            continue
        if name in _PAIRS:
            first, second = _PAIRS[name]
            params[name] = f"{getattr(cfg, first)}x{getattr(cfg, second)}"
        else:
            params[name] = getattr(cfg, name)
    return params


def drawable(cfg: GemmConfig) -> bool:
    """Whether the study's sampler can draw `cfg`: it draws no K split for
    swap_ab tiles (letting it moved the model's calibration off, as
    `tests/test_calibration.py` measures), though the space builds them."""
    return not (cfg.swap_ab and cfg.split_k > 1)


def _warm_start(key: Key, store: Store, arch: str) -> list[GemmConfig]:
    """A default per scheduler, the tile that best fills whole waves of the
    key, the swap_ab seeds of a few-row key, then the winners of the nearest
    tuned keys."""
    p = key.problem
    candidates = _fixed_seeds(key)
    near = store.winners(
        limit=10_000, arch=key.arch, device=key.device, dtype_in=p.dtype_in,
        dtype_out=p.dtype_out, layout=p.layout,
    )

    def distance(w: WinnerView) -> float:
        k = w.key
        return sum(abs(math.log2(k[f] / getattr(p, f))) for f in ("m", "n", "k"))

    near = sorted((w for w in near if w.config), key=distance)[:WARM_START_KEYS]
    for w in near:
        try:
            candidates.append(GemmConfig.from_dict(w.config))
        except (InvalidConfig, TypeError):  # a record stored before imports were checked
            continue
    out = []
    for cfg in candidates:
        if p.runs(cfg) and cfg not in out:
            out.append(cfg)
    return out


def _fixed_seeds(key: Key) -> list[GemmConfig]:
    """The warm start's configs that follow from the key alone (`_warm_start`)."""
    return (list(space.defaults(key.arch).values()) + _wave_fit_configs(key)
            + few_row_seeds(key))


def few_row_seeds(key: Key) -> list[GemmConfig]:
    """`swap_seeds` whole and split in K."""
    return swap_seeds(key) + swap_seeds(key, split=True)


def first_configs(key: Key) -> list[GemmConfig]:
    """What a measured search of `key` starts from, but for the nearest tuned
    keys' winners (compiled already): a family compiles these for all its
    keys ahead of measuring the first."""
    out = []
    for cfg in _fixed_seeds(key) + model_picks(key):
        if key.problem.runs(cfg) and cfg not in out:
            out.append(cfg)
    return out


def swap_seeds(key: Key, split: bool = False) -> list[GemmConfig]:
    """For a key of at most SWAP_SEED_MAX_M rows: single-tile swap_ab configs
    of 64 and 128 weight rows by the narrowest swap_ab activation tile that
    holds M, at their deepest pipeline, under every stage depth in K
    (`GemmConfig.tile_k`). The model prices them above split-K
    there, which the H100 reversed (27B qkv at M = 1, one tuning run: 64x16 swap_ab
    0.0325 ms, cuBLAS 0.0317, the model's split-K picks 0.040-0.044), so
    they are measured whatever the model says.

    With `split`, the same tiles with K split as many ways as fills the SMs
    without a second wave, where the weight's rows make under half as many
    tiles as the device has SMs: a few-row GEMM streams its weight, and an
    SM left without a tile streams nothing (Mistral-NeMo's k and v, N =
    1024: 16 tiles of 64 rows; cuBLAS ahead of every whole-K tile at M = 1
    to 37 on the H100)."""
    from tuner.backends.model import DEVICES

    p = key.problem
    if p.m > SWAP_SEED_MAX_M:
        return []
    tiles = [tuple(map(int, t.split("x"))) for t in _choices(key.arch).get(_SWAP_TILE, ())]
    out = []
    for tile_m in (64, 128):
        widths = [n for m, n in tiles if m == tile_m and n >= p.m]
        if not widths:
            continue
        weight_tiles = -(-p.n // tile_m)
        if not split:
            splits = [1]
        elif 2 * weight_tiles <= DEVICES[key.arch].sms:
            fit = DEVICES[key.arch].sms // weight_tiles
            splits = sorted((s for s in space.knobs(key.arch)["split_k"] if 1 < s <= fit), reverse=True)
        else:
            continue
        for tile_k in space.knobs(key.arch)["tile_k"]:
            fields = dict(arch=key.arch, scheduler="single_tile", tile_m=tile_m, tile_n=min(widths), swap_ab=True,
                          tile_k=tile_k)
            runnable = [c for c in (_deepest(fields | {"split_k": s}) for s in splits) if c is not None and p.runs(c)]
            out += runnable[:1]
    return out


def _wave_fit_configs(key: Key) -> list[GemmConfig]:
    """Static persistent configs of the wave-fit tiles of `key` (see
    WAVE_FIT_SLACK): little SM time lost to a partial last wave or to edge
    tiles.

    First the fit among tile widths that are multiples of 16; then, where a
    tile as large within WAVE_FIT_SLACK whose width is an odd number of
    8-row atoms fits better still, that one: an odd multiple of 8 costs more
    per wgmma than its fit gains in general (the model prices it), but where
    it cuts N exactly the H100 ran it ahead (27B down, N = 5376 = 32 x 168,
    M = 512: 128x168 2x1 1.009x cuBLAS, 128x176 0.979x). Each comes with
    pingpong consumers too where they hold its accumulators.
    """
    from tuner.backends.model import DEVICES, wave_fit

    p = key.problem
    sms = DEVICES[key.arch].sms
    fits = []
    for tile in _choices(key.arch)["tile"]:
        tile_m, tile_n = map(int, tile.split("x"))
        if tile_m * tile_n < WAVE_FIT_MIN_AREA:
            continue
        cfg = _deepest(dict(arch=key.arch, scheduler="static_persistent", swizzle=4, tile_m=tile_m,
                            tile_n=tile_n, **_cta_pair(key.arch, tile_m)))
        if cfg is None or not p.runs(cfg) or key.arch == "sm90" and space.sm90_accumulators(cfg) > WAVE_FIT_MAX_ACC:
            continue
        fits.append((wave_fit(p, tile_m, tile_n, sms), cfg))
    even = [(fit, cfg) for fit, cfg in fits if cfg.tile_n % 16 == 0]
    if not even:
        return []
    best = max(fit for fit, _ in even)
    close = [(cfg.tile_m * cfg.tile_n, fit, cfg) for fit, cfg in even if fit >= best * (1 - WAVE_FIT_SLACK)]
    area, first_fit, first = max(close, key=lambda c: c[:2])
    odd = [(fit, cfg.tile_m * cfg.tile_n, cfg) for fit, cfg in fits
           if cfg.tile_n % 16 and fit > first_fit and cfg.tile_m * cfg.tile_n >= area * (1 - WAVE_FIT_SLACK)]
    tiles = [first] + ([max(odd, key=lambda c: c[:2])[2]] if odd else [])
    twins = [_deepest(cfg.to_dict() | {"consumer": "pingpong"}) for cfg in tiles]
    return tiles + [t for t in twins if t is not None and p.runs(t)]


def _cta_pair(arch: str, tile_m: int) -> dict:
    """The tcgen05 CTA grouping a tile_m needs (sm100: 256 rows span two CTAs)."""
    if arch == "sm100" and tile_m == 256:
        return {"cta_group": 2, "cluster_m": 2}
    return {}


def model_picks(key: Key, count: int = MODEL_PICKS) -> list[GemmConfig]:
    """The `count` configs the analytic model predicts fastest for `key`
    (`_model_picks`)."""
    from tuner.backends.model import calibration_stamp

    return list(_model_picks(key, count, calibration_stamp()))


# A family's tune asks for a key's picks twice (compiling ahead, then
# searching), and ranking every shape takes a third of a second. The
# calibration in effect is part of the cache's key.
@functools.lru_cache(maxsize=1024)
def _model_picks(key: Key, count: int, _calibration: tuple) -> tuple[GemmConfig, ...]:
    """The `count` configs the analytic model predicts fastest for `key`, best
    first, one per tile, split-K, consumer and swap_ab shape (with its best cluster):
    the model ranks shapes better than it ranks schedulers, and the search
    tries the best measured shape under every scheduler anyway.

    Every shape is ranked first (static persistent, the smallest cluster: the
    model's wave quantization, edge-tile waste and, for pingpong consumers,
    epilogue overlap decide), then every scheduler and cluster of the
    MODEL_SHORTLIST best. A shortlisted shape whose tiles leave a partial
    last wave is picked under stream-K where the model has stream-K spread
    that wave over every SM faster; the shapes themselves stay ranked by the
    static walk, which measurements have checked, so that an unmeasured
    scheduler cannot crowd the picks with its shapes.
    """
    knobs = space.knobs(key.arch)
    choices = _choices(key.arch)
    shapes = [
        (tile, split_k, cta_group, consumer, False)
        for tile in choices["tile"] for split_k in knobs["split_k"] for cta_group in knobs["cta_group"]
        for consumer in knobs["consumer"]
    ] + [(tile, 1, 1, "cooperative", True) for tile in choices.get(_SWAP_TILE, ())]
    # The smallest cluster each shape takes (a 2-CTA MMA spans a pair).
    first = _scored(key, [("static_persistent", shape, f"{shape[2]}x1") for shape in shapes])
    shortlist = []
    for _, cfg in first:
        shape = (f"{cfg.tile_m}x{cfg.tile_n}", cfg.split_k, cfg.cta_group, cfg.consumer, cfg.swap_ab)
        if shape not in shortlist:
            shortlist.append(shape)
    shortlist = shortlist[:MODEL_SHORTLIST]
    scored = _scored(key, itertools.product(knobs["scheduler"], shortlist, choices["cluster"]))
    shapes: set[tuple] = set()
    out = []
    for _, cfg in scored:
        shape = (cfg.tile_m, cfg.tile_n, cfg.split_k, cfg.cta_group, cfg.consumer, cfg.swap_ab)
        if shape not in shapes and len(out) < count:
            shapes.add(shape)
            out.append(cfg)
    return tuple(out)


def _scored(key: Key, combos) -> list[tuple[float, GemmConfig]]:
    """(predicted ms, config) of every (scheduler, (tile, split_k, cta_group,
    consumer, swap_ab), cluster) that runs `key`, at its deepest pipeline,
    fastest first."""
    from tuner.backends.model import predict_ms

    scored: list[tuple[float, GemmConfig]] = []
    for sched, (tile, split_k, cta_group, consumer, swap), cluster in combos:
        cfg = _deepest(dict(
            arch=key.arch, scheduler=sched, split_k=split_k, cta_group=cta_group, consumer=consumer, swap_ab=swap,
            swizzle=1 if sched == "single_tile" else 4,
            **dict(zip(_PAIRS["tile"], map(int, tile.split("x")))),
            **dict(zip(_PAIRS["cluster"], map(int, cluster.split("x")))),
        ))
        if cfg is None:
            continue
        try:
            scored.append((predict_ms(key, cfg), cfg))
        except InvalidConfig:
            continue
    scored.sort(key=lambda pair: pair[0])
    return scored


def _deepest(fields: dict) -> GemmConfig | None:
    """`fields` with the most pipeline stages (and accumulator stages) that are valid."""
    return _deepest_of(tuple(sorted(fields.items())))


@functools.lru_cache(maxsize=65536)
def _deepest_of(items: tuple) -> GemmConfig | None:
    fields = dict(items)
    knobs = space.knobs(fields["arch"])
    for acc in sorted(knobs["acc_stages"], reverse=True):
        for stages in sorted(knobs["stages"], reverse=True):
            candidate = fields | {"stages": stages, "acc_stages": acc}
            if space.is_valid(candidate):
                return GemmConfig(**candidate)
    return None


def _seed(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "little")


def _env_tag(backend: str, versions: dict[str, str], arch: str) -> str:
    # The sampled space is part of a study: Optuna refuses a parameter whose
    # choices changed (the scheduler's among them), so a pool that grew
    # starts new studies (the trials measured before stay in our trial table
    # and are not timed again).
    text = (backend + repr(sorted(versions.items())) + repr(space.knobs(arch)["scheduler"])
            + repr(sorted(_choices(arch).items())))
    return hashlib.sha256(text.encode()).hexdigest()[:10]
