"""Storage maps of the families `formats.vllm` has no hand rules for, learnt from vLLM's own loaders.

Every TP rank's model is built on the meta device and its `load_weights` traced (`trace.derive_meta`), then
the copies are written as a `formats.derived` map to the cache, where planning reads them without vLLM. The
derivation runs in a child process (`provide`, reshard's `reshard.storage_derivers` entry point): vLLM's
parallel state and config context of the process that asks (a live worker) stay untouched.

    python -m reshard_cli.engines.vllm.maps < request.json     # {"config", "tp", "expert_parallel", ...}
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


def derive_map(config: dict, tp: int, expert_parallel: bool, placement: str, checkpoint: dict) -> dict:
    """The `formats.derived` map of `config` over `tp` ranks, each rank's load traced in this process."""
    from reshard_cli.engines.vllm.derive import EXACT, derive
    from reshard_cli.engines.vllm.trace import NotOnMeta, derive_meta

    ranks = []
    for r in range(tp):
        options = dict(tp_size=tp, tp_rank=r, expert_parallel=expert_parallel, expert_placement=placement,
                       checkpoint=checkpoint)
        try:
            d = derive_meta(config, **options)
        except NotOnMeta as e:  # (EP's expert map): a real build, each element its own address, where it fits
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
        ranks.append({"params": params, "unplaced": list(d.unplaced)})
    return derived.encode(config, tp, expert_parallel, placement, compat.version(), ranks)


def provide(config: dict, tp: int, expert_parallel: bool, placement: str, checkpoint: dict) -> dict | None:
    """`derive_map` in a child process (module doc); a failure there is one ConfigError with its last line.
    None where vLLM is not installed."""
    if derived.engine_version() is None:
        return None
    with tempfile.TemporaryDirectory(prefix="reshard-derive-") as tmp:
        out = Path(tmp, "map.json")
        request = json.dumps({"config": config, "tp": tp, "expert_parallel": expert_parallel,
                              "placement": placement, "checkpoint": checkpoint, "out": str(out)})
        limit = float(os.environ.get("RESHARD_DERIVE_TIMEOUT", "600"))
        try:
            proc = subprocess.run([sys.executable, "-m", "reshard_cli.engines.vllm.maps"], input=request,
                                  capture_output=True, text=True, timeout=limit)
        except subprocess.TimeoutExpired:
            raise ConfigError(f"deriving vLLM's storage of {config.get('model_type')!r} at tp {tp} took longer than "
                              f"{limit:g} s (RESHARD_DERIVE_TIMEOUT)", key="model") from None
        if proc.returncode or not out.exists():
            lines = [ln for ln in (proc.stderr + proc.stdout).strip().splitlines() if ln.startswith("reshard:")]
            why = lines[-1].removeprefix("reshard: ") if lines else f"exit {proc.returncode}"
            raise ConfigError(f"deriving vLLM's storage of {config.get('model_type')!r} at tp {tp} failed: {why}",
                              key="model")
        return json.loads(out.read_text())


def _main() -> int:
    req = json.loads(sys.stdin.read())
    t0 = time.perf_counter()
    try:
        m = derive_map(req["config"], req["tp"], req["expert_parallel"], req["placement"], req["checkpoint"])
    except ConfigError as e:
        print(f"reshard: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - vLLM's own failure, in one line for the parent's error
        print(f"reshard: vLLM failed building or loading it: {type(e).__name__}: {' '.join(str(e).split())[:300]}",
              file=sys.stderr)
        return 1
    m["seconds"] = round(time.perf_counter() - t0, 3)
    Path(req["out"]).write_text(json.dumps(m))
    return 0


if __name__ == "__main__":
    sys.exit(_main())
