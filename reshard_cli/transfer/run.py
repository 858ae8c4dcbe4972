"""`reshard run`: the launcher side and the worker that moves the weights from a source into fresh buffers.

Not under torchrun, `launch_run()` validates the layouts and the output directory, then starts one worker per
rank the layouts use (`launcher.launch`). Under torchrun, `joined()` joins the job; ranks beyond the two groups
idle. A worker's steps, each its own function below:

  1. load    — every source rank reads its shards (one error naming each failed rank, before any transfer);
               every destination rank allocates sentinel-filled buffers
  2. link    — the plan's traffic as raw send/recv: the most this backend can do for it (`--no-link-test`)
  3. move    — the reshard path, then the broadcast path, `--iters` times, each timed between barriers
  4. verify  — sources' checksums vs destinations' (and exact values when the source is synthetic)
  5. write   — rank files, then the manifest last and only when everything verified (`--out`)
  6. report  — rank 0 prints the table and returns the JSON twin

Steps 1-4 are the shared pipeline's (`transfer.pipeline`, as `reshard bench` and `Refit` run them); what is
this command's own is here: opening the source, the output directory, the table.

When the destination layout names a running engine (`engine: {kind: vllm, url: ...}`), only the source ranks
start, and the CLI hands the joined job (`joined`) to the engine's integration (`reshard_cli.engines.vllm.push`),
which moves the weights into the engine through its weight-transfer backend instead (steps 1, 3, 4 and 6 as
above, the destination side done by the engine's workers); otherwise to `work`.

`Hooks` are fixed points where tests inject faults (a rank that dies, a byte that flips), passed by the caller;
production runs with none.
"""
from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
import torch.distributed as dist

from reshard_cli.errors import ConfigError, RuntimeFailure
from reshard_cli.plan.planner import Plan
from reshard_cli.plan.schedule import TransferOptions
from reshard_cli.formats import load_pair
from reshard_cli.formats.base import checked_stage_mb
from reshard_cli.hw import nvml
from reshard_cli.layouts.topology import NO_TOPOLOGY, load_topology
from reshard_cli.base import checksums
from reshard_cli.base.text import fmt_bytes, table
from reshard_cli.transfer import launcher, pipeline, verify
from reshard_cli.transfer.dryrun import world_size
from reshard_cli.transfer.engine import Engine
from reshard_cli.transfer.launcher import JobOptions, Reported
from reshard_cli.transfer.comm import WORLD
from reshard_cli.transfer.shm import transport_name, with_transport
from reshard_cli.transfer.results import RunReport
from reshard_cli.transfer.watchdog import GroupBroken


@dataclass(kw_only=True)
class RunOptions(JobOptions):
    src: Path
    dst: Path
    mode: str = "auto"
    source: str | None = None
    out: Path | None = None
    overwrite: bool = False
    iters: int = 1
    json: Path | None = None
    link_test: bool = True
    refit_host: str | None = None  # where a running engine reaches this job's rank 0 (`engine: {url}` layouts)
    stage_mb: float | None = None  # into a running engine: what each worker stages at once (the layout's else)
    require_all: bool = False  # into a fleet: an engine that does not answer is an error (else: refit the others)

    @property
    def transfer(self) -> TransferOptions:
        """The message schedule's options: from the command line, so identical on every rank."""
        return pipeline.transfer_options(self.bucket_mb)

    def validated(self) -> "RunOptions":
        """These options, once each number a user can get wrong is refused in one line naming its flag."""
        if self.iters < 1:
            raise ConfigError("must be >= 1", key="--iters")
        if self.bucket_mb <= 0:
            raise ConfigError("must be > 0", key="--bucket-mb")
        checked_stage_mb(self.stage_mb, "--stage-mb")
        return self


class Hooks:
    """Points in the worker where tests inject faults (`work(hooks=)`, and the engine integrations' pushes).
    Production runs with none."""

    def before_transfer(self, rank: int) -> None:
        """Called on every rank after set-up, before the first transfer."""

    def after_transfer(self, rank: int, dst_shards: dict) -> None:
        """Called on every rank after the last transfer, before verification."""



# ---------------------------------------------------------------------------------------------- launcher


