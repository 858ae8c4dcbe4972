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
once (`TensorClass`, its pieces as entries), and instantiating a tensor only applies the rotation. A layout
pair's classes on a topology (`TensorClasses`) are what a `Plan` holds, and what the cost model weighs.

Broadcast path (baseline, as RL frameworks do it): the full tensor is gathered on one source rank (the root)
and broadcast to every destination rank; each keeps its slice.

Every tensor takes one *route* (`terms.Route`): forward or direct (the reshard path) or broadcast. The modes:
  * `reshard`: every tensor forward; `broadcast`: every tensor broadcast;
  * `hybrid`: tensors matching `reshard_match` (FFN/expert weights) forward, the rest broadcast;
  * `auto`: per tensor class, the route the cost model (`cost.py`, from the topology's link figures) predicts
    fastest. The plan does not choose: the cost model weighs the plan's classes and hands it their routes
    (`cost.with_auto_routes(plan)`, `Plan.class_routes`); a plan in mode auto without them has no routes.
    The choice is a pure function of the layouts, the topology and the bucket size, computed with exact sums,
    so every rank computes the same one; it weighs every class once (a rank view in mode auto pays that too).
    Without link figures (no topology, or one without `links:`) there is nothing to weigh, and auto takes
    forward everywhere: the reshard path moves the fewest bytes over the network (each byte enters each
    destination domain once), which is the scarce resource wherever a domain holds several replicas, and
    with no topology every rank is its own domain, so forward and direct are the same pieces.
"""
from __future__ import annotations

import math
import re
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Iterator, NamedTuple

from reshard_cli.errors import ConfigError
from reshard_cli.base.blocks import grid_split
from reshard_cli.base.geometry import Box
from reshard_cli.layouts.layout import Layout, Placement
from reshard_cli.formats import load_pair
from reshard_cli.plan.fp8 import Wire, counter
from reshard_cli.layouts.topology import NO_TOPOLOGY, Topology, load_topology
from reshard_cli.plan.terms import MODES, Bcast, ClassRoutes, Piece, Route, Traffic, no_gc

# FFN and expert projections (dense, shared and routed experts; mixtral's w1/w2/w3) take the reshard path.
DEFAULT_RESHARD_MATCH = r"(gate_proj|up_proj|down_proj|\.w[123])\.weight$"
PATHS = ("reshard", "broadcast")


class Entry(NamedTuple):
    """One piece of a tensor class, before the rotation picks its sender. A class keeps its entries as plain
    tuples in this field order (they are many); an entry's key is its position k in the class's list: tensor
    t's copy of it goes to `dst` from `senders[(t + k) % len(senders)]`, so consecutive pieces cycle through
    the source replicas."""

    senders: tuple  # the source replicas (phase 0) or the one forwarding destination rank (phase 1)
    dst: int
    box: Box  # global coordinates
    phase: int  # 0: from a source rank, 1: forwarded inside a destination domain
    numel: int


class _Loads(NamedTuple):
    """Figures of one tensor class at one rotation residue, in elements (scaled by item size later)."""

    wire: int
    indomain: int
    pieces: int
    send: dict  # rank -> network elements sent
    recv: dict  # rank -> network elements received
    recv_all: int = 0  # elements every destination rank receives (broadcast)
    forwarded: int = 0  # of `indomain`: what destination ranks forward to each other (phase 1)


class _Rotating(NamedTuple):
    """The figures of a class's rotating entries (several possible senders) that do not depend on the residue,
    and who sends their network elements at each residue."""

    wire: int  # network elements
    indomain: int  # in-domain elements
    recv: dict  # rank -> network elements received
    by_residue: list  # [(senders, key mod len(senders), network elements)]: tensor t's go from senders[(t + key) % L]
    pieces: int  # entries


class Columns(NamedTuple):
    """A class's entries (with forwarding, or direct) as columns. Phase-0 entries with one possible sender
    ("fixed") as sender, receiver, elements, kind; the others ("rotating") as their senders' position in
    `senders`, receiver, elements, rotation key and kind. Forwards (phase 1, fixed) as blocks, one per split
    intersection: (the domain's replicas G, the elements m_j of each sub-piece): G[j] sends m_j to every other
    G[g] (m_j > 0). Plus the loads of all fixed entries, the rotating entries' figures and the ideal send (each
    network entry split evenly over its senders)."""

    fixed_src: list
    fixed_dst: list
    fixed_numel: list
    fixed_kind: list
    rotating_sid: list
    rotating_dst: list
    rotating_numel: list
    rotating_key: list
    rotating_kind: list
    senders: list
    blocks: list
    fixed_loads: _Loads
    rotating: _Rotating
    ideal: dict


class TensorClass:
    """Geometry shared by every tensor with the same shape and placements: its entries (see `Entry`), with
    forwarding (`entries`) or direct (`direct_entries`)."""

    def __init__(self, shape: tuple, src_boxes: list, dst_boxes: list, dom: dict, receivers: tuple,
                 recv_doms: frozenset, grid: tuple | None = None):
        self.shape = shape
        self.grid = grid if len(shape) >= 2 else None  # a block-FP8 destination's blocks: forwarded parts
        # are cut on their grid, so a part of whole blocks can travel quantized (`plan.fp8.Wire`)
        self.numel = math.prod(shape)
        self.recv_doms = recv_doms  # domains of the destination group
        self.src_boxes = src_boxes
        self.dst_boxes = dst_boxes
        self.dom = dom
        self.receivers = receivers  # the baseline broadcasts every tensor to the whole destination group
        self.bn = _lcm(len(rs) for _a, rs in src_boxes)  # broadcast root/gather choice period
        self._src_doms = [{dom[s] for s in senders} for _a, senders in src_boxes]
        self._built: dict[bool, list] = {}
        self._group_list: list | None = None
        self._cols: dict[bool, Columns] = {}
        self._geometry: tuple | None = None
        self._parts: dict[int, list] = {}
        self._local: dict[tuple, tuple] = {}
        self._splits: dict[tuple, list] = {}
        self._where: dict[tuple, list] = {}
        self._loads: dict = {}
        self._counts: dict = {}  # `columns(count=...)`: count -> its function of a box
        self._counted_min: dict = {}  # count -> `min_wire` so counted

    # ---- geometry
    def _groups(self) -> list[tuple[int, Box, int, list[int]]]:
        """(destination box index, box, domain, its holders in the domain), in first-appearance order."""
        out = self._group_list
        if out is None:
            out = self._group_list = []
            dom = self.dom
            for bi, (b, holders) in enumerate(self.dst_boxes):
                groups: dict[int, list[int]] = {}
                for h in holders:
                    groups.setdefault(dom[h], []).append(h)
                out.extend((bi, b, d, g) for d, g in groups.items())
        return out

    def _parts_of(self, bi: int, b: Box) -> list:
        """The source boxes destination box `bi` needs: (src box index, senders, their domains, region, numel)."""
        parts = self._parts.get(bi)
        if parts is None:
            parts = self._parts[bi] = [(si, senders, doms, r, r.numel) for si, ((a, senders), doms)
                                       in enumerate(zip(self.src_boxes, self._src_doms))
                                       if (r := (a if a == b else a.intersect(b))) is not None]
        return parts

    def _local_senders(self, si: int, senders: tuple, d: int) -> tuple:
        out = self._local.get((si, d))
        if out is None:
            out = self._local[(si, d)] = tuple(s for s in senders if self.dom[s] == d)
        return out

    def _split(self, r: Box, k: int) -> list:
        out = self._splits.get((r, k))
        if out is None:
            subs = r.split(k) if self.grid is None else grid_split(r, k, self.shape, self.grid)
            out = self._splits[(r, k)] = [(sub, sub.numel) for sub in subs]
        return out

    def _geo(self) -> tuple[int, int, bool]:
        """(elements that must cross a domain boundary, rotation period n, whether forwarding differs from
        direct anywhere): from the boxes and domains, without building entries."""
        if self._geometry is None:
            min_wire = 0
            lens: set[int] = set()
            splits = False
            for bi, b, d, group in self._groups():
                outside = b.numel
                for si, senders, doms, r, n in self._parts_of(bi, b):
                    if d in doms:
                        outside -= n
                        lens.add(len(self._local_senders(si, senders, d)))
                    else:
                        lens.add(len(senders))
                        splits = splits or len(group) > 1
                min_wire += outside
            self._geometry = (min_wire, _lcm(lens), splits)
        return self._geometry

    def _build(self, direct: bool) -> list:
        out: list = []
        for bi, b, d, group in self._groups():
            k = len(group)
            for si, senders, doms, r, n in self._parts_of(bi, b):
                if d in doms:  # a source replica shares the domain: send directly, in-domain
                    local = self._local_senders(si, senders, d)
                    out += [(local, g, r, 0, n) for g in group]
                elif k == 1:
                    out.append((senders, group[0], r, 0, n))
                elif direct:  # every replica in the domain receives the whole intersection over the network
                    out += [(senders, g, r, 0, n) for g in group]
                else:  # split among the domain's replicas, each forwards its part to the others
                    for j, (sub, m) in enumerate(self._split(r, k)):
                        if m:
                            gj = group[j]
                            out.append((senders, gj, sub, 0, m))
                            one = (gj,)
                            out += [(one, g, sub, 1, m) for g in group if g != gj]
        return out

    def entries_of(self, direct: bool = False) -> list:
        """The class's entries (tuples in `Entry`'s field order), with forwarding or direct."""
        if direct and not self.splits:
            direct = False  # the same pieces
        out = self._built.get(direct)
        if out is None:
            out = self._built[direct] = self._build(direct)
        return out

    @property
    def entries(self) -> list:
        return self.entries_of(False)

    @property
    def direct_entries(self) -> list:
        return self.entries_of(True)

    @property
    def min_wire(self) -> int:
        """Elements that must cross a domain boundary."""
        return self._geo()[0]

    @property
    def n(self) -> int:
        """The sender choice repeats with period n in t (forwarding or direct alike)."""
        return self._geo()[1]

    @property
    def splits(self) -> bool:
        """True when some destination domain holds several replicas of a box that needs data from outside it:
        only then do forwarding and direct differ."""
        return self._geo()[2]

    # ---- reshard path
    def pieces(self, t: int, direct: bool = False) -> list[Piece]:
        return [Piece(t, s[(t + k) % len(s)], d, b, p) for k, (s, d, b, p, _n) in enumerate(self.entries_of(direct))]

    def dst_pieces(self, t: int, rank: int, direct: bool = False) -> list[Piece]:
        """The pieces a destination rank receives or forwards."""
        mine = self._where.get((direct, rank, 1))
        if mine is None:
            mine = self._where[(direct, rank, 1)] = [
                (k, e) for k, e in enumerate(self.entries_of(direct))
                if e[1] == rank or (e[3] == 1 and e[0][0] == rank)]
        return [Piece(t, s[(t + k) % len(s)], d, b, p) for k, (s, d, b, p, _n) in mine]

    def rank_pieces(self, t: int, rank: int, direct: bool = False) -> list[Piece]:
        """Pieces of tensor t that `rank` sends or receives."""
        mine = self._where.get((direct, rank, 0))
        if mine is None:  # the entries rank may send (it is one of their senders) or receives
            mine = self._where[(direct, rank, 0)] = [(k, e) for k, e in enumerate(self.entries_of(direct))
                                                     if e[1] == rank or rank in e[0]]
        out = []
        for k, (s, d, b, p, _n) in mine:
            src = s[(t + k) % len(s)]
            if src == rank or d == rank:
                out.append(Piece(t, src, d, b, p))
        return out

    def columns(self, direct: bool = False, count: str | None = None) -> Columns:
        """The entries' figures (see `Columns`), walked in `_build`'s order without building them. `count`
        names what is counted per entry instead of its elements (`plan.fp8.counter`: into a block-FP8 engine,
        the elements of its whole blocks, or the bytes they travel as), for `Plan.stats` and the cost model."""
        direct = direct and self.splits
        col = self._cols.get((direct, count))
        if col is None:
            ents, blocks, fwd, fwd_pieces, min_wire = self._walk(direct, self._counter(count))
            col = self._cols[(direct, count)] = _columns(ents, blocks, fwd, fwd_pieces)
            self._counted_min[count] = min_wire
        return col

    def min_wire_of(self, count: str | None = None) -> int:
        """`min_wire`, counted as `columns(count=count)` counts."""
        if count is None:
            return self.min_wire
        if count not in self._counted_min:
            self.columns(False, count)
        return self._counted_min[count]

    def _counter(self, count: str | None):
        """What `count` counts of a piece's box (None: its elements, the default)."""
        if count is None:
            return None
        f = self._counts.get(count)
        if f is None:
            f = self._counts[count] = counter(count, self.shape, self.grid)
        return f

    def _walk(self, direct: bool, count=None) -> tuple[list, list, int, int, int]:
        """The phase-0 entries as (senders, dst, elements, kind, key) in `_build`'s order (key: the entry's
        position there, forwards included); the forwards as blocks (see `Columns`), with their elements and
        pieces; the elements that must cross a domain boundary. `count` (a function of a piece's box) counts
        something else than elements. Computes the geometry (`_geo`) on the way."""
        ents: list[tuple] = []
        blocks: list[tuple] = []
        fwd_elems = fwd_pieces = 0
        key = 0
        min_wire = 0
        lens: set[int] = set()
        splits = False
        net, nvl0 = Traffic.NET, Traffic.NVL0
        for bi, b, d, group in self._groups():
            k = len(group)
            outside = b.numel if count is None else 0  # counted: the non-local parts added up below
            for si, srcs, doms, r, n in self._parts_of(bi, b):
                if count is not None:
                    n = count(r)
                    outside += 0 if d in doms else n
                if d in doms:  # a source replica shares the domain: each replica gets it from there
                    if count is None:
                        outside -= n
                    local = self._local_senders(si, srcs, d)
                    lens.add(len(local))
                    ents += [(local, g, n, nvl0, key + j) for j, g in enumerate(group)]
                    key += k
                    continue
                lens.add(len(srcs))
                splits = splits or k > 1
                if k == 1 or direct:
                    ents += [(srcs, g, n, net, key + j) for j, g in enumerate(group)]
                    key += k
                else:
                    parts = []
                    for j, (sub, m) in enumerate(self._split(r, k)):
                        c = m if count is None else count(sub)
                        parts.append(c)
                        if m:
                            ents.append((srcs, group[j], c, net, key))
                            key += k  # the entry, then its k - 1 forwards (fixed entries, kept as a block)
                            fwd_elems += c * (k - 1)
                            fwd_pieces += k - 1
                    blocks.append((group, parts + [0] * (k - len(parts))))  # a scalar is not split: one part
            min_wire += outside
        if self._geometry is None and count is None:
            self._geometry = (min_wire, _lcm(lens), splits)
        return ents, blocks, fwd_elems, fwd_pieces, min_wire

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

    def bcast_wire(self, residue: int) -> int:
        """`bcast_loads(residue).wire`, without the rest."""
        key = ("bwire", residue)
        out = self._loads.get(key)
        if out is None:
            loads = self._loads.get(("broadcast", residue))
            if loads is not None:
                out = loads.wire
            else:
                bc = self.bcast(residue)
                out = 0
                if bc.root >= 0:
                    dom = self.dom
                    droot = dom[bc.root]
                    numel = bc.root_box.numel
                    for s, a in bc.gather:
                        numel += a.numel
                        if dom[s] != droot:
                            out += a.numel
                    out += numel * (len(self.recv_doms) - (droot in self.recv_doms))
            self._loads[key] = out
        return out

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


