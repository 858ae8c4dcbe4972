"""The plan's vocabulary, shared by the planner, the schedule and the cost model: routes, traffic kinds, modes,
the pieces and broadcasts a plan is made of, and auto's per-class routes as handed to a plan.

It is the bottom of `reshard_cli.plan` and imports none of its siblings, so the order inside the package runs
one way: terms → planner → schedule → cost.
"""
from __future__ import annotations

import gc
from contextlib import contextmanager
from dataclasses import dataclass
from enum import Enum, IntEnum
from typing import NamedTuple

from reshard_cli.base.geometry import Box


class _StrEnum(str, Enum):
    """enum.StrEnum for Python 3.10 too: members are their string in comparisons, hashing, str(), f-strings and JSON."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)


class Route(_StrEnum):
    """A tensor's route: with forwarding or direct (the reshard path), or broadcast. A member equals and hashes
    as its string, which is what the JSON and the reports show. The order is auto's tie-break order."""

    FORWARD = "forward"
    DIRECT = "direct"
    BROADCAST = "broadcast"


ROUTES = tuple(Route)
MODES = ("auto", "hybrid", "reshard", "broadcast")


class Traffic(IntEnum):
    """The kinds of reshard-path traffic. Integers, because the cost model packs a kind into its pair keys
    (kind * world² + sender * world + receiver) and indexes arrays with it."""

    NET = 0  # phase 0 across domains (network)
    NVL0 = 1  # phase 0 inside a domain (NVLink)
    FWD = 2  # phase 1: forwards inside a destination domain (NVLink)


class Piece(NamedTuple):
    tensor: int
    src: int
    dst: int
    box: Box  # global coordinates
    phase: int  # 0: from a source rank, 1: forwarded inside a destination domain


class Bcast(NamedTuple):
    tensor: int
    root: int  # source rank that assembles the full tensor
    gather: tuple  # ((src rank, box), ...): the other source boxes sent to the root
    root_box: Box  # what the root already holds
    receivers: tuple  # destination ranks that hold a non-empty part


@dataclass(frozen=True)
class ClassRoutes:
    """Mode auto's route per tensor class (in `TensorClasses.index` order) and, in words, what decided them. The
    cost model chooses them (`cost.auto_routes`) and hands them to the plan, which only follows them."""

    routes: tuple[Route, ...]
    why: str


@contextmanager
def no_gc():
    """Pause the cyclic garbage collector: planning allocates millions of small acyclic objects (boxes, tuples),
    and the full collections they trigger cost more than the planning itself (nothing here makes cycles)."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()