def launch_run(opts: RunOptions) -> None:
    """Start torchrun with as many workers as the layouts need, running this same command."""
    src, dst = load_pair(opts.src, opts.dst, scale=opts.scale)  # validate before spawning anything
    if opts.out is not None:  # refuse a non-empty output directory before starting anything
        if dst.engine_url:
            raise ConfigError("--out writes destination files; this destination is a running engine",
                              key="--out")
        from reshard_cli.io.sinks import prepare_out_dir
        prepare_out_dir(opts.out, overwrite=opts.overwrite)
    launcher.launch(world_size(src, dst), opts.argv)


# ------------------------------------------------------------------------------------------------ worker


@dataclass(frozen=True)
class Job:
    """A worker of a `reshard run` job once it joined: the plan every rank follows, this rank, the world, and
    the device it works on."""

    plan: Plan
    rank: int
    world: int
    device: torch.device


@contextmanager
def joined(opts: RunOptions) -> Iterator[Job]:
    """One rank of `reshard run`, for the block: the layouts validated on every rank (one agreed line if any
    fails), the job's process group joined (its watchdog on), the plan ready (a discovered topology's routes
    included). The caller then moves the weights: into fresh buffers (`work`), or into a running engine (the
    engine integrations above this layer) when the destination layout names one (`engine: {url}`)."""
    rank, world = launcher.rank_and_world()
    auto = opts.topology is not None and str(opts.topology) == "auto"  # discovered once the job is up

    def validate():
        src_l, dst_l = load_pair(opts.src, opts.dst, scale=opts.scale)
        launcher.check_world(world, world_size(src_l, dst_l),
                             f"the layouts use (src {src_l.ranks[0]}-{src_l.ranks[-1]}, "
                             f"dst {dst_l.ranks[0]}-{dst_l.ranks[-1]}"
                             f"{' in the engine at ' + dst_l.engine_url if dst_l.engine_url else ''})")
        if dst_l.quantization is not None and not dst_l.engine_url:  # a running engine quantizes what lands
            q = dst_l.quantization
            raise ConfigError(f"the destination is an {q.format_name} engine ({q.describe()}): reshard refits it "
                              f"running (engine: {{url}}, or the vLLM backend); writing an {q.format_name} "
                              f"checkpoint to --out is not built yet", file=dst_l.file, key="engine.quantization")
        topo = load_topology(opts.topology) if opts.topology and not auto else NO_TOPOLOGY
        plan = pipeline.ready_plan(src_l, dst_l, topo, mode=opts.mode, reshard_match=opts.reshard_match,
                                   bucket_bytes=opts.transfer.bucket_bytes)
        return plan, launcher.pick_backend(opts.backend, opts.transport)

    plan, backend = launcher.prepare(validate)
    with launcher.process_group(backend, opts.timeout) as device:
        if auto:
            plan = pipeline.with_topology(plan, _discover_topology(world))
        yield Job(plan, rank, world, device)


def work(opts: RunOptions, job: Job, hooks: Hooks | None = None) -> RunReport | None:
    """The weights moved from the source into fresh sentinel-filled buffers, verified, written (`--out`) and
    reported: rank 0 returns the report (a `RunReport`: the table, its JSON twin, whether verification failed),
    others None. `hooks`: where a test injects faults (None in production)."""
    if job.plan.dst.engine_url:
        raise ConfigError(f"the destination is a running engine ({job.plan.dst.engine_url}): its integration moves "
                          f"the weights, not fresh buffers", key="--dst")
    return _work(opts, job.plan, job.rank, job.world, job.device, hooks)


def _discover_topology(world: int):
    """--topology auto: ranks whose GPUs (or CPU host) report the same NVML domain key share a domain."""
    key = None
    with launcher.collected("discovering the topology"):
        key = nvml.rank_domain_key(nvml.discover(), int(os.environ.get("LOCAL_RANK", "0")))
    keys = WORLD.all_gather_object(key, what="discovering the topology")  # guarded while the launcher watches
    return nvml.domains_from_keys(keys)


