"""Every family reshard refits into vLLM, judged by vLLM's own loader (`python examples/vllm_refit.py --models all
--json OUT`).

For each family a tiny config (2-4 layers, every layer kind of the family) at TP1, TP2 and, where it has
experts, TP2 with expert parallelism and DP2 x TP2 with the experts over the replicas (where vLLM runs the MoE
layers sequence-parallel): the `format: vllm` layout is loaded (the seven hand-ruled families from
`formats.vllm`'s rules, any other from a storage map vLLM's own loaders give, `formats.derived`), and on every
rank the storage is judged by `derive.storage_against_load`: vLLM's model class built in this process, loaded
once by its own `load_weights`, once written as a refit writes it, compared bit for bit. Where this vLLM cannot
build the family in a process (a kernel or an import its CPU build lacks) the entry says so in one line.
Token identity (an FSDP2 trainer refitting a running `LLM`, judged by a fresh `LLM` on the saved checkpoint) is
`vllm_refit.run_case`'s, for the families it runs.
"""
from __future__ import annotations

import json
import os

_COMMON = dict(vocab_size=1000, hidden_size=128, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
               tie_word_embeddings=False, torch_dtype="bfloat16")
_MLA = dict(kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
            n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1, moe_layer_freq=1,
            n_group=2, topk_group=1, routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc",
            norm_topk_prob=True, moe_intermediate_size=64)
_MAMBA = dict(_COMMON, architectures=["NemotronHForCausalLM"], model_type="nemotron_h",
              layers_block_type=["mamba", "attention", "mamba", "mlp"], num_attention_heads=4, num_key_value_heads=2,
              head_dim=32, intermediate_size=256, mlp_hidden_act="relu2", ssm_state_size=16, mamba_num_heads=8,
              mamba_head_dim=16, n_groups=2, conv_kernel=4, use_conv_bias=True, mamba_proj_bias=False,
              chunk_size=64, layer_norm_epsilon=1e-5)
_NEXT = dict(_COMMON, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", intermediate_size=256,
             num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
             num_key_value_heads=2, head_dim=64, partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
             linear_key_head_dim=128, linear_value_head_dim=128, linear_num_key_heads=2, linear_num_value_heads=4,
             decoder_sparse_step=1, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
             num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[])  # (head dims the CPU kernels take)
CONFIGS = {
    "llama": dict(_COMMON, architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32),
    "qwen2": dict(_COMMON, architectures=["Qwen2ForCausalLM"], model_type="qwen2", intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2),
    "qwen3": dict(_COMMON, architectures=["Qwen3ForCausalLM"], model_type="qwen3", intermediate_size=256,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=32,
                  tie_word_embeddings=True),
    "qwen3_moe": dict(_COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", intermediate_size=256,
                      moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                      head_dim=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                      norm_topk_prob=True),
    "mixtral": dict(_COMMON, architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, num_local_experts=4,
                    num_experts_per_tok=2),
    "deepseek_v3": dict(_COMMON, **_MLA, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3",
                        intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4),
    "kimi_k2": dict(_COMMON, **_MLA, architectures=["DeepseekV3ForCausalLM"], model_type="kimi_k2",
                    intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4),
    # families vLLM's own loaders place (formats.derived)
    "nemotron_h": _MAMBA,  # Mamba-2 + attention + MLP, 2 B/C groups (dividing TP2)
    "nemotron_h-groups1": dict(_MAMBA, n_groups=1),  # one group: B and C copied to both TP ranks
    "nemotron_h-moe": dict(_MAMBA, layers_block_type=["mamba", "attention", "mamba", "moe"], n_routed_experts=4,
                           num_experts_per_tok=2, moe_intermediate_size=32, moe_shared_expert_intermediate_size=32,
                           n_group=1, topk_group=1, norm_topk_prob=True, routed_scaling_factor=1.0),  # Nemotron 3
    "qwen3_next": _NEXT,
    "qwen3_5": dict(_NEXT, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text", num_experts=0,
                    layer_types=["linear_attention", "full_attention"]),
    "qwen3_5_moe": dict(_NEXT, architectures=["Qwen3_5MoeForCausalLM"], model_type="qwen3_5_moe_text"),
    "deepseek_v32": dict(_COMMON, **_MLA, architectures=["DeepseekV32ForCausalLM"], model_type="deepseek_v32",
                         intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                         index_n_heads=2, index_head_dim=32, index_topk=8),
    "glm4_moe": dict(_COMMON, architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", intermediate_size=256,
                     num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=32, partial_rotary_factor=0.5, moe_intermediate_size=32, n_routed_experts=4,
                     n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True,
                     routed_scaling_factor=1.0, use_qk_norm=True),
    "minimax_m2": dict(_COMMON, architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", intermediate_size=32,
                       num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=16,
                       num_local_experts=4, num_experts_per_tok=2, scoring_func="sigmoid", use_routing_bias=True,
                       use_qk_norm=True),
    "gpt_oss": dict(_COMMON, architectures=["GptOssForCausalLM"], model_type="gpt_oss", intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                    num_local_experts=4, num_experts_per_tok=2, sliding_window=128,
                    layer_types=["sliding_attention", "full_attention"]),
}
EXPERT_KEYS = ("num_experts", "num_local_experts", "n_routed_experts")


