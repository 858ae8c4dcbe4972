"""What `reshard topo` measures and prints beside the NVML discovery.

`measure(mb)`: copy bandwidths with torch, best of a few repetitions (the limit, not a typical run).
  - with GPUs: host -> device and device -> host from pinned memory, for every GPU, and device -> device
    between every pair of GPUs (none with one GPU);
  - always: memcpy on the CPU (`copy_` of an `mb` MiB buffer), and process to process: two processes started
    with torch.multiprocessing, one sending an `mb` MiB buffer to the other over gloo (what a refit between
    processes on one host can reach at most over that backend).

`job_topology()`: under torchrun, every rank discovers its host and its domain key, and rank 0 gets the
whole job (one section per host, and the job's domains from the keys).
"""
from __future__ import annotations

import os
import time
from datetime import timedelta
from dataclasses import dataclass
from typing import Any, Callable

import torch

from reshard_cli.base.ports import free_port
from reshard_cli.base.text import fmt_bytes, table
from reshard_cli.errors import ReshardError
from reshard_cli.hw import nvml
from reshard_cli.layouts.topology import Topology
from reshard_cli.layouts.yamlio import format_ranks

REPEATS = 5        # copies: best of this many
P2P_REPEATS = 3    # process to process: best of this many


def _row(test: str, src: str, dst: str, nbytes: int, seconds: float) -> dict:
    return {"test": test, "from": src, "to": dst, "bytes": nbytes, "seconds": seconds,
            "gbps": nbytes / seconds / 1e9 if seconds > 0 else 0.0}


def _best(fn: Callable[[], Any], sync: Callable[[], None], repeats: int) -> float:
    fn()  # warm-up: first touch, allocator, peer mappings
    sync()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        sync()
        best = min(best, time.perf_counter() - t0)
    return best


def memcpy_row(nbytes: int, repeats: int = REPEATS) -> dict:
    src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
    dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    return _row("memcpy", "cpu", "cpu", nbytes, _best(lambda: dst.copy_(src), lambda: None, repeats))


def gpu_rows(nbytes: int, repeats: int = REPEATS) -> list[dict]:
    """Host <-> device (pinned) for every GPU, device -> device for every pair (i < j)."""
    n = torch.cuda.device_count()
    rows = []

    def sync(*devs: int) -> Callable[[], None]:
        return lambda: [torch.cuda.synchronize(d) for d in devs]

    for i in range(n):
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}")
        rows.append(_row("host->device pinned", "cpu", f"cuda:{i}", nbytes,
                         _best(lambda: dev.copy_(host, non_blocking=True), sync(i), repeats)))
        rows.append(_row("device->host pinned", f"cuda:{i}", "cpu", nbytes,
                         _best(lambda: host.copy_(dev, non_blocking=True), sync(i), repeats)))
    for i in range(n):
        for j in range(i + 1, n):
            a = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{i}")
            b = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{j}")
            rows.append(_row("device->device", f"cuda:{i}", f"cuda:{j}", nbytes,
                             _best(lambda: b.copy_(a, non_blocking=True), sync(i, j), repeats)))
    return rows


def _p2p_worker(rank: int, port: int, nbytes: int, repeats: int, queue) -> None:
    """One of the two processes: rank 0 sends, rank 1 receives and reports its best time."""
    import torch.distributed as dist

    for k in list(os.environ):  # torchrun's variables must not steer this private two-process group
        if k.startswith("TORCHELASTIC_") or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            del os.environ[k]
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            timeout=timedelta(seconds=120))
    try:
        buf = torch.empty(nbytes, dtype=torch.uint8).fill_(rank)
        best = float("inf")
        for it in range(repeats + 1):  # the first is a warm-up
            dist.barrier()
            t0 = time.perf_counter()
            if rank == 0:
                dist.send(buf, 1)
            else:
                dist.recv(buf, 0)
            dt = time.perf_counter() - t0
            if it:
                best = min(best, dt)
        if rank == 1:
            queue.put(best)
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _cuda_initialized() -> bool:
    try:
        return bool(torch.cuda.is_initialized())
    except Exception:  # noqa: BLE001
        return True


def process_row(nbytes: int, repeats: int = P2P_REPEATS) -> dict:
    import torch.multiprocessing as mp

    # fork where there is one: the children need not import torch again (seconds each); they use no CUDA
    method = "fork" if "fork" in mp.get_all_start_methods() and not _cuda_initialized() else "spawn"
    queue = mp.get_context(method).SimpleQueue()
    mp.start_processes(_p2p_worker, args=(free_port("127.0.0.1"), nbytes, repeats, queue), nprocs=2, join=True,
                       start_method=method)
    return _row("process->process gloo", "cpu:0", "cpu:1", nbytes, queue.get())


