"""What `reshard bench` runs: its options, the cases of a suite (or the one --src/--dst pair) and the size sweep.

A suite YAML names its cases; a case's `src:` / `dst:` / `topology:` is a path relative to the suite file
where that file exists, else a bundled name (`demo/train`, `dgx-h100`), or an inline mapping.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from reshard_cli.errors import ConfigError
from reshard_cli.formats import load_pair
from reshard_cli.layouts import bundled
from reshard_cli.layouts.models import bundled_models
from reshard_cli.layouts.topology import load_topology
from reshard_cli.layouts.yamlio import check_keys, line_of, load_yaml
from reshard_cli.transfer.launcher import JobOptions

MODES = ("auto", "reshard", "hybrid", "broadcast", "live", "dcp")  # every case is timed in each, after the link limit
ENGINE_MODES = ("auto", "reshard", "hybrid", "broadcast")
SHM = "@shm"  # a mode's name over the shared-memory transport (`--transport shm`): "reshard@shm"
CARRIED_MODES = (*ENGINE_MODES, "live")  # the modes `--transport shm` also times over shared memory


def modes_of(transport: str) -> tuple:
    """Every mode a case is timed in: MODES, each of CARRIED_MODES followed by its twin over shared memory when
    `transport` is shm (side by side)."""
    out = []
    for m in MODES:
        out.append(m)
        if transport == "shm" and m in CARRIED_MODES:
            out.append(m + SHM)
    return tuple(out)


def base_mode(mode: str) -> str:
    """"reshard@shm" -> "reshard"."""
    return mode.removesuffix(SHM)


LIVE_MODE = "auto"  # the plan the live API (`Refit`) runs in bench: its default
CASE_KEYS = ("name", "src", "dst", "scale", "bucket_mb", "topology", "reshard_match")
SUITE_KEYS = ("name", "description", "cases", "sweep")


@dataclass(frozen=True)
class Case:
    name: str
    src: Path | str  # a path, or a bundled layout name
    dst: Path | str
    scale: int = 1
    bucket_mb: float = 64.0
    topology: Path | str | None = None
    reshard_match: str | None = None  # None: the plan's default


@dataclass
class Suite:
    name: str
    cases: list[Case]
    sweep_case: str | None = None  # name of the case the size sweep repeats
    sizes: tuple[int, ...] = ()


@dataclass(kw_only=True)
class BenchOptions(JobOptions):
    src: Path | None = None
    dst: Path | None = None
    suite: str | None = None
    iters: int = 5
    sizes: str | None = None
    json: Path | None = None
    plot: Path | None = None
    plan_scaling: bool = True
    dcp_dir: Path | None = None


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


def _plain(x: Any) -> Any:
    """YAML mappings (dict subclasses with line numbers) as plain dicts/lists, for yaml.safe_dump."""
    if isinstance(x, dict):
        return {str(k): _plain(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_plain(v) for v in x]
    return x


def load_suite(spec: str, workdir: Path) -> Suite:
    """Read a suite YAML (a path or a bundled name such as `cpu`). Inline layouts/topologies are written into
    `workdir` (this process's own)."""
    try:
        path = bundled.resolve("suite", spec)
    except ConfigError as e:
        raise ConfigError(str(e), key="--suite") from None
    file = str(path)
    doc = load_yaml(path)
    check_keys(doc, SUITE_KEYS, file=file, where="", required=("cases",))
    raw = doc["cases"]
    if not isinstance(raw, list) or not raw:
        raise ConfigError("expected a non-empty list of cases", file=file, key="cases", line=line_of(doc, "cases"))
    cases: list[Case] = []
    for i, c in enumerate(raw):
        cases.append(_load_case(c, i, cases, path, workdir))
    sweep_case, sizes = _load_sweep(doc.get("sweep"), cases, file)
    return Suite(str(doc.get("name") or path.stem), cases, sweep_case, sizes)


def _load_case(c, i: int, cases: list[Case], path: Path, workdir: Path) -> Case:
    """Case `i` of a suite file (`cases`: the ones before it, whose names it may not repeat)."""
    file, where = str(path), f"cases[{i}]"
    check_keys(c, CASE_KEYS, file=file, where=where, required=("src", "dst"))
    name = str(c.get("name") or f"case{i}")
    if not re.fullmatch(r"[\w.+-]+", name):
        raise ConfigError("a case name may use letters, digits and . _ + -", file=file, key=f"{where}.name",
                          line=line_of(c, "name"))
    if any(x.name == name for x in cases):
        raise ConfigError(f"duplicate case name {name!r}", file=file, key=f"{where}.name", line=line_of(c, "name"))
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

    def file_or_inline(key: str) -> Path | str:
        return _file_or_inline(c, key, name, where, path, workdir)

    return Case(name, file_or_inline("src"), file_or_inline("dst"), scale, float(bucket),
                file_or_inline("topology") if c.get("topology") is not None else None, match)


def _file_or_inline(c, key: str, name: str, where: str, path: Path, workdir: Path) -> Path | str:
    """A case's `src:` / `dst:` / `topology:`: a path (relative to the suite file where that exists), a bundled
    name, or an inline mapping (written into `workdir`)."""
    import yaml

    base, v = path.parent, c[key]
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
        raise ConfigError("expected a YAML path, a bundled name or an inline mapping", file=str(path),
                          key=f"{where}.{key}", line=line_of(c, key))
    p = Path(v).expanduser()
    if p.is_absolute():
        return p
    return base / p if (base / p).exists() else v  # else a bundled name, resolved when loaded


def _load_sweep(sw, cases: list[Case], file: str) -> tuple[str | None, tuple[int, ...]]:
    """A suite's `sweep:` (the case it repeats, the sizes), or (None, ()) without one."""
    if sw is None:
        return None, ()
    check_keys(sw, ("case", "sizes"), file=file, where="sweep", required=("sizes",))
    sweep_case = sw.get("case", cases[0].name)
    if sweep_case not in [x.name for x in cases]:
        raise ConfigError(f"no case named {sweep_case!r}", file=file, key="sweep.case", line=line_of(sw, "case"))
    raw_sizes = sw["sizes"]
    if not isinstance(raw_sizes, list) or not raw_sizes or \
            any(not isinstance(s, int) or isinstance(s, bool) or s < 1 for s in raw_sizes):
        raise ConfigError("expected a list of integers >= 1", file=file, key="sweep.sizes",
                          line=line_of(sw, "sizes"))
    return sweep_case, tuple(dict.fromkeys(raw_sizes))


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


def case_named(suite: Suite, name: str) -> Case:
    return next(c for c in suite.cases if c.name == name)


def sweep_cases(suite: Suite) -> list[Case]:
    """The sweep's case at each size (the one at the case's own scale is measured with the cases, and reused)."""
    if not suite.sizes or suite.sweep_case is None:
        return []
    base = case_named(suite, suite.sweep_case)
    return [replace(base, scale=s) for s in suite.sizes]


def world_needed(suite: Suite) -> int:
    """Load every pair (validating it) and return the world size the job needs."""
    world = 0
    for c in suite.cases + [c for c in sweep_cases(suite) if c.scale != case_named(suite, c.name).scale]:
        src, dst = load_pair(c.src, c.dst, scale=c.scale)
        if c.topology is not None:
            load_topology(c.topology)
        world = max(world, max(src.ranks) + 1, max(dst.ranks) + 1)
    return world
