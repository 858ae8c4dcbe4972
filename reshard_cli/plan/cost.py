"""Predicted refit time: a plan's bytes over a topology's link figures, beside the network lower bound.

Inputs: a `Plan` (any mode: the figures of every mode are computed from its tensor classes, `TensorClasses`)
and the topology's `links:` — `network_gbps` (GB/s per rank per direction across domains), `nvlink_gbps`
(GB/s per rank per direction inside a domain), `latency_us` (per message). Nothing here touches
torch.distributed; `reshard plan --topology FILE` prints it.

The model, path by path, as the engine (`reshard_cli/transfer/engine.py`) runs it:

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
* The reshard path runs first, then the broadcast path (`reshard_cli/transfer/run.py`): paths add in both
  figures.
* A tensor on the reshard path goes with forwarding (phase 0 + phase 1 as above) or **direct** (every
  destination replica receives its whole box in phase 0: no forwards, more network bytes).

**Mode auto** (`auto_routes`, `RouteSearch`): the cost model is auto's route chooser. It weighs a plan's
classes and hands the plan their routes (`with_auto_routes(plan)`; the plan only follows them). Each tensor
class takes the route — forward, direct or
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

**Bytes** are weighed as they travel: the reshard path and the lower bound per piece through
`plan.fp8.wire_weights` (into a block-FP8 engine a piece's whole blocks as FP8 bytes plus a float32 scale per
block, the rest in the source dtype; otherwise the source dtype), the broadcast path in the source dtype (full
tensors, which an FP8 engine quantizes itself). So auto's choice and every predicted time weigh what moves.

The model of a plan's classes under some links and bucket size is made once and kept with the classes
(`TensorClasses.memo`), so auto's choice and the predictions share its tables.

`with_measured_links(topology, ...)` puts measured bandwidths (e.g. a gloo run's link figures on CPU) in a
topology's links, so the same model predicts a run from measurements.
"""
from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, NamedTuple

from reshard_cli.layouts.topology import NO_TOPOLOGY, Topology
from reshard_cli.plan.bound import LowerBound, lower_bound
from reshard_cli.plan.cost_text import bound_by, fmt_seconds, prediction_text
from reshard_cli.plan.fp8 import wire_weights
from reshard_cli.plan.classes import TensorClasses
from reshard_cli.plan.routes import RouteChoice, RouteSearch
from reshard_cli.plan.rows import Table, numpy_ as _np
from reshard_cli.plan.schedule import PackFiller, TransferOptions, align
from reshard_cli.plan.terms import MODES, ClassRoutes, Route, Traffic, no_gc

if TYPE_CHECKING:  # the plan the cost model and the schedule read (`Plan` chooses its routes with
    from reshard_cli.plan.planner import Plan  # `auto_routes`: imported here for annotations only)

DEFAULT_BUCKET_BYTES = TransferOptions().bucket_bytes  # `reshard run --bucket-mb 64`
GB = 1e9

_ROUTE_CODE = {r: i for i, r in enumerate(Route)}  # a route as a small integer, for numpy


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


