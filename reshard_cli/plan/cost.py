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
  The current transport starts phase 1 on a rank after its phase 0, so the phases **add**:
  max(network, phase-0 NVLink) + forwards. A transport that forwards each bucket as soon as it lands
  ("pipelined") would reach max(network, all NVLink) — reported beside it.
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

import numpy as np

from reshard_cli.plan.planner import MODES, Plan
from reshard_cli.plan.schedule import PackFiller, TransferOptions, align
from reshard_cli.spec.topology import NO_TOPOLOGY, Topology

DEFAULT_BUCKET_BYTES = TransferOptions().bucket_bytes  # `reshard run --bucket-mb 64`
GB = 1e9

# kinds of reshard-path traffic
NET, NVL0, FWD = 0, 1, 2


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
    seconds: float  # the current transport: phase 1 after phase 0, broadcast path after the reshard path
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

    def to_json(self) -> dict:
        return {
            "predicted_seconds": {m: c.seconds for m, c in self.modes.items()},
            "predicted_pipelined_seconds": {m: c.pipelined_seconds for m, c in self.modes.items()},
            "lower_bound_seconds": self.bound.seconds,
            "prediction": {"links": {"network_gbps": self.links.network_gbps,
                                     "nvlink_gbps": self.links.nvlink_gbps,
                                     "latency_us": self.links.latency_us},
                           "modes": {m: c.to_json() for m, c in self.modes.items()},
                           "lower_bound": self.bound.to_json(),
                           "predict_seconds": self.seconds},
        }


# ---------------------------------------------------------------------------------------- the model


