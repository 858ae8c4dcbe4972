"""`reshard run` into a running `vllm serve`: the job's ranks are the sources, the engine's workers the
destination, joined through the `reshard` weight-transfer backend (`trainer`, over vLLM's HTTP client)."""
from __future__ import annotations

import os
import statistics
from dataclasses import replace

import torch.distributed as dist

from reshard_cli.base import checksums
from reshard_cli.base.ports import free_port
from reshard_cli.base.text import fmt_bytes, table
from reshard_cli.engines.fleet.handshake import layouts
from reshard_cli.engines.fleet.replicas import fleet_layout
from reshard_cli.engines.vllm.clients import check_fleet, http_client, portable_layout
from reshard_cli.layouts import bundled
from reshard_cli.plan.fp8 import fp8_figures
from reshard_cli.plan.planner import Plan
from reshard_cli.transfer import launcher
from reshard_cli.transfer.pipeline import ready_plan
from reshard_cli.transfer.results import RunReport
from reshard_cli.transfer.run import Hooks, Job, RunOptions, load


TELL_SECONDS = 10.0  # how long `reshard run` waits for a dropped member that has not answered, to tell it what
# it holds, before it exits


def push(opts: RunOptions, job: Job, hooks: Hooks | None = None) -> RunReport | None:
    """Into a running `vllm serve` (`engine: {url}` in the destination layout), for a joined `reshard run` job
    (`transfer.run.joined`): this job's ranks are the sources; the engine's workers join a refit group with them
    through the `reshard` weight-transfer backend (rank 0 drives vLLM's HTTP routes), and every piece lands in
    the engine's own storage. Verified by the checksums the workers compute of what they hold against the
    sources'. `hooks`: where a test injects faults."""
    plan, rank, world, device = job.plan, job.rank, job.world, job.device
    url = plan.dst.engine_url
    source, src_shards, _ = load(opts, plan, rank, device)
    counts, down = [], {}
    src_text, dst_text = portable_layout(plan.src.file), portable_layout(plan.dst.file)
    with launcher.collected("reaching the engine"):
        if rank == 0:
            counts, down = check_fleet(plan.dst.engine_urls, plan.dst, timeout=min(opts.timeout, 30.0),
                                       require_all=opts.require_all)
            if down:  # the fleet is the engines that answer: the layout's replica with as many members
                members = [u for u, n in zip(plan.dst.engine_urls, counts) if n is not None]
                dst_text = fleet_layout(dst_text, members, sum(n for n in counts if n is not None))
    # vLLM only once the engine answered (importing it prints to stderr)
    from reshard_cli.engines.vllm.trainer import ReshardSource, ReshardTrainerEngine, ReshardTrainerInitInfo

    shared = [(free_port(), dst_text, down) if rank == 0 else None]
    dist.broadcast_object_list(shared, 0)
    port, dst_text, down = shared[0]
    if down:  # what this refit moves: into the members only
        src_l, dst_l = layouts(src_text, dst_text)
        plan = ready_plan(replace(src_l, file=plan.src.file, name=plan.src.name),
                          replace(dst_l, file=plan.dst.file, name=plan.dst.name), plan.topology, mode=plan.mode,
                          reshard_match=plan.reshard_match, bucket_bytes=plan.bucket_bytes)
        url = dst_l.engine_url
    man = plan.src.manifest.tensors
    tensors = {man[t].name: sh.data for t, sh in src_shards.items()}
    info = ReshardTrainerInitInfo(
        host=opts.refit_host or os.environ.get("MASTER_ADDR", "127.0.0.1"), port=port, rank=rank,
        src=src_text, dst=dst_text,
        timeout=opts.timeout, bucket_mb=opts.bucket_mb, stage_mb=opts.stage_mb,
        topology=topology_text(opts.topology), mode=opts.mode,
        on_member_fault="fail" if opts.require_all else "drop")  # a member lost mid-refit: dropped, or the error
    clients = []
    for u, n in zip(plan.dst.engine_urls, [n for n in counts if n is not None]):  # rank 0: one client per
        clients.append(http_client(u, opts.timeout))  # engine that answered, with its replicas
        clients[-1].replicas = n
    with launcher.collected("starting the engine's refit"):
        engine = ReshardTrainerEngine.trainer_init(info, client=clients or None,
                                                   source=ReshardSource(lambda: tensors))
    reports = []
    if hooks is not None:
        hooks.before_transfer(rank)
    with launcher.collected("pushing into the engine"):
        for _ in range(max(opts.iters, 1)):
            reports.append(engine.send_weights())
    if rank == 0 and not engine.settle(timeout=min(opts.timeout, TELL_SECONDS)):  # dropped members that did not
        reports[-1]["untold"] = True  # answer yet are told on threads this process does not outlive
    reports[-1]["told"] = [e for e in engine.events if e["event"] in ("told", "not told")]
    engine.shutdown()
    if source is not None:
        source.close()
    if rank != 0:
        return None
    return engine_report(opts, plan, url, reports, world, down)