def measure(mb: int = 256, *, repeats: int = REPEATS) -> list[dict]:
    """Every measurement for this host, as rows {test, from, to, bytes, seconds, gbps}."""
    nbytes = int(mb) << 20
    cpu = [memcpy_row(nbytes, repeats), process_row(nbytes)]  # before CUDA starts: the children can fork
    gpu = gpu_rows(nbytes, repeats) if torch.cuda.is_available() and torch.cuda.device_count() else []
    return gpu + cpu


def bandwidth_table(rows: list[dict]) -> str:
    return "\n" + "bandwidth (best of a few):\n" + table(
        ["test", "from", "to", "size", "ms", "GB/s"],
        [[r["test"], r["from"], r["to"], fmt_bytes(r["bytes"]), f"{r['seconds'] * 1e3:.2f}", f"{r['gbps']:.2f}"]
         for r in rows])


# ------------------------------------------------------------------------------------------------ rendering


@dataclass(frozen=True)
class JobTopology:
    """What `reshard topo` under torchrun shows: the text, the JSON twin (world, hosts [{hostname, ranks,
    discovery, bandwidth}], keys per global rank, topology as YAML dict) and the Topology itself."""

    text: str
    doc: dict
    topology: Topology


def job_topology(*, bandwidth: bool = False, mb: int = 256) -> JobTopology | None:
    """Under torchrun: every rank reports its discovery; rank 0 returns the job (others None)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    local = int(os.environ.get("LOCAL_RANK", "0"))
    d = nvml.discover()
    error = None
    try:
        key = nvml.rank_domain_key(d, local)
    except ReshardError as e:
        key, error = f"rank:{rank}", str(e)  # this rank stays alone
    # before the process group: the two measuring processes must not inherit it
    rows = measure(mb) if bandwidth and local == 0 else None
    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    try:
        mine = {"rank": rank, "local_rank": local, "hostname": d.host.hostname, "key": key, "error": error,
                "discovery": nvml.to_json(d), "text": nvml.topo_text(d), "bandwidth": rows}
        everyone: list = [None] * world
        dist.all_gather_object(everyone, mine)
    finally:
        dist.destroy_process_group()
    if rank != 0:
        return None
    hosts = _hosts(everyone)
    keys = [e["key"] for e in everyone]
    topology = nvml.domains_from_keys(keys)
    doc = {"world": world, "keys": keys, "topology": topology.to_yaml_dict(),
           "hosts": [{k: v for k, v in h.items() if k != "text"} for h in hosts.values()]}
    return JobTopology(_job_text(world, hosts, topology), doc, topology)


def _hosts(everyone: list[dict]) -> dict[str, dict]:
    """Every rank's report, grouped by host: its ranks, domain keys, discovery, one bandwidth table, errors."""
    hosts: dict[str, dict] = {}
    for e in everyone:
        h = hosts.setdefault(e["hostname"], {"hostname": e["hostname"], "ranks": [], "discovery": e["discovery"],
                                             "text": e["text"], "bandwidth": None, "keys": {}})
        h["ranks"].append(e["rank"])
        h["keys"].setdefault(e["key"], []).append(e["rank"])
        if e["bandwidth"] is not None and h["bandwidth"] is None:
            h["bandwidth"] = e["bandwidth"]
        if e["error"]:
            h.setdefault("errors", []).append(f"rank {e['rank']}: {e['error']}")
    return hosts


def _job_text(world: int, hosts: dict[str, dict], topology) -> str:
    lines = [f"reshard topo: {world} ranks on {len(hosts)} host{'s' if len(hosts) != 1 else ''}, "
             f"{len(topology.domains)} domain{'s' if len(topology.domains) != 1 else ''}"]
    for h in hosts.values():
        lines.append("")
        lines.append(f"== {h['hostname']}: ranks {format_ranks(h['ranks'])}")
        lines.append(h["text"].rstrip("\n"))
        for key, ranks in h["keys"].items():
            lines.append(f"  ranks {format_ranks(ranks):<10} {key}")
        for err in h.get("errors", []):
            lines.append(f"  {err}")
        if h["bandwidth"]:
            lines.append(bandwidth_table(h["bandwidth"]))
    lines.append("")
    lines.append("job domains: " + "  ".join(format_ranks(dom) for dom in topology.domains))
    return "\n".join(lines)


__all__ = ["measure", "memcpy_row", "gpu_rows", "process_row", "bandwidth_table", "JobTopology", "job_topology"]
