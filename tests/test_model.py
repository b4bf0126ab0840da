"""The analytic model reproduces the seeds' qualitative results and stays fast."""

from __future__ import annotations

import heapq
import random
import time
from dataclasses import replace

import numpy as np
import pytest

from kernels import space
from kernels.space import DTYPE_BYTES, GemmConfig, InvalidConfig
from tuner.key import Key, Problem
from tuner.backends.model import B200, DEVICES, H100, MODEL_VERSION, ModelBackend, _greedy, baseline_ms, predict_ms

SEED000_K = (1024, 4096, 8192, 16384, 32768)


def sm90(scheduler: str, **kw) -> GemmConfig:
    fields = dict(arch="sm90", scheduler=scheduler, tile_m=128, tile_n=128, stages=4,
                  swizzle=1 if scheduler == "single_tile" else 4)
    return GemmConfig(**(fields | kw))


def sm100(scheduler: str, **kw) -> GemmConfig:
    """The 2-CTA 256x128 MMA tile on 2x1 clusters of seed 000's measurement."""
    fields = dict(arch="sm100", scheduler=scheduler, tile_m=256, tile_n=128, cluster_m=2,
                  cta_group=2, acc_stages=2, stages=4, swizzle=1 if scheduler == "single_tile" else 4)
    return GemmConfig(**(fields | kw))


def seed000(k: int) -> Problem:
    return Problem(m=1024, n=1024, k=k, groups=4, group_k=(1024, k, 1024, k))


def best_depth(p: Problem, cfg: GemmConfig, device=None) -> float:
    """The time a search would find: the best claim depth of a dynamic scheduler."""
    depths = [d for d in space.knobs(cfg.arch)["sched_depth"] if space.is_valid(cfg.to_dict() | {"sched_depth": d})]
    return min(predict_ms(p, replace(cfg, sched_depth=d), device) for d in depths)


@pytest.mark.parametrize("make, dynamic", [
    (sm90, ("dynamic_persistent",)),
    (sm100, ("dynamic_persistent", "clc")),
])
def test_seed000_dynamic_pulls_ahead_of_static_as_k_grows(make, dynamic):
    arch = make("static_persistent").arch
    static = [predict_ms(seed000(k), make("static_persistent"), DEVICES[arch]) for k in SEED000_K]
    for sched in dynamic:
        dyn = [predict_ms(seed000(k), make(sched)) for k in SEED000_K]
        ratios = [s / d for s, d in zip(static, dyn)]
        # Balanced (all K equal): no scheduler is far ahead.
        assert 0.8 < ratios[0] < 1.1, (sched, ratios)
        # Imbalanced: the dynamic scheduler wins, and by more as K grows.
        assert all(r > 1.2 for r in ratios[2:]), (sched, ratios)
        assert all(b > a for a, b in zip(ratios[1:], ratios[2:])), (sched, ratios)
        assert ratios[-1] > 1.6, (sched, ratios)


@pytest.mark.parametrize("make, sched", [(sm90, "dynamic_persistent"), (sm100, "clc")])
def test_seed000_deep_claim_pipeline_resembles_static(make, sched):
    """Claiming tiles ahead reserves long tiles early (seed 000's warning)."""
    p = seed000(32768)
    shallow = predict_ms(p, make(sched, sched_depth=1))
    deep = predict_ms(p, make(sched, sched_depth=2 if sched == "dynamic_persistent" else 3))
    static = predict_ms(p, make("static_persistent"))
    assert deep > 1.5 * shallow
    assert deep == pytest.approx(static, rel=0.05)


@pytest.mark.parametrize("base, cfg, dynamic", [
    (H100, dict(arch="sm90", tile_m=128, tile_n=128), ("dynamic_persistent",)),
    (B200, dict(arch="sm100", tile_m=128, tile_n=128, acc_stages=2), ("dynamic_persistent", "clc")),
])
def test_seed003_held_sms_hurt_static_not_dynamic(base, cfg, dynamic):
    """100 SMs, 20 held by another kernel, 20x20 output tiles, 1x1 clusters."""
    device = replace(base, sms=100)
    held = Problem(m=20 * 128, n=20 * 128, k=4096, carveout=20)
    free = replace(held, carveout=0)

    def t(p, sched):
        return predict_ms(p, GemmConfig(scheduler=sched, stages=4, swizzle=4, **cfg), device)

    for sched in dynamic:
        tuned = best_depth(free, GemmConfig(scheduler=sched, stages=4, swizzle=4, **cfg), device)
        assert tuned == pytest.approx(t(free, "static_persistent"), rel=0.03)
        assert t(held, sched) * 1.25 < t(held, "static_persistent"), sched
        # Losing a fifth of the SMs costs a dynamic scheduler about a fifth.
        assert t(held, sched) < 1.35 * t(free, sched)


