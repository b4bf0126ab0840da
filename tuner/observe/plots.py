"""Pictures of stored results (matplotlib, written as PNG files)."""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path

from tuner.runtime.lookup import BASELINE


def plot_names(maps) -> list[str]:
    """A file name (without ".png") for each of `maps` (`tuner.cli.FamilyMap`),
    none twice: the family's name, characters a file name should not hold as
    "_"; where names repeat, with the family's N and K, then its device."""

    def safe(text: str) -> str:
        return re.sub(r"[^A-Za-z0-9._+-]+", "_", text).strip("._") or "family"

    def shape(fm) -> str:
        f = fm.family
        k = "_".join(map(str, f["group_k"])) if f.get("group_k") else f["k"]
        return f"n{f['n']}-k{k}" + (f"-g{f['groups']}" if f.get("groups", 1) > 1 else "")

    names = [safe(fm.name) if fm.name.strip("-") else shape(fm) for fm in maps]
    for more in (lambda fm: shape(fm) + "-" + fm.family["dtype_in"] + "-" + fm.family["layout"],
                 lambda fm: safe(fm.family["device"])):
        seen = Counter(names)
        names = [f"{n}-{safe(more(fm))}" if seen[n] > 1 else n for n, fm in zip(names, maps)]
    seen = Counter(names)
    index = Counter()
    out = []
    for n in names:
        index[n] += 1
        out.append(f"{n}-{index[n]}" if seen[n] > 1 else n)
    return out


def plot_family(fm, output: Path):
    """Time against M of a family's M map (`tuner.cli.FamilyMap`): cuBLAS and
    the choice at every measured point, each interval shaded by its choice;
    below, cuBLAS time over the choice's and over the best kernel's. Writes
    `output` and returns the (closed) figure."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.legend_handler import HandlerTuple

    points = sorted({p["m"]: p for r in fm.ranges for p in r.evidence}.values(), key=lambda p: p["m"])
    choice_at = {p["m"]: r.config_name for r in fm.ranges for p in r.evidence if r.covers(p["m"])}
    names = list(dict.fromkeys(r.config_name for r in fm.ranges))
    colours = dict(zip(names, palette(len(names)), strict=True))
    fig, (ax, rx) = plt.subplots(2, 1, figsize=(9, 7), sharex=True, height_ratios=(3, 2))
    for r in fm.ranges:
        for axis in (ax, rx):
            axis.axvspan(r.m_lo, r.m_hi + 1, color=colours[r.config_name], alpha=0.12, lw=0)
    ms = [p["m"] for p in points]
    (cublas,) = ax.plot(ms, [p["ms"][BASELINE] for p in points], "k--", marker=".")
    ax.plot(ms, [p["ms"][choice_at[p["m"]]] for p in points], "-", color="0.4", lw=1)
    # One legend entry a choice; cuBLAS's is its line, with its points'
    # (and intervals') colour where it is a choice.
    handles, labels = [cublas], ["cuBLAS"]
    for name in names:
        at = [p for p in points if choice_at[p["m"]] == name]
        dots = ax.scatter([p["m"] for p in at], [p["ms"][name] for p in at], color=colours[name], zorder=3)
        if name == BASELINE:
            handles[0] = (cublas, dots)
        else:
            handles.append(dots)
            labels.append(name.removeprefix(f"{fm.family['arch']}-"))
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_ylabel("ms")
    f = fm.family
    ax.set_title(f"{fm.name}: N={f['n']} K={f['k']}, {f['device']}\nshaded: the choice of each M interval",
                 fontsize=10)
    ax.legend(handles, labels, fontsize=7, loc="upper left", handler_map={tuple: HandlerTuple(ndivide=None)})
    best = [max(p["ms"][BASELINE] / t for t in p["ms"].values()) for p in points]
    rx.plot(ms, [p["ms"][BASELINE] / p["ms"][choice_at[p["m"]]] for p in points], "-o", ms=3, color="0.2",
            label="cuBLAS / choice")
    rx.plot(ms, best, ":", color="tab:red", label="cuBLAS / fastest measured")
    rx.axhline(1.0, color="k", lw=0.8)
    rx.set_xlabel("M")
    rx.set_ylabel("speedup")
    rx.legend(fontsize=7, loc="lower left")
    for axis in (ax, rx):
        axis.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fig.savefig(output, dpi=110)
    plt.close(fig)
    return fig


def palette(count: int) -> list[tuple]:
    """`count` distinct RGBA colours: tab10's, tab20's past ten (a 27B map
    has eleven choices, and tab10 again gave the eleventh the first's
    colour), evenly spaced along turbo past twenty."""
    from matplotlib import colormaps

    if count <= 10:
        return [colormaps["tab10"](i) for i in range(count)]
    if count <= 20:
        return [colormaps["tab20"](i) for i in range(count)]
    return [colormaps["turbo"](i / (count - 1)) for i in range(count)]
