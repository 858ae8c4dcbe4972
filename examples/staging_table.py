"""What bounded staging costs: refit time and the staging each worker measured, against the budget, on a tiny
Qwen3-MoE of tens of layers in a real vLLM engine (CPU build), all at once and in about 2, 4 and 8 groups.

    python examples/staging_table.py --layers 24 --tp 1 --iters 3 [--json OUT]

One engine, one 2-process FSDP2 trainer (examples/vllm_refit.py's); for each budget the trainer engine is built
again (the same processes, the same port) and refits `--iters` times; the table gives the groups, the median
refit time, the most any worker staged at once (measured), the budget, the largest layer and all of a worker's
weights.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

GROUPS = (1, 2, 4, 8)  # the budgets: all at once, then about 2, 4 and 8 groups


def budgets(model_dir: str, tp: int) -> list[float]:
    """A budget in MiB per count of GROUPS (0: one group)."""
    import vllm_refit as vr

    largest = vr.stage_budget_mb(model_dir, tp, 1.0)
    layers = json.load(open(os.path.join(model_dir, "config.json")))["num_hidden_layers"]
    return [0.0 if g == 1 else largest * layers / g for g in GROUPS]


def rank1(model_dir: str, tp: int, ports: dict, iters: int) -> None:
    import torch.distributed as dist

    import vllm_refit as vr

    trainer = vr.Trainer(1, model_dir, ports["trainer"])
    for stage_mb in budgets(model_dir, tp):
        engine = vr.engines(trainer, None, model_dir, tp, ports, "reshard", stage_mb=stage_mb)
        for _ in range(iters + 1):
            engine.send_weights()
        engine.shutdown()
    dist.destroy_process_group()


def main() -> int:
    import torch.multiprocessing as mp

    import vllm_refit as vr
    from reshard_cli.base.ports import free_port
    from reshard_cli.engines.vllm.clients import LLMClient

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--json")
    args = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="staging-table-") as root:
        model_dir = vr.make_model("qwen3-moe", root, config=dict(vr.CONFIGS["qwen3-moe"],
                                                                  num_hidden_layers=args.layers))
        ports = {"trainer": free_port(), "reshard": free_port()}
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        if args.tp > 1:
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(args.tp))
            os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
        other = mp.get_context("spawn").Process(target=rank1, args=(model_dir, args.tp, ports, args.iters))
        other.start()
        llm = vr.make_engine(model_dir, args.tp, weight_transfer_config={"backend": "reshard"})
        trainer = vr.Trainer(0, model_dir, ports["trainer"])
        for stage_mb in budgets(model_dir, args.tp):
            engine = vr.engines(trainer, LLMClient(llm), model_dir, args.tp, ports, "reshard", stage_mb=stage_mb)
            engine.send_weights()  # builds the plan
            steps = [vr.summarize(engine.send_weights()) for _ in range(args.iters)]
            engine.shutdown()
            last = steps[-1]
            rows.append({"stage_mb": stage_mb, "groups": last["groups"],
                         "refit_seconds": statistics.median(s["refit_seconds"] for s in steps),
                         **{k: last[k] for k in ("peak_staged_bytes", "stage_budget_bytes", "largest_layer_bytes",
                                                 "worker_weight_bytes")}})
            r = rows[-1]
            print(f"budget {'all' if not stage_mb else f'{stage_mb:.2f} MiB':>11}: {r['groups']:2d} groups, refit "
                  f"{r['refit_seconds'] * 1e3:7.1f} ms, staged at most {r['peak_staged_bytes'] / 1e6:6.2f} MB "
                  f"(largest layer {r['largest_layer_bytes'] / 1e6:.2f} MB, all weights "
                  f"{r['worker_weight_bytes'] / 1e6:.2f} MB)", flush=True)
        import torch.distributed as dist

        dist.destroy_process_group()
        other.join(timeout=120)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"layers": args.layers, "tp": args.tp, "iters": args.iters, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
