"""`reshard bench`: every way of refitting, timed on the same processes and the same data.

One torchrun job (started here like `reshard run` does, or joined as a worker under the user's torchrun) runs
each case of a suite (or the one `--src/--dst` pair) and measures, each as the median of `--iters` timed runs
after one warm-up, every run between barriers and taken as the slowest rank:

  link limit  the reshard-mode plan's traffic (bytes per sender -> receiver pair) as raw concurrent
              isend/irecv with no packing and no phase ordering: the best this plan's traffic pattern can do
              over this backend. Its GB/s is in model bytes, like every mode's, so mode GB/s / link GB/s is
              the fraction of the best possible.
  reshard     Engine over Plan(mode="reshard")
  hybrid      Engine over Plan(mode="hybrid")
  broadcast   Engine over Plan(mode="broadcast") (gather on one trainer rank, broadcast to every inference rank)
  dcp         torch.distributed.checkpoint: save DTensors in the source layout, load DTensors in the
              destination layout, through a temporary directory (save + load timed together)

Every mode starts from destination buffers filled with the sentinel byte 0xA5 and is verified after its last
run: each destination element is compared exactly with `synthetic_values` (#wrong counts wrong elements).
Staging memory: engine modes report `Engine.peak_staging_bytes`; DCP reports the peak RSS growth during
save + load (VmHWM reset through /proc/self/clear_refs before every run), the max over ranks; where /proc does
not allow that, the bytes of the local state dict instead (the report says which).

A size sweep repeats one case at several `--scale` factors; a plan-scaling part (in the launcher, after the
job) times `Plan(...).stats()` on the bundled large layout pairs and on synthetic layouts of up to 1024 ranks
per side and 100 k tensors.
"""
from __future__ import annotations

import json
import math
import os
import re
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections import defaultdict
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from reshard_cli.errors import ConfigError, ReshardError, RuntimeFailure
from reshard_cli.report import fmt_bytes, table
from reshard_cli.run import SENTINEL_BYTE  # destination buffers start as this pattern, as in run

ROOT = Path(__file__).resolve().parent.parent
MODES = ("reshard", "hybrid", "broadcast", "dcp")
ENGINE_MODES = ("reshard", "hybrid", "broadcast")
CASE_KEYS = ("name", "src", "dst", "scale", "bucket_mb", "topology", "reshard_match")
SUITE_KEYS = ("name", "description", "cases", "sweep")
RESULT_ENV = "_RESHARD_BENCH_RESULT"  # set by the launcher: worker rank 0 leaves its figures there
LINK_CHUNK = 64 << 20  # largest single raw message of the link test
EXPECTED_CACHE_BYTES = 2 << 30  # keep expected destination values between modes up to this much per rank

# Bundled trainer -> inference pairs (as examples/bench_plan.py) and synthetic layouts for plan scaling:
# (ranks per side, layers, experts) of a qwen3-MoE-shaped config; tensors ~= layers * (3 * experts + 10).
PLAN_PAIRS = [
    ("qwen3-30b-a3b", "megatron-tp2-ep4-pp2", "vllm-tp4-dp4"),
    ("qwen3-235b-a22b", "megatron-tp2-cp2-pp4-ep16", "vllm-tp8-dp8"),
    ("deepseek-v3", "megatron-pp16-ep16", "vllm-tp32-dp8"),
    ("kimi-k2", "megatron-pp16-ep16", "vllm-tp16-dp8"),
]
SYNTHETIC_POINTS = [(256, 32, 256), (512, 32, 256), (1024, 32, 256), (1024, 32, 512), (1024, 64, 512)]


@dataclass(frozen=True)
class Case:
    name: str
    src: Path
    dst: Path
    scale: int = 1
    bucket_mb: float = 64.0
    topology: Path | None = None
    reshard_match: str | None = None


@dataclass
class Suite:
    name: str
    cases: list[Case]
    sweep_case: str | None = None  # name of the case the size sweep repeats
    sizes: tuple[int, ...] = ()


@dataclass
class BenchOptions:
    src: Path | None = None
    dst: Path | None = None
    suite: str | None = None
    iters: int = 5
    sizes: str | None = None
    scale: int = 1
    topology: Path | None = None
    reshard_match: str | None = None
    backend: str = "auto"
    bucket_mb: float = 64.0
    json: Path | None = None
    plot: Path | None = None
    plan_scaling: bool = True
    quiet: bool = False
    timeout: float = 300.0
    dcp_dir: Path | None = None
    argv: list = field(default_factory=list)


# ------------------------------------------------------------------------------------------ suites, options


def parse_sizes(text: str | None) -> tuple[int, ...]:
    if text is None or not str(text).strip():
        return ()
    try:
        sizes = tuple(int(x) for x in str(text).split(","))
    except ValueError:
        raise ConfigError(f"expected comma-separated integers like 1,2,4,8, got {text!r}", key="--sizes") from None
    if any(s < 1 for s in sizes):
        raise ConfigError("every size must be >= 1", key="--sizes")
    return tuple(dict.fromkeys(sizes))


def suite_path(spec: str) -> Path:
    """`cpu` -> examples/cpu/suite.yaml; anything else is a path to a suite YAML."""
    p = Path(spec).expanduser()
    if p.suffix in (".yaml", ".yml") or p.exists():
        return p
    bundled = ROOT / "examples" / spec / "suite.yaml"
    if bundled.is_file():
        return bundled
    known = sorted(d.parent.name for d in (ROOT / "examples").glob("*/suite.yaml"))
    raise ConfigError(f"unknown suite {spec!r} (bundled: {', '.join(known) or 'none'}; or a suite YAML path)",
                      key="--suite")