@pytest.mark.parametrize("arch, make, scheds", [
    ("sm90", sm90, ("static_persistent", "dynamic_persistent")),
    ("sm100", sm100, ("static_persistent", "dynamic_persistent", "clc")),
])
@pytest.mark.parametrize("shape", [(8192, 8192, 8192), (4096, 4096, 4096)])
def test_balanced_work_persistent_schedulers_agree(arch, make, scheds, shape):
    p = Problem(*shape)
    tuned = [best_depth(p, make(s)) for s in scheds]
    assert max(tuned) / min(tuned) < 1.03, dict(zip(scheds, tuned))
    # Even claiming one tile at a time, an exposed claim costs a few % at most.
    depth1 = [predict_ms(p, make(s)) for s in scheds]
    assert max(depth1) / min(depth1) < 1.05, dict(zip(scheds, depth1))


def test_seed002_tail_cancel_flattens_padded_grid_cost():
    """MoE grouped GEMM whose CLC grid is sized for a padded worst case."""
    p = Problem(m=4 * 4096, n=7168, k=2048, groups=4)
    pads = (1, 2, 4, 8)
    off = [predict_ms(p, sm100("clc"), padding=pad) for pad in pads]
    on = [predict_ms(p, sm100("clc", tail_cancel=True), padding=pad) for pad in pads]
    dyn = [predict_ms(p, sm100("dynamic_persistent"), padding=pad) for pad in pads]
    assert all(b > a for a, b in zip(off, off[1:])), off
    assert off[-1] > 1.5 * off[0]
    assert max(on) / min(on) < 1.05, on
    assert all(o <= f for o, f in zip(on, off))
    # A fixed worker count knows the real tile count on the device: no phantoms.
    assert len(set(dyn)) == 1


@pytest.mark.parametrize("cfg", [
    sm90("static_persistent"),
    sm90("static_persistent", tile_m=64, tile_n=256),
    sm100("static_persistent"),
    sm100("clc", tile_n=256, acc_stages=2),
])
def test_more_stages_hide_latency_then_stop_mattering(cfg):
    p = Problem(m=4096, n=4096, k=4096)
    times = {}
    for stages in space.knobs(cfg.arch)["stages"]:
        fields = cfg.to_dict() | {"stages": stages}
        if space.is_valid(fields):
            times[stages] = predict_ms(p, GemmConfig(**fields))
    ordered = [times[s] for s in sorted(times)]
    assert len(ordered) >= 3
    assert ordered[0] > 1.2 * min(ordered), times  # 2 stages expose load latency
    assert all(b <= a * 1.01 for a, b in zip(ordered, ordered[1:])), times


@pytest.mark.parametrize("make", [sm90, sm100])
@pytest.mark.parametrize("shape", [(8192, 8192, 8192), (8192, 8192, 1024)])
def test_single_tile_loses_to_persistent_on_many_tiles(make, shape):
    p = Problem(*shape)
    assert predict_ms(p, make("single_tile")) > 1.03 * predict_ms(p, make("static_persistent"))


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
@pytest.mark.parametrize("m", [1, 16, 64])
@pytest.mark.parametrize("k", [4096, 16384])
def test_split_k_wins_for_small_m_long_k_narrow_n(arch, m, k):
    p = Problem(m=m, n=1024, k=k)
    extra = {} if arch == "sm90" else {"acc_stages": 2}

    def t(split):
        return predict_ms(p, GemmConfig(arch=arch, tile_m=64, tile_n=128, stages=4, swizzle=1,
                                        split_k=split, **extra))

    assert min(t(s) for s in (2, 4, 8)) < 0.8 * t(1)


