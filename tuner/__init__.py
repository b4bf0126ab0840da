"""Scheduler-aware GEMM autotuning: `gemm` runs the tuned kernel for a shape,
`explain` says which one and why, `lookup` finds a key's winner in a store,
`patch(model)` (or `with patched(model):`) runs a model's linear layers
through `gemm`, `check(model, workload)` keeps them on the kernels only where
those win inside the model's forward, and `unpatch(model)` undoes it.

The names load on first use: `import tuner` stays cheap (no torch, no
database driver) for the command line and the HTTP service.
"""

from __future__ import annotations

import importlib
import sys
import types

_EXPORTS = {
    "gemm": "tuner.dispatch", "explain": "tuner.dispatch", "lookup": "tuner.lookup",
    "patch": "tuner.patch", "unpatch": "tuner.patch", "patched": "tuner.patch", "check": "tuner.patch",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """Importing the submodule `tuner.lookup` binds the module to the package
    attribute `lookup`, hiding the exported function of that name: bind the
    function instead."""

    def __setattr__(self, name: str, value) -> None:
        if isinstance(value, types.ModuleType) and _EXPORTS.get(name) == value.__name__:
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