def _work(opts: RunOptions, plan: Plan, rank: int, world: int, device: torch.device,
          hooks: Hooks | None) -> RunReport | None:
    source, src_shards, dst_shards = load(opts, plan, rank, device)
    bar = _progress_bar(opts, rank)
    comm = with_transport(WORLD, opts.transport, device)  # collective
    try:
        engine = pipeline.build_engine(plan, rank, src_shards, dst_shards, opts.transfer, device, comm=comm,
                                       progress=(lambda n: bar.update(n)) if bar else None)
        link_gbps = pipeline.LinkLimit(engine, device).best_gbps() if opts.link_test else None
        if hooks is not None:
            hooks.before_transfer(rank)
        try:
            seconds = _move(engine, plan, opts.iters, device)
        finally:
            if bar is not None:
                bar.close()
        if hooks is not None:
            hooks.after_transfer(rank, dst_shards)
        result = _verify(plan, rank, src_shards, dst_shards, source, device)  # collective: every message taken
        staging = launcher.allreduce_int(engine.peak_staging_bytes)
    finally:
        if comm is not WORLD:
            comm.close()  # a shared-memory transport's files
    if opts.out is not None:
        _write_output(opts.out, plan, rank, world, dst_shards, result)
    if source is not None:
        source.close()
    if rank != 0:
        if not result.ok:
            raise Reported("verification failed", 1)
        return None
    return _report(opts, plan, seconds, result, staging, link_gbps, world, device)


def _progress_bar(opts: RunOptions, rank: int):
    """Rank 0's progress bar on a terminal (None elsewhere, or with --quiet)."""
    if rank != 0 or opts.quiet or not sys.stderr.isatty():
        return None
    from tqdm import tqdm

    return tqdm(total=0, unit="B", unit_scale=True, desc="refit", leave=False)


def load(opts: RunOptions, plan: Plan, rank: int, device: torch.device):
    """Step 1: the source's check and this rank's shards; sentinel-filled destination buffers."""
    from reshard_cli.io import sinks, sources

    source, src_shards = None, {}
    with launcher.collected("loading the source"):
        if opts.out is not None and rank == 0:
            sinks.prepare_out_dir(opts.out, overwrite=opts.overwrite)
        if rank in plan.src.ranks:
            source = sources.open_source(opts.source if opts.source else plan.src.source, plan.src,
                                         base_dir=Path(plan.src.file).parent)
            source.check(plan.src, rank)
            src_shards = pipeline.source_shards(plan.src, rank, source, device)
    dst_shards = pipeline.destination_buffers(plan.dst, rank, device)
    return source, src_shards, dst_shards


def _move(engine: Engine, plan: Plan, iters: int, device: torch.device) -> dict[str, float]:
    """Step 3: the reshard path, then the broadcast path, each timed between barriers; the median over runs
    after the first (warm-up) of the slowest rank's time."""
    measures = [pipeline.Measure(path, fn) for path, fn in (("reshard", engine.run_reshard),
                                                            ("broadcast", engine.run_broadcast))
                if path in plan.paths]
    try:
        pipeline.rounds(measures, max(iters, 1), device, rotate=False, drop_first=False)
    except GroupBroken:  # the job's watchdog named who failed, died or stalled
        raise
    except Exception as e:  # a peer died or the network failed: name this rank and what it saw
        raise RuntimeFailure(f"rank {engine.rank}: transfer failed: {_short(e)}") from e
    return {m.name: pipeline.median(ts[1:] if len(ts) > 1 else ts)
            for m, ts in zip(measures, pipeline.slowest(measures))}


def _short(e: BaseException) -> str:
    """One readable line from a backend error (gloo's carry a source path prefix and advice)."""
    text = str(e).splitlines()[0] if str(e) else e.__class__.__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0]


@dataclass
class RankCheck:
    """What one destination rank found (gathered to every rank)."""

    rank: int
    mismatched: list  # tensors whose checksum differs from the sources'
    wrong: dict  # tensor -> elements that differ from the exact values (synthetic source only)
    checksum: int  # of everything the rank holds
    tensors: int
    bytes: int

    @property
    def ok(self) -> bool:
        return not self.mismatched and not self.wrong


@dataclass
class Verified:
    ok: bool  # every destination rank's shards are right
    ranks: list  # RankCheck per destination rank
    dst_checksums: dict  # this rank's checksum per tensor
    exact: bool  # the values were compared exactly too (a synthetic source), not only by checksum


