"""Storage maps of the families `formats.vllm` has no hand rules for, learnt from vLLM's own loaders.

Every rank's model (each TP rank of each pipeline stage; times the data-parallel replicas where expert
parallelism spans them) is built on the meta device and its `load_weights` traced (`trace.derive_meta`),
then the copies are written as a `formats.derived` map to the cache, where planning reads them without
vLLM. The derivation runs in child processes (`provide`, reshard's `reshard.storage_derivers` entry point;
`RESHARD_DERIVE_JOBS` of them, one per core by default, each tracing its share of the ranks): vLLM's
parallel state and config context of the process that asks (a live worker) stay untouched.

    python -m reshard_cli.engines.vllm.maps < request.json     # {"config", "tp", "ranks": [...], ...}
"""
from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from reshard_cli.engines.vllm import compat
from reshard_cli.errors import ConfigError
from reshard_cli.formats import derived

JOBS_ENV = "RESHARD_DERIVE_JOBS"


def derive_ranks(config: dict, tp: int, expert_parallel: bool, placement: str, checkpoint: dict, dp: int,
                 ranks, pp: int = 1, all2all: str = derived.ALL2ALL_DEFAULT) -> list[dict]:
    """The map entries (`formats.derived.encode`'s `ranks[r]`) of map ranks `ranks` (r = (dp_rank * pp +
    pp_rank) * tp + tp_rank), each rank's load traced in this process (under MoE all2all backend `all2all`)."""
    from reshard_cli.engines.vllm.derive import EXACT, derive
    from reshard_cli.engines.vllm.trace import NotOnMeta, derive_meta

    out = []
    for r in ranks:
        dp_rank, pp_rank, tp_rank = derived.coord(r, tp, pp)
        options = dict(tp_size=tp, tp_rank=tp_rank, expert_parallel=expert_parallel, expert_placement=placement,
                       checkpoint=checkpoint, dp_size=dp, dp_rank=dp_rank, pp_size=pp, pp_rank=pp_rank,
                       all2all=all2all)
        try:
            d = derive_meta(config, **options)
        except NotOnMeta as e:  # a real build, each element its own address, where it fits
            if sum(math.prod(s) for s in checkpoint.values()) >= EXACT:
                raise ConfigError(f"{e}; at this size ({sum(math.prod(s) for s in checkpoint.values())} "
                                  f"elements) no derivation can place it", key="model") from None
            d = derive(config, **options)
        unknown = [(s, p) for s, p, f, _n in d.transformed if f is None]
        if unknown:
            raise ConfigError(f"vLLM's loader writes {unknown[0][1]} from {unknown[0][0]} by a computation reshard "
                              f"cannot name ({len(unknown)} such): this family cannot be refit into vLLM", key="model")
        params = [[p.name, list(p.shape), p.dtype,
                   [[c.source, list(c.offsets), list(c.sizes), derived.encode_region(c.region), c.transform]
                    for c in p.copies]]
                  for p in d.params.values() if p.copies]
        out.append({"params": params, "unplaced": list(d.unplaced)})
    return out


def _check_dp(dp: int, expert_parallel: bool) -> None:
    if dp > 1 and not expert_parallel:
        raise ConfigError("data-parallel replicas hold the same storage; only expert parallelism spans them",
                          key="model")


def derive_map(config: dict, tp: int, expert_parallel: bool, placement: str, checkpoint: dict, dp: int = 1,
               pp: int = 1, all2all: str = derived.ALL2ALL_DEFAULT) -> dict:
    """The `formats.derived` map of `config` over `tp` ranks of `pp` stages (times `dp` replicas where expert
    parallelism spans them: rank (dp_rank * pp + pp_rank) * tp + tp_rank; under MoE all2all backend
    `all2all`), every rank traced in this process."""
    _check_dp(dp, expert_parallel)
    ranks = derive_ranks(config, tp, expert_parallel, placement, checkpoint, dp, range(dp * pp * tp), pp, all2all)
    return derived.encode(config, tp, expert_parallel, placement, compat.version(), ranks, dp, pp, all2all)