@pytest.mark.parametrize("tile_n", [128, 256])
def test_sm90_split_k_slices_park_whole_fp32_tiles(tile_n):
    """An sm90 slice parks its whole CTA tile, rows past M included, and the
    last reads the others back: halving the partials' rate costs a split-K
    config the same at M = 1 as at M = 16, more for a wider tile, and costs
    split_k 1 nothing."""
    slow = replace(H100, partial_bytes_per_clk=H100.partial_bytes_per_clk / 2)

    def cost(m, split):
        cfg = sm90("single_tile", tile_m=64, tile_n=tile_n, split_k=split)
        p = Problem(m=m, n=1024, k=4096)  # one wave of slices
        return predict_ms(p, cfg, slow) - predict_ms(p, cfg, H100)

    assert cost(16, 1) == 0
    assert cost(1, 8) == pytest.approx(cost(16, 8)) and cost(16, 8) > cost(16, 2) > 0
    partial = 64 * tile_n * 4 / (H100.partial_bytes_per_clk * H100.clock_hz)
    assert cost(16, 8) * 1e-3 == pytest.approx(8 * partial, rel=0.01)


def test_split_k_does_not_help_large_m():
    p = Problem(m=8192, n=8192, k=4096)
    assert predict_ms(p, sm90("static_persistent", split_k=4)) > predict_ms(p, sm90("static_persistent"))


@pytest.mark.parametrize("arch", ["sm90", "sm100"])
def test_predictions_respect_the_roofline(arch):
    """No config beats peak MMA or the compulsory DRAM traffic."""
    rng = random.Random(1)
    dev = DEVICES[arch]
    shapes = [(1, 4096, 4096), (64, 5376, 21504), (2048, 4096, 1024), (8192, 8192, 8192), (4096, 21504, 5376)]
    checked = 0
    while checked < 200:
        cfg = space.sample(arch, rng)
        m, n, k = rng.choice(shapes)
        p = Problem(m=m, n=n, k=k)
        try:
            ms = predict_ms(p, cfg)
        except InvalidConfig:
            continue
        e = DTYPE_BYTES[p.dtype_in]
        dram = (m * k + n * k) * e + m * n * DTYPE_BYTES[p.dtype_out]
        floor_s = max(p.flops / dev.peak_flops, dram / dev.hbm_bw)
        assert ms / 1e3 > floor_s, (cfg.name(), (m, n, k))
        checked += 1


@pytest.mark.parametrize("arch, low, high", [("sm90", 0.6, 0.9), ("sm100", 0.55, 0.85)])
def test_baseline_sustains_a_realistic_share_of_peak(arch, low, high):
    p = Problem(m=8192, n=8192, k=8192)
    share = p.flops / (baseline_ms(p, DEVICES[arch]) / 1e3) / DEVICES[arch].peak_flops
    assert low < share < high


def test_baseline_loops_over_groups_and_ignores_held_sms():
    dense = Problem(m=1024, n=4096, k=4096)
    grouped = Problem(m=8 * 1024, n=4096, k=4096, groups=8)
    assert baseline_ms(grouped, H100) == pytest.approx(8 * baseline_ms(dense, H100))
    held = replace(Problem(m=2560, n=2560, k=4096), carveout=40)
    assert baseline_ms(held, H100) > baseline_ms(replace(held, carveout=0), H100)


def test_greedy_matches_earliest_free_assignment():
    rng = np.random.default_rng(7)
    for _ in range(200):
        workers = int(rng.integers(1, 20))
        free = rng.uniform(0, 10, workers).round(int(rng.integers(0, 3)))
        n, cost = int(rng.integers(0, 60)), float(rng.choice([0.5, 1.0, 2.5, 3.0]))
        heap = [(f, w) for w, f in enumerate(free)]
        heapq.heapify(heap)
        for _ in range(n):
            f, w = heapq.heappop(heap)
            heapq.heappush(heap, (f + cost, w))
        expect = sorted(f for f, _ in heap)
        assert np.allclose(sorted(_greedy(free.copy(), n, cost)), expect)


def test_key_and_problem_predict_the_same():
    p = Problem(m=512, n=4096, k=4096)
    cfg = sm90("dynamic_persistent")
    assert predict_ms(Key("sm90", H100.name, p), cfg) == predict_ms(p, cfg, H100)


def test_unrunnable_problems_raise():
    with pytest.raises(InvalidConfig):
        predict_ms(Problem(m=1024, n=1024, k=1024, carveout=132), sm90("static_persistent"))
    with pytest.raises(InvalidConfig):
        predict_ms(Problem(m=1024, n=1024, k=1024), sm100("static_persistent"), H100)


