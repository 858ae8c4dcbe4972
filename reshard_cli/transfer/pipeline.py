"""One execution pipeline for a plan, shared by `reshard run` (`transfer.run`), `reshard bench`
(`bench.measure`) and the live API (`transfer.live.Refit`). Each caller keeps only what is its own (a source
to open, an output to write, a report to print); the steps are here:

  plan      `ready_plan` / `with_topology`: a Plan ready to follow (in mode auto with the routes the cost
            model chose)
  load      `source_shards` / `destination_buffers`: this rank's shards read from a source, and its
            sentinel-filled destination buffers
  engine    `build_engine`: the rank's executor, its groups and its transport to every peer set up
            (collective; under the group's watchdog)
  link      `LinkLimit`: the plan's traffic as raw concurrent send/recv, the most this backend can do for it
  time      `Measure` / `rounds` / `slowest`: runs between barriers, the slowest rank's time per run
  verify    `Expected`: exact expected values of a synthetic source's destination shards, wrong elements counted
"""
from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable

import torch
import torch.distributed as dist

from reshard_cli.base.checksums import count_differing
from reshard_cli.io.synthetic import synthetic_values
from reshard_cli.layouts.layout import Layout
from reshard_cli.layouts.topology import Topology
from reshard_cli.plan.cost import with_auto_routes
from reshard_cli.plan.planner import Plan
from reshard_cli.plan.schedule import TransferOptions
from reshard_cli.transfer import launcher
from reshard_cli.transfer.comm import WORLD
from reshard_cli.transfer.engine import Engine
from reshard_cli.transfer.linktest import CopyTest, LinkTest
from reshard_cli.transfer.shards import LocalShard, read_source_shards, sentinel_buffers

EXPECTED_CACHE_BYTES = 2 << 30  # bench keeps expected destination values between modes up to this much per rank


# ------------------------------------------------------------------------------------------------- plan


def ready_plan(src: Layout, dst: Layout, topology: Topology, *, mode: str, reshard_match: str | None,
               bucket_bytes: int | None = None) -> Plan:
    """The plan between two layouts, ready to follow: in mode auto with the routes the cost model chose for
    this topology (every other mode as planned)."""
    return with_auto_routes(Plan(src, dst, topology, mode=mode, reshard_match=reshard_match,
                                 bucket_bytes=bucket_bytes))


def with_topology(plan: Plan, topology: Topology) -> Plan:
    """`plan` over another topology (one discovered once the job is up), ready to follow: mode auto's routes
    belong to a topology, so they are chosen again."""
    return with_auto_routes(replace(plan, topology=topology, class_routes=None))


def transfer_options(bucket_mb: float) -> TransferOptions:
    """The message schedule's options for a bucket size in MiB (identical on every rank)."""
    return TransferOptions(bucket_bytes=int(bucket_mb * (1 << 20)))


# ------------------------------------------------------------------------------------------------- load


def source_shards(layout: Layout, rank: int, source, device: torch.device) -> dict[int, LocalShard]:
    """The shards `rank` holds in the source layout, read from `source` ({} on a rank that holds none)."""
    return read_source_shards(layout, rank, source, device) if rank in layout.ranks else {}


def destination_buffers(layout: Layout, rank: int, device: torch.device) -> dict[int, LocalShard]:
    """Sentinel-filled buffers for the shards `rank` holds in the destination layout ({} on other ranks)."""
    return sentinel_buffers(layout, rank, device) if rank in layout.ranks else {}


# ----------------------------------------------------------------------------------------------- engine


def build_engine(plan: Plan, rank: int, src_shards: dict, dst_shards: dict, options: TransferOptions,
                 device: torch.device, *, comm=None, progress: Callable[[int], None] | None = None) -> Engine:
    """Collective (every rank of the group, same order): the rank's executor of `plan`, its groups set up, and
    the transport to every peer its schedule exchanges messages with (their communicators, under NCCL), now
    and under the group's watchdog rather than on the first message (`Comm.connect`)."""
    extra = {} if comm is None else {"comm": comm}
    engine = Engine(plan, rank, src_shards, dst_shards, options=options, device=device, progress=progress, **extra)
    engine.setup_groups()
    engine.comm.connect(peers_of(engine))
    return engine


def peers_of(engine: Engine) -> set[int]:
    """The ranks `engine`'s schedule exchanges messages with: its reshard path's, and the broadcast path's
    gathers (a root receives from the holders of its pack's pieces, each holder sends to the root)."""
    peers = {op.peer for op in engine.ops}
    for pack in engine.packs:
        for bc, _off in pack.tensors:
            holders = {s for s, _box in bc.gather}
            if bc.root == engine.rank:
                peers |= holders
            elif engine.rank in holders:
                peers.add(bc.root)
    peers.discard(engine.rank)
    return peers


# ------------------------------------------------------------------------------------------------- link


