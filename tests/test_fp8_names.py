"""FP8 as vLLM 0.32 names it (`layouts.quant`, `formats.vllm`): `engine: {quantization: fp8}` is an FP8-serialized
checkpoint, block or per-tensor as its `quantization_config` says; `fp8_per_tensor` and `fp8_per_block` are
vLLM's online quantization of a BF16 checkpoint; everything else is one line naming the value, the file and
key, and what is supported. No vLLM needed: the layouts and the storage reshard derives from them."""
import json
import subprocess
import sys

import pytest

from reshard_cli.errors import ConfigError
from reshard_cli.formats import get, load_layout
from reshard_cli.layouts.quant import amax_names

# Qwen3-MoE: q 4 x 64 = 256 rows, k = v = 2 x 64 = 128 (a TP2 shard of k is 64 rows), experts 4 x 128
BF16 = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=1000, hidden_size=256,
            intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
            mlp_only_layers=[], norm_topk_prob=True, tie_word_embeddings=False, torch_dtype="bfloat16")
PER_TENSOR = {**BF16, "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}}
BLOCK = {**BF16, "quantization_config": {**PER_TENSOR["quantization_config"], "weight_block_size": [128, 128]}}


def _layout(tmp_path, config, quantization, mesh="{tp: 1}"):
    (tmp_path / "config.json").write_text(json.dumps(config))
    path = tmp_path / "vllm.yaml"
    path.write_text(f"model: config.json\nformat: vllm\nmesh: {mesh}\nengine: {{quantization: {quantization}}}\n")
    return load_layout(path)


def _refused(tmp_path, config, quantization, mesh="{tp: 1}") -> str:
    with pytest.raises(ConfigError) as info:
        layout = _layout(tmp_path, config, quantization, mesh)
        for rank in layout.ranks:
            get("vllm").storage(layout, rank)
    line = str(info.value)
    assert "\n" not in line and "vllm.yaml" in line and "engine.quantization" in line, line
    return line


@pytest.mark.parametrize("value", ["mxfp8", "fp8_per_channel", "modelopt_fp4", "mxfp4", "nvfp4_per_token",
                                   "int8_per_channel_weight_only", "online", "FP8", "fp16"])
def test_other_vllm_names_are_refused_in_one_line(tmp_path, value):
    line = _refused(tmp_path, BF16, value)
    assert f"{value!r} is not supported" in line and "fp8_per_tensor" in line and "fp8_per_block" in line, line


def test_fp8_on_a_bf16_checkpoint_gets_vllms_own_advice(tmp_path):
    line = _refused(tmp_path, BF16, "fp8")
    assert "no quantization_config" in line and "use --quantization fp8_per_tensor" in line, line
    assert ":4: engine.quantization:" in line, line  # file:line: key


@pytest.mark.parametrize("value", ["fp8_per_tensor", "fp8_per_block"])
def test_online_names_on_a_quantized_checkpoint_are_refused(tmp_path, value):
    line = _refused(tmp_path, BLOCK, value)
    assert "online quantization of a BF16 checkpoint" in line and "use fp8" in line, line


@pytest.mark.parametrize("qc, words", [
    ({"quant_method": "modelopt", "quant_algo": "NVFP4"}, "'modelopt', not fp8"),
    ({"quant_method": "fp8", "activation_scheme": "static"}, "static input scales"),
    ({"quant_method": "fp8", "fmt": "e5m2"}, "'e5m2' is not supported"),
])
def test_checkpoint_configs_reshard_does_not_refit(tmp_path, qc, words):
    assert words in _refused(tmp_path, {**BF16, "quantization_config": qc}, "fp8")


def test_the_schemes(tmp_path):
    block = _layout(tmp_path, BLOCK, "fp8").quantization
    assert (block.method, block.block, block.online, block.stored_fp8) == ("fp8", (128, 128), False, True)
    tensor = _layout(tmp_path, PER_TENSOR, "fp8").quantization
    assert (tensor.block, tensor.online, tensor.stored_fp8) == (None, False, True)
    online = _layout(tmp_path, BF16, "fp8_per_tensor").quantization
    assert (online.method, online.block, online.online, online.stored_fp8) == ("fp8_per_tensor", None, True, False)
    assert online.router  # Qwen3-MoE's GateLinear gets the online config too
    per_block = _layout(tmp_path, BF16, "fp8_per_block").quantization
    assert (per_block.block, per_block.online, per_block.stored_fp8) == ((128, 128), True, True)
    assert "BF16 on the wire" in online.describe() and "quantized by the senders" in per_block.describe()


def test_per_tensor_checkpoint_storage_has_one_scale_slot_per_checkpoint_tensor(tmp_path):
    layout = _layout(tmp_path, PER_TENSOR, "fp8", "{tp: 2}")
    ets = {et.name: et for et in get("vllm").storage(layout, 1)}
    qkv, scale = ets["model.layers.0.self_attn.qkv_proj.weight"], ets["model.layers.0.self_attn.qkv_proj.weight_scale"]
    assert (qkv.dtype, qkv.shape, scale.shape, scale.dtype) == ("float8_e4m3fn", (256, 256), (3,), "float32")
    assert [v.region for v in scale.scales] == [(slice(0, 1),), (slice(1, 2),), (slice(2, 3),)]
    w13 = ets["model.layers.0.mlp.experts.routed_experts.w13_weight_scale"]
    w2 = ets["model.layers.0.mlp.experts.routed_experts.w2_weight_scale"]
    assert w13.shape == (4, 2) and [v.region for v in w13.scales[:2]] == [(0, slice(0, 1)), (0, slice(1, 2))]
    assert w2.shape == (4,) and [v.region for v in w2.scales[:2]] == [(slice(0, 1),), (slice(1, 2),)]
    # Qwen3-MoE's router takes the quantization config; this one does not list it as not converted
    assert ets["model.layers.0.mlp.gate.weight"].dtype == "float8_e4m3fn"
    names = amax_names(layout)
    assert "model.layers.0.self_attn.q_proj.weight" in names and "model.embed_tokens.weight" not in names


def test_online_storage(tmp_path):
    per_tensor = _layout(tmp_path, BF16, "fp8_per_tensor", "{tp: 2}")
    assert {et.dtype for et in get("vllm").storage(per_tensor, 0)} == {"bfloat16"}  # vLLM quantizes it
    assert "model.layers.1.mlp.gate.weight" in amax_names(per_tensor)
    per_block = _layout(tmp_path, BF16, "fp8_per_block")  # TP1: every shard holds whole blocks
    ets = {et.name: et for et in get("vllm").storage(per_block, 0)}
    assert ets["model.layers.0.self_attn.qkv_proj.weight_scale_inv"].shape == (4, 2)
    assert ets["model.layers.0.mlp.experts.routed_experts.w13_weight_scale_inv"].shape == (4, 2, 2)
    assert amax_names(per_block) == []


def test_fp8_per_block_where_grids_do_not_meet_is_refused_in_one_line(tmp_path):
    line = _refused(tmp_path, BF16, "fp8_per_block", "{tp: 2}")  # k_proj: a TP2 shard is 64 rows
    assert "k_proj.weight: 64 rows" in line and "whole 128x128 blocks" in line and "fp8_per_tensor" in line, line


def test_reshard_plan_refuses_in_one_line(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(BF16))
    (tmp_path / "src.yaml").write_text("model: config.json\nmesh: {fsdp: 2}\nplacements:\n"
                                       "  - {match: '.', shard: {fsdp: 0}}\n")
    (tmp_path / "dst.yaml").write_text("model: config.json\nformat: vllm\nmesh: {tp: 1}\n"
                                       "engine: {quantization: fp8}\n")
    r = subprocess.run([sys.executable, "-m", "reshard_cli", "plan", "--src", tmp_path / "src.yaml", "--dst",
                        tmp_path / "dst.yaml"], capture_output=True, text=True, timeout=120)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 2 and len(lines) == 1 and "use --quantization fp8_per_tensor" in lines[0], r.stderr
