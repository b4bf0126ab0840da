import random
from dataclasses import replace

import pytest

from kernels import space
from kernels.space import GemmConfig, InvalidConfig


def test_defaults_are_valid_for_every_scheduler():
    for arch in space.ARCHS:
        defaults = space.defaults(arch)
        assert set(defaults) == set(space.knobs(arch)["scheduler"])


def test_sm90_pool_size_and_scheduler_split():
    pool = list(space.enumerate_configs("sm90"))
    assert len(pool) == len(set(pool))
    # A stage of K 128 is a stage of K 64 twice over: every such config's
    # twin of K 64 exists; the rules below hold for the pool of K 64.
    configs = [c for c in pool if c.tile_k == 64]
    deep = set(pool) - set(configs)
    assert {c.tile_k for c in deep} == {128} and len(deep) == 117312
    assert {replace(c, tile_k=64) for c in deep} <= set(configs)
    assert {c.scheduler for c in deep} == set(space.SCHEDULERS[:4])
    by_sched = {s: sum(c.scheduler == s for c in configs) for s in space.SCHEDULERS}
    assert by_sched["clc"] == 0
    # Two claim depths for the atomic scheduler; single_tile has no swizzle.
    assert by_sched["dynamic_persistent"] == 2 * by_sched["static_persistent"]
    assert by_sched["single_tile"] * 4 == by_sched["static_persistent"]
    # Pingpong: tile_m 64 (any width) or 128 up to 200 wide (200
    # accumulators a thread), no split-K.
    pingpong = [c for c in configs if c.pingpong]
    assert {c.tile_m for c in pingpong} == {64, 128} and {c.split_k for c in pingpong} == {1}
    assert max(c.tile_n for c in pingpong if c.tile_m == 128) == 200
    # Stream-K: the static walk's cooperative tiles the fixup takes (64, 128
    # or 256 rows, widths of whole 32-column sub-tiles), one K split (its own).
    # swap_ab stream-K (even ranges of the weight) takes every swap tile.
    stream_k = [c for c in configs if c.stream_k]
    assert not any(c.pingpong for c in stream_k) and {c.split_k for c in stream_k} == {1}
    wide = [c for c in stream_k if not c.swap_ab]
    assert {c.tile_m for c in wide} == {64, 128, 256} and all(c.tile_n % 32 == 0 for c in wide)
    # Clusters 1x1, 1x2, 2x1, 2x2, 1x4 and 4x1 (at most 4 CTAs).
    assert {(c.cluster_m, c.cluster_n) for c in configs} == {(1, 1), (1, 2), (2, 1), (2, 2), (1, 4), (4, 1)}
    # swap_ab: 64 or 128 weight rows by 8 or a multiple of 16 up to 128
    # activation rows, cooperative, K whole or split (or streamed evenly).
    swap = [c for c in configs if c.swap_ab]
    tiles = {(m, n) for m in (64, 128) for n in (8, *range(16, 129, 16))}
    assert {(c.tile_m, c.tile_n) for c in swap} == tiles
    assert {(c.tile_m, c.tile_n) for c in swap if c.stream_k} == tiles
    assert not any(c.pingpong for c in swap)
    assert {c.split_k for c in swap} == set(space.knobs("sm90")["split_k"])
    assert min(c.tile_n for c in configs if not c.swap_ab) == 64
    assert len(configs) - len(pingpong) - len(wide) - len(swap) == 100620
    assert len(pingpong) == 37752 and len(wide) == 3840 and len(swap) == 100188


@pytest.mark.parametrize(
    "fields",
    [
        dict(tile_m=128, tile_n=256, stages=4),
        dict(tile_m=256, tile_n=128, stages=3),
        dict(tile_m=64, tile_n=256, stages=5, cluster_m=2),
        dict(scheduler="dynamic_persistent", sched_depth=2),
        dict(split_k=4, tile_m=64, tile_n=128),
        # Widths in steps of 8 (5376 = 32 x 168: one wave at M = 512).
        dict(tile_m=128, tile_n=176, stages=5),
        dict(tile_m=128, tile_n=168, stages=4, cluster_m=2),
        dict(tile_m=64, tile_n=72, stages=8),
        dict(tile_m=64, tile_n=80, stages=8),
        dict(tile_m=256, tile_n=112, stages=4),
        # Three 64-row consumer warpgroups: 96 accumulators fit 128 registers.
        dict(tile_m=192, tile_n=192, stages=3),
        dict(tile_m=192, tile_n=128, stages=4, scheduler="dynamic_persistent", cluster_m=2),
        dict(arch="sm100", tile_m=256, tile_n=256, cta_group=2, cluster_m=2, acc_stages=2, stages=4),
        dict(arch="sm100", scheduler="clc", sched_depth=3, tail_cancel=True, cluster_m=4, cluster_n=4),
        dict(arch="sm100", tile_m=64, tile_n=32, stages=8, acc_stages=4),
        # Pingpong: a whole tile per warpgroup, 128 accumulators a thread at most.
        dict(consumer="pingpong", tile_m=128, tile_n=128, stages=6),
        dict(consumer="pingpong", tile_m=64, tile_n=256, stages=5, cluster_n=2),
        dict(consumer="pingpong", scheduler="dynamic_persistent", sched_depth=2, cluster_m=2),
        dict(consumer="pingpong", scheduler="single_tile"),
    ],
)
def test_accepted(fields):
    GemmConfig(**fields)


