"""Tensor classes: the geometry a refit plan is made of.

Tensors with equal (shape, src placement, dst placement) form a class; the geometry of a class is computed
once (`TensorClass`, its pieces as entries, with forwarding or direct), and instantiating a tensor only applies
the rotation (entry k of tensor t is sent by source replica (t + k) mod n). A layout pair's classes on a
topology (`TensorClasses`) are what a `planner.Plan` holds and what the cost model weighs; `Columns` is a
class's entries as columns (for the cost model's tables, `plan.rows`).
"""
from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass
from typing import NamedTuple

from reshard_cli.base.blocks import grid_split
from reshard_cli.base.geometry import Box
from reshard_cli.layouts.layout import Layout, Placement
from reshard_cli.layouts.topology import Topology
from reshard_cli.plan.fp8 import counter
from reshard_cli.plan.terms import Bcast, Piece, Traffic

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


class Loads(NamedTuple):
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
    fixed_loads: Loads
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

    def bcast_loads(self, residue: int) -> Loads:
        """Gather on the root, then a broadcast tree/ring that enters each receiving domain once."""
        key = ("broadcast", residue)
        if key not in self._loads:
            bc = self.bcast(residue)
            if bc.root < 0:
                self._loads[key] = Loads(0, 0, 0, {}, {})
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
            self._loads[key] = Loads(wire, indomain, len(bc.gather) + len(bc.receivers), send, recv,
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
                   senders, blocks, Loads(wire, indomain + fwd_elems, len(fixed_src) + fwd_pieces, send, recv,
                                           forwarded=fwd_elems),
                   _Rotating(rot_net, rot_in, rot_recv, [(senders[sid], ph, n) for (sid, ph), n in rot_by.items()],
                             len(rot_sid)),
                   ideal)


def whole_bytes(summary: dict) -> None:
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


__all__ = ["Columns", "Entry", "Loads", "RankView", "TensorClass", "TensorClasses", "whole_bytes"]
