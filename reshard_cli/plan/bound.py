"""The network lower bound of a refit (`plan.cost`, any plan and any transport, latency ignored): every
destination domain must receive, from outside, the bytes its destination ranks hold that no source rank
inside it holds, through its ranks' NICs; every source domain must send, at least once, the bytes only it
holds that another domain needs, through its NICs; and the bytes that must leave some source domain must pass
the source domains' NICs together. The bound is the largest of these. Bytes are weighed as the model weighs
the reshard path (`_Model.wire`): into a block-FP8 engine, as they would travel (`plan.fp8.wire_weights`)."""
from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from reshard_cli.base.text import fmt_bytes
from reshard_cli.plan.fp8 import counter
from reshard_cli.plan.rows import numpy_
from reshard_cli.plan.terms import Traffic


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


def lower_bound(model) -> LowerBound:
    """The network lower bound of a cost model's classes (`cost._Model`): the largest of the ingress,
    exclusive egress and all-egress figures."""
    totals = {}  # count -> per class Σ over its tensors of the bytes per unit counted
    for count, weights in model.wire.items():
        per = [0] * len(model.cls)
        for t, i in enumerate(model.cid):
            per[i] += weights[t]
        totals[count] = per
    ingress = _ingress(model, totals)
    exclusive, must_leave = _egress(model, totals)
    return _bound(model.dom, model.links, model.src_ranks, model.dst_ranks, ingress, exclusive, must_leave)


def _ingress(model, totals: dict) -> dict[int, float]:
    """Domain -> bytes entering it over the network: every phase-0 network entry (with forwarding) enters
    its receiver's domain once."""
    np = numpy_()
    w, dom = model.world, model.dom
    dom_ids = sorted(set(dom.values()))
    index = {d: j for j, d in enumerate(dom_ids)}
    dom_of_rank = np.zeros(w, dtype=np.int64)
    for r, d in dom.items():
        dom_of_rank[r] = index[d]
    per_dom = np.zeros(len(dom_ids))
    for count, per in totals.items():
        table, pos = model.table(False, count)
        held = pos >= 0
        total_of = np.zeros(int(held.sum()))
        total_of[pos[held]] = np.array(per, dtype=np.float64)[held]
        for keys, numel, n in ((table.fixed_pair, table.fixed_numel, table.fixed_count),
                               (table.rot_pair, table.rot_numel, table.rot_count)):
            if not len(keys):
                continue
            nbytes = numel * np.repeat(total_of, n)
            net = keys // (w * w) == Traffic.NET
            per_dom += np.bincount(dom_of_rank[keys[net] % w], weights=nbytes[net], minlength=len(dom_ids))
    return {dom_ids[j]: float(v) for j, v in enumerate(per_dom) if v}


def _egress(model, totals: dict) -> tuple[dict[int, float], float]:
    """(source domain -> bytes only it holds that another domain needs, bytes that must leave some source
    domain)."""
    dom = model.dom
    exclusive: dict[int, float] = defaultdict(float)
    must_leave = 0.0
    for i, c in enumerate(model.cls):
        weighed = [(None if count is None else counter(count, c.shape, c.grid), per[i])
                   for count, per in totals.items() if per[i]]
        if not weighed:
            continue
        dst_boxes = c.dst_boxes
        dst_doms = [{dom[h] for h in holders} for _b, holders in dst_boxes]
        for a, senders in c.src_boxes:
            src_doms = {dom[s] for s in senders}
            need = 0
            for (b, _h), ddoms in zip(dst_boxes, dst_doms):
                if ddoms - src_doms:
                    r = a.intersect(b)
                    if r is not None:
                        need += sum((r.numel if f is None else f(r)) * x for f, x in weighed)
            if need:
                must_leave += need
                if len(src_doms) == 1:
                    exclusive[next(iter(src_doms))] += need
    return exclusive, must_leave


def _bound(dom: dict, lk, src_ranks: list, dst_ranks: list, ingress: dict, exclusive: dict,
           must_leave: float) -> LowerBound:
    """The lower bound from the bytes each domain must receive (`ingress`) and send (`exclusive`), and those
    that must leave the source domains together, through their ranks' NICs."""
    ranks_in: dict[int, list] = defaultdict(list)
    for r in sorted(set(src_ranks) | set(dst_ranks)):
        ranks_in[dom[r]].append(r)
    src_doms = {dom[r] for r in src_ranks}

    def worst(figures: dict) -> tuple[float, int | None]:
        best = (0.0, None)
        for d, nb in figures.items():
            s = nb / (len(ranks_in[d]) * lk.net)
            if s > best[0]:
                best = (s, d)
        return best

    def where(d: int) -> str:
        rs = ranks_in[d]
        return f"domain {d} (ranks {rs[0]}-{rs[-1]})" if len(rs) > 1 else f"rank {rs[0]}"

    in_s, in_d = worst(ingress)
    ex_s, ex_d = worst(exclusive)
    src_nics = sum(len(ranks_in[d]) for d in src_doms)
    all_s = must_leave / (src_nics * lk.net) if src_nics else 0.0
    candidates = [(in_s, "ingress", in_d), (ex_s, "egress", ex_d), (all_s, "egress-all", None)]
    s, kind, d = max(candidates, key=lambda x: x[0])
    if s == 0:
        resource = "nothing crosses a domain boundary"
    elif kind == "ingress":
        resource = (f"network ingress of {where(d)}: {fmt_bytes(ingress[d])} over {len(ranks_in[d])} x "
                    f"{lk.network_gbps:g} GB/s")
    elif kind == "egress":
        resource = (f"network egress of {where(d)}: {fmt_bytes(exclusive[d])} only it holds, over "
                    f"{len(ranks_in[d])} x {lk.network_gbps:g} GB/s")
    else:
        resource = (f"network egress of all source domains: {fmt_bytes(must_leave)} over {src_nics} x "
                    f"{lk.network_gbps:g} GB/s")
    detail = {"ingress_bytes_max": max(ingress.values(), default=0),
              "egress_exclusive_bytes_max": max(exclusive.values(), default=0),
              "egress_all_bytes": must_leave}
    return LowerBound(s, resource, in_s, max(ex_s, all_s), detail)
