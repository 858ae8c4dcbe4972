"""What an engine holds after an update that ran in staging groups, and the weight version that says so.

An update commits its groups one at a time, each once every rank agreed it arrived intact. After a failure an
engine may hold the first k of n groups from the new step and the rest from the previous one; its workers may
even differ (a commit that failed part-way on one worker, a worker that stopped answering between the last
agreement and its commit). `Held` is that range for one engine, and `label` the weight version it is given,
so that no engine carries a version that does not describe its weights:

    every group             the new version
    none                    unchanged (None: the engine keeps its label)
    k of n on every worker  "<version>+partial-<k>of<n>"
    k..m of n (workers differ, or unknown within that range)   "<version>+mixed-<k>to<m>of<n>"
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Held:
    lo: int  # groups every worker of the engine committed
    hi: int  # groups some worker may hold, wholly or in part (lo when all agree)
    n: int  # the update's groups

    def __post_init__(self):
        if not 0 <= self.lo <= self.hi <= self.n:
            raise ValueError(f"held groups must satisfy 0 <= lo <= hi <= n, not {self.lo}, {self.hi}, {self.n}")

    @property
    def mixed(self) -> bool:
        """The workers (may) hold different groups."""
        return self.lo != self.hi

    @property
    def partial(self) -> bool:
        """Some but not all of the new step: the engine computes with a mix of two steps."""
        return self.hi > 0 and self.lo < self.n


def held_by(ranks, held: dict, torn: set = frozenset(), n: int = 0, *, upto: int | None = None) -> Held:
    """One engine's `Held` from its workers' refit `ranks`: `held` the groups each recorded it committed (none
    recorded: none committed), `torn` the workers whose commit of the next group failed part-way, and `upto`
    (an engine that did not answer when the update failed) the groups whose last agreement had passed: it may
    have committed up to there since."""
    counts = [held.get(r, 0) for r in ranks] or [0]
    lo = min(counts)
    hi = max(c + (1 if r in torn else 0) for r, c in zip(ranks, counts)) if ranks else 0
    if upto is not None:
        hi = max(hi, upto)
    return Held(min(lo, n), min(hi, n), n)


def label(version: str | None, held: Held) -> str | None:
    """The weight version of an engine holding `held` of a failed update to `version` (None: leave its label;
    an update that failed before it had groups committed nothing)."""
    if held.n == 0:
        return None
    if held.lo == held.n:
        return version
    if held.hi == 0:
        return None
    base = version or "update"
    if not held.mixed:
        return f"{base}+partial-{held.lo}of{held.n}"
    return f"{base}+mixed-{held.lo}to{held.hi}of{held.n}"
