"""A destination that is a fleet of identical replicas (an inference engine's data parallelism, or several
engines): which replica each destination rank belongs to, and what one refit of the whole fleet costs beside
the alternatives — one refit per replica, and the full-tensor baseline (gather, then broadcast).

A layout's replicas are the coordinates of its `dp` mesh dim: a destination rank's replica is its index in
the layout divided by the ranks per replica (`dp` is the slowest dim of an engine's mesh: vLLM places worker
`data_parallel_index × TP×PP + rank`). Within one NVLink domain, the plan's forwarding makes the fleet cost
the trainer about one replica's bytes; N separate refits cost it N times that.

Losing a replica mid-refit (`loss_figures`): a refit into a fleet runs in staging groups of whole layers
(`plan.groups`), each committed on every replica only once all of them have it. When one replica dies in
group g, the N-1 survivors form a new group, are planned again (the same topology and mode: forwarding among
themselves) and the refit resumes at the first layer of group g, in the survivors' own groups: the groups
before it are not sent again, the rest go to the survivors with their plan.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, replace

from reshard_cli.layouts.layout import Layout
from reshard_cli.layouts.topology import Topology
from reshard_cli.plan.cost import links_of, with_auto_routes
from reshard_cli.plan.fp8 import on_wire, wire_of
from reshard_cli.plan.groups import Group, resume_group, resume_layer
from reshard_cli.plan.planner import Plan


@dataclass(frozen=True)
class Fleet:
    replicas: int  # identical replicas in the destination layout
    per_replica: int  # destination ranks per replica

    def replica_of(self, index: int) -> int:
        """The replica of the destination layout's `index`-th rank."""
        return index // self.per_replica

    def ranks_of(self, dst: Layout, replica: int) -> tuple[int, ...]:
        return dst.ranks[replica * self.per_replica:(replica + 1) * self.per_replica]


