"""The tuning report: one HTML page over a database, its pictures beside it.

`write_report` draws (matplotlib, PNG) the speedup of every winner over
cuBLAS, the best time of each scheduler per key, the M map of every family,
and the model's predicted time against the measured time of every trial with
its rank correlation per key; the page links nothing outside its directory.
"""

from __future__ import annotations

import html
import math
import re
from collections import defaultdict
from datetime import datetime, timezone
from pathlib import Path

import numpy as np

from tuner.backends.calibration import predictions, samples, spearman
from tuner.backends.model import device_model
from tuner.key import Key
from tuner.observe.plots import plot_family

# Rows of one bar chart before the keys are split over several pictures.
ROWS_PER_FIGURE = 60
_SCHEDULER_MARKS = {"cublas": ("k", "s"), "single_tile": ("tab:orange", "v"),
                    "static_persistent": ("tab:blue", "o"), "dynamic_persistent": ("tab:green", "D"),
                    "stream_k": ("tab:purple", "P"), "clc": ("tab:red", "^")}


def write_report(store, maps: list, out: Path) -> Path:
    """Write `out`/index.html and its PNGs for every winner, map and trial in
    `store`; `maps` are the stored M maps (`tuner.cli.FamilyMap`). Returns the page."""
    import matplotlib

    matplotlib.use("Agg")
    out.mkdir(parents=True, exist_ok=True)
    winners = store.winners(limit=10_000_000)
    sections: list[str] = []
    by_device: dict[tuple, list] = defaultdict(list)
    for w in winners:
        by_device[w.key["arch"], w.key["device"], w.backend].append(w)

    parts = []
    for (arch, device, backend), ws in sorted(by_device.items()):
        tag = _slug(f"{device}-{backend}")
        for i, chunk in enumerate(_chunks(ws, ROWS_PER_FIGURE)):
            parts.append(_img(_speedup_png(chunk, out / f"speedup-{tag}-{i}.png",
                                           f"{device} ({backend}): speedup over cuBLAS"), "speedup over cuBLAS"))
    sections.append(_section("Speedup over cuBLAS per key", parts, _winners_table(winners)))

    parts = []
    for (arch, device, backend), ws in sorted(by_device.items()):
        tag = _slug(f"{device}-{backend}")
        for i, chunk in enumerate(_chunks(ws, ROWS_PER_FIGURE)):
            parts.append(_img(_schedulers_png(chunk, out / f"schedulers-{tag}-{i}.png",
                                              f"{device} ({backend}): best time per scheduler"),
                              "best time per scheduler"))
    sections.append(_section("Best time per scheduler per key", parts))

    parts = []
    for i, fm in enumerate(maps):
        path = out / f"map-{i}-{_slug(fm.name)}.png"
        plot_family(fm, path)
        parts.append(_img(path, f"M map of {fm.name}"))
    sections.append(_section("M map per family", parts or ["<p>No M maps stored.</p>"]))

    parts, rows = [], []
    devices = sorted({(kt.key["arch"], kt.key["device"]) for kt in store.key_trials()})
    for arch, device in devices:
        data = samples(store, arch, device)
        if not data:
            continue
        path, rhos = _model_png(data, device_model(arch, device), out / f"model-{_slug(device)}.png",
                                f"{device}: model against measurement")
        parts.append(_img(path, f"model against measurement on {device}"))
        rows.extend((device, s, rho) for s, rho in zip(data, rhos, strict=True))
    sections.append(_section("Model-predicted against measured time", parts or ["<p>No trials stored.</p>"],
                             _rank_table(rows)))

    page = out / "index.html"
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    page.write_text(_PAGE.format(stamp=stamp, body="\n".join(sections)))
    return page


# --------------------------------------------------------------------------
# Pictures


