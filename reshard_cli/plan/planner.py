"""The refit plan: pure functions over two layouts and a topology. No torch.distributed here.

Reshard path, per tensor: every unique destination box B is intersected with every unique source box A.
Each intersection must enter each destination domain once:
  * a source replica inside the domain sends it directly to every destination replica there (in-domain);
  * otherwise, with *forwarding* (the default), the intersection is split among the k destination replicas of
    B in that domain, each piece comes over the network from one source replica (phase 0) and is then
    forwarded to the other k-1 (phase 1);
  * or, *direct*, each of the k replicas receives the whole intersection from a source replica (phase 0 only):
    k times the network bytes, but no forwarding phase (cheaper only where messages, not bytes, dominate).
Source replicas share the sending by rotation: entry k of tensor t is sent by replica (t + k) mod n. The rule
needs no global pass over tensors, so a rank can build just the pieces of the tensors it touches and get
exactly the global plan restricted to itself.

Tensors with equal (shape, src placement, dst placement) form a class; the geometry of a class is computed
once (`classes.TensorClass`, its pieces as entries), and instantiating a tensor only applies the rotation. A
layout pair's classes on a topology (`classes.TensorClasses`) are what a `Plan` holds, and what the cost model
weighs.

Broadcast path (baseline, as RL frameworks do it): the full tensor is gathered on one source rank (the root)
and broadcast to every destination rank; each keeps its slice.

Every tensor takes one *route* (`terms.Route`): forward or direct (the reshard path) or broadcast. The modes:
  * `reshard`: every tensor forward; `broadcast`: every tensor broadcast;
  * `hybrid`: tensors matching `reshard_match` (FFN/expert weights) forward, the rest broadcast;
  * `auto`: per tensor class, the route the cost model (`cost.py`, from the topology's link figures) predicts
    fastest. The cost model weighs the plan's classes (`cost.auto_routes`) the first time the plan's routes
    are read, or a caller hands them in (`Plan.class_routes`): a plan in mode auto always has its routes.
    The choice is a pure function of the layouts, the topology and the bucket size, computed with exact sums,
    so every rank computes the same one; it weighs every class once (a rank view in mode auto pays that too).
    Without link figures (no topology, or one without `links:`) there is nothing to weigh, and auto takes
    forward everywhere: the reshard path moves the fewest bytes over the network (each byte enters each
    destination domain once), which is the scarce resource wherever a domain holds several replicas, and
    with no topology every rank is its own domain, so forward and direct are the same pieces.
"""
from __future__ import annotations

import re
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator

from reshard_cli.errors import ConfigError
from reshard_cli.base.geometry import Box
from reshard_cli.layouts.layout import Layout, Placement
from reshard_cli.formats import load_pair
from reshard_cli.plan.classes import Loads, RankView, TensorClasses, whole_bytes
from reshard_cli.plan.cost import auto_routes
from reshard_cli.plan.fp8 import Wire
from reshard_cli.layouts.topology import NO_TOPOLOGY, Topology, load_topology
from reshard_cli.plan.terms import MODES, Bcast, ClassRoutes, Piece, Route, no_gc

# FFN and expert projections (dense, shared and routed experts; mixtral's w1/w2/w3) take the reshard path.
DEFAULT_RESHARD_MATCH = r"(gate_proj|up_proj|down_proj|\.w[123])\.weight$"
PATHS = ("reshard", "broadcast")


class _Tally:
    """What `Plan.stats` adds up: per path its tensors, bytes, wire and in-domain bytes and pieces; per rank the
    network bytes sent and received; the bytes every destination rank receives (broadcast); the ideal send."""

    def __init__(self):
        self.per_path = {p: {"tensors": 0, "bytes": 0, "wire_bytes": 0, "indomain_bytes": 0, "forwarded_bytes": 0,
                             "pieces": 0} for p in PATHS}
        self.send: dict[int, int] = defaultdict(int)
        self.recv: dict[int, int] = defaultdict(int)
        self.recv_all = 0
        self.ideal: dict[int, float] = defaultdict(float)

    def add(self, path: str, loads: Loads, count: int, items: int) -> None:
        """`count` tensors of `items` Σ bytes per element with `loads` (in elements)."""
        st = self.per_path[path]
        st["wire_bytes"] += loads.wire * items
        st["indomain_bytes"] += loads.indomain * items
        st["forwarded_bytes"] += loads.forwarded * items
        st["pieces"] += loads.pieces * count
        send, recv = self.send, self.recv
        for r, v in loads.send.items():
            send[r] += v * items
        for r, v in loads.recv.items():
            recv[r] += v * items
        self.recv_all += loads.recv_all * items


