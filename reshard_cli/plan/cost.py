"""Predicted refit time: a plan's bytes over a topology's link figures, beside the network lower bound.

Inputs: a `Plan` (any mode: the figures of every mode are computed from the same layouts and tensor classes)
and the topology's `links:` — `network_gbps` (GB/s per rank per direction across domains), `nvlink_gbps`
(GB/s per rank per direction inside a domain), `latency_us` (per message). Nothing here touches
torch.distributed; `reshard plan --topology FILE` prints it.

The model, path by path, as `transport.py` runs it:

* **reshard path** — phase 0 moves pieces from source ranks: those crossing a domain boundary go over the
  network, those whose source replica shares the destination's domain go over NVLink, at the same time.
  Phase 1 forwards, over NVLink, what each destination rank received to its replicas in the domain.
  A rank sends and receives at the same time (full duplex), so one phase on one link costs, for the busiest
  rank, max(bytes sent, bytes received) / bandwidth + max(messages sent, messages received) × latency.
  Messages are the transport's buckets: the bytes between one pair of ranks in one phase, in buckets of half
  the staging budget (`bucket_bytes`, default 64 MiB → 32 MiB messages).
  The "time" figure lets the phases **add**: max(network, phase-0 NVLink) + forwards — what a transport
  that forwards after its whole phase 0 takes, an upper bound. The transport forwards each bucket as soon as
  it lands, so it can reach the "pipelined" figure, max(network, all NVLink), reported beside it; auto
  weighs routes by the upper bound, which never flatters forwarding.
* **broadcast path** — packs (broadcast tensors with one root, up to half a bucket: the transport's
  packing) go one after another. Each pack is first gathered on its root (blocking receives, one
  message per source box, NVLink when the sender shares the root's domain, network otherwise), then
  broadcast to {root} ∪ destination ranks by a pipelined ring (NCCL's broadcast): every byte enters each
  domain once over the network and every rank once. A ring can run one channel per NIC only as far as every
  domain it crosses has that many group members, so its bandwidth is min(nvlink_gbps, network_gbps × the
  fewest group members in any domain it crosses) — a trainer root alone in its node broadcasts through its
  one NIC. The ring costs pack bytes / that bandwidth + (group size − 1) × latency (one message per hop to
  fill the pipeline). Pipelined: a pack's gather overlaps the previous pack's broadcast.
* The reshard path runs first, then the broadcast path (`run.py`): paths add in both figures.
* A tensor on the reshard path goes with forwarding (phase 0 + phase 1 as above) or **direct** (every
  destination replica receives its whole box in phase 0: no forwards, more network bytes).

**Mode auto** (`choose_routes`, `_Model.choose`): each tensor class takes the route — forward, direct or
broadcast — under which this model predicts the whole refit fastest. It starts from forward everywhere (mode
reshard) and visits the classes in a fixed order, moving a class to another route only where the predicted
refit gets strictly faster, until a pass changes nothing; broadcast everywhere replaces the result if it is
faster still. A class is weighed in the refit, not alone: alone, its time is mostly one message latency per
pair of ranks, which the real refit shares with every other class in the same buckets (weighed alone,
DeepSeek-V3 on dgx-h100 came out at 159 ms against reshard's 147 ms). Every figure compared is a sum of
whole bytes (exact in float64 in any order) put through the same per-rank formula, so all ranks reach the
same choice; the comparisons are strict, and new routes are tried in the order forward, direct, broadcast.
So auto is never predicted slower than reshard or broadcast.

**Network lower bound** (any plan, any transport, latency ignored): every destination domain must receive,
from outside, the bytes its destination ranks hold that no source rank inside it holds (`min_wire`, per
domain) through its ranks' NICs (job ranks in the domain × network_gbps); every source domain must send, at
least once, the bytes only it holds that another domain needs, through its NICs; and the bytes that must
leave some source domain must pass the source domains' NICs together. The bound is the largest of these.

`with_measured_links(topology, ...)` puts measured bandwidths (e.g. a gloo run's link figures on CPU) in a
topology's links, so the same model predicts a run from measurements.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field, replace
from typing import Any

from reshard_cli.plan.planner import FWD, MODES, NET, NVL0, ROUTES, Plan, no_gc
from reshard_cli.plan.schedule import PackFiller, TransferOptions, align
from reshard_cli.layouts.topology import NO_TOPOLOGY, Topology

DEFAULT_BUCKET_BYTES = TransferOptions().bucket_bytes  # `reshard run --bucket-mb 64`
GB = 1e9



_ROUTE_CODE = {"forward": 0, "direct": 1, "broadcast": 2}


@dataclass(frozen=True)
class Links:
    network_gbps: float  # GB/s per rank per direction, across domains
    nvlink_gbps: float  # GB/s per rank per direction, inside a domain
    latency_us: float = 0.0  # per message

    @property
    def net(self) -> float:
        return self.network_gbps * GB

    @property
    def nvl(self) -> float:
        return self.nvlink_gbps * GB

    @property
    def lat(self) -> float:
        return self.latency_us * 1e-6

    def describe(self) -> str:
        return (f"network {self.network_gbps:g} GB/s, NVLink {self.nvlink_gbps:g} GB/s per rank per direction, "
                f"{self.latency_us:g} us per message")


def links_of(topology: Topology) -> tuple[Links | None, str]:
    """The topology's link figures, or None and a one-line reason."""
    links = topology.links or {}
    if not links:
        return None, f"topology {topology.name} has no links: figures (network_gbps, nvlink_gbps, latency_us)"
    missing = [k for k in ("network_gbps", "nvlink_gbps") if not links.get(k)]
    if missing:
        return None, f"topology {topology.name} links lack a positive {' and '.join(missing)}"
    return Links(float(links["network_gbps"]), float(links["nvlink_gbps"]),
                 float(links.get("latency_us", 0.0))), ""


