"""The Optuna search: model-guided warm start, ahead-of-time compiles, winners against the baseline."""

from dataclasses import replace

from kernels import space
from kernels.space import GemmConfig
from db.store import Store
from tuner.key import Key, Problem
from tuner.backends.model import ModelBackend
from tuner.search.study import (
    LONG_KEY_MS, LONG_KEY_TRIALS, NEIGHBOUR_SHAPES, Budget, cluster_variants, hint_variant, model_picks,
    neighbour_variants, tile_k_variants, tune_key,
)


class MeasuredBackend(ModelBackend):
    """The model's times behind a backend that is not the model (as the gpu one is:
    searched one stored trial at a time), recording what the search asks it to
    compile ahead and to measure."""

    name = "measured"

    def __init__(self, arch):
        super().__init__(arch, bulk=False)
        self.prepared: list[GemmConfig] = []
        self.measured: list[GemmConfig] = []

    def prepare(self, cfgs, key):
        self.prepared.extend(cfgs)

    def measure(self, key, cfg):
        self.measured.append(cfg)
        return super().measure(key, cfg)


def test_model_picks_are_distinct_runnable_shapes_best_first():
    from tuner.backends.model import predict_ms

    for arch in ("sm90", "sm100"):
        key = Key(arch, "dev", Problem(512, 5376, 21504))
        picks = model_picks(key, count=5)
        assert len(picks) == 5
        shapes = {(c.tile_m, c.tile_n, c.split_k, c.cta_group, c.consumer) for c in picks}
        assert len(shapes) == 5
        times = [predict_ms(key, c) for c in picks]
        assert times == sorted(times)
        for cfg in picks:
            space.check_problem(cfg, 512, 5376, 21504)


def test_winner_and_scheduler_bests_come_from_one_interleaved_run(tmp_path):
    backend = MeasuredBackend("sm90")
    rounds = []
    backend.remeasure = lambda key, cfgs, cold=False: rounds.append((cfgs, cold)) or ModelBackend.remeasure(
        backend, key, cfgs)
    key = Key("sm90", backend.device_name, Problem(4096, 4096, 4096))
    w = tune_key(key, backend, Store(str(tmp_path / "t.db")), Budget(trials=8)).winner
    ((finalists, cold),) = rounds
    # Timed as the M maps and a model's forward run a GEMM: alone, after an L2 flush.
    assert cold
    assert None in finalists
    kernels = [c for c in finalists if c]
    assert {c.scheduler for c in kernels} == set(space.knobs("sm90")["scheduler"])
    # The fastest kernel under both L2 hints (the model's times tie them: it
    # comes first, unhinted).
    assert hint_variant(kernels[0]) in kernels
    # Beside each scheduler's best: the top config's cluster neighbours, which
    # differ from it by less than one-by-one trials drift.
    extra = [c for c in kernels if [d.scheduler for d in kernels].count(c.scheduler) > 1 and c.l2_hint == "normal"]
    assert all(neighbour_variants(c) for c in extra)
    assert set(w.best_by_scheduler) == {"cublas", *space.knobs("sm90")["scheduler"]}
    assert w.ms == min(w.best_by_scheduler.values())
    assert w.baseline_ms == w.best_by_scheduler["cublas"]


def test_the_best_config_is_tried_under_every_scheduler_and_neighbouring_cluster(tmp_path):
    backend = MeasuredBackend("sm90")
    # N = 6144: the top tile is a multiple of 32 wide, which stream-K takes.
    key = Key("sm90", backend.device_name, Problem(512, 6144, 4096))
    store = Store(str(tmp_path / "t.db"))
    tune_key(key, backend, store, Budget(trials=6))
    tried = list(backend.measured)
    top = min(tried[:6], key=lambda c: ModelBackend.measure(backend, key, c).ms)
    around = neighbour_variants(top)
    assert set(around) <= set(tried)
    assert {c.scheduler for c in around} == set(space.knobs("sm90")["scheduler"])
    # ... and under the other stage depth in K.
    assert tile_k_variants(top) and set(tile_k_variants(top)) <= set(around)
    shapes = {(c.cluster_m, c.cluster_n) for c in around if c.scheduler == top.scheduler and c.tile_k == top.tile_k}
    assert shapes and all(abs(cm - top.cluster_m) + abs(cn - top.cluster_n) == 1 for cm, cn in shapes)
    # One step each: a stream-K variant drops split-K and pingpong, which it cannot have.
    sk = [c for c in around if c.stream_k]
    assert all(c.split_k == 1 and c.consumer == "cooperative" for c in sk)