@dataclass
class Plan:
    """The refit between two layouts: every piece of the reshard path and every gather→broadcast, per mode.

    Identical on every rank by construction (pure functions of the layouts, topology, mode and match, and in
    mode auto of the routes the cost model chose), so each rank can ask only for its own part (`rank_view`)
    and still agree with its peers.

    `paths` (per tensor: "reshard" or "broadcast") and `routes` (per tensor: a `Route`) are computed on first
    use. In mode auto they follow `class_routes`, which the cost model chooses from this plan's classes
    (`cost.auto_routes`, on first use unless given); they belong to this plan's layouts and topology (a plan with another topology
    needs its own). `bucket_bytes` is the transport's bucket size auto's cost figures assume (None: the
    transport's default).
    """

    src: Layout
    dst: Layout
    topology: Topology = NO_TOPOLOGY
    mode: str = "hybrid"
    reshard_match: str | None = None  # None: DEFAULT_RESHARD_MATCH
    bucket_bytes: int | None = None
    class_routes: ClassRoutes | None = None  # mode auto's route per class (in `TensorClasses.index` order)
    classes: TensorClasses = field(init=False, repr=False, compare=False)

    @classmethod
    def build(cls, src: str | Path, dst: str | Path, *, topology: str | Path | Topology | None = None,
              mode: str = "hybrid", reshard_match: str | None = None, scale: int = 1,
              bucket_bytes: int | None = None) -> "Plan":
        """Load a layout pair (paths or bundled names) and a topology (path, bundled name or object) and plan
        (in mode auto its routes are chosen when first read)."""
        with no_gc():
            src_l, dst_l = load_pair(src, dst, scale=scale)
        if topology is None:
            topology = NO_TOPOLOGY
        elif not isinstance(topology, Topology):
            topology = load_topology(topology)
        return cls(src_l, dst_l, topology, mode=mode, reshard_match=reshard_match, bucket_bytes=bucket_bytes)

    def __post_init__(self):
        if self.reshard_match is None:
            self.reshard_match = DEFAULT_RESHARD_MATCH
        if self.src.manifest is not self.dst.manifest and \
                [t.name for t in self.src.manifest.tensors] != [t.name for t in self.dst.manifest.tensors]:
            raise ConfigError("the src and dst layouts list their tensors in different orders; load them with "
                              "load_pair or reorder one with Layout.in_order_of", key="dst")
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r} (modes: {', '.join(MODES)})", key="--mode")
        try:
            self._rx = re.compile(self.reshard_match)
        except re.error as e:
            raise ConfigError(f"bad regex: {e}", key="--reshard-match") from None
        self.classes = TensorClasses(self.src, self.dst, self.topology)
        self._routes: dict[str, tuple] = {}  # mode (or ("paths", mode)) -> per tensor

    @property
    def wire(self):
        """What each reshard-path item carries (`plan.fp8.Wire`: quantized parts into a block-FP8 engine)."""
        w = self.__dict__.get("_wire")
        if w is None:
            w = self.__dict__["_wire"] = Wire(self)
        return w

    def subset(self, tensors) -> "Plan":
        """This plan over some of its tensors only (both layouts' `Layout.subset`, as a refit in staging groups
        plans each group), in the same topology and mode (mode auto: the cost model chooses
        them for these tensors). It shares this plan's tensor classes: their geometry is not computed again."""
        out = Plan(self.src.subset(tensors), self.dst.subset(tensors), self.topology, mode=self.mode,
                   reshard_match=self.reshard_match, bucket_bytes=self.bucket_bytes)
        out.classes.share_geometry(self.classes)
        return out

    def with_class_routes(self, class_routes: ClassRoutes) -> "Plan":
        """This plan with mode auto's routes handed in (its classes, already built, are shared)."""
        out = replace(self, class_routes=class_routes)
        out.classes = self.classes
        return out

    # ----------------------------------------------------------------------------------------- routes

    @property
    def routes(self) -> tuple:
        """Per tensor, in this plan's mode: `Route.FORWARD`, `Route.DIRECT` (the reshard path) or `Route.BROADCAST`."""
        return self.routes_for(self.mode)

    @property
    def paths(self) -> tuple:
        """Per tensor, in this plan's mode: "reshard" or "broadcast"."""
        key = ("paths", self.mode)
        out = self._routes.get(key)
        if out is None:
            out = self._routes[key] = tuple("broadcast" if r == Route.BROADCAST else "reshard" for r in self.routes)
        return out

    def routes_for(self, mode: str) -> tuple:
        """Per tensor, the route it takes in `mode` (any mode, from this plan's classes; auto from
        `class_routes`)."""
        out = self._routes.get(mode)
        if out is None:
            tensors = self.src.manifest.tensors
            if mode == "reshard" or mode == "broadcast":
                out = (Route.FORWARD if mode == "reshard" else Route.BROADCAST,) * len(tensors)
            elif mode == "hybrid":
                out = tuple(Route.FORWARD if self._rx.search(t.name) else Route.BROADCAST for t in tensors)
            elif mode == "auto":
                if self.class_routes is None:  # chosen once, by the cost model, from this plan's topology
                    self.class_routes = auto_routes(self)
                per_class = self.class_routes.routes
                out = tuple(per_class[i] for i in self.classes.index()[1])
            else:
                raise ConfigError(f"unknown mode {mode!r} (modes: {', '.join(MODES)})", key="--mode")
            self._routes[mode] = out
        return out

    def route_summary(self, routes: tuple) -> dict:
        """Per route ("forward", "direct", "broadcast"): the classes, tensors and bytes that take it under
        per-tensor `routes`."""
        out = {r: {"classes": 0, "tensors": 0, "bytes": 0} for r in Route}
        seen = set()
        classes, cid = self.classes.index()
        for i, item, r in zip(cid, self.classes.itemsizes(), routes):
            o = out[r]
            o["tensors"] += 1
            o["bytes"] += classes[i].numel * item
            if (i, r) not in seen:
                seen.add((i, r))
                o["classes"] += 1
        return out

    # ------------------------------------------------------------------------------------ reshard path

    def unique_boxes(self, shape: tuple, p: Placement) -> list[tuple[Box, tuple]]:
        """The non-empty boxes of a placement, each with the ranks holding it (`TensorClasses.unique_boxes`)."""
        return self.classes.unique_boxes(shape, p)

    def tensor_pieces(self, t: int) -> list[Piece]:
        """Every piece of tensor `t`: its reshard-path geometry (direct where its route is direct, else with
        forwarding), whatever its path in this mode."""
        return self.classes.of(t).pieces(t, self.routes[t] == Route.DIRECT)

    def bcast(self, t: int) -> Bcast:
        """The gather→broadcast of tensor `t`."""
        return self.classes.of(t).bcast(t)

    # -------------------------------------------------------------------------------------- rank views

    def rank_view(self, rank: int) -> RankView:
        """Only what touches `rank`; equals the global plan restricted to it (no global pass over pieces)."""
        pieces: list[Piece] = []
        bcasts: list[Bcast] = []
        is_dst = rank in self.dst.ranks
        routes = self.routes
        class_of = self.classes.of
        for t, (sp, dp) in enumerate(zip(self.src.placements, self.dst.placements)):
            route = routes[t]
            if route != Route.BROADCAST:
                if rank in sp.holder_set:
                    pieces.extend(class_of(t).rank_pieces(t, rank, route == Route.DIRECT))
                elif rank in dp.holder_set:
                    pieces.extend(class_of(t).dst_pieces(t, rank, route == Route.DIRECT))
            elif is_dst or rank in sp.holder_set:
                bc = self.bcast(t)
                if bc.root >= 0 and (is_dst or rank == bc.root or any(s == rank for s, _ in bc.gather)):
                    bcasts.append(bc)
        return RankView(rank, pieces, bcasts)

    def pieces(self) -> Iterator[Piece]:
        """All reshard-path pieces of this mode, tensor by tensor."""
        for t, route in enumerate(self.routes):
            if route != Route.BROADCAST:
                yield from self.classes.of(t).pieces(t, route == Route.DIRECT)

    def bcasts(self) -> Iterator[Bcast]:
        for t, route in enumerate(self.routes):
            if route == Route.BROADCAST:
                yield self.bcast(t)

    # ------------------------------------------------------------------------------------- statistics

    def stats(self, itemsizes: list | None = None, wire: dict | None = None) -> dict:
        """The figures `reshard plan` prints; keys documented in the README are a contract.

        Tensors of one class with the same rotation residue have identical loads, so each (class, residue)
        is evaluated once and scaled by the bytes per element of its tensors: `itemsizes` (per tensor, what
        moves per element; default the source dtype's) weighs them otherwise. `wire` weighs the reshard path
        as its items travel (`plan.fp8.wire_weights`: into a block-FP8 engine, FP8 and scales where the senders
        quantize): per count of `TensorClass.columns` (None: elements), per tensor the bytes per unit counted.
        The broadcast path and the gather->broadcast baseline keep `itemsizes`; the minimum takes `wire` for
        every tensor (any plan may send it on the reshard path).
        """
        with no_gc():
            t0 = time.perf_counter()
            classes = self.classes.index()[0]
            tally = _Tally()
            items = itemsizes or self.classes.itemsizes()
            groups, extra, bcast_baseline, min_wire = self._group_tensors(tally, items, wire)
            self._add_loads(groups, extra, tally)
            bcast_wire = sum(classes[i].bcast_wire(res) * items for (i, res), items in bcast_baseline.items())
            out = self._summary(tally, min_wire, bcast_wire)
            if wire:  # whole numbers of bytes, summed as floats (`plan.fp8.wire_weights`)
                whole_bytes(out)
            if self.mode == "auto":  # which route each class took: bytes, tensors and classes per route
                out["routes"] = self.route_summary(self.routes)
                out["routes_by"] = self.class_routes.why
            out["plan_seconds"] = time.perf_counter() - t0
            return out

    def group_wire_bytes(self, groups, itemsizes: list | None = None, wire: dict | None = None) -> list:
        """The network bytes (`stats()["wire_bytes"]`) of each group of tensors (indices into this plan's
        manifest) when the group is planned on its own, as a refit in staging groups plans each one
        (`Layout.subset`, the same topology and mode): from this plan's class figures, without planning again.

        A tensor on the reshard path costs what it costs here: its wire does not depend on the tensors planned
        beside it. A broadcast's root rotates with the tensor's position in its group's own manifest, so it
        is weighed at that position. The routes are this plan's: in mode auto with link figures, a group
        planned alone lets the cost model choose again, and may choose otherwise for some classes. One group
        of every tensor is this plan's own wire. `itemsizes`, `wire`: as for `stats`."""
        with no_gc():
            classes, cid = self.classes.index()
            items = itemsizes or self.classes.itemsizes()
            counts = list(wire.items()) if wire else [(None, items)]
            routes = self.routes
            reshard: dict[tuple, int] = {}  # (class, route, count) -> network units per tensor
            out = []
            for tensors in groups:
                total = 0
                for pos, t in enumerate(sorted(tensors)):  # a subset keeps the manifest's order
                    i, route = cid[t], routes[t]
                    if route == Route.BROADCAST:
                        c = classes[i]
                        total += c.bcast_wire(pos % c.bn) * items[t]
                        continue
                    for count, weights in counts:
                        if weights[t]:
                            wire_units = reshard.get((i, route, count))
                            if wire_units is None:
                                col = classes[i].columns(route == Route.DIRECT, count)
                                wire_units = reshard[(i, route, count)] = col.fixed_loads.wire + col.rotating.wire
                            total += wire_units * weights[t]
                out.append(round(total))
            return out

    def _group_tensors(self, tally: _Tally, itemsizes: list, wire: dict | None) -> tuple[dict, dict, dict, int]:
        """The tensors grouped by (class, route, rotation residue) -> [tensors, Σ bytes per element], and with
        `wire` the reshard path's other counts by count -> (class, route, residue) -> Σ bytes per unit; by
        (class, broadcast residue) -> Σ item size (every tensor, for broadcast_wire_bytes); the minimum wire
        bytes. Counts each path's tensors and bytes into `tally`."""
        classes, cid = self.classes.index()
        groups: dict[tuple, list] = defaultdict(lambda: [0, 0])
        bcast_baseline: dict[tuple, int] = defaultdict(int)
        min_wire = 0
        min_wire_of = [c.min_wire for c in classes]
        bcast_period = [c.bn for c in classes]
        period = [c.n for c in classes]
        numel_of = [c.numel for c in classes]
        reshard, broadcast = tally.per_path["reshard"], tally.per_path["broadcast"]
        path_of = {Route.FORWARD: reshard, Route.DIRECT: reshard, Route.BROADCAST: broadcast}
        on_wire = wire[None] if wire else itemsizes
        for t, (item, i, route) in enumerate(zip(itemsizes, cid, self.routes)):
            min_wire += min_wire_of[i] * on_wire[t]
            bcast_baseline[(i, t % bcast_period[i])] += item
            pp = path_of[route]
            pp["tensors"] += 1
            pp["bytes"] += numel_of[i] * item
            bcast = route == Route.BROADCAST
            g = groups[(i, route, t % (bcast_period[i] if bcast else period[i]))]
            g[0] += 1
            g[1] += item if bcast else on_wire[t]
        extra: dict = {}
        routes = self.routes
        for count, weights in (wire or {}).items():
            if count is None:
                continue
            by = extra[count] = defaultdict(int)
            for t, w in enumerate(weights):
                if w:
                    i = cid[t]
                    min_wire += classes[i].min_wire_of(count) * w
                    if routes[t] != Route.BROADCAST:
                        by[(i, routes[t], t % period[i])] += w
        return groups, extra, bcast_baseline, min_wire

    def _add_loads(self, groups: dict, extra: dict, tally: _Tally) -> None:
        """Every group's loads into `tally`: broadcast ones per residue; the reshard path's (`_add_reshard`), and
        its other counts' (`extra`, from `_group_tensors`)."""
        classes = self.classes.index()[0]
        reshard = {}
        for (i, route, residue), (count, items) in groups.items():
            if route != Route.BROADCAST:
                reshard[(i, route, residue)] = (count, items)
                continue
            loads = classes[i].bcast_loads(residue)
            tally.add("broadcast", loads, count, items)
            for r, v in loads.send.items():
                tally.ideal[r] += v * items
        self._add_reshard(reshard, tally, None)
        for count, by in extra.items():
            self._add_reshard({key: (0, w) for key, w in by.items()}, tally, count)
        if tally.recv_all:
            for r in self.dst.ranks:
                tally.recv[r] += tally.recv_all

    def _add_reshard(self, groups: dict, tally: _Tally, count: str | None) -> None:
        """Reshard-path groups ((class, route, residue) -> (tensors, Σ bytes per unit counted)) into `tally`: per
        residue only who sends the rotating entries, the rest (the same at every residue) once per class and
        route."""
        classes = self.classes.index()[0]
        per_class: dict[tuple, list] = defaultdict(lambda: [0, 0])  # (class, route) -> Σ over residues
        send, ideal = tally.send, tally.ideal
        for (i, route, residue), (n, items) in groups.items():
            for senders, key, v in classes[i].columns(route == Route.DIRECT, count).rotating.by_residue:
                send[senders[(residue + key) % len(senders)]] += v * items
            pc = per_class[(i, route)]
            pc[0] += n
            pc[1] += items
        for (i, route), (n, items) in per_class.items():
            col = classes[i].columns(route == Route.DIRECT, count)
            tally.add("reshard", col.fixed_loads, n, items)
            rot = col.rotating
            if rot.pieces:
                tally.add("reshard", Loads(rot.wire, rot.indomain, rot.pieces, {}, rot.recv), n, items)
            for r, v in col.ideal.items():
                ideal[r] += v * items

    def _summary(self, tally: _Tally, min_wire: int, bcast_wire: int) -> dict:
        """The figures of `stats` from its tally."""
        per_path, send, recv = tally.per_path, tally.send, tally.recv
        path_bytes = {p: v["bytes"] for p, v in per_path.items()}
        nbytes = self.src.manifest.nbytes
        # ideal send: each network piece split evenly over the source replicas that hold it (the best any
        # replica choice could do); ideal receive: the received bytes spread evenly over the destination group.
        return {
            "mode": self.mode,
            "src": self.src.name,
            "dst": self.dst.name,
            "src_ranks": self.src.size,
            "dst_ranks": self.dst.size,
            "topology": self.topology.describe(),
            "model": self.src.manifest.name,
            "params": self.src.manifest.params,
            "tensors": len(self.src.manifest.tensors),
            "bytes": nbytes,
            "paths": path_bytes,
            "reshard_share": path_bytes["reshard"] / max(nbytes, 1),
            "wire_bytes": per_path["reshard"]["wire_bytes"] + per_path["broadcast"]["wire_bytes"],
            "min_wire_bytes": min_wire,
            "broadcast_wire_bytes": bcast_wire,
            "indomain_bytes": per_path["reshard"]["indomain_bytes"] + per_path["broadcast"]["indomain_bytes"],
            # of those, what destination ranks forward to each other on the reshard path (phase 1); the rest are
            # a source rank's sends inside its own domain and the broadcast collective's fan-out inside domains
            "forwarded_bytes": per_path["reshard"]["forwarded_bytes"],
            "pieces": per_path["reshard"]["pieces"] + per_path["broadcast"]["pieces"],
            "classes": len(self.classes.index()[0]),
            "max_rank_send_bytes": max(send.values(), default=0),
            "max_rank_recv_bytes": max(recv.values(), default=0),
            "ideal_rank_send_bytes": int(max(tally.ideal.values(), default=0)),
            "ideal_rank_recv_bytes": sum(recv.get(r, 0) for r in self.dst.ranks) // max(self.dst.size, 1),
            "path_stats": per_path,
            "rank_bytes": {r: {"send": send.get(r, 0), "recv": recv.get(r, 0)}
                           for r in self.src.ranks + self.dst.ranks},
        }