@pytest.mark.parametrize(
    "fields, reason",
    [
        (dict(tile_m=256, tile_n=256), "accumulator registers"),
        (dict(tile_m=128, tile_n=256, stages=6), "shared memory"),
        (dict(scheduler="clc"), "scheduler='clc'"),
        (dict(scheduler="static_persistent", sched_depth=2), "sched_depth applies"),
        (dict(tail_cancel=True), "tail_cancel="),
        (dict(arch="sm100", scheduler="dynamic_persistent", sched_depth=3), "one tile ahead"),
        (dict(scheduler="single_tile", swizzle=4), "single_tile"),
        (dict(cluster_m=2, cluster_n=4), "exceeds 4 CTAs"),
        (dict(cluster_m=8), "cluster_m=8"),
        (dict(tile_n=76), "tile_n=76"),
        (dict(tile_n=48), "swap_ab tiles only"),
        (dict(tile_n=40), "swap_ab tiles only"),
        (dict(swap_ab=True, tile_n=12), "tile_n=12"),
        (dict(swap_ab=True, tile_n=24), "8 or a multiple of 16"),
        (dict(swap_ab=True, tile_n=144), "at most 128 activation rows"),
        (dict(swap_ab=True, tile_m=256, tile_n=32, stages=3), "64 or 128 weight rows"),
        (dict(swap_ab=True, tile_n=32, consumer="pingpong"), "are cooperative"),
        (dict(arch="sm100", swap_ab=True), "swap_ab=True"),
        (dict(tile_m=96), "tile_m=96"),
        # 512 threads get 128 registers each: one WGMMA's 104 accumulators do not fit.
        (dict(tile_m=192, tile_n=208), "registers per WGMMA"),
        # 208 accumulators against setmaxnreg's 232 - 32 (ptxas spilled them).
        (dict(tile_m=256, tile_n=208, stages=2), "accumulator registers"),
        (dict(tile_m=192, tile_n=128, stages=5), "shared memory"),
        (dict(split_k=2, tile_m=192, tile_n=64), "split-K"),
        (dict(split_k=2, tile_m=128, tile_n=240), "multiple of 32"),
        (dict(split_k=2, tile_m=256, tile_n=64), "split-K"),
        (dict(arch="sm100", cta_group=2, tile_m=256, cluster_m=1), "even cluster_m"),
        (dict(arch="sm100", cta_group=1, tile_m=256), "1-CTA"),
        (dict(arch="sm100", cta_group=2, tile_m=64, cluster_m=2), "2-CTA"),
        (dict(arch="sm100", tile_n=160, acc_stages=4), "TMEM columns"),
        (dict(arch="sm100", scheduler="clc", tail_cancel=True, sched_depth=2, cluster_m=4, cluster_n=4,
              tile_n=256, stages=8), "shared memory"),
        (dict(arch="sm70"), "unknown arch"),
        (dict(consumer="pingpong", tile_m=256, tile_n=64), "pingpong tile"),
        (dict(consumer="pingpong", tile_m=192, tile_n=64), "pingpong tile"),
        (dict(consumer="pingpong", tile_m=128, tile_n=208, stages=2), "accumulator registers"),
        (dict(consumer="pingpong", split_k=2, tile_m=64), "do not split K"),
        (dict(consumer="cooperativ"), "consumer='cooperativ'"),
        (dict(arch="sm100", consumer="pingpong"), "consumer='pingpong'"),
        (dict(l2_hint="a_first"), "l2_hint='a_first'"),
        (dict(arch="sm100", l2_hint="b_first"), "sm90 TMA loads only"),
        (dict(arch="sm100", pdl=True), "sm90 only"),
        (dict(pdl="yes"), "pdl='yes' is not a bool"),
        (dict(scheduler="single_tile", sm_budget=64), "sm_budget sizes a persistent grid"),
        (dict(cluster_m=2, cluster_n=2, sm_budget=3), "holds no cluster of 4 CTAs"),
        (dict(sm_budget=-8), "sm_budget=-8 is not a count of SMs"),
        (dict(sm_budget=2000), "sm_budget=2000 is not a count of SMs"),
    ],
)
def test_rejected(fields, reason):
    with pytest.raises(InvalidConfig, match=reason.replace("(", r"\(").replace("'", ".")):
        GemmConfig(**fields)


