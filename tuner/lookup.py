"""Which stored winner serves a key: shared by `gemm` and the HTTP service.

The rule: the exact key if it has a winner; otherwise, among the winners
that share every field but M (arch, device, dtypes, layout, N, K, groups),
the one whose M is nearest on a log scale, the larger M on a tie. M follows
the batch, and a config tuned at M' = 2M tiles the same N x K the same way,
so the nearest M in ratio is the best guess; the larger one on a tie because
it fills the machine at least as well.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from db.store import Store, WinnerView
from tuner.key import Key


@dataclass(frozen=True)
class Decision:
    winner: WinnerView
    exact: bool
    stale: bool

    @property
    def tuned_m(self) -> int:
        return self.winner.key["m"]


def nearest_m(m: int, tuned: list[int]) -> int | None:
    """The tuned M nearest to `m` in ratio; the larger on a tie."""
    if not tuned:
        return None
    return min(tuned, key=lambda t: (abs(math.log(t / m)), -t))


def lookup(store: Store, key: Key, versions: dict[str, str] | None = None) -> Decision | None:
    """The winner for `key` (exact or nearest M), or None. Staleness is judged
    against `versions` when given."""
    key_dict = key.to_dict()
    winner = store.winner(key_dict)
    exact = winner is not None
    if winner is None:
        m = nearest_m(key.problem.m, store.tuned_m(key_dict))
        if m is None:
            return None
        winner = store.winner(key.with_m(m).to_dict())
        if winner is None:
            return None
    stale = versions is not None and winner.stale(versions)
    return Decision(winner=winner, exact=exact, stale=stale)