def with_measured_links(topology: Topology, *, network_gbps: float, nvlink_gbps: float | None = None,
                        latency_us: float = 0.0) -> Topology:
    """`topology` with measured link figures (GB/s per rank per direction; seconds are predicted from them).

    For a CPU run over gloo every link is the same loopback/socket path: give the measured process-to-process
    rate as `network_gbps` and leave `nvlink_gbps` to default to it.
    """
    links = {"network_gbps": float(network_gbps),
             "nvlink_gbps": float(nvlink_gbps if nvlink_gbps is not None else network_gbps),
             "latency_us": float(latency_us)}
    return replace(topology, links=links)


# ------------------------------------------------------------------------------------------- results


@dataclass
class ModeCost:
    mode: str
    seconds: float  # upper bound: phase 1 after phase 0, broadcast path after the reshard path
    pipelined_seconds: float  # forwards overlapped with the network phase, gathers with broadcasts
    network_s: float  # reshard path, phase 0 over the network (busiest rank, with its message latency)
    nvlink0_s: float  # reshard path, phase 0 inside domains
    forward_s: float  # reshard path, phase 1 (forwards inside domains)
    gather_s: float  # broadcast path: gathers on the roots, summed over packs
    ring_s: float  # broadcast path: ring broadcasts, summed over packs (bandwidth + fill latency)
    ring_latency_s: float  # the fill-latency part of ring_s
    packs: int
    busiest: dict  # kind -> (rank, bytes, messages)
    ring_gbps: float  # slowest ring's bandwidth (0: no broadcast)
    ring_hops: int  # hops of the largest ring (group size - 1)
    bound_by: str = ""

    def to_json(self) -> dict:
        return {"seconds": self.seconds, "pipelined_seconds": self.pipelined_seconds,
                "network_seconds": self.network_s, "nvlink_phase0_seconds": self.nvlink0_s,
                "forward_seconds": self.forward_s, "gather_seconds": self.gather_s,
                "ring_seconds": self.ring_s, "ring_latency_seconds": self.ring_latency_s,
                "broadcast_packs": self.packs, "ring_gbps": self.ring_gbps, "ring_hops": self.ring_hops,
                "bound_by": self.bound_by}


@dataclass
class LowerBound:
    seconds: float
    resource: str  # what bounds it, in words
    ingress_s: float
    egress_s: float
    detail: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"seconds": self.seconds, "resource": self.resource, "ingress_seconds": self.ingress_s,
                "egress_seconds": self.egress_s, **self.detail}


@dataclass
class Prediction:
    links: Links
    topology: str
    modes: dict  # mode -> ModeCost
    bound: LowerBound
    plan_mode: str
    seconds: float  # time spent predicting
    auto_routes: dict | None = None  # what auto chose: per route, classes, tensors and bytes

    def to_json(self) -> dict:
        extra = {"auto_routes": self.auto_routes} if self.auto_routes is not None else {}
        return {
            "predicted_seconds": {m: c.seconds for m, c in self.modes.items()},
            "predicted_pipelined_seconds": {m: c.pipelined_seconds for m, c in self.modes.items()},
            "lower_bound_seconds": self.bound.seconds,
            "prediction": {"links": {"network_gbps": self.links.network_gbps,
                                     "nvlink_gbps": self.links.nvlink_gbps,
                                     "latency_us": self.links.latency_us},
                           "modes": {m: c.to_json() for m, c in self.modes.items()},
                           "lower_bound": self.bound.to_json(),
                           "predict_seconds": self.seconds, **extra},
        }


# ---------------------------------------------------------------------------------------- the model


# the per-entry columns of a class (`planner.Columns`) that `_Table` concatenates over classes
_CONCAT = ("fsrc", "fdst", "fn", "fkind", "rsid", "rdst", "rn", "rkey", "rkind", "senders")


