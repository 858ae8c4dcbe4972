"""Agreeing on an error across ranks: every rank learns of any rank's failure and raises the same one line,
so no rank waits for a peer that already gave up.

Collective over one group: every rank calls `gather_failures` with its own error or None, and gets the same
list back. `one_line` words it: for a stage that many ranks ran (`stage=`), every failed rank named (up to
`most`); for a check whose first failure says enough, that one (its own rank sees the bare message).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence


@dataclass(frozen=True)
class Failure:
    rank: int
    message: str
    exit_code: int = 1  # 2: bad input, 1: a runtime failure (the exit code the CLI leaves with)
    role: str = ""  # what the rank is, where a group mixes kinds ("trainer", "vLLM worker 3")

    def who(self, label: str = "rank") -> str:
        return f"{label} {self.rank}" + (f" ({self.role})" if self.role else "")


def gather_failures(all_gather_object: Callable[[object], list], message: str | None, *, exit_code: int = 1,
                    role: str = "") -> list[Failure]:
    """Collective: every rank's failure (rank order), from the group whose `all_gather_object` is given."""
    everyone = all_gather_object((message, exit_code, role))
    return [Failure(r, m, c, ro) for r, (m, c, ro) in enumerate(everyone) if m is not None]


def one_line(failures: Sequence[Failure], *, stage: str | None = None, me: int | None = None,
             label: str = "rank", most: int = 4) -> str:
    """The error every rank raises. With `stage`: '<stage> failed on N rank(s): rank r: msg; ...'. Without:
    the first failure, prefixed by who failed unless it is `me`."""
    if stage is None:
        first = failures[0]
        return first.message if first.rank == me else f"{first.who(label)}: {first.message}"
    text = f"{stage} failed on {len(failures)} rank(s): " + "; ".join(
        f"{f.who(label)}: {f.message}" for f in failures[:most])
    if len(failures) > most:
        text += f"; ... {len(failures) - most} more"
    return text