def test_epilogue_subtiles_divide_every_width_and_smem_counts_them():
    for tile_n in space.knobs("sm90")["tile_n"]:
        if tile_n < 64 and tile_n % 16 and tile_n != 8:
            continue  # not a swap_ab width
        cfg = GemmConfig(tile_m=64, tile_n=tile_n, stages=2, swap_ab=tile_n < 64)
        width = space.epi_subtile_n(cfg)
        # stmatrix x4 (16 columns) where tile_n allows, else x2 (8).
        assert tile_n % width == 0 and (width % 16 == 0 or tile_n % 16)
        # Stages of A and B, two fp32 epilogue buffers, the reserve: exact.
        assert cfg.smem_bytes() == 2 * (64 + tile_n) * 64 * 2 + 64 * width * 4 * 2 + space.SMEM_RESERVED
    assert space.epi_subtile_n(GemmConfig(tile_n=176, stages=2)) == 16
    assert space.epi_subtile_n(GemmConfig(tile_n=224, stages=2)) == 32
    assert space.epi_subtile_n(GemmConfig(tile_n=168, stages=2)) == 24
    assert space.epi_subtile_n(GemmConfig(tile_n=136, stages=2)) == 8


def test_register_budgets_fit_the_register_file():
    for groups, (producer, consumer) in space.SM90_REG_BUDGETS.items():
        assert 128 * (producer + groups * consumer) <= space.SM90_REGISTERS
        assert producer % 8 == 0 and consumer % 8 == 0 and 24 <= producer and consumer <= 256
    three = GemmConfig(tile_m=192, tile_n=128, stages=2)
    assert three.consumer_warpgroups == 3 and space.sm90_launch_registers(three) == 128
    assert space.sm90_launch_registers(GemmConfig(stages=2)) == 168
    # Pingpong: two consumer warpgroups whatever tile_m, one per tile.
    pp = GemmConfig(tile_m=64, consumer="pingpong", stages=2)
    assert (pp.consumer_warpgroups, pp.tile_warpgroups) == (2, 1) and space.sm90_launch_registers(pp) == 168


def test_smem_budget_is_the_stage_limit():
    # 128x128 bf16: 32 KB per stage, so 6 stages fit in 227 KB with the epilogue, 7 do not.
    GemmConfig(tile_m=128, tile_n=128, stages=6)
    with pytest.raises(InvalidConfig, match="shared memory"):
        GemmConfig(tile_m=128, tile_n=128, stages=7)


@pytest.mark.parametrize(
    "problem, reason",
    [
        (dict(m=0, n=8, k=8), "M must be positive"),
        (dict(m=4, n=8, k=12), "multiple of 8"),
        (dict(m=4, n=12, k=8, layout="nn"), "N=12"),
        (dict(m=4, n=8, k=8, dtype_in="fp8"), "input dtype"),
        (dict(m=4, n=8, k=8, layout="tt"), "layout"),
        (dict(m=4, n=8, k=4096, groups=2), "only for groups with their own K"),
        (dict(m=4, n=8, k=4096, groups=2, group_k=(4096, 192)), "K=192 split 4 ways"),
        (dict(m=4, n=8, k=4104), "16-byte aligned"),
        (dict(m=4, n=8, k=96), "under one k-block"),
    ],
)
def test_check_problem(problem, reason):
    cfg = GemmConfig(split_k=4, tile_m=64)
    with pytest.raises(InvalidConfig, match=reason):
        space.check_problem(cfg, **problem)


def test_pingpong_is_not_grouped():
    with pytest.raises(InvalidConfig, match="grouped"):
        space.check_problem(GemmConfig(consumer="pingpong"), 4096, 512, 256, groups=8)


