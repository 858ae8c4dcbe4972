"""The worker of `reshard bench`: every case of the suite timed in every mode on the same processes and data.

`worker()` validates on every rank, joins the job, runs the suite and leaves the process group; rank 0 returns
the figures (the report is written after the job, see `reshard_cli.bench.main`).
"""
from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch
import torch.distributed as dist

from reshard_cli.bench import report
from reshard_cli.bench.dcp import DcpRun
from reshard_cli.bench.suite import ENGINE_MODES, LIVE_MODE, SHM, BenchOptions, Case, Suite, base_mode, case_named, \
    modes_of, resolve, sweep_cases, world_needed
from reshard_cli.formats import load_pair
from reshard_cli.io.sources import SyntheticSource
from reshard_cli.layouts.layout import Layout
from reshard_cli.layouts.topology import NO_TOPOLOGY, Topology, load_topology
from reshard_cli.plan.planner import Plan
from reshard_cli.plan.schedule import TransferOptions
from reshard_cli.transfer import launcher, pipeline
from reshard_cli.transfer.engine import Engine
from reshard_cli.transfer.comm import WORLD
from reshard_cli.transfer.live import Refit
from reshard_cli.transfer.shm import with_transport
from reshard_cli.transfer.pipeline import EXPECTED_CACHE_BYTES, Expected, LinkLimit, Measure, median as _median, \
    rounds
from reshard_cli.transfer.shards import fill_sentinel

__all__ = ["worker", "run_suite", "run_case", "CaseFigures", "Expected", "Measure", "rounds", "EXPECTED_CACHE_BYTES"]


def worker(opts: BenchOptions) -> dict | None:
    """One rank of the job. Rank 0 returns the figures once the process group is gone; the others None."""
    rank, world = launcher.rank_and_world()
    with tempfile.TemporaryDirectory(prefix="reshard-bench-") as workdir:
        def validate():
            suite = resolve(opts, Path(workdir))
            launcher.check_world(world, world_needed(suite), "the cases use")
            backend = launcher.pick_backend(opts.backend, opts.transport)
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
            sweep.append(_sweep_point(case, r))
    if rank != 0:
        return None
    return {"suite": suite.name, "backend": dist.get_backend(), "transports": _transports(opts),
            "device": device.type, "world": world,
            "iters": opts.iters, "torch": torch.__version__,
            "staging_note": "engine modes: Engine.peak_staging_bytes; dcp: see each case's dcp.staging_kind",
            "cases": cases, "sweep": sweep}


def _transports(opts: BenchOptions) -> list[str]:
    """What carried the messages: the backend's own, and shared memory beside it (`--transport shm`)."""
    return [dist.get_backend(), "shm"] if opts.transport == "shm" else [dist.get_backend()]


def _sweep_point(case: Case, doc: dict) -> dict:
    """A size sweep point's JSON, from the case's."""
    return {"case": case.name, "scale": case.scale, "bytes": doc["bytes"],
            "link_limit_gbps": doc["link_limit_gbps"], "link_limit_seconds": doc["link_limit_seconds"],
            "modes": {m: {k: v[k] for k in ("seconds", "gbps", "wire_bytes", "wrong")}
                      for m, v in doc["modes"].items()}}


# -------------------------------------------------------------------------------------------- one case


def run_case(case: Case, opts: BenchOptions, rank: int, device: torch.device,
             say: Callable[[str], None] | None) -> dict | None:
    """Collective: every rank of the world runs every step in the same order (idle ranks join the barriers).

    Rounds: round 0 is the warm-up, then `iters` timed rounds; each round runs every measurement once, in an
    order rotated by one each round, so a load change on a shared machine hits every mode alike. Before every
    run of a mode the destination buffers are refilled with the sentinel; after it they are verified exactly.
    Rank 0 returns the case's JSON; the others None.
    """
    rig = CaseRig.build(case, opts, rank, device)
    link = LinkLimit(rig.engines["reshard"], device)  # the reshard plan's traffic, raw and all at once
    lives = {"live": Refit(rig.role(rank), src=rig.src_l, dst=rig.dst_l, topology=rig.topology, mode=LIVE_MODE,
                           bucket_mb=case.bucket_mb, reshard_match=rig.match, device=device)}
    if rig.carrier is not None:  # the same over shared memory
        lives["live" + SHM] = Refit(rig.role(rank), src=rig.src_l, dst=rig.dst_l, topology=rig.topology,
                                    mode=LIVE_MODE, bucket_mb=case.bucket_mb, reshard_match=rig.match, device=device,
                                    transport="shm")
    dcp_run = DcpRun(rig.src_l, rig.dst_l, rank, rig.src_shards, rig.dst_shards, rig.expected, device, opts.dcp_dir)
    measures = _measures(rig, link, lives, dcp_run)
    try:
        rounds(measures, opts.iters + 1, device)
        figures = CaseFigures.gather(measures, rig, lives, dcp_run, link)
    finally:
        dcp_run.close()
        rig.close(lives)
    if rank != 0:
        return None
    doc = _case_doc(rig, figures)
    if say:
        modes = doc["modes"]
        say("  " + ", ".join(f"{m} {report.ms(v['seconds'])} ms" for m, v in modes.items())
            + f", link {report.ms(doc['link_limit_seconds'])} ms; #wrong {sum(v['wrong'] for v in modes.values())}")
    return doc


