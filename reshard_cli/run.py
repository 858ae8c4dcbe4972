"""`reshard run`: the worker that moves the weights, and the launcher that starts the workers.

Not under torchrun: `launch()` works out the world size from the two layouts and runs torchrun
(`--standalone`) in this process, so its agent forwards Ctrl-C/SIGTERM to the workers and stops them all when
one fails. Under torchrun (RANK/WORLD_SIZE set): `worker()` joins the job; ranks beyond the two groups idle.
"""
from __future__ import annotations

import os
import statistics
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from reshard_cli.errors import ConfigError, ReshardError, RuntimeFailure
from reshard_cli.layout import load_pair
from reshard_cli.plan import DEFAULT_RESHARD_MATCH, Plan
from reshard_cli.topo import NO_TOPOLOGY, load_topology
from reshard_cli.transport import Engine, Shard
from reshard_cli import verify

SENTINEL_BYTE = 0xA5  # destination buffers start as this pattern: a region never written cannot pass


@dataclass
class RunOptions:
    src: Path
    dst: Path
    topology: Path | None = None
    mode: str = "hybrid"
    reshard_match: str | None = None
    backend: str = "auto"
    bucket_mb: float = 64.0
    source: str | None = None
    out: Path | None = None
    overwrite: bool = False
    iters: int = 1
    json: Path | None = None
    quiet: bool = False
    timeout: float = 300.0
    link_test: bool = True
    scale: int = 1
    argv: list = field(default_factory=list)


class Reported(ReshardError):
    """An error that another process prints (worker rank 0, or the worker itself for the launcher):
    exit with its code without printing it again."""

    quiet = True

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


class RankFailure(ReshardError):
    """Printed by rank 0: what failed on which ranks."""

    def __init__(self, message: str, exit_code: int):
        super().__init__(message)
        self.exit_code = exit_code


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


# ---------------------------------------------------------------------------------------------- launcher


def launch(opts: RunOptions) -> int:
    """Start torchrun with as many workers as the layouts need, running this same command."""
    src, dst = load_pair(opts.src, opts.dst, scale=opts.scale)  # validate before spawning anything
    world = max(max(src.ranks), max(dst.ranks)) + 1
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run as torchrun

    if opts.out is not None:  # refuse a non-empty output directory before starting anything
        from reshard_cli.sinks import prepare_out_dir
        prepare_out_dir(opts.out, overwrite=opts.overwrite)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import logging
    logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)  # workers print their own errors
    args = get_args_parser().parse_args(
        ["--standalone", "--nproc-per-node", str(world), "-m", "reshard_cli", *opts.argv])
    try:
        torchrun(args)
    except ChildFailedError as e:
        rank, failure = e.get_first_failure()
        if failure.exitcode in (1, 2):  # our own exit: the worker already printed its one-line error
            raise Reported(f"worker rank {rank} failed", failure.exitcode) from None
        raise RuntimeFailure(f"worker rank {rank} died (exit code {failure.exitcode}); "
                             f"the other workers were stopped") from None
    return 0


# ------------------------------------------------------------------------------------------------ worker


def _pick_backend(choice: str) -> str:
    if choice not in ("auto", "gloo", "nccl"):
        raise ConfigError(f"unknown backend {choice!r} (auto, gloo, nccl)", key="--backend")
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if choice == "nccl" and gpus < local:
        raise ConfigError(f"nccl needs one GPU per local rank: {local} ranks on this node, {gpus} GPUs",
                          key="--backend")
    if choice != "auto":
        return choice
    return "nccl" if gpus >= local else "gloo"


def start_process_group(backend: str, timeout: float) -> torch.device:
    """Join the job's process group; returns the device this rank works on (its GPU under nccl)."""
    device = torch.device("cpu")
    if backend == "nccl":
        device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(device)
    dist.init_process_group(backend, timeout=timedelta(seconds=timeout))
    return device


def _all_ok(stage: str, error: BaseException | None) -> None:
    """Collective: if any rank failed `stage`, every rank raises one error naming each failed rank."""
    msg = None if error is None else f"{error}"
    code = getattr(error, "exit_code", 1) if error is not None else 0
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, (msg, code))
    failed = [(r, m, c) for r, (m, c) in enumerate(gathered) if m is not None]
    if failed:
        text = f"{stage} failed on {len(failed)} rank(s): " + "; ".join(f"rank {r}: {m}" for r, m, _ in failed[:4])
        if len(failed) > 4:
            text += f"; ... {len(failed) - 4} more"
        code = max(c for _, _, c in failed)
        raise RankFailure(text, code) if dist.get_rank() == 0 else Reported(text, code)