def _verify(plan: Plan, rank: int, src_shards: dict, dst_shards: dict, source, device: torch.device) -> Verified:
    """Step 4: per (tensor, dst rank), the sources' checksum of that box vs the destination's checksum; with a
    synthetic source also every element against the value it must have."""
    from reshard_cli.io.sources import SyntheticSource

    synth = (isinstance(source, SyntheticSource), getattr(source, "seed", 0)) if source is not None else None
    actual, mismatched, extras = verify.mismatched_checksums(plan, rank, src_shards, dst_shards, synth)
    synthetic = next((x for x in extras if x is not None), None)
    exact = bool(synthetic and synthetic[0])
    wrong: dict[int, int] = {}
    if exact:
        expected = pipeline.Expected(plan.src.manifest.tensors, dst_shards, device, seed=synthetic[1], cache_bytes=0)
        wrong = expected.wrong_by_tensor({t: sh.data for t, sh in dst_shards.items()})
    mine = RankCheck(rank, mismatched, wrong, checksums.combine(actual.values()), len(actual),
                     sum(sh.data.numel() * sh.data.element_size() for sh in dst_shards.values()))
    everyone = WORLD.all_gather_object(mine if rank in plan.dst.ranks else None)
    ranks = [e for e in everyone if e is not None]
    return Verified(all(e.ok for e in ranks), ranks, actual, exact)


def _write_output(out: Path, plan: Plan, rank: int, world: int, dst_shards: dict, result: Verified) -> None:
    """Step 5: every destination rank writes its file; rank 0 writes the manifest last, only if all verified."""
    from reshard_cli.io import sinks

    man = plan.src.manifest.tensors
    entry = None
    with launcher.collected("writing the output"):
        if rank in plan.dst.ranks:
            idx = plan.dst.ranks.index(rank)
            sinks.write_rank_file(out, idx, {man[t].name: sh.data.cpu() for t, sh in dst_shards.items()})
            entry = {"index": idx, "rank": rank, "tensors": {
                man[t].name: {"shape": list(man[t].shape), "offsets": list(sh.box.offsets),
                              "local_shape": list(sh.box.sizes), "dtype": man[t].dtype,
                              "checksum": checksums.fmt(result.dst_checksums[t])}
                for t, sh in dst_shards.items()}}
    entries = WORLD.all_gather_object(entry)
    if rank == 0 and result.ok:
        sinks.write_manifest(out, sinks.build_manifest(plan.src, plan.dst, [e for e in entries if e]))


# ------------------------------------------------------------------------------------------------ report


def _report(opts, plan, seconds, result: Verified, staging, link_gbps, world, device) -> RunReport:
    """Step 6 (rank 0): the nccl-tests-like table and its JSON twin."""
    stats = plan.stats()
    paths = _path_figures(plan, stats, seconds, result)
    doc = _run_doc(opts, plan, stats, paths, result, staging, link_gbps, world, device)
    return RunReport(_run_text(opts, plan, stats, doc, result, world), doc, failed=not result.ok)


def _path_figures(plan: Plan, stats: dict, seconds: dict, result: Verified) -> dict:
    """Per path that carries tensors: its bytes, time, rates and wrong elements (+ differing checksums)."""
    wrong_by_path = {"reshard": 0, "broadcast": 0}
    mism_by_path = {"reshard": 0, "broadcast": 0}
    for e in result.ranks:
        for t, n in e.wrong.items():
            wrong_by_path[plan.paths[t]] += n
        for t in e.mismatched:
            mism_by_path[plan.paths[t]] += 1
    ps = stats["path_stats"]
    paths = {}
    for p in ("reshard", "broadcast"):
        if ps[p]["tensors"] == 0:
            continue
        sec = seconds.get(p, 0.0)
        paths[p] = {"tensors": ps[p]["tensors"], "bytes": ps[p]["bytes"], "wire_bytes": ps[p]["wire_bytes"],
                    "indomain_bytes": ps[p]["indomain_bytes"], "forwarded_bytes": ps[p]["forwarded_bytes"],
                    "seconds": sec,
                    "gbps": ps[p]["bytes"] / sec / 1e9 if sec else 0.0,
                    "wire_gbps": ps[p]["wire_bytes"] / sec / 1e9 if sec else 0.0,
                    "wrong": wrong_by_path[p] + mism_by_path[p], "checksum_mismatches": mism_by_path[p]}
    return paths


