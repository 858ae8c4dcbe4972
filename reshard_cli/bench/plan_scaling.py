"""How planning scales: `Plan(...).stats()` timed cold on the bundled large trainer -> inference pairs and on
synthetic qwen3-MoE-shaped layouts of up to 1024 ranks per side and ~100 k tensors."""
from __future__ import annotations

import json
import tempfile
import time
from pathlib import Path
from typing import Callable

from reshard_cli.formats import load_pair
from reshard_cli.layouts import models
from reshard_cli.plan.planner import Plan, no_gc

# Bundled trainer -> inference pairs (as examples/bench_plan.py) and synthetic layouts for plan scaling:
# (ranks per side, layers, experts) of a qwen3-MoE-shaped config; tensors ~= layers * (3 * experts + 10).
PLAN_PAIRS = [
    ("qwen3-30b-a3b", "megatron-tp2-ep4-pp2", "vllm-tp4-dp4"),
    ("qwen3-235b-a22b", "megatron-tp2-cp2-pp4-ep16", "vllm-tp8-dp8"),
    ("deepseek-v3", "megatron-pp16-ep16", "vllm-tp32-dp8"),
    ("kimi-k2", "megatron-pp16-ep16", "vllm-tp16-dp8"),
]
SYNTHETIC_POINTS = [(256, 32, 256), (512, 32, 256), (1024, 32, 256), (1024, 32, 512), (1024, 64, 512)]


def plan_scaling(say: Callable[[str], None] | None = None) -> list[dict]:
    """Time Plan(...).stats() on the bundled large pairs and on synthetic layouts (256..1024 ranks per side,
    up to ~100 k tensors); each row has pieces and seconds."""
    rows = []
    for model, s, d in PLAN_PAIRS:
        if say:
            say(f"plan scaling: {model}")
        rows.append(_time_plan(f"{model} {s}->{d}", f"{model}/{s}", f"{model}/{d}"))  # bundled names
    with tempfile.TemporaryDirectory(prefix="reshard-bench-plan-") as tmp:
        for ranks, layers, experts in SYNTHETIC_POINTS:
            if say:
                say(f"plan scaling: synthetic {ranks} ranks, {layers} layers x {experts} experts")
            src, dst = write_synthetic_pair(Path(tmp), ranks, layers, experts)
            rows.append(_time_plan(f"synthetic dp{ranks // 8}xtp8->dp{ranks // 16}xtp16 E{experts}", src, dst))
    return rows


def _time_plan(name: str, src: Path | str, dst: Path | str, mode: str = "reshard") -> dict:
    models._CACHE.clear()  # cold, as a fresh `reshard plan`
    t0 = time.perf_counter()
    with no_gc():  # as `reshard plan` loads them (stats() pauses the collector itself)
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
