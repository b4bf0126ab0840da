"""Where the analytic model is off, by config feature, over measured trials.

    python -m bench.probes.model_bias --db DB [--db DB ...] [--device NAME] [--m-max M] [--json]

For every key of the databases with at least three measured configs, each
config's error `log(predicted / measured)` less the key's median error (the
key's scale is `calibration`'s concern; this is about order), grouped by
one feature at a time: swap_ab, scheduler, K split, cluster, stages, tile
depth, consumer, and for the non-swapped configs whether their activation
tile holds more rows than the key has. A group whose mean sits well away
from zero is a config kind the model prices too fast (negative) or too
slow (positive) against the others of its key: a structural gap a fit of
the constants cannot close (`tuner calibrate` fits them all to the same
trials). `--m-max` keeps the keys of at most that many rows (decode: 128).
"""

from __future__ import annotations

import argparse
import json
import math
from collections import defaultdict

import numpy as np

from db.store import Store, StoreError
from tuner.backends.calibration import MIN_CONFIGS, devices, predictions, samples
from tuner.backends.model import device_model

# Groups of fewer trials than this are left out of the table.
MIN_TRIALS = 20


def features(cfg, m: int) -> list[str]:
    """The groups one config of a key of `m` rows falls into."""
    out = [
        f"swap_ab={cfg.swap_ab}",
        f"scheduler={cfg.scheduler}",
        f"split_k={cfg.split_k}",
        f"cluster={cfg.cluster_m}x{cfg.cluster_n}",
        f"stages={cfg.stages}",
        f"tile_k={cfg.tile_k}",
        f"consumer={cfg.consumer}",
    ]
    if not cfg.swap_ab:
        out.append(f"rows past M={'yes' if cfg.tile_m > m else 'no'} (tile_m {cfg.tile_m})")
    return out


def errors(dbs: list[str], device: str | None, m_max: int | None) -> dict[str, list[float]]:
    """Key-centred log errors per feature group."""
    groups: dict[str, list[float]] = defaultdict(list)
    for url in dbs:
        store = Store(url, writer=False)
        try:
            found = devices(store)
            pairs = [d for d in found if device is None or d[1] == device]
            data = [s for arch, name in pairs for s in samples(store, arch, name)]
        finally:
            store.close()
        for s in data:
            p = s.key.problem
            if m_max is not None and p.m > m_max:
                continue
            pred = predictions(s, device_model(s.key.arch, s.key.device))
            ok = np.isfinite(pred)
            if ok.sum() < MIN_CONFIGS:
                continue
            r = np.log(pred[ok] / s.ms[ok])
            r -= np.median(r)
            for cfg, err in zip((c for c, k in zip(s.configs, ok) if k), r):
                for f in features(cfg, p.m):
                    groups[f].append(float(err))
    return groups


def table(groups: dict[str, list[float]]) -> list[dict]:
    rows = []
    for name in sorted(groups):
        v = np.array(groups[name])
        if len(v) >= MIN_TRIALS:
            rows.append({"group": name, "trials": len(v), "mean": round(math.expm1(v.mean()), 4),
                         "median": round(math.expm1(float(np.median(v))), 4)})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--db", action="append", required=True, help="A database URL or SQLite path; repeatable.")
    parser.add_argument("--device", default=None, help="Default: every measured device of the databases.")
    parser.add_argument("--m-max", type=int, default=None)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    try:
        groups = errors(args.db, args.device, args.m_max)
    except StoreError as exc:
        parser.error(str(exc))
    if not groups:
        parser.error(f"no key with {MIN_CONFIGS} or more measured configs"
                     + (f" of device {args.device!r}" if args.device else "")
                     + (f" at M <= {args.m_max}" if args.m_max is not None else "") + " in the databases given")
    rows = table(groups)
    if args.json:
        print(json.dumps({"dbs": args.db, "device": args.device, "m_max": args.m_max, "groups": rows}))
        return
    print(f"{'group':44s} {'trials':>7s} {'mean':>8s} {'median':>8s}")
    for r in rows:
        print(f"{r['group'][:44]:44s} {r['trials']:7d} {100 * r['mean']:+7.1f}% {100 * r['median']:+7.1f}%")


if __name__ == "__main__":
    main()