def test_without_variants_a_key_measures_its_seeds_and_one_hint_flip(tmp_path):
    """A fill rung's seeds are explored winners: with `variants=False` the
    search measures them, the fastest under the other hint, and nothing else."""
    backend = MeasuredBackend("sm90")
    key = Key("sm90", backend.device_name, Problem(724, 5376, 21504))
    seeds = model_picks(key, 3)
    tune_key(key, backend, Store(str(tmp_path / "t.db")), Budget(trials=len(seeds)), seeds=seeds,
             explore=False, variants=False)
    fastest = min(seeds, key=lambda c: ModelBackend.measure(backend, key, c).ms)
    assert set(backend.measured) == {*seeds, hint_variant(fastest)}
    # The same key with variants explores the fastest seed's neighbours.
    again = MeasuredBackend("sm90")
    tune_key(key, again, Store(str(tmp_path / "u.db")), Budget(trials=len(seeds)), seeds=seeds, explore=False)
    assert set(neighbour_variants(fastest)) - set(backend.measured) <= set(again.measured)
    assert len(set(again.measured)) > len(set(backend.measured))


class _Scaled(MeasuredBackend):
    """The model's times, `factor` times them for the configs `which` picks."""

    def __init__(self, which, factor):
        super().__init__("sm90")
        self.which, self.factor = which, factor

    def time_of(self, key, cfg) -> float:
        ms = ModelBackend.measure(self, key, cfg).ms
        return ms * self.factor if self.which(cfg) else ms

    def measure(self, key, cfg):
        return replace(super().measure(key, cfg), ms=self.time_of(key, cfg))


def _tune_down_512(backend, tmp_path):
    """Tune 27B down at M = 512: (configs measured in order, their times,
    the interleaved finalists)."""
    rounds = []
    backend.remeasure = lambda key, cfgs, cold=False: rounds.append(cfgs) or ModelBackend.remeasure(backend, key, cfgs)
    key = Key("sm90", backend.device_name, Problem(512, 5376, 21504))
    tune_key(key, backend, Store(str(tmp_path / "t.db")), Budget(trials=12))
    tried = list(backend.measured)
    (finalists,) = rounds
    return key, tried, {c: backend.time_of(key, c) for c in tried}, finalists


def test_the_runner_up_tile_shapes_are_tried_under_neighbouring_clusters(tmp_path):
    # Every 2x1 cluster 10 % slower than the model says: the model's first
    # picks put the runner-up shapes on 2x1 clusters, where a neighbouring
    # cluster shape then wins.
    backend = _Scaled(lambda c: (c.cluster_m, c.cluster_n) == (2, 1), 1.1)
    key, tried, ms, finalists = _tune_down_512(backend, tmp_path)
    leaders = {}
    for cfg in sorted(tried[:12], key=ms.get):
        leaders.setdefault((cfg.tile_m, cfg.tile_n), cfg)
    leaders = list(leaders.values())[:NEIGHBOUR_SHAPES]
    assert len(leaders) == NEIGHBOUR_SHAPES
    led = 0
    for leader in leaders[1:]:
        around = [c for c in cluster_variants(leader) if key.problem.runs(c)]
        assert set(around) <= set(tried)
        # A neighbour that beat its shape's best one by one meets it again interleaved.
        faster = [c for c in around if ms[c] < ms[leader]]
        if faster:
            led += 1
            assert min(faster, key=ms.get) in finalists
    assert led


