import pytest

from tuner.observe.plots import palette


@pytest.mark.parametrize("count", [1, 10, 11, 20, 21, 40])
def test_every_choice_of_a_map_gets_its_own_colour(count):
    colours = palette(count)
    assert len(colours) == count == len(set(colours))