def topology_text(topology) -> str:
    """`--topology` for the engine's side of the refit: `auto` (discovered on every rank), else the file's YAML
    text (a bundled name resolved here), "" without one."""
    if topology is None:
        return ""
    if str(topology) == "auto":
        return "auto"
    return bundled.resolve("topology", topology).read_text()


def _members_lost(doc: dict, reports: list[dict], down: dict | None) -> list[str]:
    """`engine_report`'s lines (and JSON keys, into `doc`) for fleet members down at the start and members
    dropped mid-refit (the others resumed among themselves from the group that failed), and what each dropped
    member was told it holds."""
    lines, last = [], reports[-1]
    if down:
        doc["down"] = dict(down)
        lines.append(f"  not refitted, down at the start: {'; '.join(down.values())} (--require-all makes it an error)")
    dropped = [d for r in reports for d in r.get("dropped", ())]
    if dropped:
        doc["dropped"] = dropped
        doc["members"] = last["members"]
        resent = sum(r.get("resent_bytes", 0) for r in reports)
        lines.append(f"  dropped mid-refit: {'; '.join(d['why'] for d in dropped)}; the other member(s) resumed "
                     f"from the group that failed and re-sent {fmt_bytes(resent)} (--require-all makes it an error)")
        doc["told"] = last.get("told", [])
        told = [f"{e['member']} labelled {e['weight_version']}" + (", paused" if e["paused"] else "")
                for e in doc["told"] if e["event"] == "told"]
        lines.append("  told what they hold: " + ("; ".join(told) or "none") + (
            "; a member that had not answered is labelled when added again (its session is finished then)"
            if last.get("untold") else ""))
    return lines


def _worker_line(w: dict) -> str:
    """One worker's line of `engine_report`: what landed and was forwarded, its checksum and staging peak."""
    return (f"    replica {w.get('replica', 0):>3}  worker rank {w['worker']:>4}  "
            f"{fmt_bytes(w['bytes_received']):>10} landed  {fmt_bytes(w.get('forwarded_bytes', 0)):>10} "
            f"forwarded  checksum {checksums.fmt(w['checksum']) if w.get('checksum') is not None else '-'}  "
            f"{'ok' if w.get('checksums_ok') else 'WRONG'}  staged at most "
            f"{fmt_bytes(w.get('peak_staged_bytes') or 0)}")


def _fp8_lines(doc: dict, plan: Plan, stats: dict) -> list[str]:
    """`engine_report`'s line (and JSON key, into `doc`) for an FP8 engine: where its blocks were quantized."""
    fp8 = fp8_figures(plan, stats)
    if fp8 is not None:
        doc["fp8"] = {k: fp8[k] for k in ("scheme", "sender_share", "sender_quantized_bytes",
                                          "receiver_quantized_bytes", "unquantized_bytes", "wire_bytes",
                                          "bf16_wire_bytes")}
        where = ("whole blocks quantized by the trainer, cut blocks in BF16 quantized by the workers" if fp8["block"]
                 else "BF16, quantized by the workers with the maximum every rank agreed")
        return [f"  fp8 engine ({fp8['scheme']}): {where}; the plan's wire {fmt_bytes(fp8['wire_bytes'])}, "
                f"a BF16 engine's {fmt_bytes(fp8['bf16_wire_bytes'])}"]
    return []