def _columns(ents: list, blocks: list, fwd_elems: int, fwd_pieces: int) -> Columns:
    """`TensorClass.columns` from `TensorClass._walk`'s entries and forward blocks, in one pass."""
    fixed_src, fixed_dst, fixed_numel, fixed_kind = [], [], [], []
    rot_sid, rot_dst, rot_numel, rot_key, rot_kind = [], [], [], [], []
    senders: list[tuple] = []
    sid_of: dict[int, int] = {}
    wire = indomain = 0
    send: dict[int, int] = defaultdict(int)
    recv: dict[int, int] = defaultdict(int)
    by_senders: dict[tuple, int] = defaultdict(int)
    rot_net = rot_in = 0  # rotating entries: network and in-domain elements
    rot_recv: dict[int, int] = defaultdict(int)
    rot_by: dict[tuple, int] = defaultdict(int)
    net = Traffic.NET
    for s, d, n, kind, k in ents:
        if len(s) == 1:
            src = s[0]
            fixed_src.append(src)
            fixed_dst.append(d)
            fixed_numel.append(n)
            fixed_kind.append(kind)
            if kind == net:
                by_senders[s] += n
                wire += n
                send[src] += n
                recv[d] += n
            else:
                indomain += n
            continue
        sid = sid_of.get(id(s))
        if sid is None:
            sid = sid_of[id(s)] = len(senders)
            senders.append(s)
        rot_sid.append(sid)
        rot_dst.append(d)
        rot_numel.append(n)
        rot_key.append(k)
        rot_kind.append(kind)
        if kind == net:  # what does not depend on the residue, and who sends per key mod L
            by_senders[s] += n
            rot_net += n
            rot_recv[d] += n
            rot_by[(sid, k % len(s))] += n
        else:
            rot_in += n
    ideal: dict[int, float] = defaultdict(float)
    for s, n in by_senders.items():
        for x in s:
            ideal[x] += n / len(s)
    return Columns(fixed_src, fixed_dst, fixed_numel, fixed_kind, rot_sid, rot_dst, rot_numel, rot_key, rot_kind,
                   senders, blocks, _Loads(wire, indomain + fwd_elems, len(fixed_src) + fwd_pieces, send, recv,
                                           forwarded=fwd_elems),
                   _Rotating(rot_net, rot_in, rot_recv, [(senders[sid], ph, n) for (sid, ph), n in rot_by.items()],
                             len(rot_sid)),
                   ideal)