def _plain(x: Any) -> Any:
    """YAML mappings (dict subclasses with line numbers) as plain dicts/lists, for yaml.safe_dump."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    return x


def load_suite(spec: str, workdir: Path) -> Suite:
    """Read a suite YAML. Inline layouts/topologies are written into `workdir` (this process's own)."""
    import yaml

    from reshard_cli.models import bundled_models
    from reshard_cli.yamlio import check_keys, line_of, load_yaml

    path = suite_path(spec)
    file = str(path)
    doc = load_yaml(path)
    check_keys(doc, SUITE_KEYS, file=file, where="", required=("cases",))
    raw = doc["cases"]
    if not isinstance(raw, list) or not raw:
        raise ConfigError("expected a non-empty list of cases", file=file, key="cases", line=line_of(doc, "cases"))
    base = path.parent
    cases: list[Case] = []
    for i, c in enumerate(raw):
        where = f"cases[{i}]"
        check_keys(c, CASE_KEYS, file=file, where=where, required=("src", "dst"))
        name = str(c.get("name") or f"case{i}")
        if not re.fullmatch(r"[\w.+-]+", name):
            raise ConfigError("a case name may use letters, digits and . _ + -", file=file, key=f"{where}.name",
                              line=line_of(c, "name"))
        if any(x.name == name for x in cases):
            raise ConfigError(f"duplicate case name {name!r}", file=file, key=f"{where}.name", line=line_of(c, "name"))

        def file_or_inline(key: str) -> Path:
            v = c[key]
            if isinstance(v, dict):
                v = _plain(v)
                model = v.get("model")
                if isinstance(model, str) and model not in bundled_models() and not Path(model).is_absolute() \
                        and (base / model).exists():
                    v["model"] = str((base / model).resolve())
                out = workdir / f"{path.stem}.{name}.{key}.yaml"
                out.write_text(yaml.safe_dump(v, sort_keys=False))
                return out
            if not isinstance(v, str) or not v:
                raise ConfigError("expected a YAML path or an inline mapping", file=file, key=f"{where}.{key}",
                                  line=line_of(c, key))
            p = Path(v).expanduser()
            return p if p.is_absolute() else base / p

        scale = c.get("scale", 1)
        if not isinstance(scale, int) or isinstance(scale, bool) or scale < 1:
            raise ConfigError("must be an integer >= 1", file=file, key=f"{where}.scale", line=line_of(c, "scale"))
        bucket = c.get("bucket_mb", 64.0)
        if not isinstance(bucket, (int, float)) or isinstance(bucket, bool) or bucket <= 0:
            raise ConfigError("must be a number > 0", file=file, key=f"{where}.bucket_mb",
                              line=line_of(c, "bucket_mb"))
        match = c.get("reshard_match")
        if match is not None and not isinstance(match, str):
            raise ConfigError("expected a regex", file=file, key=f"{where}.reshard_match",
                              line=line_of(c, "reshard_match"))
        cases.append(Case(name, file_or_inline("src"), file_or_inline("dst"), scale, float(bucket),
                          file_or_inline("topology") if c.get("topology") is not None else None, match))
    sweep_case, sizes = None, ()
    if doc.get("sweep") is not None:
        sw = doc["sweep"]
        check_keys(sw, ("case", "sizes"), file=file, where="sweep", required=("sizes",))
        sweep_case = sw.get("case", cases[0].name)
        if sweep_case not in [x.name for x in cases]:
            raise ConfigError(f"no case named {sweep_case!r}", file=file, key="sweep.case", line=line_of(sw, "case"))
        raw_sizes = sw["sizes"]
        if not isinstance(raw_sizes, list) or not raw_sizes or \
                any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in raw_sizes):
            raise ConfigError("expected a list of integers >= 1", file=file, key="sweep.sizes",
                              line=line_of(sw, "sizes"))
        sizes = tuple(dict.fromkeys(raw_sizes))
    return Suite(str(doc.get("name") or path.stem), cases, sweep_case, sizes)


def resolve(opts: BenchOptions, workdir: Path) -> Suite:
    """The cases to run: a suite, or the one --src/--dst pair; --sizes overrides the suite's sweep sizes."""
    if opts.iters < 1:
        raise ConfigError("must be >= 1", key="--iters")
    if opts.bucket_mb <= 0:
        raise ConfigError("must be > 0", key="--bucket-mb")
    sizes = parse_sizes(opts.sizes)
    if opts.dcp_dir is not None and not Path(opts.dcp_dir).is_dir():
        raise ConfigError(f"{opts.dcp_dir} is not a directory", key="--dcp-dir")
    if opts.suite is not None:
        if opts.src is not None or opts.dst is not None:
            raise ConfigError("give either --suite or --src/--dst, not both", key="--suite")
        suite = load_suite(opts.suite, workdir)
        if sizes:
            suite.sizes = sizes
            suite.sweep_case = suite.sweep_case or suite.cases[0].name
        return suite
    if opts.src is None or opts.dst is None:
        raise ConfigError("give --src and --dst (a layout pair), or --suite NAME (e.g. --suite cpu)",
                          key="--src" if opts.src is None else "--dst")
    name = f"{Path(opts.src).stem}->{Path(opts.dst).stem}" + (f"-x{opts.scale}" if opts.scale != 1 else "")
    case = Case(name, Path(opts.src), Path(opts.dst), opts.scale, opts.bucket_mb, opts.topology, opts.reshard_match)
    return Suite("pair", [case], case.name if sizes else None, sizes)


def sweep_cases(suite: Suite) -> list[Case]:
    if not suite.sizes or suite.sweep_case is None:
        return []
    base = next(c for c in suite.cases if c.name == suite.sweep_case)
    return [replace(base, scale=s) for s in suite.sizes]