class _Model:
    """Per-class figures, shared by every mode (the geometry does not depend on the mode)."""

    def __init__(self, plan: Plan, links: Links, bucket_bytes: int):
        self.plan = plan
        self.links = links
        self.half = TransferOptions(bucket_bytes=bucket_bytes).half
        self.dom = plan.domains
        tensors = plan.src.manifest.tensors
        self.items = [s.itemsize for s in tensors]
        # tensor -> class index; per class: the class, its reshard period n, broadcast period bn, numel
        self.cls: list = []
        self.cid: list[int] = []
        index: dict[int, int] = {}
        for t in range(len(tensors)):
            c = plan.tensor_class(t)
            i = index.get(id(c))
            if i is None:
                i = index[id(c)] = len(self.cls)
                self.cls.append(c)
            self.cid.append(i)
        self.n_of = [c.n for c in self.cls]
        self.bn_of = [c.bn for c in self.cls]
        self.numel_of = [math.prod(c.shape) if c.src_boxes else 0 for c in self.cls]
        self.world = max(max(plan.src.ranks), max(plan.dst.ranks)) + 1
        self._split: dict = {}
        self._gather: dict = {}
        self._ring: dict = {}

    # ---- reshard path
    def _class_split(self, c) -> tuple:
        """A class's entries as arrays: (fixed pair keys, their elements, {L: rotating entries}).

        Pair keys are ints (kind * world + sender) * world + receiver. Entries with one possible sender are
        fixed; the others rotate over their L senders: entry k goes from senders[(t + key_k) % L]. A phase-0
        entry's senders are all inside the receiver's domain or all outside it, so its kind (network or
        NVLink) does not depend on which one sends.
        """
        out = self._split.get(id(c))
        if out is None:
            dom, w = self.dom, self.world
            ww = w * w
            rows = [(e.senders, e.dst, e.phase, e.numel, e.key) for e in c.entries]
            fixed_k: list[int] = []
            fixed_n: list[int] = []
            rot: dict[int, list] = {}
            for senders, dst, phase, n, k in rows:
                if not n:
                    continue
                kind = FWD if phase else (NET if dom[senders[0]] != dom[dst] else NVL0)
                if len(senders) == 1:
                    fixed_k.append(kind * ww + senders[0] * w + dst)
                    fixed_n.append(n)
                else:
                    rot.setdefault(len(senders), []).append((senders, k, kind * ww + dst, n))
            rot_arrays = {}
            for ln, rs in rot.items():
                rot_arrays[ln] = (np.array([r[0] for r in rs], dtype=np.int64),  # E x L sender ranks
                                  np.array([r[1] for r in rs], dtype=np.int64),  # rotation keys
                                  np.array([r[2] for r in rs], dtype=np.int64),  # kind and receiver part
                                  np.array([r[3] for r in rs], dtype=np.float64))  # elements
            out = (np.array(fixed_k, dtype=np.int64), np.array(fixed_n, dtype=np.float64), rot_arrays)
            self._split[id(c)] = out
        return out

    def reshard_loads(self, groups: dict) -> dict | None:
        """Per kind (NET, NVL0, FWD): arrays over ranks of (bytes sent, bytes received, messages sent, messages
        received). groups: class index -> (class, {rotation residue: Σ item bytes of its tensors})."""
        w = self.world
        keys: list = []
        vals: list = []
        for c, residues in groups.values():
            fk, fn, rot = self._class_split(c)
            if len(fk):
                keys.append(fk)
                vals.append(fn * float(sum(residues.values())))
            if rot:
                res = np.fromiter(residues.keys(), dtype=np.int64, count=len(residues))
                wts = np.fromiter(residues.values(), dtype=np.float64, count=len(residues))
                for ln, (snd, k, base, n) in rot.items():
                    pick = (res[:, None] + k[None, :]) % ln  # residues x entries: which replica sends
                    sender = snd[np.arange(len(k))[None, :], pick]  # residues x entries: its rank
                    keys.append((base[None, :] + sender * w).ravel())
                    vals.append((wts[:, None] * n[None, :]).ravel())
        if not keys:
            return None
        uk, inv = np.unique(np.concatenate(keys), return_inverse=True)
        nbytes = np.bincount(inv.ravel(), weights=np.concatenate(vals), minlength=len(uk))
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

    def reshard_path(self, groups: dict) -> dict:
        """Busiest-rank (seconds, rank, bytes, messages) of each kind of reshard traffic, and of all NVLink
        traffic together ("nvl_all")."""
        lk = self.links
        per = self.reshard_loads(groups)
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
    def split_paths(self, paths: tuple) -> tuple[dict, list]:
        """Reshard-path tensors grouped by (class, rotation residue) with their Σ item bytes; broadcast tensors."""
        groups: dict = {}
        bcast_tensors = []
        cid, n_of, items = self.cid, self.n_of, self.items
        for t, path in enumerate(paths):
            if path == "reshard":
                i = cid[t]
                g = groups.get(i)
                if g is None:
                    g = groups[i] = (self.cls[i], defaultdict(int))
                g[1][t % n_of[i]] += items[t]
            else:
                bcast_tensors.append(t)
        return groups, bcast_tensors

    def mode_cost(self, mode: str, paths: tuple) -> ModeCost:
        groups, bcast_tensors = self.split_paths(paths)
        rp = self.reshard_path(groups) if groups else {k: (0.0, -1, 0, 0) for k in (NET, NVL0, FWD, "nvl_all")}
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

    # ---- lower bound
    def lower_bound(self) -> LowerBound:
        plan, dom, lk = self.plan, self.dom, self.links
        per_class: list = [[c, 0, -1] for c in self.cls]  # class, Σ item bytes, a tensor of it
        for t, i in enumerate(self.cid):
            entry = per_class[i]
            entry[1] += self.items[t]
            entry[2] = t
        ingress: dict[int, float] = defaultdict(float)  # dst domain -> bytes it must receive from outside
        exclusive: dict[int, float] = defaultdict(float)  # src domain -> bytes only it holds, needed outside
        must_leave = 0.0  # bytes that must leave some source domain
        for c, items, t in per_class:
            if not items:
                continue
            for e in c.entries:
                if e.phase == 0 and e.numel and dom[e.senders[0]] != dom[e.dst]:
                    ingress[dom[e.dst]] += e.numel * items
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


def _busiest(sent, received, msgs_sent, msgs_received, bw: float, lat: float) -> tuple:
    """(seconds, rank, bytes, messages) of the busiest rank: full duplex, so the larger direction counts."""
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
    from reshard_cli.report import fmt_bytes
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


def predict(plan: Plan, topology: Topology | None = None, *, modes=MODES,
            bucket_bytes: int = DEFAULT_BUCKET_BYTES) -> Prediction | None:
    """Predicted seconds of every mode (a Plan per mode from the plan's layouts) and the network lower bound.

    `topology` defaults to the plan's; None is returned when it has no usable link figures (`links_of`).
    """
    t0 = time.perf_counter()
    topology = topology if topology is not None else plan.topology
    links, _why = links_of(topology)
    if links is None:
        return None
    if topology is not plan.topology:
        plan = Plan(plan.src, plan.dst, topology, mode=plan.mode, reshard_match=plan.reshard_match)
    model = _Model(plan, links, bucket_bytes)
    costs = {}
    for m in modes:
        paths = plan.paths if m == plan.mode else \
            Plan(plan.src, plan.dst, plan.topology, mode=m, reshard_match=plan.reshard_match).paths
        costs[m] = model.mode_cost(m, paths)
    bound = model.lower_bound()
    return Prediction(links, topology.name, costs, bound, plan.mode, time.perf_counter() - t0)


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
        "  (time: the current transport, forwards after the network phase and the broadcast path after the",
        "   reshard path; pipelined: forwards overlapped with the network phase, gathers with broadcasts)",
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
