"""The refit plan: pure functions over two layouts and a topology. No torch.distributed here.

Reshard path, per tensor: every unique destination box B is intersected with every unique source box A.
Each intersection must enter each destination domain once:
  * a source replica inside the domain sends it directly to every destination replica there (in-domain);
  * otherwise the intersection is split among the k destination replicas of B in that domain, each piece
    comes over the network from one source replica (phase 0) and is then forwarded to the other k-1 (phase 1).
Source replicas share the sending by rotation: entry k of tensor t is sent by replica (t + k) mod n. The rule
needs no global pass over tensors, so a rank can build just the pieces of the tensors it touches and get
exactly the global plan restricted to itself.

Tensors with equal (shape, src placement, dst placement) form a class; the geometry of a class is computed
once (`TensorClass`, its pieces as `Entry`s), and instantiating a tensor only applies the rotation.

Broadcast path (baseline, as RL frameworks do it): the full tensor is gathered on one source rank (the root)
and broadcast to every destination rank; each keeps its slice.
"""
from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator, NamedTuple

from reshard_cli.errors import ConfigError
from reshard_cli.plan.geometry import Box
from reshard_cli.spec.layout import Layout, Placement, load_pair
from reshard_cli.spec.topology import NO_TOPOLOGY, Topology, load_topology

MODES = ("hybrid", "reshard", "broadcast")
# FFN and expert projections (dense, shared and routed experts; mixtral's w1/w2/w3) take the reshard path.
DEFAULT_RESHARD_MATCH = r"(gate_proj|up_proj|down_proj|\.w[123])\.weight$"


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


class Entry(NamedTuple):
    """One piece of a tensor class, before the rotation picks its sender.

    Tensor t's copy of it goes to `dst` from `senders[(t + key) % len(senders)]`; `key` is the entry's position
    in the class, so consecutive pieces cycle through the source replicas.
    """

    senders: tuple  # the source replicas (phase 0) or the one forwarding destination rank (phase 1)
    dst: int
    box: Box  # global coordinates
    phase: int  # 0: from a source rank, 1: forwarded inside a destination domain
    numel: int
    key: int


class _Loads(NamedTuple):
    """Figures of one tensor class at one rotation residue, in elements (scaled by item size later)."""

    wire: int
    indomain: int
    pieces: int
    send: dict  # rank -> network elements sent
    recv: dict  # rank -> network elements received
    recv_all: int = 0  # elements every destination rank receives (broadcast)