def _world_needed(suite: Suite) -> int:
    """Load every pair (validating it) and return the world size the job needs."""
    from reshard_cli.layout import load_pair
    from reshard_cli.topo import load_topology

    world = 0
    for c in suite.cases + [c for c in sweep_cases(suite) if c.scale != _case(suite, c.name).scale]:
        src, dst = load_pair(c.src, c.dst, scale=c.scale)
        if c.topology is not None:
            load_topology(c.topology)
        world = max(world, max(src.ranks) + 1, max(dst.ranks) + 1)
    return world


def _case(suite: Suite, name: str) -> Case:
    return next(c for c in suite.cases if c.name == name)


# ---------------------------------------------------------------------------------------------- launcher


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def launch(opts: BenchOptions) -> None:
    """Start torchrun with as many workers as the largest case needs, running this same command; then
    plan scaling, the report, --json and --plot here."""
    from reshard_cli.run import Reported

    workdir = Path(tempfile.mkdtemp(prefix="reshard-bench-"))
    try:
        suite = resolve(opts, workdir)
        world = _world_needed(suite)
        if opts.plot is not None:
            _pyplot()  # a missing matplotlib fails now, not after the whole job
        for flag, p in (("--json", opts.json), ("--plot", opts.plot)):
            if p is not None and not Path(p).resolve().parent.is_dir():
                raise ConfigError(f"cannot write {p}: no such directory", key=flag)
        result = workdir / "result.json"
        from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
        from torch.distributed.run import get_args_parser, run as torchrun

        os.environ.setdefault("OMP_NUM_THREADS", "1")
        import logging
        logging.getLogger("torch.distributed.elastic").setLevel(logging.CRITICAL)
        args = get_args_parser().parse_args(
            ["--standalone", "--nproc-per-node", str(world), "-m", "reshard_cli", *opts.argv])
        old = os.environ.get(RESULT_ENV)
        os.environ[RESULT_ENV] = str(result)
        try:
            torchrun(args)
        except ChildFailedError as e:
            rank, failure = e.get_first_failure()
            if failure.exitcode in (1, 2):  # the worker printed its own one-line error
                raise Reported(f"worker rank {rank} failed", failure.exitcode) from None
            raise RuntimeFailure(f"worker rank {rank} died (exit code {failure.exitcode}); "
                                 f"the other workers were stopped") from None
        finally:
            if old is None:
                os.environ.pop(RESULT_ENV, None)
            else:
                os.environ[RESULT_ENV] = old
        doc = json.loads(result.read_text())
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    finish(doc, opts)


def finish(doc: dict, opts: BenchOptions) -> None:
    """Plan scaling, then the report on stdout, --json and --plot; exit 1 (after reporting) if a mode was wrong."""
    from reshard_cli.report import write_json

    progress = None if opts.quiet else _say
    doc["plan_scaling"] = plan_scaling(progress) if opts.plan_scaling else []
    print(report_text(doc), flush=True)
    if opts.json is not None:
        try:
            write_json(opts.json, doc)
        except OSError as e:
            raise ConfigError(f"cannot write {opts.json}: {e.strerror or e}", key="--json") from None
        print(f"  wrote {opts.json}")
    if opts.plot is not None:
        write_plot(doc, opts.plot)
        print(f"  wrote {opts.plot}")
    bad = [(c["name"], m) for c in doc["cases"] for m, v in c["modes"].items() if v["wrong"]]
    bad += [(f"sweep x{p['scale']}", m) for p in doc["sweep"] for m, v in p["modes"].items() if v["wrong"]]
    if bad:
        raise RuntimeFailure("verification failed: " + ", ".join(f"{c} {m}" for c, m in bad[:6])
                             + (" ..." if len(bad) > 6 else ""))


