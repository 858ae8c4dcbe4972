"""Planning benchmark: how long `reshard plan` takes on the bundled trainer -> inference layout pairs.

For every pair, without a topology and with `layouts/topologies/dgx-h100.yaml`, it times:
  * layout loading (`load_pair`, model manifests built from scratch, plus the topology file),
  * the whole-plan figures, `Plan(...).stats()`, in reshard and in hybrid mode (a fresh Plan each),
  * one rank's view, `Plan(...).rank_view(r)`, for the first src and the first dst rank (a fresh Plan each,
    so no tensor class is cached: what `reshard plan --rank r` costs),
and checks that reshard mode moves exactly the minimum wire bytes.

    python examples/bench_plan.py [--json FILE] [--repeat N]
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from reshard_cli.layouts import models  # noqa: E402
from reshard_cli.formats import load_pair  # noqa: E402
from reshard_cli.plan.planner import Plan  # noqa: E402
from reshard_cli.base.text import table  # noqa: E402
from reshard_cli.layouts.topology import NO_TOPOLOGY, load_topology  # noqa: E402

PAIRS = [
    ("qwen3-30b-a3b", "megatron-tp2-ep4-pp2", "vllm-tp4-dp4"),
    ("qwen3-235b-a22b", "megatron-tp2-cp2-pp4-ep16", "vllm-tp8-dp8"),
    ("deepseek-v3", "megatron-pp16-ep16", "vllm-tp32-dp8"),
    ("kimi-k2", "megatron-pp16-ep16", "vllm-tp16-dp8"),
]
TOPOLOGIES = [None, ROOT / "layouts" / "topologies" / "dgx-h100.yaml"]


def timed(fn):
    t0 = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t0


def best(fn, repeat: int):
    """(result of the last run, fastest time) over `repeat` runs."""
    times, out = [], None
    for _ in range(repeat):
        out, dt = timed(fn)
        times.append(dt)
    return out, min(times)


def load(model: str, src: str, dst: str, topo_path):
    getattr(models, "_CACHE", {}).clear()  # cold: rebuild bundled manifests, as a fresh `reshard plan` does
    folder = ROOT / "layouts" / model
    src_l, dst_l = load_pair(folder / f"{src}.yaml", folder / f"{dst}.yaml")
    topo = load_topology(topo_path) if topo_path else NO_TOPOLOGY
    return src_l, dst_l, topo


def bench(model: str, src: str, dst: str, topo_path, repeat: int) -> dict:
    (src_l, dst_l, topo), t_load = best(lambda: load(model, src, dst, topo_path), repeat)
    reshard, t_reshard = best(lambda: Plan(src_l, dst_l, topo, mode="reshard").stats(), repeat)
    hybrid, t_hybrid = best(lambda: Plan(src_l, dst_l, topo, mode="hybrid").stats(), repeat)
    views = {}
    for side, rank in (("src", src_l.ranks[0]), ("dst", dst_l.ranks[0])):
        def one_view(rank=rank):
            plan = Plan(src_l, dst_l, topo)  # fresh: no tensor class planned yet
            return timed(lambda: plan.rank_view(rank))
        runs = [one_view() for _ in range(repeat)]
        view = runs[-1][0]
        views[side] = {"rank": rank, "seconds": min(dt for _, dt in runs), "pieces": len(view.pieces),
                       "broadcasts": len(view.bcasts)}
    return {
        "pair": f"{model}: {src} -> {dst}",
        "model": model,
        "topology": topo.name,
        "src_ranks": src_l.size,
        "dst_ranks": dst_l.size,
        "tensors": len(src_l.manifest.tensors),
        "bytes": src_l.manifest.nbytes,
        "load_seconds": t_load,
        "stats_seconds": {"reshard": t_reshard, "hybrid": t_hybrid},
        "rank_view": views,
        "reshard": _figures(reshard),
        "hybrid": _figures(hybrid),
        "wire_is_min_reshard": reshard["wire_bytes"] == reshard["min_wire_bytes"],
    }


def _figures(s: dict) -> dict:
    keys = ("pieces", "classes", "wire_bytes", "min_wire_bytes", "broadcast_wire_bytes", "indomain_bytes",
            "max_rank_send_bytes", "ideal_rank_send_bytes", "max_rank_recv_bytes", "ideal_rank_recv_bytes",
            "plan_seconds")
    return {k: s[k] for k in keys}


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.2f}x" if b else "-"


def _over(actual: float, ideal: float) -> str:
    return f"{100.0 * (actual - ideal) / ideal:+.1f}" if ideal else "-"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--json", type=Path, help="also write every figure as JSON")
    ap.add_argument("--repeat", type=int, default=1, help="runs per timing; the fastest is reported")
    args = ap.parse_args()

    rows, results = [], []
    for model, src, dst in PAIRS:
        for topo_path in TOPOLOGIES:
            r = bench(model, src, dst, topo_path, max(args.repeat, 1))
            results.append(r)
            h, rs = r["hybrid"], r["reshard"]
            rows.append([
                f"{model} {src}->{dst}", r["topology"], f"{r['src_ranks']}->{r['dst_ranks']}", r["tensors"],
                f"{rs['pieces']}/{h['pieces']}", f"{r['load_seconds']:.2f}",
                f"{r['stats_seconds']['reshard']:.2f}/{r['stats_seconds']['hybrid']:.2f}",
                f"{r['rank_view']['src']['seconds'] * 1e3:.0f}/{r['rank_view']['dst']['seconds'] * 1e3:.0f}",
                "yes" if r["wire_is_min_reshard"] else "NO",
                _ratio(h["broadcast_wire_bytes"], h["wire_bytes"]),
                f"{_over(rs['max_rank_send_bytes'], rs['ideal_rank_send_bytes'])}/"
                f"{_over(h['max_rank_send_bytes'], h['ideal_rank_send_bytes'])}",
            ])
            print(f"  done: {model} {r['topology']}", file=sys.stderr, flush=True)
    print(table(["pair", "topology", "ranks", "tensors", "pieces r/h", "load s", "stats s r/h",
                 "rank-view ms src/dst", "wire==min (r)", "bcast/wire (h)", "busiest send vs ideal % r/h"], rows))
    print("  r = --mode reshard, h = --mode hybrid (the default). bcast/wire: gather->broadcast wire bytes over "
          "this plan's wire bytes.")
    if args.json:
        args.json.write_text(json.dumps({"python": sys.version.split()[0], "results": results}, indent=1) + "\n")
        print(f"  wrote {args.json}")
    if not all(r["wire_is_min_reshard"] for r in results):
        sys.exit(1)


if __name__ == "__main__":
    main()
