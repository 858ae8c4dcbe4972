"""Mode auto's route search: which route (forward, direct or broadcast) each tensor class takes, chosen by the
cost model's figures (`cost._Model`) so that the whole refit is predicted fastest (`RouteSearch`, described in
`plan/cost.py`'s module text).
"""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any, NamedTuple

from reshard_cli.plan.rows import numpy_ as _np
from reshard_cli.plan.schedule import align
from reshard_cli.plan.terms import ROUTES, Route, Traffic

class Move(NamedTuple):
    """One class moved to `route`: the predicted refit, and the search's state if the move is taken."""

    total: float
    route: Route
    pairs: Any  # positions of the pairs whose bytes change (None: no reshard-path change)
    pair_bytes: Any  # their new bytes
    loads: tuple
    rank_seconds: Any
    kind_max: list
    bcast_tensors: list
    bcast_s: float


class RouteSearch:
    """Auto's routes (`run`): start from forward everywhere (mode reshard) and, class by class in a fixed order,
    move a class to another route (direct, broadcast, or back) where the model predicts the whole refit
    strictly faster with it; repeat until a pass changes nothing (at most 4 passes). Finally, broadcast
    everywhere wins if it is predicted faster still. So auto is never predicted slower than reshard or
    broadcast.

    Every figure compared is built from sums of whole bytes (exact in float64, whatever their order) and the
    same per-rank formula as `_Model.mode_cost`, so every rank computes the same figures and the same choice;
    ties keep the current route, and among new routes go to the first of forward, direct, broadcast. A class
    is tried on broadcast only when it touches a busiest rank of a phase that sets the time (moving it
    elsewhere cannot shorten the reshard path otherwise).

    The state: per pair the bytes of the current routes (`pair_bytes`), per (kind, rank) their loads (bytes
    sent, received, messages sent, received) and seconds, per kind the busiest rank's seconds (`kind_max`),
    the broadcast tensors and their seconds, and the predicted total.
    """

    def __init__(self, model):  # the cost model of the plan's classes (`cost._Model`)
        np = _np()
        self.model = model
        self.rows = rows = model.class_rows()
        lk = model.links
        self.bandwidth = np.repeat(np.array([lk.net, lk.nvl, lk.nvl]), model.world)  # per (kind, rank)
        self.split_classes = {i for i, c in enumerate(model.cls) if c.splits}
        forward = rows.gid % 2 == 0
        self.pair_bytes = np.bincount(rows.pos[forward], weights=rows.nbytes[forward],
                                      minlength=len(rows.kind_sender))
        self.loads = self._loads(self.pair_bytes)
        # mode reshard's loads: `mode_cost` need not sum them again
        model.saved_loads[(Route.FORWARD,) * len(model.items)] = self.loads
        self.rank_seconds, self.kind_max = self._per_kind(self.loads)
        self.bcast_tensors: list[int] = []
        self.bcast_s = model.broadcast_seconds(self.bcast_tensors)
        self.total = self._reshard_s(self.kind_max) + self.bcast_s
        self.routes = [Route.FORWARD] * len(model.cls)

    def run(self) -> RouteChoice:
        start = self.total
        switches = passes = 0
        for passes in range(1, 5):
            changed = False
            bcast_ok = self._busy_classes()
            broadcast = {i for i, r in enumerate(self.routes) if r == Route.BROADCAST}
            for i in sorted(bcast_ok | self.split_classes | broadcast):
                best = None
                for route in self._options(i, bcast_ok):
                    move = self._try(i, route)
                    if move.total < (self.total if best is None else best.total):
                        best = move
                if best is not None:
                    self._take(i, best)
                    switches += 1
                    changed = True
            if not changed:
                break
        everywhere = self._broadcast_everywhere()
        routes, total = self.routes, self.total
        if everywhere is not None and everywhere < total:
            total, routes = everywhere, [Route.BROADCAST] * len(routes)
        elif any(r != Route.BROADCAST for r in routes):  # auto's loads, likewise
            self.model.saved_loads[tuple(routes[i] for i in self.model.cid)] = self.loads
        return RouteChoice(routes, total, start, everywhere, switches, passes)

    # ---- figures
    def _loads(self, pair_bytes) -> tuple:
        np = _np()
        rows, n = self.rows, len(Traffic) * self.model.world
        msgs = np.ceil(pair_bytes / self.model.half)
        return (np.bincount(rows.kind_sender, weights=pair_bytes, minlength=n),
                np.bincount(rows.kind_receiver, weights=pair_bytes, minlength=n),
                np.bincount(rows.kind_sender, weights=msgs, minlength=n),
                np.bincount(rows.kind_receiver, weights=msgs, minlength=n))

    def _per_kind(self, loads) -> tuple:
        """(seconds per (kind, rank), the busiest rank's seconds per kind)."""
        np = _np()
        seconds = (np.maximum(loads[0], loads[1]) / self.bandwidth
                   + np.maximum(loads[2], loads[3]) * self.model.links.lat)
        return seconds, [float(x) for x in seconds.reshape(len(Traffic), self.model.world).max(axis=1)]

    @staticmethod
    def _reshard_s(kind_max: list) -> float:
        """As `mode_cost`: max(network, phase-0 NVLink) + forwards."""
        return max(kind_max[Traffic.NET], kind_max[Traffic.NVL0]) + kind_max[Traffic.FWD]

    def _segment(self, i: int, route: Route) -> tuple:
        """(pair positions, bytes) of class i's rows on a reshard-path `route`."""
        rows = self.rows
        g = 2 * i + (route == Route.DIRECT and self.model.cls[i].splits)
        return rows.pos[rows.bounds[g]:rows.bounds[g + 1]], rows.nbytes[rows.bounds[g]:rows.bounds[g + 1]]

    # ---- moves
    def _busy_classes(self) -> set[int]:
        """The classes whose current rows touch a busiest rank of a phase that sets the time."""
        np = _np()
        NET, NVL0, FWD = Traffic
        w, rows, kind_max = self.model.world, self.rows, self.kind_max
        busy = []
        if kind_max[FWD] > 0:
            busy.append(FWD)
        if max(kind_max[NET], kind_max[NVL0]) > 0:
            busy += [k for k in (NET, NVL0) if kind_max[k] == max(kind_max[NET], kind_max[NVL0])]
        current_gid = np.arange(0, 2 * len(self.routes), 2, dtype=np.int64)
        for i in self.split_classes:
            current_gid[i] += self.routes[i] == Route.DIRECT
        current = current_gid[rows.gid // 2] == rows.gid
        touch = np.zeros(len(rows.gid), dtype=bool)
        for k in busy:
            r = int(np.argmax(self.rank_seconds[k * w:(k + 1) * w]))
            touch |= (rows.kind_sender[rows.pos] == k * w + r) | (rows.kind_receiver[rows.pos] == k * w + r)
        return set((rows.gid[touch & current] // 2).tolist())

    def _options(self, i: int, bcast_ok: set) -> list[Route]:
        """The routes class i may move to, in tie-break order."""
        out = []
        for route in ROUTES:
            if route == self.routes[i] or (route == Route.DIRECT and not self.model.cls[i].splits):
                continue
            if route == Route.BROADCAST and (i not in bcast_ok or not self.model.numel_of[i]):
                continue
            out.append(route)
        return out

    def _try(self, i: int, route: Route) -> Move:
        """The refit with class i moved from its current route to `route`."""
        np = _np()
        cur = self.routes[i]
        positions, deltas = [], []
        for r, sign in ((cur, -1.0), (route, 1.0)):
            if r != Route.BROADCAST:
                pos, nbytes = self._segment(i, r)
                positions.append(pos)
                deltas.append(nbytes * sign)
        if positions:
            pairs, inv = np.unique(np.concatenate(positions), return_inverse=True)
            delta = np.bincount(inv.ravel(), weights=np.concatenate(deltas), minlength=len(pairs))
            loads, new = self._moved_loads(pairs, delta)
            rank_seconds, kind_max = self._per_kind(loads)
        else:
            pairs = new = None
            loads, rank_seconds, kind_max = self.loads, self.rank_seconds, self.kind_max
        if route == Route.BROADCAST or cur == Route.BROADCAST:
            mine = set(self.model.tensors_by_class()[i])
            tensors = sorted(set(self.bcast_tensors) | mine) if route == Route.BROADCAST else \
                [t for t in self.bcast_tensors if t not in mine]
            bcast_s = self.model.broadcast_seconds(tensors)
        else:
            tensors, bcast_s = self.bcast_tensors, self.bcast_s
        return Move(self._reshard_s(kind_max) + bcast_s, route, pairs, new, loads, rank_seconds, kind_max,
                     tensors, bcast_s)

    def _moved_loads(self, pairs, delta) -> tuple:
        """(the loads with `delta` bytes added to `pairs`, those pairs' new bytes)."""
        np = _np()
        rows, loads, half, n = self.rows, self.loads, self.model.half, len(Traffic) * self.model.world
        old = self.pair_bytes[pairs]
        new = old + delta
        msgs = np.ceil(new / half) - np.ceil(old / half)
        senders, receivers = rows.kind_sender[pairs], rows.kind_receiver[pairs]
        return (loads[0] + np.bincount(senders, weights=delta, minlength=n),
                loads[1] + np.bincount(receivers, weights=delta, minlength=n),
                loads[2] + np.bincount(senders, weights=msgs, minlength=n),
                loads[3] + np.bincount(receivers, weights=msgs, minlength=n)), new

    def _take(self, i: int, move: Move) -> None:
        self.routes[i] = move.route
        if move.pairs is not None:
            self.pair_bytes[move.pairs] = move.pair_bytes
        self.total, self.loads, self.rank_seconds, self.kind_max = move.total, move.loads, move.rank_seconds, \
            move.kind_max
        self.bcast_tensors, self.bcast_s = move.bcast_tensors, move.bcast_s

    def _broadcast_everywhere(self) -> float | None:
        """The predicted refit with every tensor broadcast; None where a floor of it is already no faster than
        the routes chosen (no ring is faster than NVLink; each root's ring bytes at its ring's bandwidth, and at
        least one fill latency)."""
        model, lk = self.model, self.model.links
        floor = model.nbytes / lk.nvl
        if floor < self.total:
            floor = 0.0
            per_root: dict[int, int] = defaultdict(int)
            for i, tensors in enumerate(model.tensors_by_class()):
                if model.numel_of[i]:
                    for t in tensors:
                        per_root[model.gather_cost(i, t)[0]] += align(model.numel_of[i] * model.items[t])
            for root, nbytes in per_root.items():
                bw, size = model.ring(root)
                floor += nbytes / bw + (size - 1) * lk.lat
        if floor < self.total:
            return 0.0 + model.broadcast_seconds(list(range(len(model.items))))
        return None


@dataclass
class RouteChoice:
    """Auto's choice (`RouteSearch`): per class (in `TensorClasses.index` order) its route, and the predicted
    seconds of the refit with these routes, with forward everywhere (mode reshard) and with broadcast
    everywhere (None: not needed, its floor was already slower)."""

    routes: list
    seconds: float
    reshard_seconds: float
    broadcast_seconds: float | None
    switches: int  # classes moved off their route (counting each move)
    passes: int


__all__ = ["Move", "RouteChoice", "RouteSearch"]