def worker(opts: RunOptions) -> dict | None:
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    try:
        src_l, dst_l = load_pair(opts.src, opts.dst, scale=opts.scale)
        needed = max(max(src_l.ranks), max(dst_l.ranks)) + 1
        if world < needed:
            raise ConfigError(f"world size {world} is smaller than the {needed} ranks the layouts use "
                              f"(src {src_l.ranks[0]}-{src_l.ranks[-1]}, dst {dst_l.ranks[0]}-{dst_l.ranks[-1]})",
                              key="WORLD_SIZE")
        auto = opts.topology is not None and str(opts.topology) == "auto"  # discovered after init (below)
        topo = load_topology(opts.topology) if opts.topology and not auto else NO_TOPOLOGY
        plan = None if auto else Plan(src_l, dst_l, topo, mode=opts.mode,
                                      reshard_match=opts.reshard_match or DEFAULT_RESHARD_MATCH)
        backend = _pick_backend(opts.backend)
    except ReshardError as e:  # the same on every rank: rank 0 says it
        if rank == 0:
            raise
        raise Reported(str(e), e.exit_code) from None
    device = start_process_group(backend, opts.timeout)
    try:
        if auto:  # --topology auto: ranks whose GPUs (or CPU host) report the same NVML domain key share a domain
            from reshard_cli import nvml
            key, err = None, None
            try:
                key = nvml.rank_domain_key(nvml.discover(), int(os.environ.get("LOCAL_RANK", "0")))
            except ReshardError as e:
                err = e
            _all_ok("discovering the topology", err)
            keys: list = [None] * world
            dist.all_gather_object(keys, key)
            plan = Plan(src_l, dst_l, nvml.domains_from_keys(keys), mode=opts.mode,
                        reshard_match=opts.reshard_match or DEFAULT_RESHARD_MATCH)
        return _work(opts, plan, rank, world, device)
    finally:
        dist.destroy_process_group()