@dataclass
class CaseRig:
    """What every mode of one case runs on: the layouts, one plan and engine per engine mode, and the same
    source shards, destination buffers and expected values for all of them."""

    case: Case
    src_l: Layout
    dst_l: Layout
    topology: Topology
    match: str | None
    options: TransferOptions
    plans: dict[str, Plan]
    src_shards: dict
    dst_shards: dict
    expected: Expected
    engines: dict[str, Engine]  # per engine mode (and "mode@shm" over `carrier`)
    modes: tuple  # every mode timed (`suite.modes_of`)
    carrier: object = None  # the shared-memory transport (`--transport shm`), else None

    @classmethod
    def build(cls, case: Case, opts: BenchOptions, rank: int, device: torch.device) -> "CaseRig":
        """Collective (the engines' groups): load, plan every engine mode, read the shards, build the engines."""
        src_l, dst_l = load_pair(case.src, case.dst, scale=case.scale)
        topo = load_topology(case.topology) if case.topology is not None else NO_TOPOLOGY
        match = case.reshard_match or opts.reshard_match
        plans = {m: pipeline.ready_plan(src_l, dst_l, topo, mode=m, reshard_match=match) for m in ENGINE_MODES}
        src_shards = pipeline.source_shards(src_l, rank, SyntheticSource(src_l.manifest), device)
        dst_shards = pipeline.destination_buffers(dst_l, rank, device)
        options = pipeline.transfer_options(case.bucket_mb)
        engines = {m: pipeline.build_engine(plans[m], rank, src_shards, dst_shards, options, device)
                   for m in ENGINE_MODES}  # collective: every rank, same order
        carrier = with_transport(WORLD, "shm", device) if opts.transport == "shm" else None
        if carrier is not None:
            engines.update({m + SHM: pipeline.build_engine(plans[m], rank, src_shards, dst_shards, options, device,
                                                           comm=carrier) for m in ENGINE_MODES})
        return cls(case, src_l, dst_l, topo, match, options, plans, src_shards, dst_shards,
                   Expected(src_l.manifest.tensors, dst_shards, device), engines, modes_of(opts.transport), carrier)

    def close(self, lives: dict) -> None:
        """The shared-memory transport's files (the engines' and the live API's), once every mode ran."""
        for live in lives.values():
            live.close()
        if self.carrier is not None:
            for eng in self.engines.values():
                eng.release_staging()
            self.carrier.close()

    def role(self, rank: int) -> str:
        return "src" if rank in self.src_l.ranks else "dst" if rank in self.dst_l.ranks else "idle"

    def warm(self) -> None:
        """Every mode starts from the same state: destination buffers just filled with the sentinel, source
        shards just read (as after an optimizer step), whatever ran before it (else a mode that follows another
        on the same shards finds them in cache and one that follows the link limit does not)."""
        fill_sentinel(self.dst_shards.values())
        _touch(self.src_shards.values())

    def wrong(self) -> int:
        return self.expected.wrong({t: sh.data for t, sh in self.dst_shards.items()})


def _measures(rig: CaseRig, link: LinkLimit, lives: dict, dcp_run: DcpRun) -> list[Measure]:
    """In order: the link limit (and the copy limit beside shared memory), the engine modes, the live API, DCP
    (every one but the limits verified)."""
    measures = [Measure("link", link.run_once)]
    if rig.carrier is not None:
        measures.append(Measure("copy", link.copy_test().run_once))
    man = rig.src_l.manifest.tensors
    live_tensors = {man[t].name: sh.data for t, sh in (*rig.src_shards.items(), *rig.dst_shards.items())}
    for m in rig.modes:  # on the same shards and buffers
        if m in rig.engines:
            eng = rig.engines[m]
            measures.append(Measure(m, lambda eng=eng: (eng.run_reshard(), eng.run_broadcast()), prepare=rig.warm,
                                    check=rig.wrong))
        elif m in lives:  # the live API: a `Refit` over the same shards, called as a trainer calls it after a step
            measures.append(Measure(m, lambda live=lives[m]: live(live_tensors), prepare=rig.warm, check=rig.wrong))
    # torch.distributed.checkpoint: save in the source layout, load in the destination layout
    measures.append(Measure("dcp", dcp_run.run, prepare=lambda: (dcp_run.prepare(), _touch(rig.src_shards.values())),
                            check=dcp_run.check))
    return measures