class _Model:
    """Per-class figures of some `TensorClasses` under some links, shared by every mode (the geometry does not
    depend on the mode). The broadcast path weighs the source dtype; the reshard path and the lower bound the
    bytes that travel (`wire`: per count of `TensorClass.columns`, per tensor the bytes per unit counted;
    `plan.fp8.wire_weights`), or with `on_wire` False the source dtype too (a BF16 engine beside an FP8 one)."""

    def __init__(self, classes: TensorClasses, links: Links, bucket_bytes: int, on_wire: bool = True):
        self.links = links
        self.half = TransferOptions(bucket_bytes=bucket_bytes).half
        self.dom = classes.domains
        self.src_ranks, self.dst_ranks = classes.src.ranks, classes.dst.ranks
        self.nbytes = classes.src.manifest.nbytes
        self.classes = classes
        self.items = classes.itemsizes()
        self.wire = (wire_weights(classes) if on_wire else {}) or {None: self.items}
        # per tensor its class's index; per class: the class, its broadcast period and its elements
        self.cls, self.cid = classes.index()
        self.bcast_period_of = [c.bn for c in self.cls]
        self.numel_of = [c.numel if c.src_boxes else 0 for c in self.cls]
        self.world = max(max(classes.src.ranks), max(classes.dst.ranks)) + 1
        self._period_of: list | None = None
        self._tables: dict[bool, tuple] = {}
        self._gather: dict = {}
        self._ring: dict = {}
        self._by_class: list | None = None
        self._tensor_arrays: tuple | None = None
        self._choice: RouteChoice | None = None
        self.saved_loads: dict[tuple, tuple] = {}  # per-tensor routes -> per (kind, rank) loads (`RouteSearch`)

    @property
    def period_of(self) -> list[int]:
        """Each class's rotation period."""
        if self._period_of is None:
            self.table(False)  # walks every class's geometry on the way
            self._period_of = [c.n for c in self.cls]
        return self._period_of

    # ---- reshard path
    def table(self, direct: bool, count: str | None = None) -> tuple:
        """(the `rows.Table` of the classes whose entries differ with `direct`, counting `count` (None: elements,
        the tables any model of these classes shares; else only the classes with a tensor weighed by it), class
        index -> its position)."""
        out = self._tables.get((direct, count))
        if out is None and count is None:
            out = self._tables[(direct, None)] = self.classes.memo(("cost table", direct),
                                                                   lambda: self._table(direct, None))
        if out is None:
            out = self._tables[(direct, count)] = self._table(direct, count)
        return out

    def _table(self, direct: bool, count: str | None) -> tuple:
        np = _np()
        counted = None
        if count is not None:  # the classes of the tensors this count weighs
            class_of, by_count = self._arrays()[:2]
            counted = set(class_of[by_count[count] != 0].tolist())
        picked = [i for i, c in enumerate(self.cls) if (counted is None or i in counted) and (not direct or c.splits)]
        pos = np.full(len(self.cls), -1, dtype=np.int64)
        pos[picked] = np.arange(len(picked))
        return Table([self.cls[i] for i in picked], direct, self.world, count), pos

    def _arrays(self) -> tuple:
        """Per tensor: class index, per count its weight (`wire`), rotation residue; per class: whether direct
        differs; the largest rotation period."""
        out = self._tensor_arrays
        if out is None:
            np = _np()
            class_of = np.array(self.cid, dtype=np.int64)
            period = np.array(self.period_of, dtype=np.int64)
            residue = np.arange(len(class_of), dtype=np.int64) % period[class_of] if len(class_of) else class_of
            splits = np.array([c.splits for c in self.cls], dtype=bool)
            weights = {k: np.array(v, dtype=np.float64) for k, v in self.wire.items()}
            out = self._tensor_arrays = (class_of, weights, residue, splits, int(period.max(initial=1)))
        return out

    def _rows(self, sel, direct, grouped: bool) -> tuple | None:
        """Pair keys, bytes and group ids of the rows of tensors `sel` (indices), each with forwarding or
        `direct` (a bool per tensor; classes where direct makes no difference use forwarding's rows). With
        `grouped`, a row's group id is its class index * 2 + direct, else 0."""
        np = _np()
        class_of, by_count, residue, splits, period_max = self._arrays()
        if not len(sel):
            return None
        cls = class_of[sel]
        job = cls * 2 + (direct & splits[cls])
        uniq, inv = np.unique(job * period_max + residue[sel], return_inverse=True)
        uniq_job, uniq_residue = uniq // period_max, uniq % period_max
        jobs, inv_job = np.unique(uniq_job, return_inverse=True)
        keys, vals, gids = [np.zeros(0, dtype=np.int64)], [np.zeros(0)], [np.zeros(0, dtype=np.int64)]
        for count, item in by_count.items():  # one count's weights never mix signs: a job weighs 0 only if empty
            weights = np.bincount(inv.ravel(), weights=item[sel], minlength=len(uniq))  # Σ per (job, residue)
            totals = np.bincount(inv_job.ravel(), weights=weights, minlength=len(jobs))  # Σ per job
            for d in (0, 1):
                job_d, res_d = (jobs % 2 == d) & (totals != 0), (uniq_job % 2 == d) & (weights != 0)
                if not job_d.any():
                    continue
                table, pos = self.table(bool(d), count)
                gid = jobs[job_d] if grouped else np.zeros(int(job_d.sum()), dtype=np.int64)
                rgid = uniq_job[res_d] if grouped else np.zeros(int(res_d.sum()), dtype=np.int64)
                k, v, g = table.rows(pos[jobs[job_d] // 2], gid, totals[job_d], pos[uniq_job[res_d] // 2], rgid,
                                     uniq_residue[res_d], weights[res_d])
                keys.append(k)
                vals.append(v)
                gids.append(g)
        return np.concatenate(keys), np.concatenate(vals), np.concatenate(gids)

    def route_arrays(self, routes: tuple) -> tuple:
        """(indices of the reshard-path tensors, their direct flags) of per-tensor routes."""
        np = _np()
        code = np.array([_ROUTE_CODE[r] for r in routes], dtype=np.int8)
        sel = np.flatnonzero(code != _ROUTE_CODE[Route.BROADCAST])
        return sel, code[sel] == _ROUTE_CODE[Route.DIRECT]

    def reshard_loads(self, routes: tuple) -> dict | None:
        """Per kind (`Traffic`): arrays over ranks of (bytes sent, bytes received, messages sent, messages
        received) of the reshard-path tensors of per-tensor `routes`."""
        np = _np()
        w = self.world
        sel, direct = self.route_arrays(routes)
        rows = self._rows(sel, direct, False)
        if rows is None or not len(rows[0]):
            return None
        pairs, inv = np.unique(rows[0], return_inverse=True)
        nbytes = np.bincount(inv.ravel(), weights=rows[1], minlength=len(pairs))
        msgs = np.ceil(nbytes / self.half)
        kind = pairs // (w * w)
        sender = (pairs // w) % w
        receiver = pairs % w
        per = {}
        for kd in Traffic:
            m = kind == kd
            per[kd] = (np.bincount(sender[m], nbytes[m], minlength=w),
                       np.bincount(receiver[m], nbytes[m], minlength=w),
                       np.bincount(sender[m], msgs[m], minlength=w), np.bincount(receiver[m], msgs[m], minlength=w))
        return per

    def reshard_path(self, routes: tuple) -> dict:
        """Busiest-rank (seconds, rank, bytes, messages) of each kind of reshard traffic, and of all NVLink
        traffic together ("nvl_all"), of per-tensor `routes` (the loads auto's search summed are reused)."""
        lk = self.links
        NET, NVL0, FWD = Traffic
        saved = self.saved_loads.get(routes) if self.saved_loads else None
        if saved is not None:
            w = self.world
            per = {k: tuple(a[k * w:(k + 1) * w] for a in saved) for k in Traffic}
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
        key = (i, t % self.bcast_period_of[i])
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
            group = {root, *self.dst_ranks}
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
        gather_msgs = 0
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
            gather_msgs += msgs
            _pack, _off, new = filler.add(root, numel * item)
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
        return {"gather_s": gather_s + gather_msgs * lk.lat, "ring_s": ring_bw_s + ring_lat_s,
                "ring_latency_s": ring_lat_s, "packs": n, "ring_gbps": (slowest / GB) if n else 0.0,
                "ring_hops": hops}

    def broadcast_seconds(self, tensors: list[int]) -> float:
        """The sequential figure of the broadcast path of `tensors`: gathers, then rings."""
        bp = self.broadcast_path(tensors)
        return bp["gather_s"] + bp["ring_s"]

    # ---- one mode
    def mode_cost(self, mode: str, routes: tuple) -> ModeCost:
        """The predicted figures of per-tensor `routes` (`Route`s)."""
        NET, NVL0, FWD = Traffic
        bcast_tensors = [t for t, r in enumerate(routes) if r == Route.BROADCAST]
        rp = self.reshard_path(routes)
        key = ("broadcast path", self.links, self.half, tuple(bcast_tensors))  # the source dtype, in any model
        bp = self.classes.memo(key, lambda: self.broadcast_path(bcast_tensors))
        net_s, nvl0_s, fwd_s = rp[NET][0], rp[NVL0][0], rp[FWD][0]
        reshard_seq = max(net_s, nvl0_s) + fwd_s
        reshard_pipe = max(net_s, rp["nvl_all"][0])
        bcast_seq = bp["gather_s"] + bp["ring_s"]
        bcast_pipe = max(bp["gather_s"], bp["ring_s"])
        busiest = {"network": rp[NET][1:], "nvlink_phase0": rp[NVL0][1:], "forward": rp[FWD][1:]}
        mc = ModeCost(mode, reshard_seq + bcast_seq, reshard_pipe + bcast_pipe, net_s, nvl0_s, fwd_s,
                      bp["gather_s"], bp["ring_s"], bp["ring_latency_s"], bp["packs"], busiest, bp["ring_gbps"],
                      bp["ring_hops"])
        mc.bound_by = bound_by(mc, self.links)
        return mc

    # ---- auto: the route of each class
    def tensors_by_class(self) -> list[list[int]]:
        if self._by_class is None:
            out: list[list[int]] = [[] for _ in self.cls]
            for t, i in enumerate(self.cid):
                out[i].append(t)
            self._by_class = out
        return self._by_class

    def choice(self) -> RouteChoice:
        """Auto's routes under these links (`RouteSearch`), chosen once."""
        if self._choice is None:
            self._choice = RouteSearch(self).run()
        return self._choice

    def class_rows(self) -> _ClassRows:
        """Every (class, variant)'s rows, summed over its tensors, as positions in one sorted universe of pairs;
        the group id of (class i, direct d) is 2i + d."""
        np = _np()
        w = self.world
        ww = w * w
        class_of, _item, _res, splits, _pmax = self._arrays()
        split_tensors = np.flatnonzero(splits[class_of])
        sel = np.concatenate([np.arange(len(class_of), dtype=np.int64), split_tensors])
        direct = np.concatenate([np.zeros(len(class_of), dtype=bool), np.ones(len(split_tensors), dtype=bool)])
        rows = self._rows(sel, direct, True)
        if rows is None:
            rows = (np.zeros(0, dtype=np.int64), np.zeros(0), np.zeros(0, dtype=np.int64))
        keys, vals, gids = rows
        span = len(Traffic) * ww
        uniq, inv = np.unique(gids * span + keys, return_inverse=True)
        row_bytes = np.bincount(inv.ravel(), weights=vals, minlength=len(uniq))
        row_gid = uniq // span
        universe, row_pos = np.unique(uniq % span, return_inverse=True)
        bounds = np.searchsorted(row_gid, np.arange(2 * len(self.cls) + 1))
        return _ClassRows(row_pos.ravel(), row_bytes, row_gid, bounds,
                          (universe // ww) * w + (universe // w) % w, (universe // ww) * w + universe % w)

    # ---- lower bound
    def lower_bound(self) -> LowerBound:
        """The network lower bound (`plan.bound`)."""
        return lower_bound(self)


class _ClassRows(NamedTuple):
    """Every (class, variant)'s rows as `_Model.class_rows` sums them. Per row: its pair's position in the
    universe of pairs, its bytes, its group id (2 * class + direct); the rows of group g are bounds[g] ..
    bounds[g + 1]. Per pair of the universe: its (kind, sender) and its (kind, receiver), as kind * world + rank."""

    pos: Any
    nbytes: Any
    gid: Any
    bounds: Any
    kind_sender: Any
    kind_receiver: Any


def _busiest(sent, received, msgs_sent, msgs_received, bw: float, lat: float) -> tuple:
    """(seconds, rank, bytes, messages) of the busiest rank: full duplex, so the larger direction counts."""
    np = _np()
    nbytes = np.maximum(sent, received)
    msgs = np.maximum(msgs_sent, msgs_received)
    seconds = nbytes / bw + msgs * lat
    rank = int(np.argmax(seconds))
    if seconds[rank] <= 0:
        return (0.0, -1, 0, 0)
    return (float(seconds[rank]), rank, int(nbytes[rank]), int(msgs[rank]))


# ----------------------------------------------------------------------------------------------- API


def model_for(plan: Plan, links: Links, bucket_bytes: int | None = None, on_wire: bool = True) -> _Model:
    """The model of `plan`'s classes under `links` (kept with the classes: auto's choice and the predictions
    share its tables). `on_wire`: as `_Model`'s."""
    bucket_bytes = bucket_bytes or DEFAULT_BUCKET_BYTES
    key = ("cost model", links, TransferOptions(bucket_bytes=bucket_bytes).half, on_wire)
    return plan.classes.memo(key, lambda: _Model(plan.classes, links, bucket_bytes, on_wire))


def auto_routes(plan: Plan, on_wire: bool = True) -> ClassRoutes:
    """Mode auto's route per tensor class of `plan` (`TensorClasses.index` order) and what decided them: this
    model's choice (`RouteSearch`) from the plan's topology's links and bucket size, weighing the bytes that
    travel (`on_wire` False: the source dtype's, as into a BF16 engine); forward everywhere without link
    figures."""
    links, _why = links_of(plan.topology)
    with no_gc():
        nclasses = len(plan.classes.index()[0])
        if links is None:
            return ClassRoutes((Route.FORWARD,) * nclasses,
                               "no link figures to weigh: forward everywhere (the fewest network bytes)")
        choice = model_for(plan, links, plan.bucket_bytes, on_wire).choice()
    moved = sum(r != Route.FORWARD for r in choice.routes)
    return ClassRoutes(tuple(choice.routes),
                       f"chosen by the cost model, class by class: {moved} of {len(choice.routes)} classes off "
                       f"forward, predicted {fmt_seconds(choice.seconds)} (forward everywhere "
                       f"{fmt_seconds(choice.reshard_seconds)})")


def with_auto_routes(plan: Plan) -> Plan:
    """`plan` with mode auto's routes chosen now (a plan in mode auto chooses them itself the first time they
    are read: `Plan.routes_for`); any other plan as it is."""
    if plan.mode != "auto" or plan.class_routes is not None:
        return plan
    return plan.with_class_routes(auto_routes(plan))


def predict(plan: Plan, topology: Topology | None = None, *, modes=MODES,
            bucket_bytes: int = DEFAULT_BUCKET_BYTES, on_wire: bool = True) -> Prediction | None:
    """Predicted seconds of every mode (each mode's routes from the plan's classes) and the network lower bound.

    `topology` defaults to the plan's; None is returned when it has no usable link figures (`links_of`).
    Mode auto is costed with the routes the plan carries, else with those `auto_routes` chooses for it (from
    its topology's links and its bucket size). The reshard path weighs the bytes that travel (into a block-FP8
    engine FP8 and scales where the senders quantize); `on_wire` False: the same pieces with every byte in the
    source dtype.
    """
    t0 = time.perf_counter()
    topology = topology if topology is not None else plan.topology
    links, _why = links_of(topology)
    if links is None:
        return None
    if topology is not plan.topology:  # auto's routes, if the plan carries them, belong to its own topology
        plan = replace(plan, topology=topology, class_routes=None)
    with no_gc():
        if "auto" in modes and plan.class_routes is None:
            plan = plan.with_class_routes(auto_routes(plan, on_wire))
        model = model_for(plan, links, bucket_bytes, on_wire)
        costs = {m: model.mode_cost(m, plan.routes_for(m)) for m in modes}
        bound = model.lower_bound()
        auto = plan.route_summary(plan.routes_for("auto")) if "auto" in modes else None
    return Prediction(links, topology.name, costs, bound, plan.mode, time.perf_counter() - t0, auto)


def plan_prediction(plan: Plan) -> tuple[str, dict[str, Any]]:
    """What `reshard plan` adds: (text, JSON keys). Empty without a topology; one line without links."""
    topo = plan.topology
    if topo is NO_TOPOLOGY or topo == NO_TOPOLOGY:
        return "", {}
    links, why = links_of(topo)
    if links is None:
        return f"  predicted     none: {why}", {}
    plan = with_auto_routes(plan)
    pred = predict(plan)
    assert pred is not None
    text, doc = prediction_text(pred), pred.to_json()
    if wire_weights(plan.classes):  # into a block-FP8 engine: the same refit into a BF16 one, beside it
        bf16 = predict(plan, on_wire=False)
        doc["bf16_predicted_seconds"] = {m: c.seconds for m, c in bf16.modes.items()}
        doc["bf16_lower_bound_seconds"] = bf16.bound.seconds
        this = bf16.modes.get(plan.mode)
        text += (f"\n  in BF16       {plan.mode}: {fmt_seconds(this.seconds)} predicted, lower bound "
                 f"{fmt_seconds(bf16.bound.seconds)}: the same pieces with every byte in BF16 (above: FP8 and "
                 f"scales where the senders quantize)") if this is not None else ""
    return text, doc