def jobs(ranks: int) -> int:
    """Child processes a derivation of `ranks` ranks runs at once: `RESHARD_DERIVE_JOBS`, else one per core
    this process may use, at most one per rank (each traces its share of the ranks)."""
    raw = os.environ.get(JOBS_ENV)
    try:
        n = int(raw) if raw else len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    except ValueError:
        raise ConfigError(f"expected a number of processes, got {raw!r}", key=JOBS_ENV) from None
    return max(1, min(n or 1, ranks))


def provide(config: dict, tp: int, expert_parallel: bool, placement: str, checkpoint: dict,
            dp: int = 1, pp: int = 1, all2all: str = derived.ALL2ALL_DEFAULT) -> dict | None:
    """`derive_map` in child processes (module doc; `jobs` of them, each tracing every jobs-th rank); a failure
    there is one ConfigError with its last line. None where vLLM is not installed."""
    if derived.engine_version() is None:
        return None
    _check_dp(dp, expert_parallel)
    what = f"vLLM's storage of {config.get('model_type')!r} at {derived.grid_name(tp, dp, pp)}"
    limit = float(os.environ.get("RESHARD_DERIVE_TIMEOUT", "600"))
    total = dp * pp * tp
    n = jobs(total)
    with tempfile.TemporaryDirectory(prefix="reshard-derive-") as tmp:
        children = []
        for j in range(n):
            out = Path(tmp, f"ranks{j}.json")
            request = json.dumps({"config": config, "tp": tp, "expert_parallel": expert_parallel, "dp": dp,
                                  "pp": pp, "placement": placement, "checkpoint": checkpoint, "out": str(out),
                                  "all2all": all2all,
                                  "ranks": list(range(j, total, n))})
            Path(tmp, f"request{j}.json").write_text(request)
            with open(Path(tmp, f"request{j}.json")) as stdin, open(Path(tmp, f"log{j}"), "w") as log:
                children.append((out, subprocess.Popen([sys.executable, "-m", "reshard_cli.engines.vllm.maps"],
                                                       stdin=stdin, stdout=log, stderr=subprocess.STDOUT)))
        try:
            results = [_collect(proc, out, what, time.monotonic() + limit, limit) for out, proc in children]
        finally:
            for _out, proc in children:
                if proc.poll() is None:
                    proc.kill()
                    proc.wait()
        ranks: list = [None] * total
        for j, part in enumerate(results):
            for r, entry in zip(range(j, total, n), part["ranks"]):
                ranks[r] = entry
        m = derived.encode(config, tp, expert_parallel, placement, results[0]["vllm"], ranks, dp, pp, all2all)
        m["seconds"] = max(part["seconds"] for part in results)
        return m


def _collect(proc, out: Path, what: str, deadline: float, limit: float) -> dict:
    """One child's ranks (`_main`'s file), or one ConfigError with the child's last `reshard:` line."""
    try:
        proc.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        raise ConfigError(f"deriving {what} took longer than {limit:g} s (RESHARD_DERIVE_TIMEOUT)",
                          key="model") from None
    if proc.returncode or not out.exists():
        text = out.with_name(out.stem.replace("ranks", "log")).read_text(errors="replace")
        lines = [ln for ln in text.strip().splitlines() if ln.startswith("reshard:")]
        why = lines[-1].removeprefix("reshard: ") if lines else f"exit {proc.returncode}"
        raise ConfigError(f"deriving {what} failed: {why}", key="model")
    return json.loads(out.read_text())


def _main() -> int:
    req = json.loads(sys.stdin.read())
    t0 = time.perf_counter()
    try:
        ranks = derive_ranks(req["config"], req["tp"], req["expert_parallel"], req["placement"], req["checkpoint"],
                             req.get("dp", 1), req["ranks"], req.get("pp", 1),
                             req.get("all2all", derived.ALL2ALL_DEFAULT))
    except ConfigError as e:
        print(f"reshard: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - vLLM's own failure, in one line for the parent's error
        print(f"reshard: vLLM failed building or loading it: {type(e).__name__}: {' '.join(str(e).split())[:300]}",
              file=sys.stderr)
        return 1
    Path(req["out"]).write_text(json.dumps({"ranks": ranks, "vllm": compat.version(),
                                            "seconds": round(time.perf_counter() - t0, 3)}))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