def test_backend_measures_baselines_and_refuses():
    backend = ModelBackend("sm100")
    assert (backend.name, backend.arch, backend.device_name) == ("model", "sm100", "B200-model")
    assert backend.versions() == {"model": MODEL_VERSION}
    key = Key("sm100", backend.device_name, seed000(8192))
    good = backend.measure(key, sm100("clc"))
    assert good.ok and good.ms > 0
    assert good.detail["tiles"] == 4 * (1024 // 256) * (1024 // 128)
    assert good.detail["workers"] == 74
    base = backend.baseline(key)
    assert base.ok and base.ms == baseline_ms(key, B200)
    again = backend.remeasure(key, [sm100("clc"), None])
    assert [m.ms for m in again] == [good.ms, base.ms]
    # Split-K is not combined with grouped GEMM: a failed trial, not an exception.
    bad = backend.measure(key, GemmConfig(arch="sm100", tile_m=128, tile_n=128, split_k=2))
    assert not bad.ok and "split-K" in bad.error
    wrong_arch = backend.measure(key, sm90("static_persistent"))
    assert not wrong_arch.ok
    with pytest.raises(ValueError):
        ModelBackend("sm80")


def test_thousand_predictions_take_under_a_second():
    rng = random.Random(3)
    shapes = [
        Problem(m=m, n=n, k=k)
        for m in (1, 32, 256, 2048, 8192) for n, k in ((5376, 5376), (21504, 5376), (5376, 21504))
    ] + [seed000(16384), Problem(m=16384, n=7168, k=2048, groups=4), Problem(m=4096, n=4096, k=4096, carveout=20)]
    cases = []
    while len(cases) < 1000:
        arch = rng.choice(("sm90", "sm100"))
        cfg, p = space.sample(arch, rng), rng.choice(shapes)
        try:
            space.check_problem(cfg, p.m, p.n, p.k, p.groups, p.dtype_in, p.dtype_out, p.layout)
        except InvalidConfig:
            continue
        cases.append((p, cfg))
    started = time.perf_counter()
    for p, cfg in cases:
        predict_ms(p, cfg)
    assert time.perf_counter() - started < 1.0


def test_clusters_that_run_at_once_come_from_the_measured_table():
    # cuOccupancyMaxActiveClusters on an H100: clusters of 4 stay inside a GPC.
    assert [H100.clusters(s) for s in (1, 2, 4)] == [132, 66, 30]
    assert replace(H100, sms=100).clusters(1) == 100  # a smaller variant caps the table
    assert B200.clusters(8) == 148 // 8  # unmeasured sizes fall back to SMs / size


def test_wave_fit_counts_partial_waves_and_edge_tiles():
    from tuner.backends.model import wave_fit

    p = Problem(512, 5376, 4096)
    # 128x176: 4 x 31 tiles in one wave of 132, the last column half empty.
    assert wave_fit(p, 128, 176, 132) == pytest.approx(512 * 5376 / (132 * 128 * 176))
    # 128x128: 168 tiles, two waves, the second a quarter full.
    assert wave_fit(p, 128, 128, 132) == pytest.approx(168 / 264)
    # 33 x 4 whole tiles: one whole wave.
    assert wave_fit(Problem(4224, 1024, 64), 128, 256, 132) == 1.0


def test_the_model_prefers_the_tile_that_fills_the_wave():
    # Gemma 3 27B o at M = 512 on 132 SMs: one full wave beats 1.27 waves or
    # a wave with 27 % of the SMs idle.
    key = Key("sm90", "H100", Problem(512, 5376, 4096))
    t = {n: predict_ms(key, GemmConfig(tile_m=128, tile_n=n, stages=4, swizzle=4)) for n in (128, 176, 224)}
    assert t[176] < t[224] < t[128]


def test_pingpong_hides_epilogues_only_where_a_cta_has_two_tiles():
    coop = GemmConfig(scheduler="static_persistent", tile_m=128, tile_n=128, stages=6, swizzle=4)
    pp = replace(coop, consumer="pingpong")
    # 132 tiles of 128x128: one per SM, no second tile to run under an epilogue.
    one = Problem(128 * 11, 128 * 12, 4096)
    assert predict_ms(one, pp, H100) == pytest.approx(predict_ms(one, coop, H100))
    # Three per SM: two of the three epilogues hide under mainloops.
    three = Problem(128 * 33, 128 * 12, 4096)
    assert predict_ms(three, pp, H100) < predict_ms(three, coop, H100)
    # single_tile: a pingpong CTA runs two tiles, so half the CTA starts.
    single = Problem(128 * 66, 128 * 12, 4096)
    assert predict_ms(single, replace(pp, scheduler="single_tile", swizzle=1), H100) < predict_ms(
        single, replace(coop, scheduler="single_tile", swizzle=1), H100
    )


def test_narrow_epilogue_subtiles_cost_more():
    key = Key("sm90", "H100", Problem(4096, 4096, 4096))
    wide = predict_ms(key, GemmConfig(tile_m=128, tile_n=192, stages=4))
    narrow = predict_ms(key, GemmConfig(tile_m=128, tile_n=176, stages=4))
    # 176 columns in 11 sub-tiles of 16 against 192 in 6 of 32: more per output column.
    assert narrow / 176 > wide / 192


@pytest.mark.parametrize("tile_n", [128, 256])
def test_stream_k_spreads_one_tile_row_over_every_sm(tile_n):
    # Gemma 3 27B down at M = 128: 42 or 21 tiles of one row leave most SMs
    # idle; stream-K gives every SM the same share of the k-blocks (measured
    # on the H100, 128x256: 0.122 ms against 0.197 ms static).
    p = Problem(128, 5376, 21504)
    static = sm90("static_persistent", tile_n=tile_n)
    tiles = 5376 // tile_n
    t_static = predict_ms(p, static, H100)
    t_sk = predict_ms(p, replace(static, scheduler="stream_k"), H100)
    assert t_sk < 0.85 * t_static
    # The partials' fixup costs something: no better than perfect balance.
    assert t_sk > t_static * tiles / 132


def test_stream_k_claims_whole_tiles_where_no_partial_wave_splits():
    # 27B down at M = 512, 128x192: 112 tiles, fewer than the 132 SMs but
    # more than half, so two slices a tile would not fit one round: every
    # tile runs whole, claimed as dynamic_persistent claims it.
    p = Problem(512, 5376, 21504)
    dynamic = sm90("dynamic_persistent", tile_n=192)
    t_sk = predict_ms(p, replace(dynamic, scheduler="stream_k"), H100)
    assert t_sk == pytest.approx(predict_ms(p, dynamic, H100), rel=0.01)


def test_stream_k_fills_the_partial_wave():
    # 27B down at M = 2896, 128x224: 552 tiles, 4.18 waves. Static runs five
    # rounds of whole tiles; stream-K four, then the last 24 tiles in five
    # slices on 120 SMs.
    p = Problem(2896, 5376, 21504)
    static = sm90("static_persistent", tile_n=224, stages=4)
    t_sk = predict_ms(p, replace(static, scheduler="stream_k"), H100)
    assert t_sk < 0.9 * predict_ms(p, static, H100)


@pytest.mark.parametrize("shape, tile_n, most", [
    ((128 * 33, 128 * 4, 4096), 128, 1.05),     # one whole wave
    ((128 * 33, 256 * 4, 4096), 256, 1.05),
    ((128 * 22, 128 * 12, 8192), 128, 1.05),    # two
    # 256 tiles (1.94 waves) whose B panels four tile rows share: measured
    # on the H100 (27B qkv at M = 512), 128x128 stream-K 0.116 ms against
    # 0.099 ms for the same tile with K split in two.
    ((512, 8192, 5376), 128, None),
])
def test_stream_k_gains_nothing_where_the_waves_are_whole(shape, tile_n, most):
    p = Problem(*shape)
    static = sm90("static_persistent", tile_n=tile_n)
    t_static = predict_ms(p, static, H100)
    t_sk = predict_ms(p, replace(static, scheduler="stream_k"), H100)
    assert t_static <= t_sk
    if most:
        assert t_sk < most * t_static


def test_stream_k_splits_the_partial_wave_as_the_kernel_does():
    from tuner.backends.model import SK_MAX_SLICES, SK_MIN_K_TILES, _stream_k_plan

    schedulers = pytest.importorskip("kernels.schedulers")
    assert (SK_MIN_K_TILES, SK_MAX_SLICES) == (schedulers.SK_MIN_K_TILES, schedulers.SK_MAX_SLICES)
    assert _stream_k_plan(552, 336, 132) == (24, 5)     # 24 x 5 units on 132 workers
    assert _stream_k_plan(168, 64, 132) == (36, 7)      # 36 x 7 = 252: two rounds end sooner than 36 x 3
    assert _stream_k_plan(84, 64, 132) == (84, 3)       # fewer tiles than workers: every tile
    assert _stream_k_plan(20, 336, 132) == (20, 6)      # six slices: 120 units (seven would be 140)
    assert _stream_k_plan(4, 336, 132) == (4, SK_MAX_SLICES)
    assert _stream_k_plan(140, 24, 132) == (8, 3)       # units of SK_MIN_K_TILES k-blocks at least
    assert _stream_k_plan(140, 4, 132) == (0, 1)        # k-blocks too few to split
    assert _stream_k_plan(264, 64, 132) == (0, 1)       # whole waves: data-parallel
    assert _stream_k_plan(384, 336, 132) == (0, 1)      # 120 of 132: two slices would not fit


def _units(tiles: int, kblocks: int, sk: int, slices: int) -> list[tuple[int, int, int]]:
    """Stream-K's units by unit index u (its partial slot): (tile, first
    k-block, k-blocks), as the kernel's scheduler decodes them."""
    out = []
    for u in range(sk * slices):
        t, s = u % sk, u // sk
        lo, hi = s * kblocks // slices, (s + 1) * kblocks // slices
        out.append((tiles - sk + t, lo, hi - lo))
    return out


@pytest.mark.parametrize("tiles, kblocks, workers", [
    (552, 336, 132), (168, 64, 132), (84, 64, 132), (20, 336, 132), (4, 336, 132), (140, 24, 132),
    (7, 81, 66), (200, 100, 66), (67, 17, 66), (1, 64, 132), (133, 83, 132),
])
def test_stream_k_units_cover_every_k_block_once_and_fit_two_slots(tiles, kblocks, workers):
    from tuner.backends.model import SK_MIN_K_TILES, _stream_k_plan

    sk, slices = _stream_k_plan(tiles, kblocks, workers)
    units = _units(tiles, kblocks, sk, slices)
    covered = sorted((t, k) for t, lo, n in units for k in range(lo, lo + n))
    assert covered == [(t, k) for t in range(tiles - sk, tiles) for k in range(kblocks)]
    # Unit u parks in slot u: the scratch holds two a worker, each unit long enough to be worth one.
    assert len(units) <= 2 * workers
    assert all(n >= SK_MIN_K_TILES for _, _, n in units)
    # Units of one round start at one k-block per slice: the same for every tile.
    if units:
        starts = {t: sorted(lo for tt, lo, _ in units if tt == t) for t in range(tiles - sk, tiles)}
        assert len({tuple(v) for v in starts.values()}) == 1


def test_stream_k_predictions_are_finite_and_positive():
    shapes = [Problem(1, 4096, 64), Problem(8, 128, 65536), Problem(128, 5376, 21504),
              Problem(2048, 43008, 5376), Problem(4096, 4096, 4096, carveout=20), Problem(100, 1000, 1000)]
    cfgs = [
        sm90("stream_k", tile_m=tile_m, tile_n=tile_n, stages=stages, cluster_m=cluster_m, cluster_n=cluster_n)
        for tile_m, tile_n, stages in [(64, 128, 8), (128, 128, 6), (128, 256, 4), (64, 256, 5), (128, 96, 6)]
        for cluster_m, cluster_n in [(1, 1), (2, 1), (1, 2), (2, 2)]
    ]
    # sm100 stream-K, where the pool has it.
    sm100_fields = [sm100("static_persistent", tile_m=128, tile_n=n, cluster_m=1, cta_group=1).to_dict()
                    | {"scheduler": "stream_k"} for n in (128, 256)]
    cfgs += [GemmConfig(**f) for f in sm100_fields if space.is_valid(f)]
    checked = 0
    for cfg in cfgs:
        for p in shapes:
            try:
                ms = predict_ms(p, cfg)
            except InvalidConfig:
                continue
            assert np.isfinite(ms) and ms > 0, (cfg.name(), p.label())
            checked += 1
    assert checked > 80
