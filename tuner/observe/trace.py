"""One traced launch of a pool kernel: where and when every tile ran.

`run` launches the traced build (`kernels.trace`) of a config once on the
current GPU (dense or grouped, on the gpu backend's operands), after a
warm-up launch, holding SMs for a `held=S` key, and returns a `Trace`; `summarise` reduces its records to what the seeds draw
(tiles and busy time per SM, SM idle time, the launch's span), and `draw`
writes the pictures: a per-SM timeline of tiles, the tiles-per-SM
histogram and the idle time of every SM.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from kernels.space import GemmConfig, InvalidConfig
from kernels.trace import FIELDS, RECORD_WORDS
from tuner.key import Key


@dataclass(frozen=True)
class Trace:
    key: dict
    config: str
    device: str
    sms: int
    rows: list[int]          # output rows of each group (a record's `group`): K slices of a dense key too
    records: list[dict]      # one per tile that ran (FIELDS), times in ns

    @property
    def tiles(self) -> int:
        """CTA tiles of the problem: those inside each group's rows and N."""
        cfg = GemmConfig.from_name(self.config)
        return sum(_cdiv(r, cfg.cta_tile_m) for r in self.rows) * _cdiv(self.key["n"], cfg.tile_n)

    def to_json(self) -> dict:
        return {**asdict(self), "tiles": self.tiles, "summary": summarise(self)}


def group_rows(key: Key, cfg: GemmConfig) -> list[int]:
    """Output rows of each group of the launch (the groups of the records):
    a dense key's K slices, seed 000's problems (each K slice of each), or
    the MoE groups as the gpu backend routes them."""
    from tuner.backends.gpu_worker import group_bounds

    p = key.problem
    if p.groups == 1:
        return [p.m] * cfg.split_k
    if p.group_k:
        return [p.m] * p.groups * cfg.split_k
    bounds = group_bounds(p.m, p.groups)
    return [hi - lo for lo, hi in zip(bounds, bounds[1:])]


def slots(key: Key, cfg: GemmConfig) -> int:
    """Records the buffer holds: for every group, the CTA tiles of whole
    clusters over all M rows (a cluster's CTA past the edge still runs its
    tile; an MoE group has at most every row)."""
    p = key.problem
    tiles_m = _cdiv(_cdiv(p.m, cfg.cta_tile_m), cfg.cluster_m) * cfg.cluster_m
    tiles_n = _cdiv(_cdiv(p.n, cfg.tile_n), cfg.cluster_n) * cfg.cluster_n
    return tiles_m * tiles_n * len(group_rows(key, cfg))


def run(key: Key, cfg: GemmConfig, *, seed: int = 0) -> Trace:
    """Trace one launch of `cfg` on `key` on the current CUDA device."""
    import torch

    from kernels.compile import get_kernel
    from tuner.backends.gpu_worker import _make_operands, grouped_form
    from tuner.backends.carveout import hold_sms

    p = key.problem
    if not p.runs(cfg):
        raise InvalidConfig(f"{cfg.name()} cannot run {p.label()}")
    problem = key.to_dict()
    # The operands the gpu backend measures with (MoE groups routed alike).
    args = _make_operands(problem, torch.Generator(device="cuda").manual_seed(seed)).args
    runner = get_kernel(cfg, dtype_in=p.dtype_in, dtype_out=p.dtype_out, layout=p.layout,
                        grouped=grouped_form(problem), trace=True)
    buf = torch.full((slots(key, cfg) * RECORD_WORDS,), -1, dtype=torch.int64, device="cuda")
    runner(*args, buf)  # loads the module and warms L2 and the clocks
    buf.fill_(-1)
    torch.cuda.synchronize()
    if p.carveout:
        with hold_sms(p.carveout):
            runner(*args, buf)
    else:
        runner(*args, buf)
    torch.cuda.synchronize()
    words = buf.view(-1, RECORD_WORDS).cpu().tolist()
    records = [dict(zip(FIELDS, w)) for w in words if w[FIELDS.index("end_ns")] >= 0]
    props = torch.cuda.get_device_properties(torch.cuda.current_device())
    return Trace(problem, cfg.name(), props.name, props.multi_processor_count, group_rows(key, cfg), records)