class _Table:
    """The entries of some tensor classes (with forwarding, or direct) as flat arrays: what the model sums.

    Per class position `pos`: fixed rows (one possible sender) fs[pos] .. fs[pos] + fc[pos], rotating rows
    rs[pos] .. rs[pos] + rc[pos]. A fixed row is a pair key (kind * world + sender) * world + receiver and its
    elements; a rotating row is (kind * world * world + receiver, its senders' row in `stab`, its rotation key,
    the number of senders L, its elements): tensor t's copy goes from stab[sid, (t + key) % L]. A phase-0
    entry's senders are all inside the receiver's domain or all outside it, so its kind (network or NVLink)
    does not depend on which one sends.
    """

    def __init__(self, classes: list, direct: bool, world: int):
        np = _np()
        w, ww = world, world * world
        cat: dict[str, list] = {f: [] for f in _CONCAT}  # every class's columns, one after another
        fsrc, rsid, senders = cat["fsrc"], cat["rsid"], cat["senders"]
        fs, fc, rs, rc, sbase = [], [], [], [], []
        by_k: dict[int, tuple] = {}  # forward blocks by domain size k: (class positions, G rows, m rows)
        for pos, c in enumerate(classes):
            col = c.columns(direct)
            for g, ms in col.blocks:
                acc = by_k.get(len(g))
                if acc is None:
                    acc = by_k[len(g)] = ([], [], [])
                acc[0].append(pos)
                acc[1].append(g)
                acc[2].append(ms)
            fs.append(len(fsrc))
            rs.append(len(rsid))
            sbase.append(len(senders))
            fc.append(len(col.fsrc))
            rc.append(len(col.rsid))
            for f, xs in cat.items():
                xs += getattr(col, f)
        i64, f64 = np.int64, np.float64
        self.fs, self.fc, self.rs, self.rc = (np.array(x, dtype=i64) for x in (fs, fc, rs, rc))
        self.fk = (np.array(cat["fkind"], dtype=i64) * ww + np.array(fsrc, dtype=i64) * w
                   + np.array(cat["fdst"], dtype=i64))
        self.fn = np.array(cat["fn"], dtype=f64)
        self.rb = np.array(cat["rkind"], dtype=i64) * ww + np.array(cat["rdst"], dtype=i64)
        # a rotating row's senders: its class's first senders row + its position among the class's
        self.rsid = np.array(rsid, dtype=i64) + np.repeat(np.array(sbase, dtype=i64), self.rc)
        self.rkey = np.array(cat["rkey"], dtype=i64)
        self.rn = np.array(cat["rn"], dtype=f64)
        lens = np.array([len(x) for x in senders] or [1], dtype=i64)
        stab = np.zeros((max(len(senders), 1), int(lens.max())), dtype=i64)
        for j, x in enumerate(senders):
            stab[j, :len(x)] = x
        self.stab = stab
        self.rl = lens[self.rsid] if len(self.rsid) else np.zeros(0, dtype=i64)
        self.world = world
        # forwards: G[j] -> G[g] (g != j) carries m_j, expanded per block and kept by class position
        keys, vals, owner = [np.zeros(0, dtype=i64)], [np.zeros(0, dtype=f64)], [np.zeros(0, dtype=i64)]
        for k, (cpos, gs, mss) in by_k.items():
            g = np.array(gs, dtype=i64)  # blocks x k
            m = np.array(mss, dtype=f64)
            kk = FWD * ww + g[:, :, None] * w + g[:, None, :]  # blocks x j x g
            vv = np.broadcast_to(m[:, :, None], kk.shape)
            keep = (~np.eye(k, dtype=bool))[None, :, :] & (vv > 0)
            keys.append(kk[keep])
            vals.append(vv[keep])
            owner.append(np.repeat(np.array(cpos, dtype=i64), keep.reshape(len(gs), -1).sum(axis=1)))
        owner_a = np.concatenate(owner)
        order = np.argsort(owner_a, kind="stable")
        self.bk, self.bn = np.concatenate(keys)[order], np.concatenate(vals)[order]
        bcount = np.bincount(owner_a, minlength=len(classes)).astype(i64)
        self.bc = bcount
        self.bs = np.cumsum(bcount) - bcount

    def rows(self, pos, gid, total, rpos, rgid, res, wts) -> tuple:
        """Pair keys, bytes and group id of every row of some tensors: per (class position `pos`, group `gid`),
        `total` Σ item bytes of its tensors (for the fixed rows); per (class position `rpos`, group `rgid`,
        rotation residue `res`), `wts` Σ item bytes of its tensors at that residue (for the rotating rows)."""
        np = _np()
        keys, vals, gids = [], [], []
        for start, count, k, n in ((self.fs, self.fc, self.fk, self.fn), (self.bs, self.bc, self.bk, self.bn)):
            cnt = count[pos]
            idx = _ranges(start[pos], cnt)
            keys.append(k[idx])
            vals.append(n[idx] * np.repeat(total, cnt))
            gids.append(np.repeat(gid, cnt))
        cnt = self.rc[rpos]
        if cnt.sum():
            idx = _ranges(self.rs[rpos], cnt)
            pick = (np.repeat(res, cnt) + self.rkey[idx]) % self.rl[idx]
            sender = self.stab[self.rsid[idx], pick]
            keys.append(self.rb[idx] + sender * self.world)
            vals.append(self.rn[idx] * np.repeat(wts, cnt))
            gids.append(np.repeat(rgid, cnt))
        return np.concatenate(keys), np.concatenate(vals), np.concatenate(gids)


def _ranges(starts, counts):
    """Concatenated aranges starts[i] .. starts[i] + counts[i]."""
    np = _np()
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(total, dtype=np.int64)