def _work(opts: RunOptions, plan: Plan, rank: int, world: int, device: torch.device) -> dict | None:
    from reshard_cli import sinks, sources

    src_l, dst_l = plan.src, plan.dst
    man = src_l.manifest.tensors
    is_src, is_dst = rank in src_l.ranks, rank in dst_l.ranks

    # 1. source check + load this rank's shards (before any transfer)
    source = None
    src_shards: dict[int, Shard] = {}
    err = None
    try:
        if opts.out is not None and rank == 0:
            sinks.prepare_out_dir(opts.out, overwrite=opts.overwrite)
        if is_src:
            source = sources.open_source(opts.source if opts.source else src_l.source, src_l,
                                         base_dir=Path(src_l.file).parent)
            source.check(src_l, rank)
            wanted = [(t, p.box_of(man[t].shape, rank)) for t, p in enumerate(src_l.placements)
                      if rank in p.holder_set]
            for (t, box), data in zip(wanted, source.read_many(wanted)):
                src_shards[t] = Shard(box, data.to(device))
    except ReshardError as e:
        err = e
    except Exception as e:  # noqa: BLE001 - reported collectively below
        err = RuntimeFailure(f"{e.__class__.__name__}: {e}")
    _all_ok("loading the source", err)

    dst_shards: dict[int, Shard] = {}
    if is_dst:
        for t, p in enumerate(dst_l.placements):
            if rank in p.holder_set:
                box = p.box_of(man[t].shape, rank)
                buf = torch.empty(box.sizes, dtype=getattr(torch, man[t].dtype), device=device)
                if buf.numel():
                    buf.reshape(-1).view(torch.uint8).fill_(SENTINEL_BYTE)
                dst_shards[t] = Shard(box, buf)

    bar = None
    if rank == 0 and not opts.quiet and sys.stderr.isatty():
        from tqdm import tqdm
        bar = tqdm(total=0, unit="B", unit_scale=True, desc="refit", leave=False)
    engine = Engine(plan, rank, src_shards, dst_shards, bucket_bytes=int(opts.bucket_mb * (1 << 20)),
                    device=device, progress=(lambda n: bar.update(n)) if bar else None)
    engine.setup_groups()

    # 2. the link limit: raw concurrent send/recv between the same src→dst pairs
    link_gbps = _link_limit(plan, rank, device, engine) if opts.link_test else None

    # 3. transfers: reshard path, then broadcast path; each timed between barriers, max over ranks
    times: dict[str, list[float]] = {"reshard": [], "broadcast": []}
    has = {p: any(x == p for x in plan.paths) for p in times}
    if f"die:{rank}" in os.environ.get("RESHARD_FAULT", "").split(","):
        os._exit(17)  # fault injection (tests): this rank dies before moving anything
    try:
        for _ in range(max(opts.iters, 1)):
            for path, fn in (("reshard", engine.run_reshard), ("broadcast", engine.run_broadcast)):
                if not has[path]:
                    continue
                _sync(device)
                t0 = time.perf_counter()
                fn()
                _sync(device)
                times[path].append(time.perf_counter() - t0)
    except Exception as e:  # a peer died or the network failed: name this rank and what it saw
        raise RuntimeFailure(f"rank {rank}: transfer failed: {_short(e)}") from e
    finally:
        if bar is not None:
            bar.close()
    _inject_fault(rank, plan, dst_shards)
    seconds = {}
    for path, ts in times.items():
        if ts:
            t = torch.tensor(ts, dtype=torch.float64)
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
            vals = t.tolist()
            seconds[path] = statistics.median(vals[1:] if len(vals) > 1 else vals)

    # 4. verification: sources' checksums vs destinations' checksums, exact values when synthetic
    result = _verify(plan, rank, src_shards, dst_shards, source)
    staging = torch.tensor([engine.peak_staging_bytes], dtype=torch.int64)
    dist.all_reduce(staging, op=dist.ReduceOp.MAX)

    # 5. output directory: rank files first, manifest last and only when everything verified
    if opts.out is not None:
        err = None
        entry = None
        try:
            if is_dst:
                idx = dst_l.ranks.index(rank)
                sinks.write_rank_file(opts.out, idx, {man[t].name: sh.data.cpu() for t, sh in dst_shards.items()})
                entry = {"index": idx, "rank": rank, "tensors": {
                    man[t].name: {"shape": list(man[t].shape), "offsets": list(sh.box.offsets),
                                  "local_shape": list(sh.box.sizes), "dtype": man[t].dtype,
                                  "checksum": verify.fmt(result["dst_checksums"][t])}
                    for t, sh in dst_shards.items()}}
        except Exception as e:  # noqa: BLE001
            err = e
        _all_ok("writing the output", err)
        entries: list = [None] * world
        dist.all_gather_object(entries, entry)
        if rank == 0 and result["ok"]:
            sinks.write_manifest(opts.out, sinks.build_manifest(src_l, dst_l, [e for e in entries if e]))
    if source is not None:
        source.close()
    if rank != 0:
        if not result["ok"]:
            raise Reported("verification failed", 1)
        return None
    stats = plan.stats()
    report = _report(opts, plan, stats, seconds, result, int(staging.item()), link_gbps, world, device)
    if not result["ok"]:
        report["_failed"] = True
    return report


def _short(e: BaseException) -> str:
    """One readable line from a backend error (gloo's carry a source path prefix and advice)."""
    text = str(e).splitlines()[0] if str(e) else e.__class__.__name__
    if text.startswith("[") and "] " in text:
        text = text.split("] ", 1)[1]
    return text.split(". This is typically", 1)[0]


def _inject_fault(rank: int, plan: Plan, dst_shards: dict) -> None:
    """Test hook: RESHARD_FAULT=KIND:RANK damages one destination shard after the transfer, so tests can
    prove that verification catches it. KIND: corrupt (one flipped byte), missing (an element left as the
    sentinel), misplaced (two elements swapped), duplicated (one element copied over another)."""
    for spec in os.environ.get("RESHARD_FAULT", "").split(","):
        kind, _, target = spec.partition(":")
        if spec and kind != "die" and target == str(rank):
            _damage(kind, dst_shards)


def _damage(kind: str, dst_shards: dict) -> None:
    t = max(dst_shards, key=lambda k: dst_shards[k].data.numel())
    x = dst_shards[t].data.reshape(-1)
    if kind == "corrupt":
        x.view(torch.uint8)[1] ^= 0x10
    elif kind == "missing":
        x[3:4].view(torch.uint8).fill_(SENTINEL_BYTE)
    elif kind in ("misplaced", "duplicated"):
        j = next(j for j in range(1, x.numel()) if not torch.equal(x[j:j + 1], x[0:1]))
        a, b = x[0:1].clone(), x[j:j + 1].clone()
        x[0:1] = b
        if kind == "misplaced":
            x[j:j + 1] = a
    else:
        raise ConfigError(f"unknown fault {kind!r}", key="RESHARD_FAULT")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    dist.barrier()