def _whole_bytes(summary: dict) -> None:
    """`Plan.stats`'s byte figures as ints (weighed with a power-of-two fraction per element, each a whole number
    of bytes: `plan.fp8.wire_weights`)."""
    for k, v in summary.items():
        if k.endswith("_bytes") and isinstance(v, float):
            summary[k] = round(v)
    for per in (*summary["path_stats"].values(), *summary["rank_bytes"].values()):
        for k, v in per.items():
            per[k] = round(v)


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


class TensorClasses:
    """The tensor classes of a layout pair on a topology: built on first use, shared by every tensor of equal
    shape and placements, and by every mode (the geometry does not depend on the mode). A `Plan` holds one;
    the cost model weighs it (and keeps its tables in `memo`, so that auto's choice and the predictions share
    them)."""

    def __init__(self, src: Layout, dst: Layout, topology: Topology):
        self.src, self.dst = src, dst
        self.domains = {r: topology.domain_of(r) for r in src.ranks + dst.ranks}  # rank -> domain id
        self._recv_doms = frozenset(self.domains[r] for r in dst.ranks)
        q = dst.quantization
        self._grid = q.block if q is not None else None
        self._by_key: dict[tuple, TensorClass] = {}  # (shape, id(src placement), id(dst placement)) -> class
        self._boxes: dict[tuple, list] = {}  # (shape, id(placement)) -> `unique_boxes`
        self._index: tuple | None = None
        self._itemsizes: list[int] | None = None
        self._memo: dict = {}

    def share_geometry(self, other: "TensorClasses") -> None:
        """Take `other`'s classes (built and to be built) as this one's: `other` is over the same ranks and
        domains, with the same placement objects (a plan over some of its tensors: `Plan.subset`), so a class
        has the same geometry in both. The cost model's tables stay this one's own."""
        if self.domains != other.domains or self.dst.ranks != other.dst.ranks or self._grid != other._grid:
            raise ValueError("tensor classes are shared only between plans over the same ranks and domains")
        self._by_key, self._boxes = other._by_key, other._boxes

    def of(self, t: int) -> TensorClass:
        """The class of tensor `t`."""
        shape = self.src.manifest.tensors[t].shape
        sp, dp = self.src.placements[t], self.dst.placements[t]
        key = (shape, id(sp), id(dp))
        c = self._by_key.get(key)
        if c is None:
            c = self._by_key[key] = TensorClass(shape, self.unique_boxes(shape, sp), self.unique_boxes(shape, dp),
                                                self.domains, self.dst.ranks, self._recv_doms, self._grid)
        return c

    def index(self) -> tuple[list[TensorClass], list[int]]:
        """(every class, in order of first tensor; per tensor, its class's position in that list)."""
        if self._index is None:
            classes: list[TensorClass] = []
            cid: list[int] = []
            pos: dict[tuple, int] = {}
            for t, (spec, sp, dp) in enumerate(zip(self.src.manifest.tensors, self.src.placements,
                                                   self.dst.placements)):
                key = (spec.shape, id(sp), id(dp))
                i = pos.get(key)
                if i is None:
                    i = pos[key] = len(classes)
                    classes.append(self.of(t))
                cid.append(i)
            self._index = (classes, cid)
        return self._index

    def itemsizes(self) -> list[int]:
        """Bytes per element of every tensor."""
        if self._itemsizes is None:
            self._itemsizes = [t.itemsize for t in self.src.manifest.tensors]
        return self._itemsizes

    def unique_boxes(self, shape: tuple, p: Placement) -> list[tuple[Box, tuple]]:
        """The non-empty boxes of a placement, each with the ranks holding it (replicas), first holder first."""
        key = (shape, id(p))
        boxes = self._boxes.get(key)
        if boxes is None:
            boxes = self._boxes[key] = [(b, rs) for b, rs in p.boxes(shape) if not b.empty]
        return boxes

    def memo(self, key, make):
        """What `make()` returns, made once per `key` for these classes: the cache of figures other modules
        derive from them (the cost model keys its models by link figures and bucket size)."""
        out = self._memo.get(key)
        if out is None:
            out = self._memo[key] = make()
        return out


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

    def add(self, path: str, loads: _Loads, count: int, items: int) -> None:
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
    (`cost.with_auto_routes`); they belong to this plan's layouts and topology (a plan with another topology
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
        (in mode auto, without routes yet: see `cost.with_auto_routes`)."""
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
        plans each group), in the same topology and mode (mode auto without routes yet: the cost model chooses
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
                if self.class_routes is None:
                    raise ValueError("mode auto takes each class's route from the cost model, and this plan has "
                                     "none: plan = cost.with_auto_routes(plan)")
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
                _whole_bytes(out)
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
                tally.add("reshard", _Loads(rot.wire, rot.indomain, rot.pieces, {}, rot.recv), n, items)
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