def _run_doc(opts, plan, stats, paths, result: Verified, staging, link_gbps, world, device) -> dict:
    """The JSON twin of the table (`--json`): built here only."""
    total_s = sum(v["seconds"] for v in paths.values())
    return {
        "mode": plan.mode, "src": plan.src.name, "dst": plan.dst.name, "model": plan.src.manifest.name,
        "world": world, "backend": dist.get_backend(), "transport": transport_name(opts.transport),
        "device": device.type, "iters": opts.iters, "bucket_bytes": opts.transfer.bucket_bytes,
        "seconds": total_s, "bytes": stats["bytes"], "gbps": stats["bytes"] / total_s / 1e9 if total_s else 0.0,
        "wire_bytes": stats["wire_bytes"],
        "wire_gbps": stats["wire_bytes"] / total_s / 1e9 if total_s else 0.0,
        "wrong": sum(v["wrong"] for v in paths.values()),
        "verified": "exact values + checksums" if result.exact else "checksums",
        "peak_staging_bytes": staging,
        "link_limit_gbps": link_gbps,
        "paths": paths,
        "checksums": {str(e.rank): checksums.fmt(e.checksum) for e in result.ranks},
    }


def _run_text(opts, plan, stats, doc: dict, result: Verified, world: int) -> str:
    """The nccl-tests-like table, from the JSON twin."""
    paths, link_gbps = doc["paths"], doc["link_limit_gbps"]
    rows = [[p, v["tensors"], fmt_bytes(v["bytes"]), fmt_bytes(v["wire_bytes"]), fmt_bytes(v["indomain_bytes"]),
             f"{v['seconds'] * 1e3:.1f}", f"{v['gbps']:.2f}", v["wrong"]] for p, v in paths.items()]
    rows.append(["all", stats["tensors"], fmt_bytes(stats["bytes"]), fmt_bytes(stats["wire_bytes"]),
                 fmt_bytes(stats["indomain_bytes"]), f"{doc['seconds'] * 1e3:.1f}", f"{doc['gbps']:.2f}",
                 doc["wrong"]])
    lines = [f"reshard run: {plan.src.manifest.name}  {plan.src.name} ({plan.src.size} ranks) -> {plan.dst.name} "
             f"({plan.dst.size} ranks)  mode {plan.mode}  transport {doc['transport']}  world {world}"
             f"  iters {opts.iters} (median{' after warm-up' if opts.iters > 1 else ''})",
             table(["path", "tensors", "bytes", "wire", "in-domain", "time ms", "GB/s", "#wrong"], rows)]
    if link_gbps:
        lines.append(f"  link limit {link_gbps:.2f} GB/s (raw concurrent send/recv, same pairs); refit wire rate "
                     f"{doc['wire_gbps']:.2f} GB/s = {100 * doc['wire_gbps'] / link_gbps:.0f} % of it")
    lines.append(f"  peak staging {fmt_bytes(doc['peak_staging_bytes'])} per rank "
                 f"(bucket {fmt_bytes(doc['bucket_bytes'])})")
    lines.append(f"  verified by {doc['verified']}:")
    for e in result.ranks:
        state = "ok" if e.ok else f"WRONG ({len(e.mismatched)} tensors differ, {sum(e.wrong.values())} elements)"
        lines.append(f"    rank {e.rank:>5}  {e.tensors:>6} tensors  {fmt_bytes(e.bytes):>10}  "
                     f"checksum {checksums.fmt(e.checksum)}  {state}")
    if not result.ok:
        bad = next(e for e in result.ranks if not e.ok)
        t = (bad.mismatched or list(bad.wrong))[0]
        lines.append(f"  FAILED: rank {bad.rank} tensor {plan.src.manifest.tensors[t].name} is wrong")
    return "\n".join(lines)


__all__ = ["RunOptions", "Hooks", "Job", "joined", "work", "launch_run", "load", "RunReport"]
