import subprocess
import sys
from datetime import datetime, timezone
from pathlib import Path

import pytest

from db.store import RangeView
from tuner.cli import FamilyMap
from tuner.observe.plots import palette, plot_family, plot_names
from tuner.runtime.lookup import BASELINE

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize("count", [1, 10, 11, 20, 21, 40])
def test_every_choice_of_a_map_gets_its_own_colour(count):
    colours = palette(count)
    assert len(colours) == count == len(set(colours))


ROOT = Path(__file__).resolve().parents[1]
FAMILY = {"arch": "sm90", "device": "H100-model", "dtype_in": "bf16", "dtype_out": "bf16", "layout": "tn",
          "n": 1024, "k": 1024, "groups": 1, "group_k": None, "carveout": 0}
KERNEL = "sm90-single_tile-t64x16x128-c1x1-s8-w1m-k8-ab"


def _range(lo, hi, choice, points, family=FAMILY):
    return RangeView(family, lo, hi, choice, "-", None if choice == BASELINE else {}, points, "ladder", "model",
                     {}, datetime.now(timezone.utc))


def _map(name="fam", family=FAMILY):
    points = [{"m": m, "ms": {BASELINE: 1.0 + m / 100, KERNEL: 1.0 + m / 100 + (0.1 if m < 8 else -0.1)}}
              for m in (1, 2, 4, 8, 16)]
    return FamilyMap(name, family, [_range(1, 7, BASELINE, points[:3], family),
                                    _range(8, 16, KERNEL, points[3:], family)])


def test_cublas_has_one_legend_entry_where_it_is_a_choice(tmp_path):
    fig = plot_family(_map(), tmp_path / "f.png")
    labels = [t.get_text() for t in fig.axes[0].get_legend().get_texts()]
    assert [label for label in labels if label.lower() == "cublas"] == ["cuBLAS"], labels
    assert labels == ["cuBLAS", KERNEL.removeprefix("sm90-")]
    assert (tmp_path / "f.png").read_bytes()[:8] == PNG


def test_file_names_of_families_never_repeat():
    other = {**FAMILY, "device": "NVIDIA H100 80GB HBM3"}
    wider = {**FAMILY, "n": 2048}
    maps = [_map("m.o"), _map("m.o", other), _map("m/q"), _map("", wider), _map("-"), _map("m.o", wider)]
    names = plot_names(maps)
    assert len(set(names)) == len(names) and all("/" not in n and " " not in n for n in names), names
    assert names[2] == "m_q" and names[3] == "n2048-k1024"


def _cli(*args, db):
    return subprocess.run([sys.executable, "-m", "tuner.cli", *args, "--db", str(db)], capture_output=True,
                          text=True, cwd=ROOT, check=True)


@pytest.fixture(scope="module")
def two_families(tmp_path_factory):
    d = tmp_path_factory.mktemp("plot")
    (d / "s.txt").write_text("1,8 1024 1024 name=x.a\n16 2048 1024 name=x.b\n4 512 512 name=y\n")
    _cli("tune", "--shapes", str(d / "s.txt"), "--backend", "model", "--trials", "2", db=d / "t.db")
    return d / "t.db"


def test_a_glob_plots_each_family_it_matches_into_a_directory(two_families, tmp_path):
    out = tmp_path / "plots"
    printed = _cli("plot", "--family", "x.*", "-o", str(out), db=two_families).stdout.splitlines()
    assert printed == [f"wrote {out / 'x.a.png'}", f"wrote {out / 'x.b.png'}"]
    assert sorted(p.name for p in out.iterdir()) == ["x.a.png", "x.b.png"]
    assert all(p.read_bytes()[:8] == PNG for p in out.iterdir())


def test_a_glob_with_a_png_file_names_one_file_a_family_after_it(two_families, tmp_path):
    printed = _cli("plot", "--family", "x.*", "-o", str(tmp_path / "map.png"), db=two_families).stdout
    assert sorted(p.name for p in tmp_path.iterdir()) == ["map-x.a.png", "map-x.b.png"]
    assert all(str(p) in printed for p in tmp_path.iterdir())
    one = tmp_path / "one" / "y.png"
    assert _cli("plot", "--family", "y", "-o", str(one), db=two_families).stdout.strip() == f"wrote {one}"
    assert one.read_bytes()[:8] == PNG
