"""How well a quick calibration's model ranks a device's measured configs.

    python -m bench.probes.quick_calibration --db DB --quick QUICK_JSON [--device NAME]

QUICK_JSON is what `tuner calibrate --quick --json` printed on the device.
Scores (median Spearman per key, the model's pick against the best
measured, mean error of the times; `tuner.backends.calibration.score`) over
every key of DB with trials of the device, for: its calibration in effect,
the arch's datasheet model, the quick entry built without a reference (as
on a device no fitted entry covers), and the quick entry scaled from the
calibration in effect as if the device were another one (which must
predict what that calibration predicts).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import replace

from db.store import Store
from tuner.backends.calibration import quick_entry, samples, score
from tuner.backends.model import DEVICES, calibration_path, device_model, read_calibrations


def _entry_model(arch: str, name: str, entry: dict):
    return replace(DEVICES[arch], name=name, **entry["facts"], **entry["constants"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", required=True)
    parser.add_argument("--quick", required=True, help="`tuner calibrate --quick --json` output.")
    parser.add_argument("--device", default=None, help="Default: the quick run's device.")
    args = parser.parse_args()
    quick = json.load(open(args.quick))
    arch, name = quick["arch"], args.device or quick["device"]
    store = Store(args.db, writer=False)
    data = samples(store, arch, name)
    store.close()
    alone, _ = quick_entry(arch, quick["driver"], quick["probe"], {})
    mine = read_calibrations(calibration_path())
    scaled, _ = quick_entry(arch, quick["driver"] | {"name": "another"}, quick["probe"], mine)
    models = {
        "calibration in effect": device_model(arch, name),
        "datasheet": DEVICES[arch],
        "quick, no reference": _entry_model(arch, name, alone),
        "quick, scaled from it": _entry_model(arch, "another", scaled) if "facts" in scaled else None,
    }
    out = {}
    for label, model in models.items():
        if model is None:
            continue
        s = score(data, model)
        out[label] = {"keys": s.keys, "median_spearman": round(s.median_spearman, 3),
                      "mean_pick_slowdown": round(s.mean_pick_slowdown, 4),
                      "mean_abs_error": round(s.mean_abs_error, 3)}
        print(f"{label:24s} keys {s.keys:3d}  Spearman {s.median_spearman:.3f}  "
              f"pick {100 * s.mean_pick_slowdown:5.2f} % slower  time error {100 * s.mean_abs_error:4.1f} %")
    print(json.dumps({"db": args.db, "device": name, "scores": out}))


if __name__ == "__main__":
    main()
