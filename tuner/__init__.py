"""Scheduler-aware GEMM autotuning: `gemm` runs the tuned kernel for a shape,
`explain` says which one and why, `lookup` finds a key's winner in a store,
`patch(model)` (or `with patched(model):`) runs a model's linear layers
through `gemm`, `check(model, workload)` keeps them on the kernels only where
those win inside the model's forward, and `unpatch(model)` undoes it.
`with overlap(nbytes):` makes `gemm` look up the keys tuned beside an
all-reduce of that many bytes.

The names load on first use: `import tuner` stays cheap (no torch, no
database driver) for the command line and the HTTP service.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "gemm": "tuner.runtime.dispatch", "explain": "tuner.runtime.dispatch", "overlap": "tuner.runtime.dispatch",
    "lookup": "tuner.runtime.lookup",
    "patch": "tuner.runtime.patch", "unpatch": "tuner.runtime.patch", "patched": "tuner.runtime.patch", "check": "tuner.runtime.patch",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value