def test_the_wave_fit_tile_is_tried_under_neighbouring_clusters_when_it_trails(tmp_path):
    from tuner.search.study import _wave_fit_configs

    # 128x176 (down M = 512's wave-fit tile) on 1x1 clusters 40 % slower than
    # the model says, as its tiles straggled on an H100.
    backend = _Scaled(lambda c: (c.tile_m, c.tile_n, c.cluster_m, c.cluster_n) == (128, 176, 1, 1), 1.4)
    key, tried, ms, finalists = _tune_down_512(backend, tmp_path)
    fit = _wave_fit_configs(key)[0]
    assert (fit.tile_m, fit.tile_n) == (128, 176)
    ranked = sorted(tried[:12], key=ms.get)
    shapes = list(dict.fromkeys((c.tile_m, c.tile_n) for c in ranked))
    assert (128, 176) in shapes[NEIGHBOUR_SHAPES:]  # no runner-up: only the wave fit brings it
    fitted = next(c for c in ranked if (c.tile_m, c.tile_n) == (128, 176))
    around = [c for c in cluster_variants(fitted) if key.problem.runs(c)]
    assert around and set(around) <= set(tried)
    assert min(around, key=ms.get) in finalists


def test_the_wave_fit_takes_exact_eighth_widths_and_pingpong_twins():
    from tuner.search.study import _wave_fit_configs

    def fits(m, n, k):
        return [(c.tile_m, c.tile_n) for c in _wave_fit_configs(Key("sm90", "dev", Problem(m, n, k)))]

    # N = 5376 = 32 x 168: 4 x 32 tiles fill 128 of 132 SMs with no edge
    # tile; each fit tile comes with pingpong consumers too.
    down = _wave_fit_configs(Key("sm90", "dev", Problem(512, 5376, 21504)))
    assert [(c.tile_m, c.tile_n, c.consumer) for c in down] == [
        (128, 176, "cooperative"), (128, 168, "cooperative"), (128, 176, "pingpong"), (128, 168, "pingpong")]
    # Tiles past 128 accumulators a thread (256 x 168) hold 3 stages: not a fit.
    assert fits(1024, 5376, 21504)[:2] == [(128, 176), (128, 168)]
    # A tile that fits better only by being much smaller is the model's call.
    assert fits(2048, 5376, 21504) == [(128, 224)]
    assert fits(512, 6144, 4096) == [(128, 192), (128, 192)]
    assert all(n % 16 == 0 for m in (128, 2048, 8192) for _, n in fits(m, 43008, 5376)[:1])


def test_a_few_row_key_starts_from_swap_ab_seeds(tmp_path):
    from tuner.search.study import swap_seeds

    backend = MeasuredBackend("sm90")
    key = Key("sm90", backend.device_name, Problem(4, 5376, 4096))
    seeds = swap_seeds(key)
    # One 8-row atom holds M = 4 (the H100 ran 64x8 0.2-0.5 % ahead of 64x16
    # on the 27B keys at M = 1 to 8).
    # Each under both stage depths in K: 128 streams a weight faster in
    # DRAM, at half the stages.
    assert all(c.swap_ab for c in seeds)
    assert [(c.tile_m, c.tile_n, c.tile_k) for c in seeds] == [(64, 8, 64), (64, 8, 128), (128, 8, 64), (128, 8, 128)]
    tune_key(key, backend, Store(str(tmp_path / "t.db")), Budget(trials=12))
    assert set(seeds) <= set(backend.measured[:12])
    # Up to 128 rows, the narrowest activation tile that holds them.
    assert {c.tile_n for c in swap_seeds(Key("sm90", "dev", Problem(65, 5376, 4096)))} == {80}
    assert swap_seeds(Key("sm90", "dev", Problem(129, 5376, 4096))) == []
    assert swap_seeds(Key("sm100", "dev", Problem(4, 5376, 4096))) == []
    # Where the weight makes few tiles, the same tiles with K split are
    # measured too, outside the study's budget: N = 5376 is 42 tiles of 128
    # weight rows, split 2 ways (3 would fill more SMs but leaves K = 4096
    # unaligned); 84 tiles of 64 rows split none.
    splits = swap_seeds(key, split=True)
    assert [(c.tile_m, c.tile_n, c.split_k, c.tile_k) for c in splits] == [(128, 8, 2, 64), (128, 8, 2, 128)]
    assert all(c.swap_ab for c in splits) and set(splits) <= set(backend.measured)
    # A weight of 16 tiles (Mistral-NeMo's k and v) splits K 8 ways: 128 CTAs
    # of the H100's 132; 336 tiles (Gemma 3 27B's gate_up) split none.
    few = swap_seeds(Key("sm90", "dev", Problem(4, 1024, 5120)), split=True)
    assert [(c.tile_m, c.split_k, c.tile_k) for c in few] == [(64, 8, 64), (64, 8, 128), (128, 8, 64), (128, 8, 128)]
    assert swap_seeds(Key("sm90", "dev", Problem(4, 43008, 5376)), split=True) == []


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


