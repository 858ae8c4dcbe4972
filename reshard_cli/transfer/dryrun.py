"""Launching `reshard run` on one node or many: torchrun command lines and the rank map to check first.

The engine for many machines is torch.distributed under torchrun; this module only writes its command lines
and shows where every rank lands, so a 256-GPU job can be checked on a laptop (`reshard run --dry-run`).

Rank placement. torchrun starts `nproc_per_node` workers on every node; worker `local_rank` of node
`node_rank` gets global rank `node_rank * nproc_per_node + local_rank`. The layouts name global ranks (src
from 0, dst right after), so the trainer group lands on the first nodes and the inference group on the next
ones, and a topology with `ranks_per_domain: G` (G = GPUs per node) puts each node's GPUs in one domain.
Node ranks: `--standalone` is one node (rank 0); the c10d rendezvous numbers nodes in sorted host-name order
(torch's DynamicRendezvousHandler sorts its participants); a static rendezvous (`--node-rank`) takes them
as given (Slurm: `$SLURM_NODEID`). Either way each node holds a block of consecutive global ranks, which is
all a per-node domain needs; domains spanning several nodes (NVL72 racks) also need the nodes of one rack
to be consecutive in that order.

    python -m reshard_cli.transfer.dryrun world-size --src A --dst B [other run options are ignored]

prints the number of processes the two layouts need (what `launchers/local.sh` and `launchers/slurm.sbatch`
use).
"""
from __future__ import annotations

import os
import shlex
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

from reshard_cli.errors import ConfigError, ReshardError
from reshard_cli.layouts.layout import Layout
from reshard_cli.formats import load_pair
from reshard_cli.layouts.topology import NO_TOPOLOGY, Topology, load_topology

DEFAULT_PORT = 29500
DEFAULT_GPUS_PER_NODE = 8
HEAD = "HEAD"  # placeholder for the first node's address in printed commands


def _pair(src, dst, scale: int = 1) -> tuple[Layout, Layout]:
    if isinstance(src, Layout) and isinstance(dst, Layout):
        return src, dst
    return load_pair(src, dst, scale=scale)


def world_size(src, dst, *, scale: int = 1) -> int:
    """Processes a run starts: the highest global rank of either layout + 1 (Layouts or YAML paths), or of the
    sources only when the destination is a running engine (its workers are the engine's own processes)."""
    s, d = _pair(src, dst, scale)
    return max(s.ranks) + 1 if d.engine_url else max(max(s.ranks), max(d.ranks)) + 1


