"""The worker of `reshard bench`: every case of the suite timed in every mode on the same processes and data.

`worker()` validates on every rank, joins the job, runs the suite and leaves the process group; rank 0 returns
the figures (the report is written after the job, see `reshard_cli.bench.main`).
"""
from __future__ import annotations

import os
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from reshard_cli.bench import report
from reshard_cli.bench.dcp import DcpRun
from reshard_cli.bench.suite import ENGINE_MODES, LIVE_MODE, MODES, BenchOptions, Case, Suite, case_named, resolve, \
    sweep_cases, world_needed
from reshard_cli.transfer import launcher

EXPECTED_CACHE_BYTES = 2 << 30  # keep expected destination values between modes up to this much per rank


def worker(opts: BenchOptions) -> dict | None:
    """One rank of the job. Rank 0 returns the figures once the process group is gone; the others None."""
    rank, world = launcher.rank_and_world()
    with tempfile.TemporaryDirectory(prefix="reshard-bench-") as workdir:
        def validate():
            suite = resolve(opts, Path(workdir))
            launcher.check_world(world, world_needed(suite), "the cases use")
            backend = launcher.pick_backend(opts.backend)
            if rank == 0:
                report.check_outputs(opts)  # rank 0 writes them
            return suite, backend

        suite, backend = launcher.prepare(validate)
        with launcher.process_group(backend, opts.timeout) as device:
            return run_suite(suite, opts, rank, world, device)


def run_suite(suite: Suite, opts: BenchOptions, rank: int, world: int, device: torch.device) -> dict | None:
    say = report.say if rank == 0 and not opts.quiet else None
    cases = []
    for i, case in enumerate(suite.cases):
        if say:
            say(f"case {i + 1}/{len(suite.cases)}: {case.name}")
        cases.append(run_case(case, opts, rank, device, say))
    sweep = []
    for case in sweep_cases(suite):
        if case.scale == case_named(suite, case.name).scale:  # measured above: same case, same scale
            r = cases[[c.name for c in suite.cases].index(case.name)]
        else:
            if say:
                say(f"sweep: {case.name} at scale {case.scale}")
            r = run_case(case, opts, rank, device, say)
        if r is not None:
            sweep.append({"case": case.name, "scale": case.scale, "bytes": r["bytes"],
                          "link_limit_gbps": r["link_limit_gbps"], "link_limit_seconds": r["link_limit_seconds"],
                          "modes": {m: {k: v[k] for k in ("seconds", "gbps", "wire_bytes", "wrong")}
                                    for m, v in r["modes"].items()}})
    if rank != 0:
        return None
    return {"suite": suite.name, "backend": dist.get_backend(), "device": device.type, "world": world,
            "iters": opts.iters, "torch": torch.__version__,
            "staging_note": "engine modes: Engine.peak_staging_bytes; dcp: see each case's dcp.staging_kind",
            "cases": cases, "sweep": sweep}


# -------------------------------------------------------------------------------------------- one case


