"""The `reshard` command line: thin Typer commands over library calls.

Every ReshardError becomes one line on stderr and its exit code (2: bad input, 1: runtime failure);
`--debug` shows the traceback instead.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path
from typing import Optional

import typer

from reshard_cli import formats
from reshard_cli.base.text import fmt_bytes, table, write_json, write_json_option
from reshard_cli.errors import ConfigError, ReshardError, RuntimeFailure
from reshard_cli.formats import derived, load_pair
from reshard_cli.hw import nvml
from reshard_cli.layouts.models import not_refit
from reshard_cli.plan.cost import plan_prediction, with_auto_routes
from reshard_cli.plan.groups import stage_groups, staging
from reshard_cli.plan.fleet import fleet_figures, fleet_of, loss_figures
from reshard_cli.plan.fp8 import fp8_figures, on_wire
from reshard_cli.plan.planner import Plan, no_gc
from reshard_cli.report import plan_text, write_pieces
from reshard_cli.transfer import dryrun

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Refit LLM weights between trainer and inference layouts, moving only the bytes each rank needs.")

_state = {"debug": False}


@app.callback()
def _root(debug: bool = typer.Option(False, "--debug", help="Show tracebacks instead of one-line errors.")):
    _state["debug"] = debug


SrcOpt = typer.Option(..., "--src", help="Trainer (source) layout: a YAML path or a bundled name "
                                        "(e.g. deepseek-v3/megatron-pp16-ep16, demo/train).")
DstOpt = typer.Option(..., "--dst", help="Inference (destination) layout: a YAML path or a bundled name.")
TopoOpt = typer.Option(None, "--topology", help="Topology YAML or bundled name (dgx-h100, gb200-nvl72): which "
                                                "ranks share an NVLink domain.")
ModeOpt = typer.Option("auto", "--mode", help="auto | reshard | broadcast | hybrid. auto: per tensor class, the "
                                               "route the cost model predicts cheapest from the topology's links "
                                               "(reshard with or without in-domain forwarding, or broadcast; "
                                               "reshard with forwarding without link figures); hybrid: FFN/expert "
                                               "weights by reshard, the rest by broadcast.")
MatchOpt = typer.Option(None, "--reshard-match", help="Regex of tensors that take the reshard path in hybrid mode.")
TransportOpt = typer.Option("auto", "--transport", help="auto | gloo | nccl | shm: what carries the messages (shm: "
                            "shared memory between ranks of one host, the backend between hosts; auto: the backend).")
ScaleOpt = typer.Option(1, "--scale", min=1, help="Grow a bundled model's FFN/expert widths N-fold (benchmarks).")


@app.command()
def plan(
    src: Path = SrcOpt,
    dst: Path = DstOpt,
    topology: Optional[Path] = TopoOpt,
    mode: str = ModeOpt,
    reshard_match: Optional[str] = MatchOpt,
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the summary figures as JSON (with --rank: "
                                            "that rank's pieces and broadcasts)."),
    pieces_out: Optional[Path] = typer.Option(None, "--pieces", help="Stream every piece and broadcast to this file "
                                              "as JSON Lines (.gz: compressed)."),
    rank: Optional[int] = typer.Option(None, "--rank", help="Show only what this global rank sends and receives."),
    replicas: Optional[int] = typer.Option(None, "--replicas", help="Refit N replicas of the dst layout's replica "
                                           "(its mesh without dp; the dp of its mesh set to N), and print what "
                                           "losing one of them mid-refit costs (N >= 2)."),
    scale: int = ScaleOpt,
):
    """Show what a refit between two layouts moves, and what it costs, before any GPU is touched."""
    with no_gc():  # millions of small acyclic objects: the collector's full passes would only cost time
        _plan(src, dst, topology, mode, reshard_match, json_out, pieces_out, rank, scale, replicas)


def _plan(src, dst, topology, mode, reshard_match, json_out, pieces_out, rank, scale, replicas=None) -> None:
    t0 = time.perf_counter()
    if replicas is not None and replicas < 1:
        raise ConfigError(f"a fleet has at least one replica, not {replicas}", key="--replicas")
    p = Plan.build(src, dst, topology=topology, mode=mode, reshard_match=reshard_match, scale=scale)
    given = p.dst
    if replicas is not None:  # the dst layout's replica, `replicas` times
        p = Plan(p.src, _replicated(p.src, given, replicas, scale), p.topology, mode=p.mode,
                 reshard_match=p.reshard_match, bucket_bytes=p.bucket_bytes)
    t_layout = time.perf_counter() - t0
    if rank is not None:
        _plan_rank(p, rank, json_out, pieces_out)
        return
    t1 = time.perf_counter()
    p = with_auto_routes(p)  # mode auto: the cost model chooses each class's route
    stats = on_wire(p)  # into a block-FP8 engine: the bytes that travel, the source dtype's as bf16_<key>
    stats["plan_seconds"] = time.perf_counter() - t1  # planning, auto's choice included
    stats["layout_seconds"] = t_layout
    trainer, engine = formats.summary(p.src), formats.summary(p.dst)
    if trainer is not None:  # the bytes are read from the trainer's own tensors
        stats["trainer"] = trainer
    if engine is not None:  # the bytes land in the engine's own tensors: what one rank's storage looks like
        stats["engine"] = engine
    stage = staging(p.dst)
    if stage is not None:  # what an update stages per worker beside the engine's kernels
        stats["staging"] = stage
    fleet = fleet_of(p.dst)
    if fleet.replicas > 1:  # one refit of every replica, beside one refit per replica
        stats["fleet"] = fleet_figures(p, fleet, stats)
        if replicas is not None:  # and what losing one of them mid-refit costs: the survivors' plan, by group
            survivors = _replicated(p.src, given, fleet.replicas - 1, scale)
            stats["fleet"]["loss"] = loss_figures(p, survivors, stage_groups(p.dst), stage_groups(survivors))
    fp8 = fp8_figures(p, stats)
    if fp8 is not None:  # an FP8 engine: where its blocks are quantized, the wire beside a BF16 refit's
        stats["fp8"] = fp8
    stats["plan_seconds"] = time.perf_counter() - t1  # with the figures above
    stats["not_refit"] = not_refit(p.src.manifest.config)  # a checkpoint's MTP layers, named: never dropped silently
    typer.echo(plan_text(stats))
    cost_text, cost_doc = plan_prediction(p)
    if cost_text:
        typer.echo(cost_text)
    stats.update(cost_doc)
    if json_out:  # the summary: its size does not grow with the number of pieces
        write_json_option("--json", json_out, stats)
        typer.echo(f"  wrote {json_out}")
    if pieces_out:
        n = write_pieces(pieces_out, p, p.pieces(), p.bcasts())
        typer.echo(f"  wrote {pieces_out} ({n} lines)")


def _plan_rank(p, rank: int, json_out, pieces_out) -> None:
    """`reshard plan --rank`: one rank's pieces and broadcasts (what that rank would build for itself)."""
    if rank not in p.src.ranks and rank not in p.dst.ranks:
        raise ConfigError(f"rank {rank} is in neither group (src {p.src.ranks[0]}-{p.src.ranks[-1]}, "
                          f"dst {p.dst.ranks[0]}-{p.dst.ranks[-1]})", key="--rank")
    t1 = time.perf_counter()
    p = with_auto_routes(p)  # mode auto: the cost model chooses each class's route
    view = p.rank_view(rank)
    dt = time.perf_counter() - t1
    names = p.src.manifest.tensors
    rows = [[names[pc.tensor].name, pc.src, pc.dst, str(pc.box), "fwd" if pc.phase else "net",
             fmt_bytes(_piece_bytes(p, pc))] for pc in view.pieces]
    typer.echo(f"rank {rank}: {len(view.pieces)} pieces, {len(view.bcasts)} broadcasts (planned in {dt * 1e3:.1f} ms)")
    if rows:
        typer.echo(table(["tensor", "src", "dst", "box", "phase", "bytes"], rows[:200]))
        if len(rows) > 200:
            typer.echo(f"  ... {len(rows) - 200} more (use --json)")
    if json_out:
        write_json_option("--json", json_out, {"rank": rank, "plan_seconds": dt,
                                               "pieces": [_piece_json(p, pc) for pc in view.pieces],
                                               "broadcasts": [_bcast_json(p, b) for b in view.bcasts]})
    if pieces_out:
        n = write_pieces(pieces_out, p, view.pieces, view.bcasts)
        typer.echo(f"  wrote {pieces_out} ({n} lines)")