def summarise(trace: Trace) -> dict:
    """Per SM: tiles, busy time (inside at least one of its tiles) and idle
    time (us) over the launch's span; and the claim latencies of dynamic
    schedulers."""
    recs = trace.records
    if not recs:
        return {"tiles_run": 0}
    t0 = min(r["start_ns"] for r in recs)
    span = max(r["end_ns"] for r in recs) - t0
    cfg = GemmConfig.from_name(trace.config)
    tiles_n = _cdiv(trace.key["n"], cfg.tile_n)
    intervals = {sm: [] for sm in range(trace.sms)}
    for r in recs:
        intervals.setdefault(r["sm"], []).append((r["start_ns"], r["end_ns"]))
    per_sm = {}
    for sm, tiles in intervals.items():
        busy = _covered(tiles) / 1000
        per_sm[sm] = {"tiles": len(tiles), "busy_us": round(busy, 3), "idle_us": round(span / 1000 - busy, 3)}
    claims = sorted(r["claim_ns"] for r in recs if r["claim_ns"] >= 0)
    return {
        "tiles_run": len(recs),
        "tiles_in_problem": sum(
            r["tile_n"] < tiles_n and r["tile_m"] < _cdiv(trace.rows[r["group"]], cfg.cta_tile_m) for r in recs),
        "span_us": round(span / 1000, 3),
        "sms_used": sum(s["tiles"] > 0 for s in per_sm.values()),
        "idle_us_total": round(sum(s["idle_us"] for s in per_sm.values()), 3),
        "claims": len(claims),
        "claim_ns_median": claims[len(claims) // 2] if claims else None,
        "per_sm": {str(sm): s for sm, s in sorted(per_sm.items())},
    }


def _covered(intervals: list[tuple[int, int]]) -> int:
    """Nanoseconds inside at least one (start, end) interval: an SM's tiles
    overlap where an sm100 mainloop runs beside the previous tile's epilogue
    (or two CTAs share the SM), and busy time counts each moment once."""
    total, reach = 0, min((start for start, _ in intervals), default=0)
    for start, end in sorted(intervals):
        total += max(0, end - max(start, reach))
        reach = max(reach, end)
    return total


def write(trace: Trace, out: Path, stem: str = "trace") -> list[Path]:
    """`out`/`stem`.json and the pictures (`stem`.timeline.png, ...); returns the files written."""
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{stem}.json"
    path.write_text(json.dumps(trace.to_json(), indent=1) + "\n")
    return [path, *draw(trace, out, stem)]


def draw(trace: Trace, out: Path, stem: str = "trace") -> list[Path]:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    summary = summarise(trace)
    title = f"{trace.config}\n{_key_label(trace.key)} on {trace.device}"
    recs = trace.records
    t0 = min((r["start_ns"] for r in recs), default=0)
    groups = sorted({r["group"] for r in recs})
    colour_by = "group" if len(groups) > 1 else "tile_m"
    values = sorted({r[colour_by] for r in recs})
    cmap = plt.get_cmap("viridis", max(len(values), 2))
    colour = {v: cmap(i) for i, v in enumerate(values)}

    fig, ax = plt.subplots(figsize=(11, max(4.0, trace.sms * 0.06)))
    for r in recs:
        ax.barh(r["sm"], (r["end_ns"] - r["start_ns"]) / 1000, left=(r["start_ns"] - t0) / 1000, height=0.8,
                color=colour[r[colour_by]], edgecolor="k", linewidth=0.2)
    ax.set_ylim(-1, trace.sms)
    ax.invert_yaxis()
    ax.set_xlabel("us since the first tile began")
    ax.set_ylabel("SM (%smid)")
    what = "group (K slice)" if trace.key["groups"] == 1 else "group"
    ax.set_title(f"{title}\none bar per tile, coloured by {what if colour_by == 'group' else 'tile row'}",
                 fontsize=9)
    timeline = _save(fig, out / f"{stem}.timeline.png")

    per_sm = summary.get("per_sm", {})
    counts = [s["tiles"] for s in per_sm.values()]
    fig, ax = plt.subplots(figsize=(7, 4))
    if counts:
        ax.hist(counts, bins=range(0, max(counts) + 2), align="left", rwidth=0.8, color="tab:blue")
    ax.set_xlabel("tiles run by an SM")
    ax.set_ylabel("SMs")
    ax.set_title(f"{title}\ntiles per SM ({summary.get('tiles_run', 0)} tiles, {trace.sms} SMs)", fontsize=9)
    histogram = _save(fig, out / f"{stem}.tiles_per_sm.png")

    fig, ax = plt.subplots(figsize=(11, 4))
    sms = [int(sm) for sm in per_sm]
    ax.bar(sms, [s["idle_us"] for s in per_sm.values()], color="tab:red", width=0.9)
    ax.set_xlabel("SM (%smid)")
    ax.set_ylabel("idle us within the launch")
    ax.set_title(f"{title}\nSM idle time: {summary.get('idle_us_total', 0):.0f} us in all over a "
                 f"{summary.get('span_us', 0):.1f} us span", fontsize=9)
    idle = _save(fig, out / f"{stem}.sm_idle.png")
    return [timeline, histogram, idle]


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _key_label(key: dict) -> str:
    k = ",".join(map(str, key["group_k"])) if key["group_k"] else str(key["k"])
    text = f"{key['m']}x{key['n']}x{k}" + (f" groups={key['groups']}" if key["groups"] > 1 else "")
    return text + (f" held={key['carveout']}" if key["carveout"] else "")


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)