def fleet_of(dst: Layout) -> Fleet:
    """The replicas of a destination layout: the size of its meshes' `dp` dim (one replica without one)."""
    replicas = 1
    for mesh in dst.meshes.values():
        sizes = dict(zip(mesh.dims, mesh.shape))
        if "dp" in sizes and tuple(mesh.ranks) == tuple(dst.ranks) and mesh.dims[0] in ("dp", "pp"):
            replicas = sizes["dp"]
            break
    if dst.size % replicas:
        replicas = 1
    return Fleet(replicas, dst.size // replicas)


def separate_topology(topology: Topology, dst: Layout, fleet: Fleet) -> Topology:
    """`topology` with every domain cut at replica boundaries: what N separate refits, one per replica, can
    forward (inside a replica only)."""
    owner = {r: fleet.replica_of(i) for i, r in enumerate(dst.ranks)}
    ranks = sorted(set(dst.ranks) | {r for d in topology.domains for r in d})
    cut: dict[tuple, list[int]] = {}
    for r in ranks:
        cut.setdefault((topology.domain_of(r), owner.get(r, -1)), []).append(r)
    return replace(topology, name=f"{topology.name} (per replica)", ranks_per_domain=None,
                   domains=tuple(tuple(v) for v in sorted(cut.values(), key=lambda v: v[0]) if len(v) > 1))


def _within_replicas(topology: Topology, dst: Layout, fleet: Fleet) -> bool:
    """Whether no domain spans two replicas (or a replica and ranks outside the fleet): cutting the domains
    at replica boundaries then changes nothing, and one refit per replica is this very plan."""
    owner = {r: fleet.replica_of(i) for i, r in enumerate(dst.ranks)}
    seen: dict[int, int] = {}  # domain -> the owner of its ranks
    for r in set(dst.ranks) | {r for d in topology.domains for r in d}:
        if seen.setdefault(topology.domain_of(r), owner.get(r, -1)) != owner.get(r, -1):
            return False
    return True


def fleet_figures(plan, fleet: Fleet, stats: dict | None = None) -> dict:
    """What one refit of the whole fleet moves (`plan`'s own figures) beside N separate refits (one plan in the
    same mode whose domains stop at replica boundaries: forwarding inside each replica only) and the full-tensor
    baseline.
    `forwarded_bytes` are what the destination ranks forward to each other inside domains (the workers'
    sends); `indomain_bytes` add what a source rank sends inside its own domain and a broadcast's fan-out.
    Bytes are weighed as they travel (`plan.fp8.on_wire`: into a block-FP8 engine, FP8 and scales where the
    senders quantize; the gather->broadcast baseline in the source dtype). `stats`: the plan's, so weighed,
    when at hand."""
    stats = stats or on_wire(plan)
    separate = stats["wire_bytes"]
    if fleet.replicas > 1 and not _within_replicas(plan.topology, plan.dst, fleet):
        alone = with_auto_routes(Plan(plan.src, plan.dst, separate_topology(plan.topology, plan.dst, fleet),
                                      mode=plan.mode, reshard_match=plan.reshard_match))  # the same mode
        separate = alone.stats(wire=wire_of(alone))["wire_bytes"]
    return {"mode": plan.mode, "replicas": fleet.replicas, "workers_per_replica": fleet.per_replica,
            "wire_bytes": stats["wire_bytes"], "min_wire_bytes": stats["min_wire_bytes"],
            "indomain_bytes": stats["indomain_bytes"], "forwarded_bytes": stats["forwarded_bytes"],
            "separate_refits_wire_bytes": separate,
            "broadcast_wire_bytes": stats["broadcast_wire_bytes"]}


def loss_figures(plan, survivors: Layout, groups: list[Group], survivor_groups: list[Group]) -> dict:
    """What losing one replica of `plan`'s fleet mid-refit costs: `survivors` is its destination with one
    replica fewer (`formats.with_replicas`), `groups` the staging groups the fleet's refit runs in and
    `survivor_groups` the survivors' (`plan.groups.stage_groups`: experts spread over fewer replicas may group
    the layers otherwise). Lost in group g, the survivors resume at the layer after groups 0..g-1
    (`resume_layer`), from their first group holding it (`resume_group`), and are sent their groups from there
    on (`resent_bytes_by_group[g]`): lost in the first group, a whole refit of the survivors; in the last,
    about that group.

    Each survivors' group is weighed as the refit plans it: on its own (`Layout.subset`), with the survivors'
    layout and `plan`'s topology, mode and reshard match. Its wire comes from the survivors' plan of the whole
    model (`Plan.group_wire_bytes`: a tensor's wire on the reshard path does not depend on its neighbours, a
    broadcast's root rotates with its place in the group), built once. Only in mode auto with link figures
    is each group planned on its own, since the cost model chooses a group's routes from its own traffic and
    may choose otherwise than for the whole model. Bytes are weighed as they travel, as in `fleet_figures`."""
    t0 = time.perf_counter()
    alone = with_auto_routes(Plan(plan.src, survivors, plan.topology, mode=plan.mode,
                                  reshard_match=plan.reshard_match, bucket_bytes=plan.bucket_bytes))
    everything = [range(len(plan.src.manifest.tensors))]
    if plan.mode == "auto" and links_of(plan.topology)[0] is not None and len(survivor_groups) > 1:
        per_group = [_wire(_part(alone, g), [range(len(g.tensors))])[0] for g in survivor_groups]
    else:
        per_group = _wire(alone, [g.tensors for g in survivor_groups])
    tail = [sum(per_group[i:]) for i in range(len(per_group))] or [0]  # the survivors' groups i..end
    resent = [tail[resume_group(survivor_groups, resume_layer(groups[:g]))] for g in range(len(groups))]
    return {"replicas_after": fleet_of(survivors).replicas, "groups": len(groups),
            "survivor_groups": len(survivor_groups),
            "resent_bytes_first_group": resent[0] if resent else 0,
            "resent_bytes_last_group": resent[-1] if resent else 0,
            "resent_bytes_mean": sum(resent) / len(resent) if resent else 0,
            "resent_bytes_by_group": resent,
            "group_wire_bytes": per_group,  # each survivors' group's own wire
            "survivors_wire_bytes": _wire(alone, everything)[0],  # one refit of them, not in groups
            "plan_seconds": time.perf_counter() - t0}


def _wire(plan: Plan, groups) -> list:
    """`Plan.group_wire_bytes` weighed as the bytes travel."""
    return plan.group_wire_bytes(groups, wire=wire_of(plan))


def _part(whole: Plan, group: Group) -> Plan:
    """The plan of one staging group on its own, as a refit in groups builds it, with mode auto's routes
    chosen for it (the class geometry is `whole`'s)."""
    return with_auto_routes(whole.subset(group.tensors))