def torchrun_command(src_yaml, dst_yaml, *, nnodes: int = 1, nproc_per_node: int | None = None,
                     rdzv_endpoint: str | None = None, extra_args: Sequence[str] = (), rdzv_id: str = "reshard",
                     world: int | None = None, torchrun: str = "torchrun") -> list[str]:
    """The argv that starts `reshard run` for this layout pair (run it on every node when nnodes > 1).

    One node: `torchrun --standalone --nproc-per-node WORLD`. Several: a c10d rendezvous at `rdzv_endpoint`
    (host:port of the first node), `nproc_per_node` per node (default: the world size spread over nnodes).
    """
    if world is None:
        world = world_size(src_yaml, dst_yaml)
    if nnodes < 1:
        raise ConfigError("must be >= 1", key="nnodes")
    if nproc_per_node is None:
        nproc_per_node = -(-world // nnodes)
    if nproc_per_node < 1:
        raise ConfigError("must be >= 1", key="nproc_per_node")
    if nnodes * nproc_per_node < world:
        raise ConfigError(f"{nnodes} node(s) x {nproc_per_node} processes = {nnodes * nproc_per_node} < the "
                          f"{world} ranks the layouts use", key="nproc_per_node")
    run = ["-m", "reshard_cli", "run", "--src", str(src_yaml), "--dst", str(dst_yaml), *map(str, extra_args)]
    if nnodes == 1 and rdzv_endpoint is None:
        return [torchrun, "--standalone", "--nproc-per-node", str(nproc_per_node), *run]
    if not rdzv_endpoint:
        raise ConfigError("several nodes need a rendezvous endpoint (host:port of the first node)",
                          key="rdzv_endpoint")
    return [torchrun, "--nnodes", str(nnodes), "--nproc-per-node", str(nproc_per_node), "--rdzv-backend", "c10d",
            "--rdzv-endpoint", rdzv_endpoint, "--rdzv-id", rdzv_id, *run]


@dataclass
class LaunchOptions:
    """What `dry_run` reads (a run.RunOptions has the same fields)."""

    src: Path
    dst: Path
    topology: Path | None = None
    scale: int = 1
    argv: list = field(default_factory=list)  # the command line after the program name


@dataclass(frozen=True)
class RankRow:
    rank: int
    node: int
    local: int
    group: str  # src | dst | idle
    coords: str  # e.g. "dense(pp=0,dp=1) expert(pp=0,ep=1)"
    domain: int | None  # the topology's domain id; None without a topology (every rank alone)


def _coords(layout: Layout, rank: int, index: dict) -> str:
    i = index[rank]
    parts = []
    for m in layout.meshes.values():
        j, coord = i, []
        for n in reversed(m.shape):
            coord.append(j % n)
            j //= n
        name = "mesh" if m.name == "default" else m.name
        parts.append(f"{name}(" + ",".join(f"{d}={c}" for d, c in zip(m.dims, reversed(coord))) + ")")
    return " ".join(parts)


def rank_map(src, dst, topology: Topology | None = None, nproc_per_node: int = DEFAULT_GPUS_PER_NODE, *,
             world: int | None = None) -> list[RankRow]:
    """Every global rank of the job: node, local rank, group, mesh coordinates, domain.

    `world` defaults to whole nodes: the layouts' world size rounded up to a multiple of nproc_per_node
    (the extra ranks of the last node idle).
    """
    s, d = _pair(src, dst)
    topology = topology or NO_TOPOLOGY
    need = world_size(s, d)
    if world is None:
        world = -(-need // nproc_per_node) * nproc_per_node
    s_idx = {r: i for i, r in enumerate(s.ranks)}
    d_idx = {r: i for i, r in enumerate(d.ranks)}
    rows = []
    for r in range(world):
        if r in s_idx:
            group, coords = "src", _coords(s, r, s_idx)
        elif r in d_idx:
            group, coords = "dst", _coords(d, r, d_idx)
        else:
            group, coords = "idle", ""
        rows.append(RankRow(r, r // nproc_per_node, r % nproc_per_node, group, coords,
                            topology.domain_of(r) if topology.grouped else None))
    return rows


def _gpus_per_node(topology: Topology) -> tuple[int, str]:
    env = os.environ.get("GPUS_PER_NODE")
    if env:
        try:
            n = int(env)
            if n < 1:
                raise ValueError
        except ValueError:
            raise ConfigError(f"expected a positive integer, got {env!r}", key="GPUS_PER_NODE") from None
        return n, "GPUS_PER_NODE"
    rpd = topology.ranks_per_domain
    if rpd and rpd <= DEFAULT_GPUS_PER_NODE:
        return rpd, "the topology's ranks_per_domain; set GPUS_PER_NODE to change"
    return DEFAULT_GPUS_PER_NODE, "default; set GPUS_PER_NODE to change"


def _domain_check(rows: list[RankRow], topology: Topology) -> str:
    """Does every domain sit inside one node, or consist of whole nodes?"""
    if not topology.grouped:
        return "domains: none (no --topology: every rank is its own domain)"
    nodes_of: dict[int, set] = {}
    ranks_of: dict[int, list] = {}
    for row in rows:
        if row.group == "idle":
            continue
        nodes_of.setdefault(row.domain, set()).add(row.node)
        ranks_of.setdefault(row.domain, []).append(row.rank)
    node_ranks: dict[int, set] = {}
    for row in rows:
        if row.group != "idle":
            node_ranks.setdefault(row.node, set()).add(row.domain)
    split = [d for d, ns in nodes_of.items() if len(ns) > 1]
    if not split:
        mixed = [n for n, ds in node_ranks.items() if len(ds) > 1]
        if mixed:
            return (f"domains: every domain is inside one node; node {mixed[0]} holds {len(node_ranks[mixed[0]])} "
                    f"domains (fine: NVLink only inside each)")
        return "domains: every domain is inside one node (NVLink forwards stay on the node)"
    # a domain over several nodes: right only if those nodes hold nothing else (a multi-node NVLink domain)
    bad = [d for d in split if any(len(node_ranks[n]) > 1 for n in nodes_of[d])]
    if bad:
        d = bad[0]
        rs = ranks_of[d]
        return (f"domains: WARNING domain {d} (ranks {rs[0]}-{rs[-1]}) shares nodes "
                f"{sorted(nodes_of[d])} with other domains: its ranks are not whole nodes (check GPUS_PER_NODE)")
    k = sorted({len(nodes_of[d]) for d in split})
    return (f"domains: each multi-node domain is {'/'.join(map(str, k))} whole nodes (a multi-node NVLink domain: "
            f"its nodes must be consecutive in the rendezvous order)")


def dry_run(opts) -> str:
    """What `reshard run --dry-run` prints: launch commands and the rank -> node -> group -> mesh -> domain
    table (every rank). `opts`: a LaunchOptions or run.RunOptions; nothing is started, torch is not imported."""
    s, d = load_pair(opts.src, opts.dst, scale=getattr(opts, "scale", 1))
    topology = load_topology(opts.topology) if getattr(opts, "topology", None) else NO_TOPOLOGY
    world = world_size(s, d)
    gpn, why = _gpus_per_node(topology)
    nnodes = -(-world // gpn)
    argv = [a for a in (getattr(opts, "argv", None) or []) if a != "--dry-run"]
    if "run" not in argv:  # called from Python: rebuild the run options that matter
        argv = ["run", "--src", str(opts.src), "--dst", str(opts.dst)]
        if getattr(opts, "topology", None):
            argv += ["--topology", str(opts.topology)]
    run_args = argv[argv.index("run") + 1:]
    pre = argv[:argv.index("run")]  # global options such as --debug
    tail = ["-m", "reshard_cli", *pre, "run", *run_args]
    single = ["torchrun", "--standalone", "--nproc-per-node", str(world), *tail]
    multi = ["torchrun", "--nnodes", str(nnodes), "--nproc-per-node", str(gpn), "--rdzv-backend", "c10d",
             "--rdzv-endpoint", f"{HEAD}:{DEFAULT_PORT}", "--rdzv-id", "reshard", *tail]
    static = ["torchrun", "--nnodes", str(nnodes), "--nproc-per-node", str(gpn), "--node-rank", "NODE_RANK",
              "--master-addr", HEAD, "--master-port", str(DEFAULT_PORT), *tail]
    rows = rank_map(s, d, topology, gpn, world=nnodes * gpn)
    src_nodes = sorted({r.node for r in rows if r.group == "src"})
    dst_nodes = sorted({r.node for r in rows if r.group == "dst"})
    both = sorted(set(src_nodes) & set(dst_nodes))
    lines = [
        f"reshard run --dry-run: {s.manifest.name}  {s.name} ({s.size} ranks, {_span(s.ranks)}) -> {d.name} "
        f"({d.size} ranks, {_span(d.ranks)})  world {world}",
        f"  topology {topology.describe()};  {gpn} GPUs per node ({why}) -> {nnodes} node(s)",
        "",
        f"  one node ({world} processes):",
        f"    {shlex.join(single)}",
        f"  {nnodes} node(s) x {gpn} GPUs, the same line on every node ({HEAD} = the first node's address):",
        f"    {shlex.join(multi)}",
        "    or a static rendezvous (node ranks as given, e.g. NODE_RANK=$SLURM_NODEID):",
        f"    {shlex.join(static)}",
        f"    or with Slurm: sbatch --nodes {nnodes} launchers/slurm.sbatch {shlex.join(run_args)}",
        f"  global rank = node rank x {gpn} + local rank; c10d numbers the nodes in sorted host-name order, the "
        "static rendezvous as given",
        f"  src on node(s) {_span(src_nodes)}, dst on node(s) {_span(dst_nodes)}"
        + (f"; node(s) {_span(both)} hold both groups" if both else ""),
        "  " + _domain_check(rows, topology),
        "",
    ]
    idle = world < nnodes * gpn
    wr = max(len(str(world - 1)), 4)
    wn = max(len(str(nnodes - 1)), 4)
    lines.append(f"  # {'rank':>{wr}}  {'node':>{wn}}  local  group  domain  mesh coordinates")
    for r in rows:
        dom = "-" if r.domain is None else str(r.domain)
        lines.append(f"    {r.rank:>{wr}}  {r.node:>{wn}}  {r.local:>5}  {r.group:<5}  {dom:>6}  {r.coords or '-'}")
    if idle:
        lines.append(f"  (ranks {world}-{nnodes * gpn - 1} fill the last node and stay idle)")
    return "\n".join(lines)


def _span(xs) -> str:
    xs = sorted(xs)
    if not xs:
        return "-"
    if xs == list(range(xs[0], xs[-1] + 1)):
        return f"{xs[0]}-{xs[-1]}" if len(xs) > 1 else str(xs[0])
    return ",".join(map(str, xs))


def main(argv: list[str] | None = None) -> int:
    """`python -m reshard_cli.transfer.dryrun world-size --src A --dst B [...]`: print the process count."""
    import argparse

    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] != "world-size":
        print("usage: python -m reshard_cli.transfer.dryrun world-size --src A --dst B [run options]", file=sys.stderr)
        return 2
    p = argparse.ArgumentParser(prog="reshard_cli.transfer.dryrun world-size", add_help=False, allow_abbrev=False)
    p.add_argument("--src")
    p.add_argument("--dst")
    p.add_argument("--scale", type=int, default=1)
    args, _rest = p.parse_known_args(argv[1:])
    if not args.src or not args.dst:
        print("reshard: error: --src and --dst are required", file=sys.stderr)
        return 2
    try:
        print(world_size(Path(args.src), Path(args.dst), scale=args.scale))
    except ReshardError as e:
        print(f"reshard: error: {e}", file=sys.stderr)
        return e.exit_code
    return 0


if __name__ == "__main__":
    sys.exit(main())