def _replicated(src, dst, replicas: int, scale: int):
    """`dst`'s replica `replicas` times, its ranks after `src`'s (`formats.with_replicas`); a layout whose replica
    cannot be told is an error naming --replicas."""
    try:
        out = formats.with_replicas(dst, replicas, after=src, scale=scale)
    except ConfigError as e:
        raise ConfigError(f"cannot make {replicas} replica(s) of {dst.name}: {e}", key="--replicas") from None
    got = fleet_of(out)
    if got.replicas != replicas:  # the replicas `reshard plan` reports must be the ones asked for
        raise ConfigError(f"{dst.name} as {replicas} replica(s) reads as {got.replicas} replica(s) of "
                          f"{got.per_replica} ranks", key="--replicas")
    return out


def _piece_bytes(p, pc) -> int:
    """A piece's bytes as they travel (into a block-FP8 engine: FP8 and scales of its whole blocks)."""
    return sum(p.wire.payload(pc.tensor, b) for b in p.wire.parts(pc.tensor, pc.box))


def _piece_json(p, pc) -> dict:
    return {"tensor": p.src.manifest.tensors[pc.tensor].name, "src": pc.src, "dst": pc.dst,
            "offsets": list(pc.box.offsets), "sizes": list(pc.box.sizes), "phase": pc.phase}


