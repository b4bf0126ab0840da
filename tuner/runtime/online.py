"""Online tuning, opt in (PyTorch TunableOp's convention): `TUNER_ONLINE=1` or
`tuner.runtime.dispatch.configure(online=True)`.

The first `gemm` call at an M that no measured interval of its family's M map
covers measures, on the live device and the caller's own operands, cuBLAS
and the choices of the nearest measured M below and above (the candidates a
ladder would validate there), interleaved, within about `BUDGET_S` (a kernel
not yet in the compile cache is built first, which takes longer). The
fastest runs at once and is stored as a one-M range of the map with its
measurements and source "online", so later processes use it without
measuring. A measurement taken in a slow spell of the GPU (its cuBLAS call
`tuner.backends.measure.slow_spell` against one stored for a larger M of the family)
decides nothing: the call runs cuBLAS and a later process measures again.
Never during CUDA graph capture or torch.compile tracing (the
dispatcher does not reach this module then); off by default, so the default
path never measures.
"""

from __future__ import annotations

import math
import os
import statistics
import time
from typing import Callable, Sequence

from db.store import Store
from kernels.space import GemmConfig
from tuner.key import Key
from tuner.runtime.lookup import BASELINE, Decision, decide, family_of
from tuner.backends.measure import slow_spell

ENV_VAR = "TUNER_ONLINE"
# Time one new M may spend measuring, launches included.
BUDGET_S = 0.05
# Interleaved rounds at least, even for slow products (each candidate runs once per round).
MIN_ROUNDS = 3

# `measure(candidates)` -> ms per candidate (None: failed), cuBLAS as None in the list.
Measure = Callable[[Sequence[GemmConfig | None]], list[float | None]]


def enabled_by_env() -> bool:
    return os.environ.get(ENV_VAR, "").strip().lower() in ("1", "true", "yes", "on")


def candidates(store: Store, key: Key) -> list[GemmConfig]:
    """The kernel choices of the nearest measured M below and above the key's
    (map ranges, else tuned winners) that can run its shape."""
    return _stored(store, key)[0]


def tune(store: Store, key: Key, measure: Measure, backend: str, versions: dict[str, str]) -> Decision | None:
    """Measure the key's M now, store the choice (unless another process stored
    one first) and return the decision the map then gives."""
    near, cublas_above = _stored(store, key)
    cands: list[GemmConfig | None] = [None, *near]
    times = measure(cands)
    ms = {(c.name() if c else BASELINE): t for c, t in zip(cands, times, strict=True) if t is not None}
    if BASELINE not in ms or slow_spell(ms[BASELINE], cublas_above):
        return None
    choice = min(ms, key=ms.get)
    cfg = next((c for c in cands if c is not None and c.name() == choice), None)
    env_id = store.environment(backend, key.arch, key.device, versions)
    m = key.problem.m
    store.add_online_range(family_of(key), env_id, dict(
        m_lo=m, m_hi=m, config_name=choice, scheduler=cfg.scheduler if cfg else BASELINE,
        config=cfg.to_dict() if cfg else None, evidence=[{"m": m, "ms": ms}],
    ))
    return decide(m, store.ranges(**family_of(key)), [])


def _stored(store: Store, key: Key) -> tuple[list[GemmConfig], float]:
    """From one read of the family's map and winners: `candidates`, and the
    fastest cuBLAS time stored at a larger M (map evidence and tuned keys'
    baselines; infinite where none is), the reference of `slow_spell`."""
    family, m = family_of(key), key.problem.m
    ranges, winners = store.ranges(**family), store.winners(limit=100_000, **family)
    measured: dict[int, dict | None] = {}
    for r in ranges:
        # A range's evidence includes the ends of its neighbours: keep the points it covers.
        measured.update((point["m"], r.config) for point in r.evidence if r.covers(point["m"]))
    for w in winners:
        measured.setdefault(w.key["m"], w.config)
    below = [t for t in measured if t < m]
    above = [t for t in measured if t > m]
    near: list[GemmConfig] = []
    for t in ([max(below)] if below else []) + ([min(above)] if above else []):
        if measured[t] is None:
            continue
        cfg = GemmConfig.from_dict(measured[t])
        if key.problem.runs(cfg) and cfg not in near:
            near.append(cfg)
    cublas = [p["ms"][BASELINE] for r in ranges for p in r.evidence if p["m"] > m and BASELINE in p["ms"]]
    cublas += [w.baseline_ms for w in winners if w.key["m"] > m]
    return near, min(cublas, default=math.inf)


def time_interleaved(launches: Sequence[Callable[[], object]], budget_s: float = BUDGET_S) -> list[float]:
    """Median ms per launch of each callable, timed round robin with CUDA
    events on the current stream, within about `budget_s` in all."""
    import torch

    for launch in launches:
        launch()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for launch in launches:
        launch()
    torch.cuda.synchronize()
    one_round = max(time.perf_counter() - start, 1e-6)
    rounds = max(MIN_ROUNDS, int(budget_s / one_round) - 1)
    events = [[(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
               for _ in range(rounds)] for _ in launches]
    for r in range(rounds):
        for i, launch in enumerate(launches):
            events[i][r][0].record()
            launch()
            events[i][r][1].record()
    torch.cuda.synchronize()
    return [statistics.median(s.elapsed_time(e) for s, e in per) for per in events]