class TensorClass:
    """Geometry shared by every tensor with the same shape and placements: its `entries` (see `Entry`)."""

    def __init__(self, shape: tuple, src_boxes: list, dst_boxes: list, dom: dict, receivers: tuple,
                 recv_doms: frozenset):
        self.shape = shape
        self.recv_doms = recv_doms  # domains of the destination group
        self.src_boxes = src_boxes
        self.dst_boxes = dst_boxes
        self.dom = dom
        self.receivers = receivers  # the baseline broadcasts every tensor to the whole destination group
        self.bn = _lcm(len(rs) for _a, rs in src_boxes)  # broadcast root/gather choice period
        self._src_doms = [{dom[s] for s in senders} for _a, senders in src_boxes]
        self._entries: list | None = None
        self._where: dict | None = None
        self._parts: dict[int, list] = {}
        self._loads: dict = {}

    def _groups(self, holders: tuple) -> list[tuple[int, list[int]]]:
        groups: dict[int, list[int]] = {}
        for h in holders:
            groups.setdefault(self.dom[h], []).append(h)
        return list(groups.items())

    def _group_entries(self, bi: int, b: Box, d: int, group: list) -> tuple[list, int]:
        """Entries of one destination box inside one domain, and the elements that must enter the domain."""
        entries = []
        from_outside = b.numel
        parts = self._parts.get(bi)
        if parts is None:  # the source boxes this destination box needs: once per box, not per domain group
            parts = self._parts[bi] = [(senders, doms, r) for (a, senders), doms in zip(self.src_boxes, self._src_doms)
                                       if (r := a.intersect(b)) is not None]
        for senders, doms, r in parts:
            n = r.numel
            if d in doms:  # a source replica shares the domain: send directly, in-domain
                from_outside -= n
                local = tuple(s for s in senders if self.dom[s] == d)
                entries.extend((local, g, r, 0, n) for g in group)
            elif len(group) == 1:
                entries.append((senders, group[0], r, 0, n))
            else:  # split among the domain's replicas, each forwards its part to the others
                for j, sub in enumerate(r.split(len(group))):
                    m = sub.numel
                    if m:
                        entries.append((senders, group[j], sub, 0, m))
                        entries.extend(((group[j],), g, sub, 1, m) for g in group if g != group[j])
        return entries, from_outside

    @property
    def entries(self) -> list[Entry]:
        if self._entries is None:
            entries: list[tuple] = []
            min_wire = 0
            for bi, (b, holders) in enumerate(self.dst_boxes):
                for d, group in self._groups(holders):
                    e, outside = self._group_entries(bi, b, d, group)
                    entries.extend(e)
                    min_wire += outside
            self._entries = [Entry(s, d, b, p, n, k) for k, (s, d, b, p, n) in enumerate(entries)]
            self._min_wire = min_wire
            self._n = _lcm(len(e[0]) for e in entries)
        return self._entries

    @property
    def min_wire(self) -> int:
        """Elements that must cross a domain boundary."""
        self.entries  # noqa: B018 - builds them
        return self._min_wire

    @property
    def n(self) -> int:
        """The sender choice repeats with period n in t."""
        self.entries  # noqa: B018
        return self._n

    # ---- reshard path
    def pieces(self, t: int) -> list[Piece]:
        return [Piece(t, s[(t + k) % len(s)], d, b, p) for s, d, b, p, _n, k in self.entries]

    def dst_pieces(self, t: int, rank: int) -> list[Piece]:
        """The pieces a destination rank receives or forwards."""
        if self._where is None:
            self._where = {}
        mine = self._where.get(rank)
        if mine is None:
            mine = self._where[rank] = [e for e in self.entries
                                             if e.dst == rank or (e.phase == 1 and e.senders[0] == rank)]
        return [Piece(t, s[(t + k) % len(s)], d, b, p) for s, d, b, p, _n, k in mine]

    def rank_pieces(self, t: int, rank: int) -> list[Piece]:
        """Pieces of tensor t that `rank` sends or receives (a scan of the class's entries)."""
        out = []
        for s, d, b, p, _n, k in self.entries:
            src = s[(t + k) % len(s)]
            if src == rank or d == rank:
                out.append(Piece(t, src, d, b, p))
        return out

    def reshard_loads(self, residue: int | None) -> _Loads:
        """Loads of the entries whose sender depends on the rotation (at `residue`), or with residue None
        of the entries with a single possible sender (the same for every tensor of the class)."""
        key = ("reshard", residue)
        if key not in self._loads:
            dom = self.dom
            wire = indomain = pieces = 0
            send: dict[int, int] = defaultdict(int)
            recv: dict[int, int] = defaultdict(int)
            for s, d, _b, _p, n, k in self.entries:
                if (len(s) == 1) != (residue is None):
                    continue
                pieces += 1
                src = s[0] if residue is None else s[(residue + k) % len(s)]
                if dom[src] != dom[d]:
                    wire += n
                    send[src] += n
                    recv[d] += n
                else:
                    indomain += n
            self._loads[key] = _Loads(wire, indomain, pieces, send, recv)
        return self._loads[key]

    def ideal_send(self) -> dict:
        """Network elements per source rank if every piece were split evenly over its replicas."""
        if "ideal" not in self._loads:
            dom = self.dom
            by_senders: dict[tuple, int] = defaultdict(int)
            for s, d, _b, _p, n, _k in self.entries:
                if dom[s[0]] != dom[d]:
                    by_senders[s] += n
            out: dict[int, float] = defaultdict(float)
            for s, n in by_senders.items():
                for x in s:
                    out[x] += n / len(s)
            self._loads["ideal"] = out
        return self._loads["ideal"]

    # ---- broadcast path
    def bcast(self, t: int) -> Bcast:
        if not self.src_boxes:  # a 0-element tensor: nothing to move
            return Bcast(t, -1, (), Box.full(self.shape), ())
        root_box, replicas = self.src_boxes[0]
        root = replicas[t % len(replicas)]
        dom = self.dom
        gather = []
        for a, rs in self.src_boxes[1:]:
            near = [r for r in rs if dom[r] == dom[root]] or list(rs)
            gather.append((near[t % len(near)], a))
        return Bcast(t, root, tuple(gather), root_box, self.receivers)

    def bcast_loads(self, residue: int) -> _Loads:
        """Gather on the root, then a broadcast tree/ring that enters each receiving domain once."""
        key = ("broadcast", residue)
        if key not in self._loads:
            bc = self.bcast(residue)
            if bc.root < 0:
                self._loads[key] = _Loads(0, 0, 0, {}, {})
                return self._loads[key]
            dom = self.dom
            wire = indomain = 0
            send: dict[int, int] = {}
            recv: dict[int, int] = {}
            numel = bc.root_box.numel + sum(a.numel for _, a in bc.gather)
            for s, a in bc.gather:
                if dom[s] != dom[bc.root]:
                    wire += a.numel
                    send[s] = send.get(s, 0) + a.numel
                    recv[bc.root] = recv.get(bc.root, 0) + a.numel
                else:
                    indomain += a.numel
            remote = len(self.recv_doms) - (dom[bc.root] in self.recv_doms)
            wire += numel * remote
            indomain += numel * (len(bc.receivers) - remote)
            if bc.receivers:
                send[bc.root] = send.get(bc.root, 0) + numel
            self._loads[key] = _Loads(wire, indomain, len(bc.gather) + len(bc.receivers), send, recv,
                                      numel if bc.receivers else 0)
        return self._loads[key]