def test_swap_ab_takes_a_linear_weight_only():
    swap = GemmConfig(scheduler="single_tile", tile_m=64, tile_n=16, stages=8, swap_ab=True)
    space.check_problem(swap, 1, 5376, 4096)
    for problem in (dict(layout="nn"), dict(groups=4)):
        with pytest.raises(InvalidConfig, match="swap_ab"):
            space.check_problem(swap, 16, 5376, 4096, **problem)
    assert GemmConfig.from_name(swap.name()) == swap and swap.name().endswith("-ab")
    assert swap.m_rows == 16 and GemmConfig().m_rows == 128  # a tile row of M: its activation rows
    # Split-K semaphores count the tiles of out.T: 84 weight-row tiles by one of the 9 rows.
    split = GemmConfig(scheduler="single_tile", tile_m=64, tile_n=32, stages=8, split_k=3, swap_ab=True)
    assert space.split_k_tiles(split, 9, 5376) == 84
    assert space.split_k_scratch_words(split, 9, 5376) == space.split_k_partials_offset(84) + 84 * 3 * 64 * 32


def test_grouped_split_k_is_for_groups_with_their_own_k_on_sm90():
    cfg = GemmConfig(split_k=4, tile_m=64)
    space.check_problem(cfg, 1024, 1024, 32768, groups=4, group_k=(1024, 32768, 1024, 32768))
    # Every group's tiles have a semaphore and four partial slots.
    tiles = space.split_k_tiles(cfg, 1000, 1024, groups=4)
    assert tiles == 4 * 16 * 8
    assert space.split_k_scratch_words(cfg, 1000, 1024, groups=4) == (
        space.split_k_partials_offset(tiles) + tiles * 4 * 64 * 128)
    sm100 = GemmConfig(arch="sm100", split_k=2, tile_m=128, tile_n=128)
    with pytest.raises(InvalidConfig, match="built for sm90"):
        space.check_problem(sm100, 1024, 1024, 4096, groups=2, group_k=(4096, 1024))


def test_split_k_scratch_must_stay_int32_indexable():
    # Gemma 3 27B gate+up at M 8192: 8 slices of 128x64 tiles need 2.8e9 words.
    big = GemmConfig(split_k=8, tile_m=128, tile_n=64, cluster_m=2)
    with pytest.raises(InvalidConfig, match="int32"):
        space.check_problem(big, 8192, 43008, 5376)
    space.check_problem(GemmConfig(split_k=2, tile_m=128, tile_n=64), 8192, 43008, 5376)
    space.check_problem(GemmConfig(arch="sm100", split_k=8, tile_m=128, tile_n=64), 8192, 43008, 5376)


def test_sample_draws_valid_configs_of_every_scheduler():
    rng = random.Random(0)
    drawn = [space.sample("sm100", rng) for _ in range(400)]
    assert {c.scheduler for c in drawn} == set(space.SCHEDULERS)
    assert any(c.tail_cancel for c in drawn)


def test_round_trip_and_unknown_fields():
    cfg = GemmConfig(scheduler="dynamic_persistent", sched_depth=2)
    assert GemmConfig.from_dict(cfg.to_dict()) == cfg
    # A config stored before the consumer knob existed is cooperative, and
    # cooperative names are what they were; pingpong ones end in -pp.
    old = {k: v for k, v in cfg.to_dict().items() if k != "consumer"}
    assert GemmConfig.from_dict(old) == cfg and cfg.consumer == "cooperative"
    assert cfg.name() == "sm90-dynamic_persistent-t128x128-c1x1-s4-w1m-d2"
    pp = GemmConfig(scheduler="dynamic_persistent", sched_depth=2, consumer="pingpong")
    assert pp.name() == "sm90-dynamic_persistent-t128x128-c1x1-s4-w1m-d2-pp"
    assert GemmConfig.from_name(pp.name()) == pp and GemmConfig.from_name(cfg.name()) == cfg
    assert GemmConfig.from_dict(pp.to_dict()) == pp
    # Configs stored before the L2 hint existed load as "normal"; hinted names end in -Lbf.
    assert GemmConfig.from_dict({k: v for k, v in pp.to_dict().items() if k != "l2_hint"}) == pp
    hinted = GemmConfig(tile_n=176, stages=5, l2_hint="b_first")
    assert hinted.name() == "sm90-static_persistent-t128x176-c1x1-s5-w1m-Lbf"
    assert GemmConfig.from_name(hinted.name()) == hinted
    with pytest.raises(InvalidConfig, match="unknown config fields"):
        GemmConfig.from_dict({**cfg.to_dict(), "bogus": 1})