def cases(config: dict) -> list[tuple[int, int, bool]]:
    """(tp, dp, expert_parallel) judged for a family: TP1, TP2, and where it has experts TP2 with expert
    parallelism and DP2 x TP2 with the experts over both replicas."""
    return [(1, 1, False), (2, 1, False)] + ([(2, 1, True), (2, 2, True)] if any(config.get(k) for k in EXPERT_KEYS)
                                             else [])


def judge(name: str, config: dict, tp: int, ep: bool, root: str, dp: int = 1) -> dict:
    """One family x parallel config: how its storage was placed and whether it is vLLM's load, rank by rank."""
    from reshard_cli.engines.vllm.derive import storage_against_load
    from reshard_cli.errors import ConfigError
    from reshard_cli.formats import derived, load_layout

    entry = {"family": name, "model_type": config["model_type"], "tp": tp, "dp": dp, "expert_parallel": ep,
             "derived": None, "storage_identical": None, "tokens_identical": None, "unplaced": None, "reason": None}
    path = os.path.join(root, f"{name}-{'dp' + str(dp) + '-' if dp > 1 else ''}tp{tp}{'-ep' if ep else ''}")
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "infer.yaml"), "w") as f:
        f.write(f"model: config.json\nformat: vllm\nmesh: {{{f'dp: {dp}, ' if dp > 1 else ''}tp: {tp}}}\n"
                + ("engine: {expert_parallel: true}\n" if ep else ""))
    try:
        layout = load_layout(os.path.join(path, "infer.yaml"))
        entry["derived"] = not derived.known(layout)
        entry["unplaced"] = (sorted(set.intersection(*(set(r["unplaced"]) for r in derived.map_of(layout)["ranks"])))
                             if entry["derived"] else [])
        lines = [f"rank {r}: {line}" for r in layout.ranks for line in storage_against_load(layout, r, seed=r)]
    except ConfigError as e:
        entry["reason"] = str(e)
        return entry
    entry["storage_identical"] = not lines
    entry["differences"] = lines[:5]
    return entry


def run(root: str) -> list[dict]:
    os.environ.setdefault("RESHARD_DERIVE_TIMEOUT", "180")  # a derivation that cannot finish is named, not waited on
    out = []
    for name, config in CONFIGS.items():
        for tp, dp, ep in cases(config):
            entry = judge(name, config, tp, ep, root, dp)
            out.append(entry)
            state = {True: "identical to vLLM's load", False: "DIFFERS from vLLM's load", None: "not judged"}
            how = {True: "derived from vLLM", False: "hand rules", None: "not placed"}[entry["derived"]]
            where = f"{'dp' + str(dp) + ' ' if dp > 1 else ''}tp{tp}{' ep' if ep else ''}"
            print(f"[{name} {where}] {how}; storage {state[entry['storage_identical']]}"
                  + (f" ({entry['reason'][:160]})" if entry["reason"] else ""), flush=True)
    return out