class _Model:
    """Per-class figures, shared by every mode (the geometry does not depend on the mode)."""

    def __init__(self, plan: Plan, links: Links, bucket_bytes: int):
        self.plan = plan
        self.links = links
        self.half = TransferOptions(bucket_bytes=bucket_bytes).half
        self.dom = plan.domains
        self.items = plan.itemsizes()
        # tensor -> class index; per class: the class, its reshard period n, broadcast period bn, numel
        self.cls, self.cid = plan.class_index()
        self._n_of: list | None = None
        self.bn_of = [c.bn for c in self.cls]
        self.numel_of = [c.numel if c.src_boxes else 0 for c in self.cls]
        self.world = max(max(plan.src.ranks), max(plan.dst.ranks)) + 1
        self._tables: dict[bool, tuple] = {}
        self._gather: dict = {}
        self._ring: dict = {}
        self._by_class: list | None = None
        self._cache_arrays: tuple | None = None
        self.choice: RouteChoice | None = None  # auto's, once chosen
        self._saved: dict[tuple, tuple] = {}  # per-class routes -> per (kind, rank) loads (`choose`)

    @property
    def n_of(self) -> list[int]:
        """Each class's rotation period."""
        if self._n_of is None:
            self.table(False)  # walks every class's geometry on the way
            self._n_of = [c.n for c in self.cls]
        return self._n_of

    # ---- reshard path
    def table(self, direct: bool) -> tuple:
        """(the `_Table` of the classes whose entries differ with `direct`, class index -> its position)."""
        out = self._tables.get(direct)
        if out is None:
            np = _np()
            picked = [i for i, c in enumerate(self.cls) if c.splits] if direct else list(range(len(self.cls)))
            table = _Table([self.cls[i] for i in picked], direct, self.world)
            pos = np.full(len(self.cls), -1, dtype=np.int64)
            pos[picked] = np.arange(len(picked))
            out = self._tables[direct] = (table, pos)
        return out

    def _arrays(self) -> tuple:
        """Per tensor: class index, item size, rotation residue; per class: whether direct differs."""
        out = self._cache_arrays
        if out is None:
            np = _np()
            cid = np.array(self.cid, dtype=np.int64)
            n = np.array(self.n_of, dtype=np.int64)
            res = np.arange(len(cid), dtype=np.int64) % n[cid] if len(cid) else cid
            splits = np.array([c.splits for c in self.cls], dtype=bool)
            out = self._cache_arrays = (cid, np.array(self.items, dtype=np.float64), res, splits, int(n.max(initial=1)))
        return out

    def _rows(self, sel, direct, grouped: bool) -> tuple | None:
        """Pair keys, bytes and group ids of the rows of tensors `sel` (indices), each with forwarding or
        `direct` (a bool per tensor; classes where direct makes no difference use forwarding's rows). With
        `grouped`, a row's group id is its class index * 2 + direct, else 0."""
        np = _np()
        cid, item, res, splits, rmax = self._arrays()
        if not len(sel):
            return None
        c = cid[sel]
        job = c * 2 + (direct & splits[c])
        u, inv = np.unique(job * rmax + res[sel], return_inverse=True)
        w = np.bincount(inv.ravel(), weights=item[sel], minlength=len(u))  # Σ item per (job, residue)
        ujob, rr = u // rmax, u % rmax
        jobs, invj = np.unique(ujob, return_inverse=True)
        tot = np.bincount(invj.ravel(), weights=w, minlength=len(jobs))  # Σ item per job
        keys, vals, gids = [], [], []
        for d in (0, 1):
            mj, mr = jobs % 2 == d, ujob % 2 == d
            if not mj.any():
                continue
            table, pos = self.table(bool(d))
            gj = jobs[mj] if grouped else np.zeros(int(mj.sum()), dtype=np.int64)
            gr = ujob[mr] if grouped else np.zeros(int(mr.sum()), dtype=np.int64)
            k, v, g = table.rows(pos[jobs[mj] // 2], gj, tot[mj], pos[ujob[mr] // 2], gr, rr[mr], w[mr])
            keys.append(k)
            vals.append(v)
            gids.append(g)
        return np.concatenate(keys), np.concatenate(vals), np.concatenate(gids)

    def route_arrays(self, routes: tuple) -> tuple:
        """(indices of the reshard-path tensors, their direct flags) of per-tensor routes."""
        np = _np()
        code = np.array([_ROUTE_CODE[r] for r in routes], dtype=np.int8)
        sel = np.flatnonzero(code != 2)
        return sel, code[sel] == 1

    def reshard_loads(self, routes: tuple) -> dict | None:
        """Per kind (NET, NVL0, FWD): arrays over ranks of (bytes sent, bytes received, messages sent, messages
        received) of the reshard-path tensors of per-tensor `routes`."""
        np = _np()
        w = self.world
        sel, direct = self.route_arrays(routes)
        rows = self._rows(sel, direct, False)
        if rows is None or not len(rows[0]):
            return None
        uk, inv = np.unique(rows[0], return_inverse=True)
        nbytes = np.bincount(inv.ravel(), weights=rows[1], minlength=len(uk))
        msgs = np.ceil(nbytes / self.half)
        kind = uk // (w * w)
        snd = (uk // w) % w
        rcv = uk % w
        per = {}
        for kd in (NET, NVL0, FWD):
            m = kind == kd
            per[kd] = (np.bincount(snd[m], nbytes[m], minlength=w), np.bincount(rcv[m], nbytes[m], minlength=w),
                       np.bincount(snd[m], msgs[m], minlength=w), np.bincount(rcv[m], msgs[m], minlength=w))
        return per

    def reshard_path(self, routes: tuple) -> dict:
        """Busiest-rank (seconds, rank, bytes, messages) of each kind of reshard traffic, and of all NVLink
        traffic together ("nvl_all"), of per-tensor `routes` (the loads `choose` summed are reused)."""
        lk = self.links
        saved = self._saved.get(routes) if self._saved else None
        if saved is not None:
            w = self.world
            per = {k: tuple(a[k * w:(k + 1) * w] for a in saved) for k in (NET, NVL0, FWD)}
        else:
            per = self.reshard_loads(routes)
        if per is None:
            zero = (0.0, -1, 0, 0)
            return {NET: zero, NVL0: zero, FWD: zero, "nvl_all": zero}
        out = {NET: _busiest(*per[NET], lk.net, lk.lat), NVL0: _busiest(*per[NVL0], lk.nvl, lk.lat),
               FWD: _busiest(*per[FWD], lk.nvl, lk.lat)}
        # all NVLink traffic of a rank (phase 0 in-domain + forwards): what a pipelined transport overlaps
        out["nvl_all"] = _busiest(*(a + b for a, b in zip(per[NVL0], per[FWD])), lk.nvl, lk.lat)
        return out

    # ---- broadcast path
    def gather_cost(self, i: int, t: int) -> tuple[int, float, int]:
        """(root, seconds per byte of item size, messages) of the gather of tensor t (class index i)."""
        key = (i, t % self.bn_of[i])
        out = self._gather.get(key)
        if out is None:
            bc = self.cls[i].bcast(t)
            dom, lk = self.dom, self.links
            per_item = 0.0
            for s, a in bc.gather:
                per_item += a.numel / (lk.nvl if dom[s] == dom[bc.root] else lk.net)
            self._gather[key] = out = (bc.root, per_item, len(bc.gather))
        return out

    def ring(self, root: int) -> tuple[float, int]:
        """(bandwidth in bytes/s, group size) of the broadcast ring from `root` to the destination group."""
        out = self._ring.get(root)
        if out is None:
            group = {root, *self.plan.dst.ranks}
            per_dom: dict[int, int] = defaultdict(int)
            for r in group:
                per_dom[self.dom[r]] += 1
            lk = self.links
            bw = lk.nvl if len(per_dom) == 1 else min(lk.nvl, lk.net * min(per_dom.values()))
            self._ring[root] = out = (bw, len(group))
        return out

    def broadcast_path(self, tensors: list[int]) -> dict:
        """Packs as the transport builds them; gather then ring per pack, one pack after another."""
        lk = self.links
        gather_s = 0.0
        gather_m = 0
        filler = PackFiller(self.half)  # the transport's packing rule
        packs: dict[int, list] = {}  # root -> [packs, bytes]
        cid, items, numel_of = self.cid, self.items, self.numel_of
        for t in tensors:
            i = cid[t]
            numel = numel_of[i]
            if not numel:  # 0-element tensor: nothing moves
                continue
            root, per_item, msgs = self.gather_cost(i, t)
            item = items[t]
            gather_s += per_item * item
            gather_m += msgs
            _pack, off, new = filler.add(root, numel * item)
            acc = packs.setdefault(root, [0, 0])
            acc[0] += new
            acc[1] += align(numel * item)
        ring_bw_s = ring_lat_s = 0.0
        slowest, hops = math.inf, 0
        for root, (count, nbytes) in packs.items():
            bw, size = self.ring(root)
            ring_bw_s += nbytes / bw
            ring_lat_s += count * (size - 1) * lk.lat
            slowest = min(slowest, bw)
            hops = max(hops, size - 1)
        n = sum(c for c, _ in packs.values())
        return {"gather_s": gather_s + gather_m * lk.lat, "ring_s": ring_bw_s + ring_lat_s,
                "ring_latency_s": ring_lat_s, "packs": n, "ring_gbps": (slowest / GB) if n else 0.0,
                "ring_hops": hops}

    # ---- one mode
    def mode_cost(self, mode: str, routes: tuple) -> ModeCost:
        """The predicted figures of per-tensor `routes` ("forward", "direct", "broadcast")."""
        bcast_tensors = [t for t, r in enumerate(routes) if r == "broadcast"]
        rp = self.reshard_path(routes)
        bp = self.broadcast_path(bcast_tensors)
        net_s, nvl0_s, fwd_s = rp[NET][0], rp[NVL0][0], rp[FWD][0]
        reshard_seq = max(net_s, nvl0_s) + fwd_s
        reshard_pipe = max(net_s, rp["nvl_all"][0])
        bcast_seq = bp["gather_s"] + bp["ring_s"]
        bcast_pipe = max(bp["gather_s"], bp["ring_s"])
        busiest = {"network": rp[NET][1:], "nvlink_phase0": rp[NVL0][1:], "forward": rp[FWD][1:]}
        mc = ModeCost(mode, reshard_seq + bcast_seq, reshard_pipe + bcast_pipe, net_s, nvl0_s, fwd_s,
                      bp["gather_s"], bp["ring_s"], bp["ring_latency_s"], bp["packs"], busiest, bp["ring_gbps"],
                      bp["ring_hops"])
        mc.bound_by = _bound_by(mc, self.links)
        return mc

    # ---- auto: the route of each class
    def tensors_by_class(self) -> list[list[int]]:
        if self._by_class is None:
            out: list[list[int]] = [[] for _ in self.cls]
            for t, i in enumerate(self.cid):
                out[i].append(t)
            self._by_class = out
        return self._by_class

    def choose(self) -> "RouteChoice":
        """Auto's routes: start from forward everywhere (mode reshard) and, class by class in a fixed order,
        move a class to another route (direct, broadcast, or back) where this model predicts the whole refit
        strictly faster with it; repeat until a pass changes nothing (at most 4 passes). Finally, broadcast
        everywhere wins if it is predicted faster still. So auto is never predicted slower than reshard or
        broadcast.

        Every figure compared is built from sums of whole bytes (exact in float64, whatever their order) and the
        same per-rank formula as `mode_cost`, so every rank computes the same figures and the same choice;
        ties keep the current route, and among new routes go to the first of forward, direct, broadcast.
        A class is tried on broadcast only when it touches a busiest rank of a phase that sets the time
        (moving it elsewhere cannot shorten the reshard path otherwise)."""
        np = _np()
        w = self.world
        ww, w3 = w * w, 3 * w
        lk = self.links
        by_class = self.tensors_by_class()
        ncls = len(self.cls)
        items = self.items
        # every (class, variant)'s rows, summed over its tensors, as positions in one sorted key universe;
        # group id of (class i, direct d): 2i + d
        cid, _item, _res, splits, _rmax = self._arrays()
        split_t = np.flatnonzero(splits[cid])
        sel = np.concatenate([np.arange(len(cid), dtype=np.int64), split_t])
        direct = np.concatenate([np.zeros(len(cid), dtype=bool), np.ones(len(split_t), dtype=bool)])
        ngid = 2 * ncls
        rows = self._rows(sel, direct, True)
        if rows is None:
            rows = (np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0, dtype=np.int64))
        keys, vals, gids = rows
        span = 3 * ww
        uk, inv = np.unique(gids * span + keys, return_inverse=True)
        row_bytes = np.bincount(inv.ravel(), weights=vals, minlength=len(uk))
        row_gid = uk // span
        universe, row_pos = np.unique(uk % span, return_inverse=True)
        row_pos = row_pos.ravel()
        bounds = np.searchsorted(row_gid, np.arange(ngid + 1))
        ks = (universe // ww) * w + (universe // w) % w  # (kind, sender) of each pair, flat
        kr = (universe // ww) * w + universe % w  # (kind, receiver)
        bwv = np.repeat(np.array([lk.net, lk.nvl, lk.nvl]), w)

        def seg(i: int, route: str) -> tuple:
            g = 2 * i + (route == "direct" and self.cls[i].splits)
            return row_pos[bounds[g]:bounds[g + 1]], row_bytes[bounds[g]:bounds[g + 1]]

        def loads(pb) -> tuple:
            m = np.ceil(pb / self.half)
            return (np.bincount(ks, weights=pb, minlength=w3), np.bincount(kr, weights=pb, minlength=w3),
                    np.bincount(ks, weights=m, minlength=w3), np.bincount(kr, weights=m, minlength=w3))

        def per_kind(ld) -> tuple:
            t = np.maximum(ld[0], ld[1]) / bwv + np.maximum(ld[2], ld[3]) * lk.lat
            return t, [float(x) for x in t.reshape(3, w).max(axis=1)]

        def reshard_s(mx) -> float:
            return max(mx[NET], mx[NVL0]) + mx[FWD]  # as mode_cost: max(network, phase-0 NVLink) + forwards

        def bcast_s(tensors: list) -> float:
            bp = self.broadcast_path(tensors)
            return bp["gather_s"] + bp["ring_s"]

        mask = row_gid % 2 == 0
        pb = np.bincount(row_pos[mask], weights=row_bytes[mask], minlength=len(universe))
        ld = loads(pb)
        self._saved[("forward",) * len(items)] = ld  # mode reshard's loads: mode_cost need not sum them again
        t_rank, mx = per_kind(ld)
        bset: list[int] = []
        b_s = bcast_s(bset)
        total = reshard_s(mx) + b_s
        start = total
        routes = ["forward"] * ncls
        class_of_g = np.arange(ngid, dtype=np.int64) // 2
        split_classes = set(np.flatnonzero(splits).tolist())
        switches = passes = 0
        for passes in range(1, 5):
            changed = False
            # classes whose current rows touch a busiest rank of a phase that sets the time
            busy = []
            if mx[FWD] > 0:
                busy.append(FWD)
            if max(mx[NET], mx[NVL0]) > 0:
                busy += [k for k in (NET, NVL0) if mx[k] == max(mx[NET], mx[NVL0])]
            cur_g = np.arange(0, ngid, 2, dtype=np.int64)
            for i in split_classes:
                cur_g[i] += routes[i] == "direct"
            current = cur_g[class_of_g[row_gid]] == row_gid
            touch = np.zeros(len(row_gid), dtype=bool)
            for k in busy:
                r = int(np.argmax(t_rank[k * w:(k + 1) * w]))
                touch |= (ks[row_pos] == k * w + r) | (kr[row_pos] == k * w + r)
            bcast_ok = set(class_of_g[row_gid[touch & current]].tolist())
            for i in sorted(bcast_ok | split_classes | {i for i, r in enumerate(routes) if r == "broadcast"}):
                cur = routes[i]
                options = []
                for route in ROUTES:
                    if route == cur or (route == "direct" and not self.cls[i].splits):
                        continue
                    if route == "broadcast" and (i not in bcast_ok or not self.numel_of[i]):
                        continue
                    options.append(route)
                best = None
                for route in options:
                    parts_i, parts_b = [], []
                    for r, sign in ((cur, -1.0), (route, 1.0)):
                        if r != "broadcast":
                            pos, nb = seg(i, r)
                            parts_i.append(pos)
                            parts_b.append(nb * sign)
                    if parts_i:
                        u, inv2 = np.unique(np.concatenate(parts_i), return_inverse=True)
                        delta = np.bincount(inv2.ravel(), weights=np.concatenate(parts_b), minlength=len(u))
                        old = pb[u]
                        new = old + delta
                        dm = np.ceil(new / self.half) - np.ceil(old / self.half)
                        ld2 = (ld[0] + np.bincount(ks[u], weights=delta, minlength=w3),
                               ld[1] + np.bincount(kr[u], weights=delta, minlength=w3),
                               ld[2] + np.bincount(ks[u], weights=dm, minlength=w3),
                               ld[3] + np.bincount(kr[u], weights=dm, minlength=w3))
                        t2, mx2 = per_kind(ld2)
                    else:
                        u = new = None
                        ld2, t2, mx2 = ld, t_rank, mx
                    if route == "broadcast" or cur == "broadcast":
                        bset2 = sorted(set(bset) | set(by_class[i])) if route == "broadcast" else \
                            [t for t in bset if t not in set(by_class[i])]
                        b2 = bcast_s(bset2)
                    else:
                        bset2, b2 = bset, b_s
                    total2 = reshard_s(mx2) + b2
                    if total2 < (total if best is None else best[0]):
                        best = (total2, route, u, new, ld2, t2, mx2, bset2, b2)
                if best is not None:
                    total, routes[i], u, new, ld, t_rank, mx, bset, b_s = best
                    if u is not None:
                        pb[u] = new
                    switches += 1
                    changed = True
            if not changed:
                break
        # broadcast everywhere, where that is faster still (tried only if a floor of its time is below)
        floor = self.plan.src.manifest.nbytes / lk.nvl  # no ring is faster than NVLink
        if floor < total:  # each root's ring bytes at its ring's bandwidth, and at least one fill latency
            floor = 0.0
            per_root: dict[int, int] = defaultdict(int)
            for i, ts in enumerate(by_class):
                if self.numel_of[i]:
                    for t in ts:
                        per_root[self.gather_cost(i, t)[0]] += align(self.numel_of[i] * items[t])
            for root, nbytes in per_root.items():
                bw, size = self.ring(root)
                floor += nbytes / bw + (size - 1) * lk.lat
        broadcast = None
        if floor < total:
            broadcast = 0.0 + bcast_s(list(range(len(items))))
        if broadcast is not None and broadcast < total:
            total, routes = broadcast, ["broadcast"] * ncls
        elif any(r != "broadcast" for r in routes):  # auto's loads, likewise
            self._saved[tuple(routes[i] for i in self.cid)] = ld
        return RouteChoice(routes, total, start, broadcast, switches, passes)

    # ---- lower bound
    def lower_bound(self) -> LowerBound:
        np = _np()
        plan, dom, lk = self.plan, self.dom, self.links
        w = self.world
        ww = w * w
        totals = [0] * len(self.cls)  # class -> Σ item bytes of its tensors
        for t, i in enumerate(self.cid):
            totals[i] += self.items[t]
        # ingress: every phase-0 network entry (with forwarding) enters its receiver's domain once
        table, _pos = self.table(False)
        tot = np.array(totals, dtype=np.float64)
        dom_ids = sorted(set(dom.values()))
        index = {d: j for j, d in enumerate(dom_ids)}
        dom_idx = np.zeros(w, dtype=np.int64)
        for r, d in dom.items():
            dom_idx[r] = index[d]
        ingress_arr = np.zeros(len(dom_ids))
        for keys, n, cnt in ((table.fk, table.fn, table.fc), (table.rb, table.rn, table.rc)):
            if not len(keys):
                continue
            weight = n * np.repeat(tot, cnt)
            net = keys // ww == NET
            ingress_arr += np.bincount(dom_idx[keys[net] % w], weights=weight[net], minlength=len(dom_ids))
        ingress: dict[int, float] = {dom_ids[j]: float(v) for j, v in enumerate(ingress_arr) if v}
        exclusive: dict[int, float] = defaultdict(float)  # src domain -> bytes only it holds, needed outside
        must_leave = 0.0  # bytes that must leave some source domain
        for c, items in zip(self.cls, totals):
            if not items:
                continue
            dst_boxes = c.dst_boxes
            dst_doms = [{dom[h] for h in holders} for _b, holders in dst_boxes]
            for a, senders in c.src_boxes:
                sdoms = {dom[s] for s in senders}
                need = 0
                for (b, _h), ddoms in zip(dst_boxes, dst_doms):
                    if ddoms - sdoms:
                        r = a.intersect(b)
                        if r is not None:
                            need += r.numel
                if need:
                    must_leave += need * items
                    if len(sdoms) == 1:
                        exclusive[next(iter(sdoms))] += need * items
        ranks_in: dict[int, list] = defaultdict(list)
        for r in sorted(set(plan.src.ranks) | set(plan.dst.ranks)):
            ranks_in[dom[r]].append(r)
        src_doms = {dom[r] for r in plan.src.ranks}

        def worst(figures: dict) -> tuple[float, int | None]:
            best = (0.0, None)
            for d, nb in figures.items():
                s = nb / (len(ranks_in[d]) * lk.net)
                if s > best[0]:
                    best = (s, d)
            return best

        in_s, in_d = worst(ingress)
        ex_s, ex_d = worst(exclusive)
        src_nics = sum(len(ranks_in[d]) for d in src_doms)
        all_s = must_leave / (src_nics * lk.net) if src_nics else 0.0

        def where(d: int) -> str:
            rs = ranks_in[d]
            return f"domain {d} (ranks {rs[0]}-{rs[-1]})" if len(rs) > 1 else f"rank {rs[0]}"

        egress_s = max(ex_s, all_s)
        candidates = [(in_s, "ingress", in_d), (ex_s, "egress", ex_d), (all_s, "egress-all", None)]
        s, kind, d = max(candidates, key=lambda x: x[0])
        if s == 0:
            resource = "nothing crosses a domain boundary"
        elif kind == "ingress":
            resource = (f"network ingress of {where(d)}: {_gb(ingress[d])} over {len(ranks_in[d])} x "
                        f"{lk.network_gbps:g} GB/s")
        elif kind == "egress":
            resource = (f"network egress of {where(d)}: {_gb(exclusive[d])} only it holds, over "
                        f"{len(ranks_in[d])} x {lk.network_gbps:g} GB/s")
        else:
            resource = (f"network egress of all source domains: {_gb(must_leave)} over {src_nics} x "
                        f"{lk.network_gbps:g} GB/s")
        detail = {"ingress_bytes_max": max(ingress.values(), default=0),
                  "egress_exclusive_bytes_max": max(exclusive.values(), default=0),
                  "egress_all_bytes": must_leave}
        return LowerBound(s, resource, in_s, egress_s, detail)


@dataclass
class RouteChoice:
    """Auto's choice (`_Model.choose`): per class (in `Plan.class_index` order) its route, and the predicted
    seconds of the refit with these routes, with forward everywhere (mode reshard) and with broadcast
    everywhere (None: not needed, its floor was already slower)."""

    routes: list
    seconds: float
    reshard_seconds: float
    broadcast_seconds: float | None
    switches: int  # classes moved off their route (counting each move)
    passes: int


def _np():
    """numpy, imported on first use: planning without link figures never needs it."""
    import numpy

    return numpy


def _busiest(sent, received, msgs_sent, msgs_received, bw: float, lat: float) -> tuple:
    """(seconds, rank, bytes, messages) of the busiest rank: full duplex, so the larger direction counts."""
    np = _np()
    nb = np.maximum(sent, received)
    m = np.maximum(msgs_sent, msgs_received)
    t = nb / bw + m * lat
    r = int(np.argmax(t))
    if t[r] <= 0:
        return (0.0, -1, 0, 0)
    return (float(t[r]), r, int(nb[r]), int(m[r]))


def fmt_seconds(x: float) -> str:
    """A duration with its unit: 143.1 s, 2.36 s, 144 ms, 35.5 us."""
    if x >= 100:
        return f"{x:.1f} s"
    if x >= 1:
        return f"{x:.2f} s"
    if x >= 1e-3:
        return f"{x * 1e3:.3g} ms" if x < 0.1 else f"{x * 1e3:.0f} ms"
    if x > 0:
        return f"{x * 1e6:.3g} us"
    return "0"


def _gb(n: float) -> str:
    from reshard_cli.base.text import fmt_bytes
    return fmt_bytes(n)


def _bound_by(mc: ModeCost, lk: Links) -> str:
    """The largest term of the sequential figure, in words."""
    terms = []
    phase0 = max(mc.network_s, mc.nvlink0_s)
    if phase0:
        if mc.network_s >= mc.nvlink0_s:
            r, nb, m = mc.busiest["network"]
            terms.append((mc.network_s, f"network: rank {r} moves {_gb(nb)} in {m} messages"))
        else:
            r, nb, m = mc.busiest["nvlink_phase0"]
            terms.append((mc.nvlink0_s, f"NVLink phase 0: rank {r} moves {_gb(nb)}"))
    if mc.forward_s:
        r, nb, m = mc.busiest["forward"]
        terms.append((mc.forward_s, f"NVLink forwards: rank {r} moves {_gb(nb)}"))
    if mc.ring_s:
        bw = mc.ring_s - mc.ring_latency_s
        if mc.ring_latency_s > bw:
            terms.append((mc.ring_s, f"broadcast ring latency: {mc.packs} packs x {mc.ring_hops} hops x "
                                     f"{lk.latency_us:g} us"))
        else:
            terms.append((mc.ring_s, f"broadcast rings: {mc.packs} packs through {mc.ring_gbps:g} GB/s rings"))
    if mc.gather_s:
        terms.append((mc.gather_s, "gathers on the broadcast roots"))
    if not terms:
        return "nothing to move"
    return max(terms, key=lambda x: x[0])[1]


# ----------------------------------------------------------------------------------------------- API


def model_for(plan: Plan, links: Links, bucket_bytes: int | None = None) -> _Model:
    """The model of `plan` under `links` (kept on the plan: auto's choice and the predictions share its tables)."""
    half = TransferOptions(bucket_bytes=bucket_bytes or DEFAULT_BUCKET_BYTES).half
    key = ("model", links, half)
    model = plan._cache.get(key)
    if model is None:
        model = plan._cache[key] = _Model(plan, links, bucket_bytes or DEFAULT_BUCKET_BYTES)
    return model


def choose_routes(plan: Plan, links: Links | None = None, bucket_bytes: int | None = None) -> RouteChoice | None:
    """Auto's route per tensor class of `plan` (`Plan.class_index` order): the one this model predicts cheapest
    for the class's tensors refit alone, from `links` (default: the plan's topology's; None without figures)."""
    if links is None:
        links, _why = links_of(plan.topology)
        if links is None:
            return None
    model = model_for(plan, links, bucket_bytes)
    if model.choice is None:
        model.choice = model.choose()
    return model.choice


def predict(plan: Plan, topology: Topology | None = None, *, modes=MODES,
            bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Prediction | None:
    """Predicted seconds of every mode (each mode's routes from the plan's classes) and the network lower bound.

    `topology` defaults to the plan's; None is returned when it has no usable link figures (`links_of`).
    Mode auto is costed with the routes the plan chose (from its topology's links and its bucket size).
    """
    t0 = time.perf_counter()
    topology = topology if topology is not None else plan.topology
    links, _why = links_of(topology)
    if links is None:
        return None
    if topology is not plan.topology:
        plan = Plan(plan.src, plan.dst, topology, mode=plan.mode, reshard_match=plan.reshard_match,
                    bucket_bytes=plan.bucket_bytes)
    with no_gc():
        model = model_for(plan, links, bucket_bytes)
        costs = {m: model.mode_cost(m, plan.routes_for(m)) for m in modes}
        bound = model.lower_bound()
        auto = plan.route_summary(plan.routes_for("auto")) if "auto" in modes else None
    return Prediction(links, topology.name, costs, bound, plan.mode, time.perf_counter() - t0, auto)


def prediction_text(pred: Prediction) -> str:
    rows = []
    lb = pred.bound.seconds
    for m, c in pred.modes.items():
        rows.append([m, fmt_seconds(c.seconds), fmt_seconds(c.pipelined_seconds), fmt_seconds(c.network_s),
                     fmt_seconds(c.nvlink0_s + c.forward_s), fmt_seconds(c.gather_s + c.ring_s),
                     f"{c.seconds / lb:.2f}x" if lb else "-", c.bound_by])
    lines = [
        f"  predicted     {pred.topology} links: {pred.links.describe()}  (predicted in "
        f"{pred.seconds * 1e3:.0f} ms)",
        _table(["mode", "time", "pipelined", "network", "in-domain", "broadcast", "vs bound", "bound by"], rows),
        "  (time: forwards after the network phase and the broadcast path after the reshard path, an upper",
        "   bound; pipelined: forwards overlapped with the network phase, as the transport forwards each",
        "   bucket as it lands, and gathers with broadcasts)",
        f"  lower bound   {fmt_seconds(lb)}  {pred.bound.resource}"
        f"  (ingress {fmt_seconds(pred.bound.ingress_s)}, egress {fmt_seconds(pred.bound.egress_s)})",
    ]
    this = pred.modes.get(pred.plan_mode)
    if this is not None:
        ratio = f" = {this.seconds / lb:.2f}x the lower bound" if lb else ""
        lines.append(f"  this plan     {pred.plan_mode}: {fmt_seconds(this.seconds)} predicted{ratio}, bound by "
                     f"{this.bound_by}")
    return "\n".join(lines)


def _table(headers: list, rows: list) -> str:
    """Like report.table (first column left, the rest right-aligned), but the last column (a phrase) left."""
    cells = [headers] + rows
    widths = [max(len(str(r[i])) for r in cells) for i in range(len(headers))]
    out = []
    for j, r in enumerate(cells):
        parts = [str(r[0]).ljust(widths[0])] + [str(c).rjust(w) for c, w in zip(r[1:-1], widths[1:-1])] + [str(r[-1])]
        out.append("  " + ("# " if j == 0 else "  ") + "  ".join(parts).rstrip())
    return "\n".join(out)


def plan_prediction(plan: Plan) -> tuple[str, dict[str, Any]]:
    """What `reshard plan` adds: (text, JSON keys). Empty without a topology; one line without links."""
    topo = plan.topology
    if topo is NO_TOPOLOGY or topo == NO_TOPOLOGY:
        return "", {}
    links, why = links_of(topo)
    if links is None:
        return f"  predicted     none: {why}", {}
    pred = predict(plan)
    assert pred is not None
    return prediction_text(pred), pred.to_json()