def test_a_pdl_build_is_named_and_loads_as_plain_from_older_records():
    plain = GemmConfig(scheduler="static_persistent", tile_m=64, tile_n=8, stages=8, swap_ab=True)
    pdl = replace(plain, pdl=True)
    assert pdl.name() == plain.name() + "-pdl" and GemmConfig.from_name(pdl.name()) == pdl
    assert GemmConfig.from_dict(pdl.to_dict()) == pdl
    assert GemmConfig.from_dict({k: v for k, v in pdl.to_dict().items() if k != "pdl"}) == plain
    # A launch variant of a winner, not a knob the search samples.
    assert "pdl" not in space.knobs("sm90")


def test_an_sm_budget_is_named_sizes_the_grid_and_shares_the_compile():
    import kernels.compile as kc

    whole = GemmConfig(scheduler="dynamic_persistent", tile_n=256, cluster_m=2)
    budget = replace(whole, sm_budget=100)
    assert budget.name() == whole.name() + "-sm100" and GemmConfig.from_name(budget.name()) == budget
    assert GemmConfig.from_dict({k: v for k, v in budget.to_dict().items() if k != "sm_budget"}) == whole
    # 100 SMs hold 50 clusters of 2; a wave of the device, 66, otherwise.
    assert (budget.budget_clusters(66), whole.budget_clusters(66), budget.budget_clusters(40)) == (50, 66, 40)
    assert replace(whole, sm_budget=2).budget_clusters(66) == 1
    assert kc.cache_path(budget) == kc.cache_path(whole)
    assert "sm_budget" not in space.knobs("sm90")


def test_a_stage_of_k_128_is_named_sized_and_checked():
    deep = GemmConfig(scheduler="single_tile", tile_m=128, tile_n=16, stages=5, swap_ab=True, tile_k=128)
    assert deep.name() == "sm90-single_tile-t128x16x128-c1x1-s5-w1m-ab"
    assert GemmConfig.from_name(deep.name()) == deep and GemmConfig.from_dict(deep.to_dict()) == deep
    # Stored before the knob: K 64, and names without a third tile size.
    assert GemmConfig.from_dict({k: v for k, v in deep.to_dict().items() if k != "tile_k"}).tile_k == 64
    assert GemmConfig.from_name("sm90-single_tile-t128x16-c1x1-s5-w1m-ab") == replace(deep, tile_k=64)
    with pytest.raises(InvalidConfig, match="did you mean"):
        GemmConfig.from_name("sm90-single_tile-t128x16x64-c1x1-s5-w1m-ab")
    for bad in ("sm90-single_tile-t128x16x128x2-c1x1-s5-w1m-ab", "sm90-single_tile-t128x16x96-c1x1-s5-w1m-ab"):
        with pytest.raises(InvalidConfig):
            GemmConfig.from_name(bad)
    # Twice the ring bytes a stage: 6 stages of 128x16 by 64 fit, not of 128.
    assert deep.smem_bytes() - replace(deep, tile_k=64).smem_bytes() == 5 * 144 * 64 * 2
    with pytest.raises(InvalidConfig, match="shared memory"):
        replace(deep, stages=6)
    replace(deep, stages=6, tile_k=64)
    # sm100 keeps stages of 64; grouped kernels walk K in 64s; a K slice holds a stage.
    with pytest.raises(InvalidConfig, match="tile_k=128"):
        GemmConfig(arch="sm100", tile_k=128)
    with pytest.raises(InvalidConfig, match="grouped GEMM walks K in stages of 64"):
        space.check_problem(GemmConfig(stages=3, tile_k=128), 512, 4096, 4096, groups=8)
    split = GemmConfig(scheduler="single_tile", tile_m=64, tile_n=64, stages=4, split_k=4, tile_k=128)
    space.check_problem(split, 16, 4096, 512)
    with pytest.raises(InvalidConfig, match="under one k-block"):
        space.check_problem(split, 16, 4096, 384)
    space.check_problem(replace(split, tile_k=64), 16, 4096, 384)


def test_eighth_widths_store_16_bit_outputs_only():
    cfg = GemmConfig(tile_m=128, tile_n=168, stages=4)
    for dtype_out in ("bf16", "fp16"):
        space.check_problem(cfg, 512, 5376, 4096, dtype_out=dtype_out)
    with pytest.raises(InvalidConfig, match="tile_n 168 .* not fp32"):
        space.check_problem(cfg, 512, 5376, 4096, dtype_out="fp32")
    # Multiples of 16, and swap_ab tiles (M-major output), store fp32 too.
    space.check_problem(GemmConfig(tile_m=128, tile_n=176, stages=4), 512, 5376, 4096, dtype_out="fp32")
    space.check_problem(GemmConfig(tile_n=8, stages=8, swap_ab=True), 4, 5376, 4096, dtype_out="fp32")
