"""The all-reduce group beside overlap keys, on the CPU (gloo): the lockstep of its ranks."""

import pytest

torch = pytest.importorskip("torch")

from tuner.backends.collective import Group  # noqa: E402


def test_partners_run_every_announced_all_reduce_in_step_and_stop_when_told():
    group = Group([None, None, None])
    try:
        buf = group.begin(3, 64)
        for _ in range(3):
            group.align()
            group.all_reduce(buf)
        # Every rank took part in each: ones summed over 3 ranks, three times.
        assert buf.numel() == 32 and bool((buf.float() == 27).all())
        with pytest.raises(RuntimeError, match="past the all-reduces"):
            group.align()
        group.begin(0, 64)
        buf = group.begin(2, 130)
        group.align()
        group.all_reduce(buf)
        with pytest.raises(RuntimeError, match="1 all-reduces of the last measurement"):
            group.begin(1, 64)
        group.align()
        group.all_reduce(buf)
        assert bool((buf.float() == 9).all())
        with pytest.raises(ValueError, match="count -2"):
            group.begin(-2, 64)
    finally:
        group.close()
    assert group.exitcodes == [0, 0]


def test_a_group_spans_two_devices_at_least():
    with pytest.raises(ValueError, match="at least 2 devices"):
        Group([None])