def run_case(case: Case, opts: BenchOptions, rank: int, device: torch.device,
             say: Callable[[str], None] | None) -> dict | None:
    """Collective: every rank of the world runs every step in the same order (idle ranks join the barriers).

    Rounds: round 0 is the warm-up, then `iters` timed rounds; each round runs every measurement once, in an
    order rotated by one each round, so a load change on a shared machine hits every mode alike. Before every
    run of a mode the destination buffers are refilled with the sentinel; after it they are verified exactly.
    """
    from reshard_cli.io.sources import SyntheticSource
    from reshard_cli.plan.planner import Plan
    from reshard_cli.plan.schedule import TransferOptions
    from reshard_cli.formats import load_pair
    from reshard_cli.layouts.topology import NO_TOPOLOGY, load_topology
    from reshard_cli.transfer.engine import Engine
    from reshard_cli.transfer.linktest import LinkTest
    from reshard_cli.transfer.shards import fill_sentinel, read_source_shards, sentinel_buffers

    src_l, dst_l = load_pair(case.src, case.dst, scale=case.scale)
    topo = load_topology(case.topology) if case.topology is not None else NO_TOPOLOGY
    match = case.reshard_match or opts.reshard_match
    plans = {m: Plan(src_l, dst_l, topo, mode=m, reshard_match=match) for m in ENGINE_MODES}
    man = src_l.manifest.tensors

    # the same source shards and destination buffers for every mode
    src_shards = read_source_shards(src_l, rank, SyntheticSource(src_l.manifest), device) \
        if rank in src_l.ranks else {}
    dst_shards = sentinel_buffers(dst_l, rank, device) if rank in dst_l.ranks else {}
    expected = Expected(man, dst_shards, device)
    dst_data = {t: sh.data for t, sh in dst_shards.items()}

    options = TransferOptions(bucket_bytes=int(case.bucket_mb * (1 << 20)))
    engines = {m: Engine(plans[m], rank, src_shards, dst_shards, options=options, device=device)
               for m in ENGINE_MODES}
    for m in ENGINE_MODES:
        engines[m].setup_groups()  # collective: every rank, same order

    # 1. link limit: the reshard plan's traffic per sender -> receiver pair, raw and all at once
    link = LinkTest(plans["reshard"], engines["reshard"].view.pieces, rank, device)
    measures = [Measure("link", link.run_once)]
    # every mode starts from the same state: destination buffers just filled with the sentinel, source shards
    # just read (as after an optimizer step), whatever ran before it (else a mode that follows another on the
    # same shards finds them in cache and one that follows the link limit does not)
    def warm() -> None:
        fill_sentinel(dst_shards.values())
        _touch(src_shards.values())

    # 2-4. the engine modes, on the same shards and buffers
    for m in ENGINE_MODES:
        eng = engines[m]
        measures.append(Measure(m, lambda eng=eng: (eng.run_reshard(), eng.run_broadcast()), prepare=warm,
                                check=lambda: expected.wrong(dst_data)))
    # 6. the live API: a `Refit` over the same shards, called as a trainer calls it after each step
    from reshard_cli.transfer.live import Refit
    role = "src" if rank in src_l.ranks else "dst" if rank in dst_l.ranks else "idle"
    live = Refit(role, src=src_l, dst=dst_l, topology=topo, mode=LIVE_MODE, bucket_mb=case.bucket_mb,
                 reshard_match=match, device=device)
    live_tensors = {man[t].name: sh.data for t, sh in (*src_shards.items(), *dst_shards.items())}
    measures.append(Measure("live", lambda: live(live_tensors), prepare=warm, check=lambda: expected.wrong(dst_data)))
    # 7. torch.distributed.checkpoint: save in the source layout, load in the destination layout
    dcp_run = DcpRun(src_l, dst_l, rank, src_shards, dst_shards, expected, device, opts.dcp_dir)
    measures.append(Measure("dcp", dcp_run.run, prepare=lambda: (dcp_run.prepare(), _touch(src_shards.values())),
                            check=dcp_run.check))
    try:
        rounds(measures, opts.iters, device)
    finally:
        dcp_run.close()

    times = torch.tensor([m.times for m in measures], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # per run: the slowest rank
    cpu = torch.tensor([m.cpu for m in measures], dtype=torch.float64)
    dist.all_reduce(cpu, op=dist.ReduceOp.SUM)  # per run: every process of the job
    wrong = torch.tensor([m.wrong for m in measures if m.name != "link"], dtype=torch.int64)
    dist.all_reduce(wrong, op=dist.ReduceOp.SUM)  # per run: wrong elements over all ranks
    staging = {m: launcher.allreduce_int(engines[m].peak_staging_bytes) for m in ENGINE_MODES}
    staging["live"] = launcher.allreduce_int(live.engine.peak_staging_bytes if live.engine else 0)
    dcp_doc = dcp_run.figures()
    link_bytes = launcher.allreduce_int(link.sent_bytes, dist.ReduceOp.SUM)
    if rank != 0:
        return None

    per = {m.name: times[i].tolist() for i, m in enumerate(measures)}
    per_cpu = {m.name: cpu[i].tolist() for i, m in enumerate(measures)}
    worst = {m.name: int(wrong[i].max()) for i, m in enumerate(x for x in measures if x.name != "link")}
    nbytes = src_l.manifest.nbytes
    modes: dict[str, dict] = {}
    for m in MODES:
        sec = _median(per[m])
        modes[m] = {"seconds": sec, "times": per[m], "gbps": nbytes / sec / 1e9 if sec else 0.0,
                    "cpu_seconds": _median(per_cpu[m]), "wrong": worst[m]}
        if m in ENGINE_MODES or m == "live":
            plan = plans[m if m in ENGINE_MODES else LIVE_MODE]
            modes[m].update(wire_bytes=plan.stats()["wire_bytes"], peak_staging_bytes=staging[m])
        else:
            modes[m].update(dcp_doc)
    t_link = _median(per["link"])
    doc = {
        "name": case.name, "src": src_l.name, "dst": dst_l.name, "src_file": str(case.src), "dst_file": str(case.dst),
        "model": src_l.manifest.name, "scale": case.scale, "src_ranks": src_l.size, "dst_ranks": dst_l.size,
        "tensors": len(man), "bytes": nbytes, "bucket_bytes": options.bucket_bytes, "topology": topo.describe(),
        "link_limit_seconds": t_link, "link_limit_times": per["link"], "link_bytes": link_bytes,
        "link_limit_cpu_seconds": _median(per_cpu["link"]), "cores": _cores(),
        "link_limit_gbps": nbytes / t_link / 1e9 if t_link else 0.0,
        "link_wire_gbps": link_bytes / t_link / 1e9 if t_link else 0.0,
        "modes": modes,
    }
    report.add_ratios(doc)
    if say:
        say("  " + ", ".join(f"{m} {report.ms(modes[m]['seconds'])} ms" for m in MODES)
            + f", link {report.ms(t_link)} ms; #wrong {sum(v['wrong'] for v in modes.values())}")
    return doc


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


def rounds(measures: list[Measure], iters: int, device: torch.device) -> None:
    for r in range(iters + 1):
        k = r % len(measures)
        for m in measures[k:] + measures[:k]:
            if m.prepare is not None:
                m.prepare()
            launcher.sync(device)
            t0, c0 = time.perf_counter(), time.process_time()
            m.run()
            c1 = time.process_time()  # before the barrier: its own CPU is not the mode's
            launcher.sync(device)
            dt = time.perf_counter() - t0
            if m.check is not None:
                m.wrong.append(m.check())  # every run is verified, the warm-up too
            if r:  # the warm-up's time is dropped
                m.times.append(dt)
                m.cpu.append(c1 - c0)


class Expected:
    """Exact expected values of this rank's destination shards (kept between runs while they fit)."""

    def __init__(self, man, dst_shards: dict, device: torch.device):
        self.man, self.boxes, self.device = man, {t: sh.box for t, sh in dst_shards.items()}, device
        total = sum(sh.data.numel() * sh.data.element_size() for sh in dst_shards.values())
        self._cache: dict[int, torch.Tensor] | None = {} if total <= EXPECTED_CACHE_BYTES else None

    def get(self, t: int, dtype: torch.dtype) -> torch.Tensor:
        from reshard_cli.io.sources import synthetic_values

        if self._cache is not None and t in self._cache:
            return self._cache[t]
        x = synthetic_values(t, self.boxes[t], self.man[t].shape, dtype, 0).to(self.device)
        if self._cache is not None:
            self._cache[t] = x
        return x

    def wrong(self, data: dict[int, torch.Tensor]) -> int:
        """Elements that differ from the expected values, bit for bit."""
        from reshard_cli.base.checksums import count_differing

        return sum(count_differing(x, self.get(t, x.dtype)) for t, x in data.items() if x.numel())


def _touch(shards) -> None:
    """Read every byte of these shards (brings them into cache as a trainer's last write would)."""
    for sh in shards:
        x = sh.data
        if isinstance(x, torch.Tensor) and x.numel():
            x.reshape(-1).view(torch.uint8).max()


def _cores() -> int:
    """CPU cores this process may run on (the job's processes share the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0
