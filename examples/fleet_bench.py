"""A fleet in one refit vs one refit per replica vs gather -> broadcast, on CPU with gloo: `reshard run` from a
2-rank FSDP-style trainer into N replicas of a vLLM TP1 layout (`mesh: {dp: N, tp: 1}`) whose workers share
one NVLink domain (a topology file), for N = 1, 2, 4.

    python examples/fleet_bench.py                       # N = 1 2 4, a 200 MB model, 5 timed refits each
    python examples/fleet_bench.py --replicas 1 2 --iters 3 --json fleet.json

  fleet        one `reshard run --mode reshard` into all N replicas: the trainer sends each byte once into
               the domain, the replicas forward the rest to each other
  per replica  N separate refits, one replica each (one run into a single replica, its time and bytes x N)
  broadcast    `--mode broadcast` into all N: the root gathers each tensor and broadcasts it to every worker

Time is the median refit after a warm-up (the slowest rank's, between barriers); wire is what crosses a domain
boundary (the trainer's sends). Every run verifies every destination element against the source.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

CONFIG = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 32000, "hidden_size": 1024,
          "intermediate_size": 3072, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 8,
          "head_dim": 64, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def run(root: Path, replicas: int, mode: str, iters: int) -> dict:
    dst = root / f"infer-dp{replicas}.yaml"
    dst.write_text(f"model: config.json\nformat: vllm\nmesh: {{dp: {replicas}, tp: 1}}\n")
    topo = root / f"domain-dp{replicas}.yaml"
    topo.write_text(f"name: one-domain\ndomains: ['2-{1 + replicas}']\n")
    out = root / f"{mode}-dp{replicas}.json"
    p = subprocess.run([sys.executable, "-m", "reshard_cli", "run", "--src", "train.yaml", "--dst", dst.name,
                        "--topology", topo.name, "--mode", mode, "--iters", str(iters), "--no-link-test", "--quiet",
                        "--json", out.name], cwd=root, capture_output=True, text=True)
    if p.returncode != 0:
        raise SystemExit(f"reshard run failed ({mode}, {replicas} replicas): {p.stdout[-1500:]}{p.stderr[-1500:]}")
    doc = json.loads(out.read_text())
    if doc["wrong"]:
        raise SystemExit(f"{mode}, {replicas} replicas: {doc['wrong']} wrong elements")
    return {"seconds": doc["seconds"], "wire_bytes": doc["wire_bytes"],
            "forwarded_bytes": sum(v["forwarded_bytes"] for v in doc["paths"].values())}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--replicas", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--iters", type=int, default=6)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="fleet-bench-") as tmp:
        root = Path(tmp)
        (root / "config.json").write_text(json.dumps(CONFIG))
        (root / "train.yaml").write_text("model: config.json\nmesh: {fsdp: 2}\nplacements:\n"
                                         "  - {match: '.', shard: {fsdp: 0}}\n")
        one = run(root, 1, "reshard", args.iters)
        for n in args.replicas:
            fleet = one if n == 1 else run(root, n, "reshard", args.iters)
            bcast = run(root, n, "broadcast", args.iters)
            rows.append({"replicas": n, "fleet": fleet,
                         "per_replica": {"seconds": n * one["seconds"], "wire_bytes": n * one["wire_bytes"]},
                         "broadcast": bcast})
    print(f"{'replicas':>8}  {'fleet ms':>9} {'wire MB':>8} {'fwd MB':>7}  {'per-replica ms':>14} {'wire MB':>8}  "
          f"{'broadcast ms':>12} {'wire MB':>8}")
    for r in rows:
        f, s, b = r["fleet"], r["per_replica"], r["broadcast"]
        print(f"{r['replicas']:>8}  {f['seconds'] * 1e3:>9.1f} {f['wire_bytes'] / 1e6:>8.1f} "
              f"{f['forwarded_bytes'] / 1e6:>7.1f}  {s['seconds'] * 1e3:>14.1f} {s['wire_bytes'] / 1e6:>8.1f}  "
              f"{b['seconds'] * 1e3:>12.1f} {b['wire_bytes'] / 1e6:>8.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