class LinkLimit:
    """The reshard-path traffic of `engine`'s plan as raw concurrent send/recv (`LinkTest`). Collective: every
    rank builds it from the same plan and runs it together."""

    def __init__(self, engine: Engine, device: torch.device):
        self.test = LinkTest(engine.plan, engine.view.pieces, engine.rank, device)
        self.device = device

    def run_once(self) -> None:
        self.test.run_once()

    def copy_test(self) -> CopyTest:
        """The same traffic's copy limit through memory (`CopyTest`)."""
        return CopyTest(self.test, self.device)

    def total_bytes(self) -> int:
        """Collective: the bytes every rank sends, summed."""
        return launcher.allreduce_int(self.test.sent_bytes, dist.ReduceOp.SUM)

    def best_gbps(self, tries: int = 3) -> float:
        """Collective: aggregate GB/s of the best of `tries` runs (this rank's clock): the link limit."""
        total = self.total_bytes()
        m = Measure("link", self.run_once)
        rounds([m], tries, self.device, rotate=False, drop_first=False)
        best = min(m.times) if m.times else None
        return total / best / 1e9 if total and best else 0.0


# ------------------------------------------------------------------------------------------------- time


@dataclass
class Measure:
    """One thing to time: `run` between barriers; `prepare` before it and `check` after it, untimed (`check`
    returns the wrong elements on this rank)."""

    name: str
    run: Callable[[], Any]
    prepare: Callable[[], Any] | None = None
    check: Callable[[], int] | None = None
    times: list = field(default_factory=list)
    cpu: list = field(default_factory=list)  # this process's CPU seconds (every thread, user + sys), per run
    wrong: list = field(default_factory=list)  # wrong elements on this rank, per run (warm-up first)

    def once(self, device: torch.device, keep: bool = True) -> None:
        """Collective: prepare, run between barriers, check; the time and CPU time kept when `keep`."""
        if self.prepare is not None:
            self.prepare()
        launcher.sync(device)
        t0, c0 = time.perf_counter(), time.process_time()
        self.run()
        c1 = time.process_time()  # before the barrier: its own CPU is not the measurement's
        launcher.sync(device)
        dt = time.perf_counter() - t0
        if self.check is not None:
            self.wrong.append(self.check())  # every run is verified, the warm-up too
        if keep:
            self.times.append(dt)
            self.cpu.append(c1 - c0)


def rounds(measures: list[Measure], runs: int, device: torch.device, *, rotate: bool = True,
           drop_first: bool = True) -> None:
    """Collective: `runs` rounds, each running every measurement once. `rotate`: each round's order rotated by
    one (a load change on a shared machine hits every measurement alike). `drop_first`: round 0 is a warm-up
    whose times are not kept."""
    for r in range(runs):
        k = r % len(measures) if rotate else 0
        for m in measures[k:] + measures[:k]:
            m.once(device, keep=r > 0 or not drop_first)


def slowest(measures: list[Measure]) -> list[list[float]]:
    """Collective: per measurement, per run, the slowest rank's time (every rank runs the same measurements)."""
    if not measures:
        return []
    times = torch.tensor([m.times for m in measures], dtype=torch.float64)
    WORLD.all_reduce(times, dist.ReduceOp.MAX)
    return times.tolist()


def median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


# ----------------------------------------------------------------------------------------------- verify


class Expected:
    """Exact expected values of this rank's destination shards under a synthetic source of `seed` (kept between
    runs while they fit in `cache_bytes`)."""

    def __init__(self, man, dst_shards: dict, device: torch.device, *, seed: int = 0,
                 cache_bytes: int = EXPECTED_CACHE_BYTES):
        self.man, self.boxes, self.device, self.seed = man, {t: sh.box for t, sh in dst_shards.items()}, device, seed
        total = sum(sh.data.numel() * sh.data.element_size() for sh in dst_shards.values())
        self._cache: dict[int, torch.Tensor] | None = {} if total <= cache_bytes else None

    def get(self, t: int, dtype: torch.dtype) -> torch.Tensor:
        if self._cache is not None and t in self._cache:
            return self._cache[t]
        x = synthetic_values(t, self.boxes[t], self.man[t].shape, dtype, self.seed).to(self.device)
        if self._cache is not None:
            self._cache[t] = x
        return x

    def wrong_by_tensor(self, data: dict[int, torch.Tensor]) -> dict[int, int]:
        """Per tensor with any: the elements that differ from the expected values, bit for bit."""
        out = {}
        for t, x in data.items():
            if x.numel():
                n = count_differing(x, self.get(t, x.dtype))
                if n:
                    out[t] = n
        return out

    def wrong(self, data: dict[int, torch.Tensor]) -> int:
        """Elements that differ from the expected values, bit for bit."""
        return sum(self.wrong_by_tensor(data).values())