def _bcast_json(p, b) -> dict:
    return {"tensor": p.src.manifest.tensors[b.tensor].name, "root": b.root,
            "gather": [{"src": s, "offsets": list(a.offsets), "sizes": list(a.sizes)} for s, a in b.gather],
            "receivers": list(b.receivers)}


@app.command()
def run(
    ctx: typer.Context,
    src: Path = SrcOpt,
    dst: Path = DstOpt,
    topology: Optional[Path] = TopoOpt,
    mode: str = ModeOpt,
    reshard_match: Optional[str] = MatchOpt,
    backend: str = typer.Option("auto", "--backend", help="auto | gloo | nccl (auto: nccl when every rank has a GPU)."),
    transport: str = TransportOpt,
    bucket_mb: float = typer.Option(64.0, "--bucket-mb", help="Staging memory per rank for packed buckets (MiB)."),
    source: Optional[str] = typer.Option(None, "--source", help="Override the src layout's source: synthetic | "
                                         "safetensors:PATH | shards:PATH | dcp:PATH | megatron:PATH "
                                         "(a Megatron torch_dist checkpoint)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Write one safetensors file per destination rank here."),
    overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output directory's files."),
    iters: int = typer.Option(1, "--iters", help="Repeat the refit; the first is warm-up, the median is reported."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the report as JSON."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress bar."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds before a stuck rank makes every rank fail."),
    link_test: bool = typer.Option(True, "--link-test/--no-link-test", help="Measure raw send/recv first."),
    refit_host: Optional[str] = typer.Option(None, "--refit-host", help="Into a running engine (`engine: {url}`): "
                                             "the address its workers reach this job's rank 0 at (default: "
                                             "MASTER_ADDR)."),
    stage_mb: Optional[float] = typer.Option(None, "--stage-mb", help="Into a running engine: checkpoint-format "
                                             "MiB each worker stages at once, whole layers (0: the whole model; "
                                             "default: the layout's engine.stage_mb, else 1024)."),
    require_all: bool = typer.Option(False, "--require-all", help="Into a fleet (`engine: {url: [...]}`): every "
                                     "engine must answer and none may be lost mid-refit (default: refit the ones "
                                     "that do, name the others, and finish the step on the survivors)."),
    scale: int = ScaleOpt,
    dry_run: bool = typer.Option(False, "--dry-run", help="Print the launch commands and the rank -> node -> "
                                 "group -> mesh -> domain map, start nothing."),
):
    """Move the weights: starts torchrun itself, or runs as one of its workers."""
    if dry_run:  # before torch is imported: a laptop checks a 256-GPU job in a second
        typer.echo(dryrun.dry_run(dryrun.LaunchOptions(src=src, dst=dst, topology=topology, scale=scale,
                                                       argv=sys.argv[1:])))
        return
    from reshard_cli.transfer import run as run_mod
    from reshard_cli.transfer.launcher import under_torchrun

    opts = run_mod.RunOptions(src=src, dst=dst, topology=topology, mode=mode, reshard_match=reshard_match,
                              backend=backend, transport=transport, bucket_mb=bucket_mb, source=source, out=out,
                              overwrite=overwrite,
                              iters=iters, json=json_out, quiet=quiet, timeout=timeout, link_test=link_test,
                              refit_host=refit_host, stage_mb=stage_mb, require_all=require_all, scale=scale,
                              argv=sys.argv[1:]).validated()
    if not under_torchrun():
        run_mod.launch_run(opts)
        return
    _run_worker(opts, json_out, (ctx.obj or {}).get("hooks"))  # hooks: faults a test injects (tests/faults.py)


def _run_worker(opts, json_out: Optional[Path], hooks) -> None:
    """One torchrun worker of `reshard run`: it joins the job, then pushes into a running engine or moves the
    weights into fresh buffers; rank 0 prints the report."""
    from reshard_cli.transfer import run as run_mod

    with run_mod.joined(opts) as job:
        if job.plan.dst.engine_url:  # into a running engine, through its weight-transfer backend
            from reshard_cli.engines.vllm.push import push  # torch and vLLM's names: only once a worker runs

            report = push(opts, job, hooks)
        else:
            report = run_mod.work(opts, job, hooks)
    if report is None:  # not rank 0
        return
    typer.echo(report.text)
    if json_out:
        write_json_option("--json", json_out, report.doc)
    if report.failed:
        raise RuntimeFailure("verification failed: some destination shards are wrong (see the table above)")


@app.command()
def check(
    src: Path = SrcOpt,
    dst: Path = DstOpt,
    out: Path = typer.Option(..., "--out", help="The output directory of `reshard run --out`."),
    source: Optional[str] = typer.Option(None, "--source", help="Override the src layout's source: synthetic | "
                                         "safetensors:PATH | shards:PATH | dcp:PATH | megatron:PATH "
                                         "(a Megatron torch_dist checkpoint)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the result as JSON."),
    scale: int = ScaleOpt,
):
    """Check an output directory against its source, element by element, without torchrun."""
    from reshard_cli.io.check import check_output

    src_l, dst_l = load_pair(src, dst, scale=scale)
    result = check_output(src_l, dst_l, out, source)
    typer.echo(result.text())
    if json_out:
        write_json_option("--json", json_out, result.to_json())
    if not result.ok:
        bad = sorted({p.rank for p in result.problems if p.rank is not None})
        where = f" on rank{'s' if len(bad) != 1 else ''} {', '.join(map(str, bad[:8]))}" if bad else ""
        raise RuntimeFailure(f"check failed: {len(result.problems)} problem{'s' if len(result.problems) != 1 else ''}"
                             f"{where} (see above)")


@app.command()
def derive(
    dst: Path = DstOpt,
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write what was derived as JSON."),
):
    """Learn where vLLM keeps a model it has no hand rules for, from vLLM's own loaders (needs vLLM), and
    cache it: planning and refitting that layout then need no vLLM (`formats.derived`)."""
    layout = formats.load_layout(dst)
    if layout.format != "vllm":
        raise ConfigError(f"`reshard derive` learns vLLM's storage; this layout has format: {layout.format}",
                          file=str(dst), key="format")
    if derived.known(layout):
        typer.echo(f"{layout.manifest.config.get('model_type')}: placed by reshard's hand rules for vLLM (checked "
                   f"against vLLM's loaders in the tests); nothing to derive")
        return
    m = derived.map_of(layout)
    ranks = [get_summary(layout, r) for r in layout.ranks[: len(m["ranks"])]]  # (dp x tp where experts span dp)
    grid = derived.grid_name(m["tp"], m.get("dp", 1), m.get("pp", 1))
    typer.echo(f"{layout.manifest.config.get('model_type')} at {grid}: vLLM "
               f"{m['vllm']}'s loaders place every "
               f"checkpoint tensor ({m.get('seconds', 0):.1f} s to derive; cached in {derived.cache_dir()})")
    typer.echo(table(["rank", "engine tensors", "written in place", "staged", "staged tensors"],
                     [[s["rank"], s["engine_tensors"], fmt_bytes(s["direct_bytes"]), fmt_bytes(s["staged_bytes"]),
                       s["staged_tensors"]] for s in ranks]))
    if json_out:
        write_json_option("--json", json_out, {"model_type": layout.manifest.config.get("model_type"), "tp": m["tp"],
                                               "dp": m.get("dp", 1), "pp": m.get("pp", 1), "vllm": m["vllm"],
                                               "seconds": m.get("seconds"), "ranks": ranks})


def get_summary(layout, rank: int) -> dict:
    return formats.get(layout.format).summary(layout, rank)


@app.command()
def topo(
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write the discovery (and bandwidths) as JSON."),
    yaml_out: Optional[Path] = typer.Option(None, "--yaml", help="Write the topology YAML that plan/run --topology take."),
    ranks_per_node: Optional[int] = typer.Option(None, "--ranks-per-node", min=1,
                                                 help="Local ranks per host for --yaml (default: one per GPU; "
                                                      "without GPUs, each rank alone)."),
    bandwidth: bool = typer.Option(False, "--bandwidth", help="Measure copy and process-to-process bandwidth."),
    bandwidth_mb: int = typer.Option(256, "--bandwidth-mb", min=1, help="Buffer size for --bandwidth (MiB)."),
):
    """Show this host's GPUs and NVLink domains (NVML); under torchrun, every host of the job."""
    import yaml

    def write(path: Path, fn) -> None:
        try:
            fn(path)
        except OSError as e:
            raise ConfigError(f"cannot write {path}: {e.strerror or e}") from None

    from reshard_cli.transfer.launcher import under_torchrun
    if under_torchrun():
        from reshard_cli.hw.bandwidth import job_topology
        job = job_topology(bandwidth=bandwidth, mb=bandwidth_mb)
        if job is None:  # not rank 0
            return
        typer.echo(job.text)
        if json_out:
            write(json_out, lambda p: write_json(p, job.doc))
        if yaml_out:
            write(yaml_out, lambda p: p.write_text(yaml.safe_dump(job.topology.to_yaml_dict(), sort_keys=False)))
        return
    d = nvml.discover()
    typer.echo(nvml.topo_text(d), nl=False)
    doc = nvml.to_json(d)
    if bandwidth:
        from reshard_cli.hw.bandwidth import bandwidth_table, measure
        rows = measure(mb=bandwidth_mb)
        typer.echo(bandwidth_table(rows))
        doc["bandwidth"] = rows
    if json_out:
        write(json_out, lambda p: write_json(p, doc))
        typer.echo(f"wrote {json_out}")
    if yaml_out:
        topology = nvml.to_topology(d, ranks_per_node=ranks_per_node)
        write(yaml_out, lambda p: p.write_text(yaml.safe_dump(topology.to_yaml_dict(), sort_keys=False)))
        typer.echo(f"wrote {yaml_out} ({topology.describe()})")


@app.command()
def bench(
    src: Optional[Path] = typer.Option(None, "--src", help="Trainer (source) layout YAML."),
    dst: Optional[Path] = typer.Option(None, "--dst", help="Inference (destination) layout YAML."),
    suite: Optional[str] = typer.Option(None, "--suite", help="A bundled suite (cpu) or a suite YAML, instead of --src/--dst."),
    iters: int = typer.Option(5, "--iters", help="Timed runs per measurement after one warm-up; the median is reported."),
    sizes: Optional[str] = typer.Option(None, "--sizes", help="Size sweep: --scale factors, e.g. 1,2,4,8."),
    topology: Optional[Path] = TopoOpt,
    reshard_match: Optional[str] = MatchOpt,
    backend: str = typer.Option("auto", "--backend", help="auto | gloo | nccl."),
    transport: str = typer.Option("auto", "--transport", help="auto | gloo | nccl | shm (shm: every engine mode "
                                  "and the live API also over shared memory, beside the backend's own)."),
    bucket_mb: float = typer.Option(64.0, "--bucket-mb", help="Staging memory per rank for packed buckets (MiB)."),
    json_out: Optional[Path] = typer.Option(None, "--json", help="Write every figure as JSON."),
    plot: Optional[Path] = typer.Option(None, "--plot", help="Write a PNG of time and GB/s per mode (needs matplotlib)."),
    plan_scaling: bool = typer.Option(True, "--plan-scaling/--no-plan-scaling", help="Also time planning at scale."),
    quiet: bool = typer.Option(False, "--quiet", help="No progress lines."),
    timeout: float = typer.Option(300.0, "--timeout", help="Seconds before a stuck rank makes every rank fail."),
    dcp_dir: Optional[Path] = typer.Option(None, "--dcp-dir", help="Where DCP checkpoints go (shared by all nodes)."),
    scale: int = ScaleOpt,
):
    """Time link limit, auto, reshard, hybrid, broadcast, the live API and torch.distributed.checkpoint on the same processes."""
    from reshard_cli import bench as bench_mod

    bench_mod.main(bench_mod.BenchOptions(
        src=src, dst=dst, suite=suite, iters=iters, sizes=sizes, scale=scale, topology=topology,
        reshard_match=reshard_match, backend=backend, transport=transport, bucket_mb=bucket_mb, json=json_out, plot=plot,
        plan_scaling=plan_scaling, quiet=quiet, timeout=timeout, dcp_dir=dcp_dir, argv=sys.argv[1:]))


def dist_initialized() -> bool:
    """Whether this process joined a torch.distributed group (torch is already imported when it did)."""
    dist = sys.modules.get("torch.distributed")
    return bool(dist is not None and dist.is_available() and dist.is_initialized())


def main(obj: dict | None = None) -> None:
    """Console entry point: one-line errors, exit codes 2 (bad input) / 1 (runtime failure). `obj`: the
    commands' context object (Click's), where a test's entry point hands `reshard run` its fault hooks."""
    debug = "--debug" in sys.argv[1:]
    try:
        app(obj=obj)
    except ReshardError as e:
        if debug:  # the traceback, but still the error's exit code (2 = bad input)
            import traceback

            traceback.print_exc()
            sys.exit(e.exit_code)
        if not e.quiet:
            typer.echo(f"reshard: error: {e}", err=True)
        broken = getattr(e, "group_broken", False)  # a helper thread may still wait on the dead group
        if (broken or e.exit_code == 2) and "RANK" in os.environ and dist_initialized():
            from reshard_cli.transfer.launcher import leave  # torch: only torchrun workers get here

            leave(e.exit_code, printer=not e.quiet)  # the printer first, then the others (os._exit)
        if broken:  # not joined: os._exit
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.exit_code)
        sys.exit(e.exit_code)
    except KeyboardInterrupt:
        typer.echo("reshard: interrupted", err=True)
        sys.exit(130)
    except Exception as e:  # a bug: still one line unless --debug
        if debug:
            raise
        typer.echo(f"reshard: internal error: {e.__class__.__name__}: {e} (run with --debug for the traceback)",
                   err=True)
        sys.exit(1)


if __name__ == "__main__":
    main()