def _speedup_png(ws, path: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    labels = [_label(w.name, w.key) for w in ws]
    speedup = [w.speedup for w in ws]
    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.22 * len(ws)))
    y = np.arange(len(ws))
    ax.barh(y, speedup, color=["tab:green" if s >= 1 else "tab:red" for s in speedup])
    ax.axvline(1.0, color="k", lw=0.8)
    ax.set_yticks(y, labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlabel("cuBLAS time / winner time")
    ax.set_title(title, fontsize=10)
    ax.grid(True, axis="x", alpha=0.3)
    return _save(fig, path)


def _schedulers_png(ws, path: Path, title: str) -> Path:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 1.2 + 0.22 * len(ws)))
    seen = set()
    for row, w in enumerate(ws):
        best = min(w.best_by_scheduler.values(), default=w.ms)
        for sched, ms in w.best_by_scheduler.items():
            colour, marker = _SCHEDULER_MARKS.get(sched, ("tab:gray", "x"))
            ax.scatter(ms / best, row, color=colour, marker=marker, s=22,
                       label=None if sched in seen else sched, zorder=3)
            seen.add(sched)
    ax.set_yticks(np.arange(len(ws)), [_label(w.name, w.key) for w in ws], fontsize=7)
    ax.invert_yaxis()
    ax.set_xscale("log")
    ax.set_xlabel("best time of the scheduler / best time of the key (1 = fastest)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, which="both", axis="x", alpha=0.3)
    if seen:
        ax.legend(fontsize=7, loc="lower right")
    return _save(fig, path)


def _model_png(data, device, path: Path, title: str) -> tuple[Path, list[float]]:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 6))
    rhos = []
    lo, hi = math.inf, 0.0
    for s in data:
        pred = predictions(s, device)
        ok = np.isfinite(pred)
        rhos.append(spearman(pred[ok], s.ms[ok]) if ok.sum() >= 3 else math.nan)
        if ok.any():
            ax.scatter(s.ms[ok], pred[ok], s=9, alpha=0.7)
            lo = min(lo, s.ms[ok].min(), pred[ok].min())
            hi = max(hi, s.ms[ok].max(), pred[ok].max())
    if hi > 0:
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("measured ms")
    ax.set_ylabel(f"predicted ms ({device.name})")
    valid = [r for r in rhos if not math.isnan(r)]
    median = f"{np.median(valid):.2f}" if valid else "-"
    ax.set_title(f"{title}\nmedian per-key Spearman {median} over {len(valid)} keys; a colour per key",
                 fontsize=10)
    ax.grid(True, which="both", alpha=0.3)
    return _save(fig, path), rhos


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


# --------------------------------------------------------------------------
# HTML


_PAGE = """<!DOCTYPE html>
<html lang="en"><head><meta charset="utf-8"><title>gemm-tuner report</title>
<style>
body {{ font-family: sans-serif; margin: 2em; max-width: 1100px; }}
table {{ border-collapse: collapse; font-size: 0.85em; margin: 1em 0; }}
td, th {{ border-bottom: 1px solid #ddd; padding: 2px 8px; text-align: right; }}
td:first-child, th:first-child {{ text-align: left; }}
img {{ max-width: 100%; display: block; margin: 1em 0; }}
</style></head>
<body>
<h1>gemm-tuner report</h1>
<p>Written {stamp}.</p>
{body}
</body></html>
"""


def _section(title: str, parts: list[str], table: str = "") -> str:
    return f"<h2>{html.escape(title)}</h2>\n" + "\n".join(parts) + ("\n" + table if table else "")


def _img(path: Path, alt: str) -> str:
    return f'<img src="{html.escape(path.name)}" alt="{html.escape(alt)}">'


def _winners_table(winners) -> str:
    if not winners:
        return "<p>No winners stored.</p>"
    return _table(("key", "device", "winner", "ms", "cuBLAS ms", "speedup"), (
        (_label(w.name, w.key), w.key["device"], w.config_name, f"{w.ms:.4f}", f"{w.baseline_ms:.4f}",
         f"{w.speedup:.2f}")
        for w in winners))


def _rank_table(rows) -> str:
    if not rows:
        return ""
    return _table(("key", "device", "configs", "Spearman"), (
        (_label(s.name, s.key.to_dict()), device, str(len(s.configs)), "-" if math.isnan(rho) else f"{rho:.2f}")
        for device, s, rho in rows))


def _table(headers, rows) -> str:
    """An HTML table of `headers` and `rows` of cell text (escaped here)."""
    head = "".join(f"<th>{html.escape(h)}</th>" for h in headers)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _label(name: str, key: dict) -> str:
    return f"{name or '-'} {Key.from_dict(key).problem.label()}"


def _chunks(items: list, size: int) -> list[list]:
    return [items[i:i + size] for i in range(0, len(items), size)]


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-").lower() or "x"