def _say(msg: str) -> None:
    print(f"bench: {msg}", file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------------------ worker


def worker(opts: BenchOptions) -> None:
    from reshard_cli.run import Reported, _pick_backend, start_process_group

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    workdir = Path(tempfile.mkdtemp(prefix="reshard-bench-"))
    try:
        try:
            suite = resolve(opts, workdir)
            needed = _world_needed(suite)
            if world < needed:
                raise ConfigError(f"world size {world} is smaller than the {needed} ranks the cases use",
                                  key="WORLD_SIZE")
            backend = _pick_backend(opts.backend)
            if opts.plot is not None and rank == 0 and not os.environ.get(RESULT_ENV):
                _pyplot()  # rank 0 will draw it: a missing matplotlib fails now, not after the whole job
        except ReshardError as e:  # the same on every rank: rank 0 says it
            if rank == 0:
                raise
            raise Reported(str(e), e.exit_code) from None
        device = start_process_group(backend, opts.timeout)
        try:
            doc = _run_suite(suite, opts, rank, world, device)
        finally:
            dist.destroy_process_group()
    finally:
        shutil.rmtree(workdir, ignore_errors=True)
    if rank != 0:
        return
    result = os.environ.get(RESULT_ENV)
    if result:  # started by launch(): it finishes (plan scaling, report) after the job
        Path(result).write_text(json.dumps(doc))
    else:  # under the user's own torchrun: rank 0 finishes
        finish(doc, opts)


def _run_suite(suite: Suite, opts: BenchOptions, rank: int, world: int, device: torch.device) -> dict | None:
    say = _say if rank == 0 and not opts.quiet else None
    cases = []
    for i, case in enumerate(suite.cases):
        if say:
            say(f"case {i + 1}/{len(suite.cases)}: {case.name}")
        cases.append(_run_case(case, opts, rank, device, say))
    sweep = []
    for case in sweep_cases(suite):
        if case.scale == _case(suite, case.name).scale:  # measured above: same case, same scale
            r = cases[[c.name for c in suite.cases].index(case.name)]
        else:
            if say:
                say(f"sweep: {case.name} at scale {case.scale}")
            r = _run_case(case, opts, rank, device, say)
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


def _run_case(case: Case, opts: BenchOptions, rank: int, device: torch.device,
              say: Callable[[str], None] | None) -> dict | None:
    """Collective: every rank of the world runs every step in the same order (idle ranks join the barriers).

    Rounds: round 0 is the warm-up, then `iters` timed rounds; each round runs every measurement once, in an
    order rotated by one each round, so a load change on a shared machine hits every mode alike. Before every
    run of a mode the destination buffers are refilled with the sentinel; after it they are verified exactly.
    """
    from reshard_cli.layout import load_pair
    from reshard_cli.plan import DEFAULT_RESHARD_MATCH, Plan
    from reshard_cli.sources import SyntheticSource
    from reshard_cli.topo import NO_TOPOLOGY, load_topology
    from reshard_cli.transport import Engine, Shard

    src_l, dst_l = load_pair(case.src, case.dst, scale=case.scale)
    topo = load_topology(case.topology) if case.topology is not None else NO_TOPOLOGY
    match = case.reshard_match or opts.reshard_match or DEFAULT_RESHARD_MATCH
    plans = {m: Plan(src_l, dst_l, topo, mode=m, reshard_match=match) for m in ENGINE_MODES}
    man = src_l.manifest.tensors

    # the same source shards and destination buffers for every mode
    src_shards: dict[int, Shard] = {}
    if rank in src_l.ranks:
        source = SyntheticSource(src_l.manifest)
        wanted = [(t, p.box_of(man[t].shape, rank)) for t, p in enumerate(src_l.placements) if rank in p.holder_set]
        for (t, box), data in zip(wanted, source.read_many(wanted)):
            src_shards[t] = Shard(box, data.to(device))
    dst_shards: dict[int, Shard] = {}
    if rank in dst_l.ranks:
        for t, p in enumerate(dst_l.placements):
            if rank in p.holder_set:
                box = p.box_of(man[t].shape, rank)
                dst_shards[t] = Shard(box, torch.empty(box.sizes, dtype=getattr(torch, man[t].dtype), device=device))
    expected = _Expected(man, dst_shards, device)
    dst_data = {t: sh.data for t, sh in dst_shards.items()}

    bucket = int(case.bucket_mb * (1 << 20))
    engines = {m: Engine(plans[m], rank, src_shards, dst_shards, bucket_bytes=bucket, device=device)
               for m in ENGINE_MODES}
    for m in ENGINE_MODES:
        engines[m].setup_groups()  # collective: every rank, same order

    measures: list[_Measure] = []
    # 1. link limit: the reshard plan's traffic per sender -> receiver pair, raw and all at once
    msgs = _link_messages(engines["reshard"].view, man, rank)
    largest = max((n for _p, n in msgs), default=0)
    sbuf = torch.empty(min(largest, LINK_CHUNK), dtype=torch.uint8, device=device)
    rbuf = torch.empty(min(largest, LINK_CHUNK), dtype=torch.uint8, device=device)
    measures.append(_Measure("link", lambda: _link_once(msgs, rank, sbuf, rbuf)))

    # 2-4. the engine modes, on the same shards and buffers
    def engine_measure(m: str) -> _Measure:
        eng = engines[m]
        meas = _Measure(m, lambda: (eng.run_reshard(), eng.run_broadcast()))
        meas.prepare = lambda: _fill_sentinel(dst_shards.values())
        meas.check = lambda: meas.wrong.append(expected.wrong(dst_data))
        return meas

    measures += [engine_measure(m) for m in ENGINE_MODES]
    # 5. torch.distributed.checkpoint: save in the source layout, load in the destination layout
    dcp_run = _DcpRun(src_l, dst_l, rank, src_shards, dst_shards, expected, device, opts.dcp_dir)
    measures.append(dcp_run.measure)
    try:
        _rounds(measures, opts.iters, device)
    finally:
        dcp_run.close()

    times = torch.tensor([m.times for m in measures], dtype=torch.float64)
    dist.all_reduce(times, op=dist.ReduceOp.MAX)  # per run: the slowest rank
    wrong = torch.tensor([m.wrong for m in measures if m.name != "link"], dtype=torch.int64)
    dist.all_reduce(wrong, op=dist.ReduceOp.SUM)  # per run: wrong elements over all ranks
    staging = {m: _allreduce_max(engines[m].peak_staging_bytes) for m in ENGINE_MODES}
    dcp_doc = dcp_run.figures()
    link_bytes = _allreduce_sum(sum(n for (s, _d), n in msgs if s == rank))
    if rank != 0:
        return None

    per = {m.name: times[i].tolist() for i, m in enumerate(measures)}
    worst = {m.name: int(wrong[i].max()) for i, m in enumerate(x for x in measures if x.name != "link")}
    nbytes = src_l.manifest.nbytes
    modes: dict[str, dict] = {}
    for m in MODES:
        sec = _median(per[m])
        modes[m] = {"seconds": sec, "times": per[m], "gbps": nbytes / sec / 1e9 if sec else 0.0,
                    "wrong": worst[m]}
        if m in ENGINE_MODES:
            modes[m].update(wire_bytes=plans[m].stats()["wire_bytes"], peak_staging_bytes=staging[m])
        else:
            modes[m].update(dcp_doc)
    t_link = _median(per["link"])
    doc = {
        "name": case.name, "src": src_l.name, "dst": dst_l.name, "src_file": str(case.src), "dst_file": str(case.dst),
        "model": src_l.manifest.name, "scale": case.scale, "src_ranks": src_l.size, "dst_ranks": dst_l.size,
        "tensors": len(man), "bytes": nbytes, "bucket_bytes": bucket, "topology": topo.describe(),
        "link_limit_seconds": t_link, "link_limit_times": per["link"], "link_bytes": link_bytes,
        "link_limit_gbps": nbytes / t_link / 1e9 if t_link else 0.0,
        "link_wire_gbps": link_bytes / t_link / 1e9 if t_link else 0.0,
        "modes": modes,
    }
    add_ratios(doc)
    if say:
        say("  " + ", ".join(f"{m} {_ms(modes[m]['seconds'])} ms" for m in MODES)
            + f", link {_ms(t_link)} ms; #wrong {sum(v['wrong'] for v in modes.values())}")
    return doc


@dataclass
class _Measure:
    """One thing to time: `run` between barriers; `prepare` / `check` around it, untimed."""

    name: str
    run: Callable[[], Any]
    prepare: Callable[[], Any] | None = None
    check: Callable[[], Any] | None = None
    times: list = field(default_factory=list)
    wrong: list = field(default_factory=list)  # wrong elements on this rank, per timed run


def _rounds(measures: list[_Measure], iters: int, device: torch.device) -> None:
    from reshard_cli.run import _sync

    for r in range(iters + 1):
        k = r % len(measures)
        for m in measures[k:] + measures[:k]:
            if m.prepare is not None:
                m.prepare()
            _sync(device)
            t0 = time.perf_counter()
            m.run()
            _sync(device)
            dt = time.perf_counter() - t0
            if m.check is not None:
                m.check()  # every run is verified, the warm-up too
            if r:  # the warm-up's time is dropped
                m.times.append(dt)


class _Expected:
    """Exact expected values of this rank's destination shards (kept between runs while they fit)."""

    def __init__(self, man, dst_shards: dict, device: torch.device):
        from reshard_cli.sources import synthetic_values

        self._values = synthetic_values
        self.man, self.boxes, self.device = man, {t: sh.box for t, sh in dst_shards.items()}, device
        total = sum(sh.data.numel() * sh.data.element_size() for sh in dst_shards.values())
        self._cache: dict[int, torch.Tensor] | None = {} if total <= EXPECTED_CACHE_BYTES else None

    def get(self, t: int, dtype: torch.dtype) -> torch.Tensor:
        if self._cache is not None and t in self._cache:
            return self._cache[t]
        x = self._values(t, self.boxes[t], self.man[t].shape, dtype, 0).to(self.device)
        if self._cache is not None:
            self._cache[t] = x
        return x

    def wrong(self, data: dict[int, torch.Tensor]) -> int:
        """Elements that differ from the expected values, bit for bit."""
        n = 0
        for t, x in data.items():
            if x.numel() == 0:
                continue
            e = self.get(t, x.dtype)
            a = x.detach().contiguous().reshape(-1).view(torch.uint8)
            b = e.contiguous().reshape(-1).view(torch.uint8)
            if torch.equal(a, b):
                continue
            item = x.element_size()
            n += int((a.view(-1, item) != b.view(-1, item)).any(dim=1).sum()) if item > 1 else int((a != b).sum())
        return n


def _fill_sentinel(shards) -> None:
    for sh in shards:
        if sh.data.numel():
            sh.data.reshape(-1).view(torch.uint8).fill_(SENTINEL_BYTE)


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else 0.0


def _ms(s: float) -> str:
    return f"{s * 1e3:.1f}"


def _allreduce(n: int, op) -> int:
    t = torch.tensor([n], dtype=torch.int64)
    dist.all_reduce(t, op=op)
    return int(t.item())


def _allreduce_sum(n: int) -> int:
    return _allreduce(n, dist.ReduceOp.SUM)


def _allreduce_max(n: int) -> int:
    return _allreduce(n, dist.ReduceOp.MAX)


def _allreduce_min(n: int) -> int:
    return _allreduce(n, dist.ReduceOp.MIN)


# ------------------------------------------------------------------------------------------ link limit


def _link_messages(view, man, rank: int) -> list[tuple[tuple[int, int], int]]:
    """((sender, receiver), bytes) of every plan message this rank takes part in, in one global order."""
    per: dict[tuple[int, int], int] = defaultdict(int)
    for p in view.pieces:
        if p.src != rank and p.dst != rank:
            continue
        spec = man[p.tensor]
        per[(p.src, p.dst)] += p.box.numel * (spec.nbytes // spec.numel if spec.numel else 0)
    return sorted((k, v) for k, v in per.items() if v)


def _link_once(msgs, rank: int, sbuf: torch.Tensor, rbuf: torch.Tensor) -> None:
    """Post every message at once (chunks of at most LINK_CHUNK), then wait for all: nothing is copied."""
    works = []
    for (s, d), n in msgs:
        for off in range(0, n, LINK_CHUNK):
            k = min(LINK_CHUNK, n - off)
            works.append(dist.isend(sbuf[:k], d) if s == rank else dist.irecv(rbuf[:k], s))
    for w in works:
        w.wait()


# ------------------------------------------------------------------------------ torch.distributed.checkpoint


def _mesh_key(p) -> tuple:
    """A placement's DeviceMesh: its holders, shaped by the mesh dims that are not fixed (stage / expert)."""
    shape = tuple(n for n, f in zip(p.mesh.shape, p.fixed) if f is None) or (1,)
    return p.holders, shape


def _dt_placements(p) -> list:
    from torch.distributed.tensor import Replicate, Shard as DShard

    out = [DShard(s) if s is not None else Replicate() for s, f in zip(p.shard, p.fixed) if f is None]
    return out or [Replicate()]


def _device_meshes(layouts, device: torch.device) -> dict:
    """Every distinct (sub-)mesh of both layouts. Collective: every rank creates every mesh, same order."""
    from torch.distributed.device_mesh import DeviceMesh

    meshes: dict[tuple, Any] = {}
    for layout in layouts:
        for p in dict.fromkeys(layout.placements):  # placements are interned: first appearance order
            key = _mesh_key(p)
            if key not in meshes:
                holders, shape = key
                meshes[key] = DeviceMesh(device.type, torch.tensor(holders, dtype=torch.int).reshape(shape))
    return meshes


def _dtensors(layout, shards: dict, meshes: dict, man) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    for t, sh in shards.items():
        p = layout.placements[t]
        shape = tuple(man[t].shape)
        stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
        out[man[t].name] = DTensor.from_local(sh.data, meshes[_mesh_key(p)], _dt_placements(p), run_check=False,
                                              shape=torch.Size(shape), stride=stride)
    return out


def _counting_reader(path: str):
    """A FileSystemReader that adds up the stored bytes it reads (each request reads its whole stored chunk)."""
    from torch.distributed.checkpoint import FileSystemReader

    class CountingReader(FileSystemReader):
        nbytes: int | None = 0

        def read_data(self, plan, planner):
            try:
                self.nbytes += sum(self.storage_data[item.storage_index].length for item in plan.items)
            except Exception:  # noqa: BLE001 - another torch version's internals: no figure, still a load
                self.nbytes = None
            return super().read_data(plan, planner)

    return CountingReader(path)


def _rss_reset() -> int | None:
    """Give freed heap back to the OS, reset this process's peak RSS (VmHWM) and return the current RSS in bytes;
    None where /proc does not allow it."""
    try:
        import ctypes
        ctypes.CDLL(None).malloc_trim(0)  # else reused free heap pages would hide new allocations
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _proc_status("VmRSS")
    except OSError:
        return None


def _proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class _DcpRun:
    """DCP as users run it offline: `dcp.save` of the source DTensors into a fresh directory, then `dcp.load`
    into DTensors of the destination layout (wrapping the same destination buffers, sentinel-filled)."""

    def __init__(self, src_l, dst_l, rank: int, src_shards: dict, dst_shards: dict, expected: _Expected,
                 device: torch.device, dcp_dir: Path | None):
        self.rank, self.device, self.expected = rank, device, expected
        self.dst_shards = dst_shards
        man = src_l.manifest.tensors
        meshes = _device_meshes((src_l, dst_l), device)  # collective
        self.src_sd = _dtensors(src_l, src_shards, meshes, man)
        self.dst_sd = _dtensors(dst_l, dst_shards, meshes, man)
        self.names = {t: man[t].name for t in dst_shards}
        self.sd_bytes = sum(sh.data.numel() * sh.data.element_size()
                            for sh in list(src_shards.values()) + list(dst_shards.values()))
        base = [tempfile.mkdtemp(prefix="reshard-bench-dcp-", dir=str(dcp_dir) if dcp_dir else None)
                if rank == 0 else None]
        dist.broadcast_object_list(base, src=0)
        self.root = Path(base[0])
        self.dcp_dir = str(dcp_dir or tempfile.gettempdir())
        self.i = 0
        self.read: int | None = 0
        self.written = 0
        self.rss = 0
        self.rss_ok = True
        self.rss0: int | None = None
        self.reader = None
        self.measure = _Measure("dcp", self._run, self._prepare, self._check)

    def _ckpt(self) -> Path:
        return self.root / f"run{self.i}"

    def _prepare(self) -> None:
        _fill_sentinel(self.dst_shards.values())  # sentinel, not zeros: an element DCP never writes cannot pass
        self.rss0 = _rss_reset()

    def _run(self) -> None:
        import torch.distributed.checkpoint as dcp

        self.reader = _counting_reader(str(self._ckpt()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(self.src_sd, checkpoint_id=str(self._ckpt()))
            dcp.load(self.dst_sd, storage_reader=self.reader)

    def _check(self) -> None:
        from reshard_cli.run import _sync

        hwm = _proc_status("VmHWM")
        if self.rss0 is None or hwm is None:
            self.rss_ok = False
        else:
            self.rss = max(self.rss, hwm - self.rss0)
        self.read = self.reader.nbytes if self.reader is not None else None
        if self.rank == 0:
            self.written = sum(f.stat().st_size for f in self._ckpt().rglob("*") if f.is_file())
        loaded = {t: self.dst_sd[name].to_local() for t, name in self.names.items()}
        self.measure.wrong.append(self.expected.wrong(loaded))
        _sync(self.device)  # every rank is done with the checkpoint before it goes
        if self.rank == 0:
            shutil.rmtree(self._ckpt(), ignore_errors=True)
        self.i += 1

    def close(self) -> None:
        from reshard_cli.run import _sync

        _sync(self.device)
        if self.rank == 0:
            shutil.rmtree(self.root, ignore_errors=True)

    def figures(self) -> dict:
        """Collective: the DCP-only figures (bytes written and read, staging)."""
        read_ok = _allreduce_min(0 if self.read is None else 1)
        read = _allreduce_sum(self.read or 0)
        written = _allreduce_sum(self.written)
        if _allreduce_min(1 if self.rss_ok else 0):
            staging, kind = _allreduce_max(self.rss), "peak RSS growth during save+load (VmHWM), max over ranks"
        else:
            staging, kind = _allreduce_max(self.sd_bytes), "bytes of the local state dict, max over ranks"
        return {"peak_staging_bytes": staging, "staging_kind": kind, "bytes_written": written,
                "bytes_read": read if read_ok else None, "wire_bytes": written + (read if read_ok else 0),
                "checkpoint_dir": self.dcp_dir}


# ---------------------------------------------------------------------------------------------- ratios


def add_ratios(case: dict) -> dict:
    """Per mode: speed-up over broadcast and over DCP (their time / this time) and the fraction of the link
    limit (this GB/s / link GB/s, both in model bytes). None where a time is missing."""
    modes = case["modes"]

    def over(other: str, m: str):
        a, b = modes.get(other, {}).get("seconds"), modes[m].get("seconds")
        return a / b if a and b else None

    link = case.get("link_limit_gbps")
    for m, v in modes.items():
        v["vs_broadcast"] = over("broadcast", m)
        v["vs_dcp"] = over("dcp", m)
        v["of_link"] = v["gbps"] / link if link and v.get("gbps") else None
    return case


def _x(r: float | None) -> str:
    return f"{r:.2f}x" if r is not None else "-"


def _pct(r: float | None) -> str:
    return f"{100 * r:.0f} %" if r is not None else "-"


def case_table(case: dict) -> str:
    """One case, nccl-tests style: a header line, then link limit and every mode."""
    head = (f"{case['name']}: {case['model']} {fmt_bytes(case['bytes'])} in {case['tensors']} tensors  "
            f"{case['src']} ({case['src_ranks']} ranks) -> {case['dst']} ({case['dst_ranks']} ranks)  "
            f"bucket {fmt_bytes(case['bucket_bytes'])}")
    rows = [["link limit", _ms(case["link_limit_seconds"]), f"{case['link_limit_gbps']:.2f}",
             fmt_bytes(case["link_bytes"]), "-", "-", "-", "-", "100 %"]]
    for m in MODES:
        v = case["modes"].get(m)
        if v is None:
            continue
        rows.append([m, _ms(v["seconds"]), f"{v['gbps']:.2f}", fmt_bytes(v["wire_bytes"]),
                     fmt_bytes(v["peak_staging_bytes"]) + ("*" if m == "dcp" else ""), v["wrong"],
                     _x(v.get("vs_broadcast")), _x(v.get("vs_dcp")), _pct(v.get("of_link"))])
    return "\n".join([f"  {head}", table(["mode", "time ms", "GB/s", "wire", "staging", "#wrong", "vs bcast",
                                          "vs dcp", "of link"], rows, indent="    ")])


def sweep_table(points: list[dict]) -> str:
    rows = []
    for p in points:
        row = [f"x{p['scale']}", fmt_bytes(p["bytes"]), f"{_ms(p['link_limit_seconds'])} / {p['link_limit_gbps']:.2f}"]
        row += [f"{_ms(p['modes'][m]['seconds'])} / {p['modes'][m]['gbps']:.2f}" for m in MODES]
        rows.append(row)
    return table(["scale", "bytes", "link ms / GB/s"] + [f"{m} ms / GB/s" for m in MODES], rows, indent="    ")


def plan_table(rows: list[dict]) -> str:
    return table(["pair", "ranks", "tensors", "classes", "pieces", "load s", "stats s", "us/piece", "us/tensor"],
                 [[r["name"], f"{r['src_ranks']}->{r['dst_ranks']}", r["tensors"], r["classes"], r["pieces"],
                   f"{r['load_seconds']:.2f}", f"{r['seconds']:.2f}", f"{1e6 * r['seconds'] / max(r['pieces'], 1):.3f}",
                   f"{1e6 * r['seconds'] / max(r['tensors'], 1):.1f}"] for r in rows], indent="    ")


def report_text(doc: dict) -> str:
    lines = [f"reshard bench: suite {doc['suite']}  backend {doc['backend']}  device {doc['device']}  "
             f"world {doc['world']}  iters {doc['iters']} (median after 1 warm-up; each run between barriers, "
             f"slowest rank)"]
    for case in doc["cases"]:
        lines += ["", case_table(case)]
    dcp_kinds = {c["modes"]["dcp"].get("staging_kind") for c in doc["cases"]}
    lines += ["",
              "  GB/s: model bytes / time (link limit too: the reshard plan's traffic per sender->receiver pair as raw "
              "concurrent isend/irecv). vs bcast / vs dcp: their time / this time. of link: this GB/s / link GB/s.",
              "  wire: plan network bytes (dcp: bytes written + read). staging: Engine.peak_staging_bytes per rank; "
              f"* dcp: {'; '.join(sorted(k for k in dcp_kinds if k))}."]
    if doc.get("sweep"):
        lines += ["", f"  size sweep: {doc['sweep'][0]['case']} at --scale {','.join(str(p['scale']) for p in doc['sweep'])}",
                  sweep_table(doc["sweep"])]
        lines.append("  " + _growth_text(doc["sweep"]))
    if doc.get("plan_scaling"):
        lines += ["", "  plan scaling: Plan(src, dst, mode=reshard).stats() in the launcher (fresh Plan, no topology)",
                  plan_table(doc["plan_scaling"])]
    return "\n".join(lines)


def _growth_text(points: list[dict]) -> str:
    """How time grows with bytes from the smallest to the largest sweep point, per mode."""
    if len(points) < 2:
        return "growth: one size only"
    a, b = points[0], points[-1]
    k = b["bytes"] / a["bytes"] if a["bytes"] else 0
    parts = []
    for m in MODES:
        ta, tb = a["modes"][m]["seconds"], b["modes"][m]["seconds"]
        parts.append(f"{m} {tb / ta:.1f}x" if ta else f"{m} -")
    return f"time growth for {k:.1f}x the bytes: " + ", ".join(parts)


# ----------------------------------------------------------------------------------------------- plot


def _pyplot():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("needs matplotlib: pip install 'reshard[plot]' (or pip install matplotlib)",
                          key="--plot") from None
    return plt


def write_plot(doc: dict, path: Path) -> None:
    """Time and GB/s per mode for every case, and the size sweep (time vs bytes)."""
    plt = _pyplot()
    cases = doc["cases"]
    panels = 3 if doc.get("sweep") else 2
    fig, axes = plt.subplots(1, panels, figsize=(6 * panels, 4.5))
    width = 0.8 / len(MODES)
    xs = range(len(cases))
    for j, m in enumerate(MODES):
        off = [x - 0.4 + width * (j + 0.5) for x in xs]
        axes[0].bar(off, [c["modes"][m]["seconds"] * 1e3 for c in cases], width, label=m)
        axes[1].bar(off, [c["modes"][m]["gbps"] for c in cases], width, label=m)
    axes[1].scatter(list(xs), [c["link_limit_gbps"] for c in cases], marker="_", s=600, color="k", zorder=3,
                    label="link limit")
    for ax, ylabel in ((axes[0], "time (ms, median)"), (axes[1], "GB/s (model bytes)")):
        ax.set_xticks(list(xs))
        ax.set_xticklabels([c["name"] for c in cases], rotation=20, ha="right", fontsize=8)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=8)
    axes[0].set_yscale("log")
    if panels == 3:
        pts = doc["sweep"]
        ax = axes[2]
        by = [p["bytes"] / 1e6 for p in pts]
        ax.plot(by, [p["link_limit_seconds"] * 1e3 for p in pts], "k--", label="link limit")
        for m in MODES:
            ax.plot(by, [p["modes"][m]["seconds"] * 1e3 for p in pts], "o-", label=m)
        ax.set_xscale("log")
        ax.set_yscale("log")
        ax.set_xlabel("model MB")
        ax.set_ylabel("time (ms, median)")
        ax.set_title(f"size sweep: {pts[0]['case']}", fontsize=9)
        ax.legend(fontsize=8)
    fig.suptitle(f"reshard bench: {doc['suite']} ({doc['backend']}, world {doc['world']}, iters {doc['iters']})")
    fig.tight_layout()
    try:
        fig.savefig(path, dpi=110)
    except OSError as e:
        raise ConfigError(f"cannot write {path}: {e.strerror or e}", key="--plot") from None
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------------------- plan scaling


def plan_scaling(say: Callable[[str], None] | None = None) -> list[dict]:
    """Time Plan(...).stats() on the bundled large pairs and on synthetic layouts (256..1024 ranks per side,
    up to ~100 k tensors); each row has pieces and seconds."""
    rows = []
    for model, s, d in PLAN_PAIRS:
        folder = ROOT / "layouts" / model
        if say:
            say(f"plan scaling: {model}")
        rows.append(_time_plan(f"{model} {s}->{d}", folder / f"{s}.yaml", folder / f"{d}.yaml"))
    with tempfile.TemporaryDirectory(prefix="reshard-bench-plan-") as tmp:
        for ranks, layers, experts in SYNTHETIC_POINTS:
            if say:
                say(f"plan scaling: synthetic {ranks} ranks, {layers} layers x {experts} experts")
            src, dst = write_synthetic_pair(Path(tmp), ranks, layers, experts)
            rows.append(_time_plan(f"synthetic dp{ranks // 8}xtp8->dp{ranks // 16}xtp16 E{experts}", src, dst))
    return rows


def _time_plan(name: str, src: Path, dst: Path, mode: str = "reshard") -> dict:
    from reshard_cli import models
    from reshard_cli.layout import load_pair
    from reshard_cli.plan import Plan

    getattr(models, "_CACHE", {}).clear()  # cold, as a fresh `reshard plan`
    t0 = time.perf_counter()
    src_l, dst_l = load_pair(src, dst)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    stats = Plan(src_l, dst_l, mode=mode).stats()
    dt = time.perf_counter() - t0
    return {"name": name, "src_ranks": src_l.size, "dst_ranks": dst_l.size, "tensors": stats["tensors"],
            "mode": mode, "pieces": stats["pieces"], "classes": stats["classes"], "load_seconds": t_load,
            "seconds": dt}


def write_synthetic_pair(folder: Path, ranks: int, layers: int, experts: int) -> tuple[Path, Path]:
    """A qwen3-MoE-shaped config.json plus a Megatron-like dp x tp8 (experts on ep) trainer layout and a
    vLLM-like dp x tp16 inference layout, `ranks` ranks each."""
    d = folder / f"synthetic-{ranks}-{layers}-{experts}"
    d.mkdir(parents=True, exist_ok=True)
    config = {"model_type": "qwen3_moe", "torch_dtype": "bfloat16", "vocab_size": 32768, "hidden_size": 1024,
              "intermediate_size": 4096, "moe_intermediate_size": 256, "num_hidden_layers": layers,
              "num_attention_heads": 16, "num_key_value_heads": 8, "head_dim": 64, "num_experts": experts,
              "num_experts_per_tok": 8, "decoder_sparse_step": 1, "mlp_only_layers": [],
              "tie_word_embeddings": False}
    (d / "config.json").write_text(json.dumps(config))
    dp = ranks // 8
    (d / "src.yaml").write_text(
        f"name: megatron-dp{dp}-tp8-ep{dp}\nmodel: config.json\n"
        f"meshes:\n  dense: {{dp: {dp}, tp: 8}}\n  expert: {{ep: {dp}, etp: 8}}\nexperts: ep\nplacements:\n"
        "  - {match: 'experts\\.\\d+\\.(gate|up)_proj', mesh: expert, shard: {etp: 0}}\n"
        "  - {match: 'experts\\.\\d+\\.down_proj', mesh: expert, shard: {etp: 1}}\n"
        "  - {match: '(q|k|v)_proj\\.weight$|embed_tokens|lm_head', mesh: dense, shard: {tp: 0}}\n"
        "  - {match: 'o_proj\\.weight$', mesh: dense, shard: {tp: 1}}\n")
    (d / "dst.yaml").write_text(
        f"name: vllm-dp{ranks // 16}-tp16\nmodel: config.json\nmesh: {{dp: {ranks // 16}, tp: 16}}\nplacements:\n"
        "  - {match: '(q|k|v|gate|up)_proj\\.weight$|embed_tokens|lm_head', shard: {tp: 0}}\n"
        "  - {match: '(o|down)_proj\\.weight$', shard: {tp: 1}}\n")
    return d / "src.yaml", d / "dst.yaml"


# ------------------------------------------------------------------------------------------------ entry


def main(opts: BenchOptions) -> None:
    """`reshard bench`: launch torchrun, or be one of its workers."""
    if not under_torchrun():
        launch(opts)
    else:
        worker(opts)