def engine_report(opts: RunOptions, plan: Plan, url: str, reports: list[dict], world: int,
                  down: dict | None = None) -> RunReport:
    """Rank 0's table for a push into a running engine (or a fleet of them), and its JSON twin."""
    timed = reports[1:] if len(reports) > 1 else reports
    seconds = statistics.median(r["seconds"] for r in timed)
    last = reports[-1]
    workers, replicas, fleet = last["workers"], last["replicas"], last.get("fleet") or {}
    landed = last["landed_bytes"]
    direct = sum(w["direct_bytes"] for w in workers)
    repacked = sum(w.get("processed_bytes", 0) for w in workers)
    peak = max((w.get("peak_staged_bytes") or 0 for w in workers), default=0)
    groups = last["trainer"].get("groups", 1)
    ok = all(r["trainer"]["checksums_ok"] for r in reports) and all(w.get("checksums_ok") for w in workers)
    stats = plan.stats()
    doc = {"mode": fleet.get("mode", plan.mode), "src": plan.src.name, "dst": plan.dst.name, "engine": url,
           "model": plan.src.manifest.name, "world": world + plan.dst.size, "iters": opts.iters,
           "seconds": seconds, "bytes": stats["bytes"], "wire_bytes": last["wire_bytes"],
           "wire_gbps": last["wire_bytes"] / seconds / 1e9 if seconds else 0.0,
           "forwarded_bytes": last["forwarded_bytes"], "landed_bytes": landed,
           "direct_bytes": direct, "direct_bytes_fraction": direct / landed if landed else 1.0,
           "engine_repacked_bytes": repacked, "staging_groups": groups, "peak_staged_bytes": peak,
           "weight_version": last.get("weight_version"), "verified": "checksums", "ok": ok,
           "replicas_identical": last["replicas_identical"], "fleet": fleet, "replicas": replicas,
           "workers": [{k: v for k, v in w.items() if k != "error"} for w in workers]}
    rows = [[doc["mode"], stats["tensors"], fmt_bytes(stats["bytes"]), fmt_bytes(doc["wire_bytes"]),
             fmt_bytes(doc["forwarded_bytes"]), f"{seconds * 1e3:.1f}", f"{doc['wire_gbps']:.2f}",
             0 if ok else "checksums differ"]]
    lines = [f"reshard run: {plan.src.manifest.name}  {plan.src.name} ({plan.src.size} ranks) -> vllm serve at {url} "
             f"({plan.dst.size} workers in {len(replicas)} replica(s), {plan.dst.name})  mode {doc['mode']}  "
             f"iters {opts.iters}{' (median after warm-up)' if opts.iters > 1 else ''}",
             table(["path", "tensors", "bytes", "wire", "forwarded", "time ms", "GB/s", "#wrong"], rows)]
    lines += _members_lost(doc, reports, down)
    doc["not_refit"] = sorted({line for w in workers for line in w.get("not_refit") or ()})
    lines += [f"  not refit: {line}" for line in doc["not_refit"]]  # the engine's speculative draft, named
    lines += _fp8_lines(doc, plan, stats)
    if fleet:
        lines.append(f"  fleet: {fleet['replicas']} replica(s) x {fleet['workers_per_replica']} worker(s); the trainer "
                     f"sent {fmt_bytes(doc['wire_bytes'])} (plan {fmt_bytes(fleet['wire_bytes'])}, minimum "
                     f"{fmt_bytes(fleet['min_wire_bytes'])}), the workers forwarded {fmt_bytes(doc['forwarded_bytes'])} "
                     f"(plan {fmt_bytes(fleet['forwarded_bytes'])}); one refit per replica would send "
                     f"{fmt_bytes(fleet['separate_refits_wire_bytes'])}, gather->broadcast "
                     f"{fmt_bytes(fleet['broadcast_wire_bytes'])}")
    lines += [f"  into engine storage: {fmt_bytes(direct)} of {fmt_bytes(landed)} landed bytes in place "
              f"({100 * doc['direct_bytes_fraction']:.0f} %); vLLM then repacked {fmt_bytes(repacked)} into its "
              f"kernels' format",
              f"  staged in {groups} group(s) of whole layers, each committed once every worker had it: at most "
              f"{fmt_bytes(peak)} in checkpoint format at once on one worker",
              "  verified by checksums the workers computed of what they hold:"]
    lines += [_worker_line(w) for w in workers]
    if len(replicas) > 1:
        lines.append(f"  replicas {'identical' if doc['replicas_identical'] else 'DIFFER'} (checksums, worker by worker)")
    if not ok:
        lines.append("  FAILED: the engine's weights differ from the source")
    return RunReport("\n".join(lines), doc, failed=not ok)