def _lcm(values) -> int:
    out = 1
    for v in values:
        out = out * v // math.gcd(out, v)
    return out


@dataclass
class RankView:
    """What one rank does: its reshard pieces (as sender or receiver) and the broadcasts it takes part in."""

    rank: int
    pieces: list[Piece]
    bcasts: list[Bcast]


@dataclass
class Plan:
    """The refit between two layouts: every piece of the reshard path and every gather→broadcast, per mode.

    Identical on every rank by construction (pure functions of the layouts, topology, mode and match), so
    each rank can ask only for its own part (`rank_view`) and still agree with its peers.
    """

    src: Layout
    dst: Layout
    topology: Topology = NO_TOPOLOGY
    mode: str = "hybrid"
    reshard_match: str | None = None  # None: DEFAULT_RESHARD_MATCH
    paths: tuple = field(init=False)

    @classmethod
    def build(cls, src: str | Path, dst: str | Path, *, topology: str | Path | Topology | None = None,
              mode: str = "hybrid", reshard_match: str | None = None, scale: int = 1) -> "Plan":
        """Load a layout pair (paths or bundled names) and a topology (path, bundled name or object) and plan."""
        src_l, dst_l = load_pair(src, dst, scale=scale)
        if topology is None:
            topology = NO_TOPOLOGY
        elif not isinstance(topology, Topology):
            topology = load_topology(topology)
        return cls(src_l, dst_l, topology, mode=mode, reshard_match=reshard_match)

    def __post_init__(self):
        if self.reshard_match is None:
            self.reshard_match = DEFAULT_RESHARD_MATCH
        if [t.name for t in self.src.manifest.tensors] != [t.name for t in self.dst.manifest.tensors]:
            raise ConfigError("the src and dst layouts list their tensors in different orders; load them with "
                              "load_pair or reorder one with Layout.in_order_of", key="dst")
        if self.mode not in MODES:
            raise ConfigError(f"unknown mode {self.mode!r} (modes: {', '.join(MODES)})", key="--mode")
        try:
            rx = re.compile(self.reshard_match)
        except re.error as e:
            raise ConfigError(f"bad regex: {e}", key="--reshard-match") from None
        tensors = self.src.manifest.tensors
        if self.mode == "hybrid":
            self.paths = tuple("reshard" if rx.search(t.name) else "broadcast" for t in tensors)
        else:
            self.paths = (self.mode,) * len(tensors)
        self._classes: dict[tuple, TensorClass] = {}
        self.domains = {r: self.topology.domain_of(r) for r in self.src.ranks + self.dst.ranks}  # rank -> domain id
        self._recv_doms = frozenset(self.domains[r] for r in self.dst.ranks)
        self._boxes: dict[tuple, list] = {}

    # ------------------------------------------------------------------------------------ reshard path

    def tensor_class(self, t: int) -> TensorClass:
        """The class of tensor `t` (built on first use, shared by every tensor of equal shape and placements)."""
        shape = self.src.manifest.tensors[t].shape
        sp, dp = self.src.placements[t], self.dst.placements[t]
        key = (shape, id(sp), id(dp))
        c = self._classes.get(key)
        if c is None:
            c = self._classes[key] = TensorClass(shape, self.unique_boxes(shape, sp), self.unique_boxes(shape, dp),
                                                 self.domains, self.dst.ranks, self._recv_doms)
        return c

    def unique_boxes(self, shape: tuple, p: Placement) -> list[tuple[Box, tuple]]:
        """The non-empty boxes of a placement, each with the ranks holding it (replicas), first holder first."""
        key = (shape, id(p))
        boxes = self._boxes.get(key)
        if boxes is None:
            boxes = self._boxes[key] = [(b, rs) for b, rs in p.boxes(shape) if not b.empty]
        return boxes

    def tensor_pieces(self, t: int) -> list[Piece]:
        """Every piece of tensor `t` (its reshard-path geometry, whatever its path in this mode)."""
        return self.tensor_class(t).pieces(t)

    def bcast(self, t: int) -> Bcast:
        """The gather→broadcast of tensor `t`."""
        return self.tensor_class(t).bcast(t)

    # -------------------------------------------------------------------------------------- rank views

    def rank_view(self, rank: int) -> RankView:
        """Only what touches `rank`; equals the global plan restricted to it (no global pass over pieces)."""
        pieces: list[Piece] = []
        bcasts: list[Bcast] = []
        is_dst = rank in self.dst.ranks
        for t, (sp, dp) in enumerate(zip(self.src.placements, self.dst.placements)):
            if self.paths[t] == "reshard":
                if rank in sp.holder_set:
                    pieces.extend(self.tensor_class(t).rank_pieces(t, rank))
                elif rank in dp.holder_set:
                    pieces.extend(self.tensor_class(t).dst_pieces(t, rank))
            elif is_dst or rank in sp.holder_set:
                bc = self.bcast(t)
                if bc.root >= 0 and (is_dst or rank == bc.root or any(s == rank for s, _ in bc.gather)):
                    bcasts.append(bc)
        return RankView(rank, pieces, bcasts)

    def pieces(self) -> Iterator[Piece]:
        """All reshard-path pieces of this mode, tensor by tensor."""
        for t, path in enumerate(self.paths):
            if path == "reshard":
                yield from self.tensor_class(t).pieces(t)

    def bcasts(self) -> Iterator[Bcast]:
        for t, path in enumerate(self.paths):
            if path == "broadcast":
                yield self.bcast(t)

    # ------------------------------------------------------------------------------------- statistics

    def stats(self) -> dict:
        """The figures `reshard plan` prints; keys documented in the README are a contract.

        Tensors of one class with the same rotation residue have identical loads, so each (class, residue)
        is evaluated once and scaled by the bytes per element of its tensors.
        """
        t0 = time.perf_counter()
        tensors = self.src.manifest.tensors
        groups: dict[tuple, list] = defaultdict(lambda: [0, 0])  # (class, path, residue) -> [tensors, Σ item]
        baseline: dict[tuple, int] = defaultdict(int)  # (class, residue) -> Σ item, for broadcast_wire_bytes
        per_path = {p: {"tensors": 0, "bytes": 0, "wire_bytes": 0, "indomain_bytes": 0, "pieces": 0}
                    for p in ("reshard", "broadcast")}
        min_wire = 0
        ideal: dict[int, float] = defaultdict(float)
        for t, spec in enumerate(tensors):
            item = spec.itemsize
            c = self.tensor_class(t)
            min_wire += c.min_wire * item
            baseline[(c, t % c.bn)] += item
            path = self.paths[t]
            per_path[path]["tensors"] += 1
            per_path[path]["bytes"] += spec.nbytes
            g = groups[(c, path, t % (c.n if path == "reshard" else c.bn))]
            g[0] += 1
            g[1] += item
        send: dict[int, int] = defaultdict(int)
        recv: dict[int, int] = defaultdict(int)
        recv_all = 0
        per_class: dict[TensorClass, list] = defaultdict(lambda: [0, 0])  # reshard: Σ over residues

        def add(path: str, loads: _Loads, count: int, items: int) -> None:
            nonlocal recv_all
            st = per_path[path]
            st["wire_bytes"] += loads.wire * items
            st["indomain_bytes"] += loads.indomain * items
            st["pieces"] += loads.pieces * count
            for r, v in loads.send.items():
                send[r] += v * items
            for r, v in loads.recv.items():
                recv[r] += v * items
            recv_all += loads.recv_all * items

        for (c, path, residue), (count, items) in groups.items():
            if path == "reshard":
                add(path, c.reshard_loads(residue), count, items)
                pc = per_class[c]
                pc[0] += count
                pc[1] += items
            else:
                loads = c.bcast_loads(residue)
                add(path, loads, count, items)
                for r, v in loads.send.items():
                    ideal[r] += v * items
        for c, (count, items) in per_class.items():  # entries with one possible sender: once per class
            add("reshard", c.reshard_loads(None), count, items)
            for r, v in c.ideal_send().items():
                ideal[r] += v * items
        if recv_all:
            for r in self.dst.ranks:
                recv[r] += recv_all
        bcast_wire = sum(c.bcast_loads(res).wire * items for (c, res), items in baseline.items())
        path_bytes = {p: v["bytes"] for p, v in per_path.items()}
        nbytes = self.src.manifest.nbytes
        # ideal send: each network piece split evenly over the source replicas that hold it (the best any
        # replica choice could do); ideal receive: the received bytes spread evenly over the destination group.
        out = {
            "mode": self.mode,
            "src": self.src.name,
            "dst": self.dst.name,
            "src_ranks": self.src.size,
            "dst_ranks": self.dst.size,
            "topology": self.topology.describe(),
            "model": self.src.manifest.name,
            "params": self.src.manifest.params,
            "tensors": len(tensors),
            "bytes": nbytes,
            "paths": path_bytes,
            "reshard_share": path_bytes["reshard"] / max(nbytes, 1),
            "wire_bytes": per_path["reshard"]["wire_bytes"] + per_path["broadcast"]["wire_bytes"],
            "min_wire_bytes": min_wire,
            "broadcast_wire_bytes": bcast_wire,
            "indomain_bytes": per_path["reshard"]["indomain_bytes"] + per_path["broadcast"]["indomain_bytes"],
            "pieces": per_path["reshard"]["pieces"] + per_path["broadcast"]["pieces"],
            "classes": len(self._classes),
            "max_rank_send_bytes": max(send.values(), default=0),
            "max_rank_recv_bytes": max(recv.values(), default=0),
            "ideal_rank_send_bytes": int(max(ideal.values(), default=0)),
            "ideal_rank_recv_bytes": sum(recv.get(r, 0) for r in self.dst.ranks) // max(self.dst.size, 1),
            "path_stats": per_path,
            "rank_bytes": {r: {"send": send.get(r, 0), "recv": recv.get(r, 0)}
                           for r in self.src.ranks + self.dst.ranks},
        }
        out["plan_seconds"] = time.perf_counter() - t0
        return out