def test_a_key_whose_cublas_call_is_long_samples_more_trials(tmp_path):
    backend = ModelBackend("sm90")
    store = Store(str(tmp_path / "t.db"))
    for problem, long in ((Problem(8192, 43008, 5376), True), (Problem(128, 4096, 4096), False)):
        key = Key("sm90", backend.device_name, problem)
        assert (backend.baseline(key).ms >= LONG_KEY_MS) is long
        totals = []
        w = tune_key(key, backend, store, Budget(trials=7), on_trial=lambda tick: totals.append(tick.total)).winner
        want = round(7 * LONG_KEY_TRIALS) if long else 7
        assert set(totals) == {want} and w.trials == want
    # A key measuring only its seeds (a ladder rung) keeps its budget however long.
    key = Key("sm90", backend.device_name, Problem(4096, 43008, 5376))
    seeds = model_picks(key, 3)
    w = tune_key(key, backend, store, Budget(trials=3), seeds=seeds, explore=False).winner
    assert backend.baseline(key).ms >= LONG_KEY_MS and w.trials == 3


def _tiles_at(key, cfg) -> int:
    return -(-key.problem.m // cfg.tile_m) * -(-key.problem.n // cfg.tile_n)


def test_first_picks_of_27b_o_at_512_try_the_wave_filling_width():
    # Gemma 3 27B o: N = 5376. Multiples of 32 give 96 tiles (128x224: 27 %
    # of 132 SMs idle), 112 (128x192) or 168 (128x128: 1.27 waves); 128x176
    # gives 4 x 31 = 124. The H100 measured this key at 35.1 us with 128x192
    # and 42.9 us with 128x176 (an odd multiple of 16 columns costs more per
    # wgmma, `wgmma_n16_clk`): of the tiles walked whole, 128x192 comes first,
    # the wave-filling width right after it. Stream-K (not yet measured)
    # spreads the partial wave of a wide tile over every SM instead, which
    # the uncalibrated model puts level with 128x192.
    key = Key("sm90", "dev", Problem(512, 5376, 4096))
    picks = model_picks(key)
    walked = [c for c in picks if not c.stream_k]
    first = walked[0]
    assert (first.tile_m, first.tile_n) == (128, 192) and first in picks[:2]
    assert any(c.tile_n % 32 and 120 <= _tiles_at(key, c) <= 132 for c in walked[:3])
    assert any(c.tile_n % 32 or c.tile_m == 192 for c in walked[:3])


def test_picks_try_stream_k_where_the_best_tiles_leave_a_partial_wave():
    from tuner.backends.model import predict_ms

    # 27B down at M = 2896: 128x224 tiles make 4.18 waves; stream-K cuts
    # the last 24 tiles into five slices each, on 120 of the 132 SMs.
    partial = Key("sm90", "dev", Problem(2896, 5376, 21504))
    picks = model_picks(partial)
    assert any(c.stream_k for c in picks)
    # Over whole waves stream-K deals the tiles as static does (the same
    # time): it is picked only where it is predicted to gain.
    whole = Key("sm90", "dev", Problem(128 * 33, 256 * 4, 4096))
    for key in (partial, whole):
        for cfg in model_picks(key):
            if cfg.stream_k:
                assert predict_ms(key, cfg) < predict_ms(key, replace(cfg, scheduler="static_persistent"))


def test_picks_take_pingpong_where_ctas_have_tiles_to_overlap():
    # 27B o at M = 1024: 128x112 pingpong tiles give 8 x 48 = 384 tiles, about
    # three per SM, each epilogue under another tile's mainloop; at M = 8192
    # the big cooperative tiles' operand reuse wins.
    # (Stream-K, spreading the 1.45 waves of 128x224 tiles over every SM,
    # the model puts a little ahead of the tiles walked whole.)
    mid = model_picks(Key("sm90", "dev", Problem(1024, 5376, 5376)))
    assert next(c for c in mid if not c.stream_k).pingpong and any(not c.pingpong for c in mid)
    assert not model_picks(Key("sm90", "dev", Problem(8192, 5376, 5376)))[0].pingpong
    # sm100 overlaps epilogues with TMEM accumulator stages instead.
    assert not any(c.pingpong for c in model_picks(Key("sm100", "dev", Problem(1024, 5376, 5376))))


def test_pingpong_samples_draw_only_pingpong_tiles_and_never_split_k():
    import optuna

    from tuner.search.study import _suggest

    study = optuna.create_study(sampler=optuna.samplers.RandomSampler(seed=0))
    drawn = [_suggest(study.ask(), "sm90") for _ in range(300)]
    pingpong = [f for f in drawn if f.get("consumer") == "pingpong"]
    assert 100 < len(pingpong) < 200 and all("split_k" not in f for f in pingpong)
    # Stream-K keeps cooperative consumers and splits K itself: it draws neither.
    stream_k = [f for f in drawn if f["scheduler"] == "stream_k"]
    assert stream_k and all("consumer" not in f and "split_k" not in f for f in stream_k)
    # At the shallowest pipeline every pingpong sample is a config: none is
    # pruned for a tile or a split it cannot have.
    assert all(space.is_valid({**f, "stages": 2}) for f in pingpong)
    # swap_ab samples (cooperative) draw a swap tile and no split; stream-K ones too.
    swap = [f for f in drawn if f.get("swap_ab")]
    assert swap and all("split_k" not in f and f.get("consumer", "cooperative") == "cooperative" for f in swap)
    assert any(f["scheduler"] == "stream_k" for f in swap)
    assert all(space.is_valid({**f, "stages": 2}) for f in swap)


def test_model_ranks_every_tile_shape_before_clusters_and_schedulers():
    # N = 43008 = 224 x 192: the whole-width tiles come first, not samples.
    key = Key("sm90", "dev", Problem(512, 43008, 5376))
    shapes = [(c.tile_m, c.tile_n) for c in model_picks(key)]
    assert (128, 224) in shapes[:2] and (128, 192) in shapes


def test_warm_start_adds_the_wave_fit_tile(tmp_path):
    from tuner.search.study import _warm_start

    store = Store(str(tmp_path / "w.db"))
    try:
        for (m, n, k), tile in [((512, 5376, 4096), (128, 176)), ((8192, 43008, 5376), (192, 192)),
                                ((512, 43008, 5376), (128, 224))]:
            cfgs = _warm_start(Key("sm90", "dev", Problem(m, n, k)), store, "sm90")
            assert tile in {(c.tile_m, c.tile_n) for c in cfgs}
            assert len(cfgs) == len(set(cfgs))
    finally:
        store.close()


def test_sampled_tiles_are_the_buildable_ones_and_the_space_names_the_study():
    from tuner.search.study import _choices, _env_tag

    tiles = _choices("sm90")["tile"]
    assert "128x176" in tiles and "192x192" in tiles
    assert "192x208" not in tiles and "256x256" not in tiles
    for tile in tiles:
        tile_m, tile_n = map(int, tile.split("x"))
        assert space.is_valid(dict(arch="sm90", tile_m=tile_m, tile_n=tile_n, stages=2))
    # A study's parameter space is part of its name: a grown pool starts anew.
    assert _env_tag("gpu", {"torch": "x"}, "sm90") != _env_tag("gpu", {"torch": "x"}, "sm100")


def test_picks_stay_cheap_with_the_grown_space():
    import time

    key = Key("sm90", "dev", Problem(2048, 21504 * 2, 5376))
    started = time.perf_counter()
    model_picks(key)
    assert time.perf_counter() - started < 2.0