@dataclass
class CaseFigures:
    """One case's measurements, reduced over the job's ranks (the case's JSON is built from them)."""

    times: dict[str, list[float]]  # per measurement, per timed run: the slowest rank's seconds
    cpu: dict[str, list[float]]  # per measurement, per timed run: CPU seconds of every process of the job
    wrong: dict[str, int]  # per mode: wrong elements over all ranks, in its worst run
    staging: dict[str, int]  # per engine mode and live: peak staging bytes, max over ranks
    dcp: dict  # the DCP-only figures (`DcpRun.figures`)
    link_bytes: int  # the link limit's bytes, every rank's sum

    @classmethod
    def gather(cls, measures: list[Measure], rig: CaseRig, lives: dict, dcp_run: DcpRun,
               link: LinkLimit) -> "CaseFigures":
        """Collective: every rank, the same measurements."""
        times = pipeline.slowest(measures)
        cpu = torch.tensor([m.cpu for m in measures], dtype=torch.float64)
        dist.all_reduce(cpu, op=dist.ReduceOp.SUM)  # per run: every process of the job
        checked = [m for m in measures if m.name not in ("link", "copy")]
        wrong = torch.tensor([m.wrong for m in checked], dtype=torch.int64)
        dist.all_reduce(wrong, op=dist.ReduceOp.SUM)  # per run: wrong elements over all ranks
        staging = {m: launcher.allreduce_int(eng.peak_staging_bytes) for m, eng in rig.engines.items()}
        for m, live in lives.items():
            staging[m] = launcher.allreduce_int(live.engine.peak_staging_bytes if live.engine else 0)
        dcp_doc = dcp_run.figures()
        link_bytes = link.total_bytes()
        return cls(times={m.name: times[i] for i, m in enumerate(measures)},
                   cpu={m.name: cpu[i].tolist() for i, m in enumerate(measures)},
                   wrong={m.name: int(wrong[i].max()) for i, m in enumerate(checked)},
                   staging=staging, dcp=dcp_doc, link_bytes=link_bytes)


def _case_doc(rig: CaseRig, fig: CaseFigures) -> dict:
    """The case's JSON (with the ratios between modes): built here only."""
    case, src_l, dst_l = rig.case, rig.src_l, rig.dst_l
    nbytes = src_l.manifest.nbytes
    t_link = _median(fig.times["link"])
    doc = {
        "name": case.name, "src": src_l.name, "dst": dst_l.name, "src_file": str(case.src), "dst_file": str(case.dst),
        "model": src_l.manifest.name, "scale": case.scale, "src_ranks": src_l.size, "dst_ranks": dst_l.size,
        "tensors": len(src_l.manifest.tensors), "bytes": nbytes, "bucket_bytes": rig.options.bucket_bytes,
        "topology": rig.topology.describe(),
        "link_limit_seconds": t_link, "link_limit_times": fig.times["link"], "link_bytes": fig.link_bytes,
        "link_limit_cpu_seconds": _median(fig.cpu["link"]), "cores": _cores(),
        "link_limit_gbps": nbytes / t_link / 1e9 if t_link else 0.0,
        "link_wire_gbps": fig.link_bytes / t_link / 1e9 if t_link else 0.0,
        "modes": _mode_docs(rig, fig, nbytes),
    }
    if "copy" in fig.times:
        t_copy = _median(fig.times["copy"])
        doc.update(copy_limit_seconds=t_copy, copy_limit_gbps=nbytes / t_copy / 1e9 if t_copy else 0.0)
    return report.add_ratios(doc)


def _mode_docs(rig: CaseRig, fig: CaseFigures, nbytes: int) -> dict[str, dict]:
    modes: dict[str, dict] = {}
    for m in rig.modes:
        sec = _median(fig.times[m])
        modes[m] = {"seconds": sec, "times": fig.times[m], "gbps": nbytes / sec / 1e9 if sec else 0.0,
                    "cpu_seconds": _median(fig.cpu[m]), "wrong": fig.wrong[m]}
        if m in fig.staging:
            plan = rig.plans[base_mode(m) if base_mode(m) in ENGINE_MODES else LIVE_MODE]
            modes[m].update(wire_bytes=plan.stats()["wire_bytes"], peak_staging_bytes=fig.staging[m])
        else:
            modes[m].update(fig.dcp)
    return modes


def _touch(shards) -> None:
    """Read every byte of these shards (brings them into cache as a trainer's last write would)."""
    for sh in shards:
        x = sh.data
        if isinstance(x, torch.Tensor) and x.numel():
            x.reshape(-1).view(torch.uint8).max()


def _cores() -> int:
    """CPU cores this process may run on (the job's processes share the machine's)."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