def _link_limit(plan: Plan, rank: int, device: torch.device, engine: Engine) -> float:
    """Aggregate GB/s of concurrent send/recv along the plan's schedule (each step a src→dst matching)."""
    src, dst = plan.src.ranks, plan.dst.ranks
    m = max(len(src), len(dst))
    per_src = max(sum(op.nbytes for op in engine.ops if op.send), 16 << 20)
    t = torch.tensor([per_src], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    per_step = min(int(t.item()) // m + 1, 64 << 20)
    buf = torch.empty(per_step, dtype=torch.uint8, device=device)
    steps = [(s, [(i, (i + s) % m) for i in range(m) if i < len(src) and (i + s) % m < len(dst)])
             for s in range(m)]
    total = sum(len(pairs) for _, pairs in steps) * per_step
    best = None
    for _ in range(3):  # best of 3: the limit, not a typical run
        _sync(device)
        t0 = time.perf_counter()
        works = []
        for _s, pairs in steps:
            for i, j in pairs:
                if rank == src[i]:
                    works.append(dist.isend(buf, dst[j]))
                elif rank == dst[j]:
                    works.append(dist.irecv(buf, src[i]))
            for w in works:
                w.wait()
            works.clear()
        _sync(device)
        dt = time.perf_counter() - t0
        best = dt if best is None else min(best, dt)
    return total / best / 1e9


def _verify(plan: Plan, rank: int, src_shards: dict, dst_shards: dict, source) -> dict:
    """Compare per (tensor, dst rank): the sources' checksum of that box vs the destination's checksum."""
    from reshard_cli.sources import SyntheticSource, synthetic_values

    man = plan.src.manifest.tensors
    contrib = verify.source_contributions(plan, rank, src_shards)
    actual: dict[int, int] = {}
    wrong: dict[int, int] = {}
    synthetic = None
    for t, sh in dst_shards.items():
        actual[t] = verify.checksum(sh.data, sh.box, man[t].shape)
    gathered: list = [None] * dist.get_world_size()
    is_synth = isinstance(source, SyntheticSource) if source is not None else None
    dist.all_gather_object(gathered, (contrib, is_synth, getattr(source, "seed", 0)))
    expected = verify.merge_contributions(c for c, _s, _seed in gathered)
    for _c, synth, seed in gathered:
        if synth is not None:
            synthetic = (synth, seed)
    mismatched = []
    for t, sh in dst_shards.items():
        if sh.box.numel == 0:
            continue
        if expected.get((t, sh.box.offsets), 0) != actual[t]:
            mismatched.append(t)
        if synthetic and synthetic[0]:
            exp = synthetic_values(t, sh.box, man[t].shape, sh.data.dtype, synthetic[1]).to(sh.data.device)
            a = sh.data.reshape(-1).view(torch.uint8) if sh.data.dim() else sh.data
            b = exp.reshape(-1).view(torch.uint8) if exp.dim() else exp
            item = sh.data.element_size()
            diff = (a.view(-1, item) != b.view(-1, item)).any(dim=1) if item > 1 else (a != b)
            n = int(diff.sum())
            if n:
                wrong[t] = n
    mine = {"rank": rank, "mismatched": mismatched, "wrong": wrong,
            "checksum": verify.combine(actual.values()), "tensors": len(actual),
            "bytes": sum(sh.data.numel() * sh.data.element_size() for sh in dst_shards.values())}
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, mine if dst_shards or rank in plan.dst.ranks else None)
    ranks = [e for e in everyone if e is not None]
    ok = all(not e["mismatched"] and not e["wrong"] for e in ranks)
    return {"ok": ok, "ranks": ranks, "dst_checksums": actual, "exact": bool(synthetic and synthetic[0])}


def _report(opts, plan, stats, seconds, result, staging, link_gbps, world, device) -> dict:
    from reshard_cli.report import fmt_bytes, table

    man = plan.src.manifest.tensors
    path_of = plan.paths
    wrong_by_path = {"reshard": 0, "broadcast": 0}
    mism_by_path = {"reshard": 0, "broadcast": 0}
    for e in result["ranks"]:
        for t, n in e["wrong"].items():
            wrong_by_path[path_of[t]] += n
        for t in e["mismatched"]:
            mism_by_path[path_of[t]] += 1
    ps = stats["path_stats"]
    paths = {}
    for p in ("reshard", "broadcast"):
        if ps[p]["tensors"] == 0:
            continue
        sec = seconds.get(p, 0.0)
        paths[p] = {"tensors": ps[p]["tensors"], "bytes": ps[p]["bytes"], "wire_bytes": ps[p]["wire_bytes"],
                    "indomain_bytes": ps[p]["indomain_bytes"], "seconds": sec,
                    "gbps": ps[p]["bytes"] / sec / 1e9 if sec else 0.0,
                    "wire_gbps": ps[p]["wire_bytes"] / sec / 1e9 if sec else 0.0,
                    "wrong": wrong_by_path[p] + mism_by_path[p], "checksum_mismatches": mism_by_path[p]}
    total_s = sum(v["seconds"] for v in paths.values())
    doc = {
        "mode": plan.mode, "src": plan.src.name, "dst": plan.dst.name, "model": plan.src.manifest.name,
        "world": world, "backend": dist.get_backend(), "device": device.type, "iters": opts.iters,
        "bucket_bytes": int(opts.bucket_mb * (1 << 20)),
        "seconds": total_s, "bytes": stats["bytes"], "gbps": stats["bytes"] / total_s / 1e9 if total_s else 0.0,
        "wire_bytes": stats["wire_bytes"],
        "wire_gbps": stats["wire_bytes"] / total_s / 1e9 if total_s else 0.0,
        "wrong": sum(v["wrong"] for v in paths.values()),
        "verified": "exact values + checksums" if result["exact"] else "checksums",
        "peak_staging_bytes": staging,
        "link_limit_gbps": link_gbps,
        "paths": paths,
        "checksums": {str(e["rank"]): verify.fmt(e["checksum"]) for e in result["ranks"]},
    }
    rows = [[p, v["tensors"], fmt_bytes(v["bytes"]), fmt_bytes(v["wire_bytes"]), fmt_bytes(v["indomain_bytes"]),
             f"{v['seconds'] * 1e3:.1f}", f"{v['gbps']:.2f}", v["wrong"]] for p, v in paths.items()]
    rows.append(["all", stats["tensors"], fmt_bytes(stats["bytes"]), fmt_bytes(stats["wire_bytes"]),
                 fmt_bytes(stats["indomain_bytes"]), f"{total_s * 1e3:.1f}", f"{doc['gbps']:.2f}", doc["wrong"]])
    lines = [f"reshard run: {plan.src.manifest.name}  {plan.src.name} ({plan.src.size} ranks) -> {plan.dst.name} "
             f"({plan.dst.size} ranks)  mode {plan.mode}  backend {doc['backend']}  world {world}"
             f"  iters {opts.iters} (median{' after warm-up' if opts.iters > 1 else ''})",
             table(["path", "tensors", "bytes", "wire", "in-domain", "time ms", "GB/s", "#wrong"], rows)]
    if link_gbps:
        lines.append(f"  link limit {link_gbps:.2f} GB/s (raw concurrent send/recv, same pairs); refit wire rate "
                     f"{doc['wire_gbps']:.2f} GB/s = {100 * doc['wire_gbps'] / link_gbps:.0f} % of it")
    lines.append(f"  peak staging {fmt_bytes(staging)} per rank (bucket {fmt_bytes(doc['bucket_bytes'])})")
    lines.append(f"  verified by {doc['verified']}:")
    for e in result["ranks"]:
        state = "ok" if not e["mismatched"] and not e["wrong"] else \
            f"WRONG ({len(e['mismatched'])} tensors differ, {sum(e['wrong'].values())} elements)"
        lines.append(f"    rank {e['rank']:>5}  {e['tensors']:>6} tensors  {fmt_bytes(e['bytes']):>10}  "
                     f"checksum {verify.fmt(e['checksum'])}  {state}")
    if not result["ok"]:
        bad = next(e for e in result["ranks"] if e["mismatched"] or e["wrong"])
        t = (bad["mismatched"] or list(bad["wrong"]))[0]
        lines.append(f"  FAILED: rank {bad['rank']} tensor {man[t].name} is wrong")
    doc["_text"] = "\n".join(lines)
    return doc
