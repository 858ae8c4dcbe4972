"""Tests for reshard_cli.layouts.hf_meta: tensor lists learnt from transformers' model classes on the meta device.

Two checks, on tiny configs (seconds each):
- for the families with a hand table in `models.ARCHITECTURES`, the learnt list equals the hand table's
  (name, shape, dtype) set;
- for families without one, the learnt list equals the safetensors header transformers itself writes for a tiny
  real model: `save_pretrained`, reloaded with `from_pretrained` in the config's dtype (which applies the fp32
  rules), saved again. The first save's names and shapes must match too. Three hand-table families are checked
  this way as well.
"""
from __future__ import annotations

import copy
import re

import pytest

pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
if int(transformers.__version__.split(".")[0]) < 5:
    pytest.skip("hf_meta needs transformers >= 5", allow_module_level=True)

import torch  # noqa: E402

from reshard_cli.errors import ConfigError  # noqa: E402
from reshard_cli.layouts import hf_meta  # noqa: E402
from reshard_cli.layouts.hf_meta import tensors_from_transformers  # noqa: E402
from reshard_cli.layouts.models import (  # noqa: E402
    load_manifest,
    manifest_from_hf_config,
    manifest_from_safetensors,
)

# ---- the seven families with a hand table --------------------------------------------------------------------------

_GQA = {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "torch_dtype": "bfloat16"}
_MLA = {"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48,
        "moe_intermediate_size": 16, "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 4,
        "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4, "v_head_dim": 8,
        "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1,
        "moe_layer_freq": 1, "topk_method": "noaux_tc", "n_group": 2, "topk_group": 1, "torch_dtype": "bfloat16",
        "tie_word_embeddings": False}

HAND_TABLE_CONFIGS = {
    "llama": {**_GQA, "model_type": "llama"},
    "llama-attention-bias": {**_GQA, "model_type": "llama", "attention_bias": True},
    "llama-tied-fp32": {**_GQA, "model_type": "llama", "tie_word_embeddings": True, "torch_dtype": "float32"},
    "qwen2": {**_GQA, "model_type": "qwen2", "tie_word_embeddings": False},
    "qwen3": {**_GQA, "model_type": "qwen3", "head_dim": 16, "tie_word_embeddings": True},
    "qwen3_moe": {**_GQA, "model_type": "qwen3_moe", "head_dim": 16, "num_hidden_layers": 3,
                  "moe_intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 2,
                  "decoder_sparse_step": 1, "mlp_only_layers": [0]},
    "mixtral": {**_GQA, "model_type": "mixtral", "num_local_experts": 3, "num_experts_per_tok": 2},
    "deepseek_v3": _MLA,
    "deepseek_v3-no-q-lora-greedy": {**_MLA, "q_lora_rank": None, "topk_method": "greedy", "n_shared_experts": 2},
    # Kimi-K2 is DeepSeek-V3's architecture under a remote-code model_type transformers does not know
    "kimi_k2-as-deepseek_v3": {**_MLA, "n_routed_experts": 6, "num_experts_per_tok": 2},
    # configs on which the two disagree (see KNOWN_DIFFERENCES)
    "llama-mlp-bias": {**_GQA, "model_type": "llama", "mlp_bias": True},
    "deepseek_v3-moe-layer-freq-2": {**_MLA, "num_hidden_layers": 4, "moe_layer_freq": 2},
    "deepseek_v3-no-shared-experts": {**_MLA, "n_shared_experts": 0},
    "deepseek_v3-attention-bias": {**_MLA, "attention_bias": True},
}

# Where transformers and the hand tables disagree: config key -> (regex every name only transformers lists must
# match, regex every name only the hand table lists must match); None: there must be none. Each listed key must
# show at least one difference, so a fix on either side is noticed.
KNOWN_DIFFERENCES: dict[str, tuple[str | None, str | None]] = {
    # transformers' DeepseekV3TopkRouter always holds the buffer; the hand table (like vLLM) only for noaux_tc
    "deepseek_v3-no-q-lora-greedy": (r"model\.layers\.[12]\.mlp\.gate\.e_score_correction_bias", None),
    # transformers ignores moe_layer_freq (MoE on every layer >= first_k_dense_replace); the hand table and vLLM
    # keep layers with i % freq != 0 dense
    "deepseek_v3-moe-layer-freq-2": (r"model\.layers\.[13]\.mlp\.(gate\..*|(shared_)?experts\..*)",
                                     r"model\.layers\.[13]\.mlp\.(gate|up|down)_proj\.weight"),
    # transformers builds a zero-width shared expert for n_shared_experts 0; the hand table lists none
    "deepseek_v3-no-shared-experts": (r"model\.layers\.[12]\.mlp\.shared_experts\.(gate|up|down)_proj\.weight",
                                      None),
    # the hand table ignores attention_bias for MLA
    "deepseek_v3-attention-bias": (r"model\.layers\.\d+\.self_attn\.(q_a_proj|kv_a_proj_with_mqa|o_proj)\.bias",
                                   None),
}


def _as_set(tensors) -> set:
    return {(n, tuple(s), d) for n, s, d in tensors}


def _hand(config: dict) -> set:
    return {(t.name, t.shape, t.dtype) for t in manifest_from_hf_config(config, name="x").tensors}


@pytest.mark.parametrize("key", sorted(HAND_TABLE_CONFIGS))
def test_matches_hand_table(key):
    config = copy.deepcopy(HAND_TABLE_CONFIGS[key])
    learnt = _as_set(tensors_from_transformers(config, key))
    hand = _hand(config)
    only_learnt, only_hand = learnt - hand, hand - learnt
    learnt_re, hand_re = KNOWN_DIFFERENCES.get(key, (None, None))
    for diff, pattern in ((only_learnt, learnt_re), (only_hand, hand_re)):
        if pattern is None:
            assert diff == set()
        else:
            assert diff and {t for t in diff if not re.fullmatch(pattern, t[0])} == set()
    if key in KNOWN_DIFFERENCES:
        # the names both list agree on shape and dtype: the difference is only which tensors exist
        assert {n for n, _, _ in only_learnt}.isdisjoint(n for n, _, _ in only_hand)


def test_bundled_deepseek_v3_full_size():
    """The whole bundled DeepSeek-V3 (61 layers, 256 experts) lists on meta and equals the hand table."""
    m = load_manifest("deepseek-v3")
    learnt = tensors_from_transformers(m.config, "deepseek-v3")
    assert len(learnt) == len(m.tensors) == 45395
    assert _as_set(learnt) == {(t.name, t.shape, t.dtype) for t in m.tensors}


def test_tiny_moe_bundled():
    m = load_manifest("tiny-moe")
    assert _as_set(tensors_from_transformers(m.config, "tiny-moe")) == {(t.name, t.shape, t.dtype) for t in m.tensors}


# ---- families without a hand table: ground truth is transformers' own save_pretrained --------------------------------

_LINEAR_ATTN = {"linear_conv_kernel_dim": 4, "linear_key_head_dim": 8, "linear_value_head_dim": 8,
                "linear_num_key_heads": 2, "linear_num_value_heads": 4}
_VISION = {"depth": 1, "hidden_size": 16, "intermediate_size": 32, "num_heads": 2, "in_channels": 3, "patch_size": 4,
           "spatial_merge_size": 2, "temporal_patch_size": 2, "out_hidden_size": 32, "num_position_embeddings": 16}

NEW_FAMILY_CONFIGS = {
    "nemotron_h": {
        "model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "torch_dtype": "bfloat16",
        "vocab_size": 64, "hidden_size": 32, "hybrid_override_pattern": "ME*-", "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "intermediate_size": 48,
        "ssm_state_size": 8, "mamba_num_heads": 4, "mamba_head_dim": 8, "n_groups": 2, "conv_kernel": 4,
        "expand": 1, "chunk_size": 8, "n_routed_experts": 4, "n_shared_experts": 1, "num_experts_per_tok": 2,
        "moe_intermediate_size": 16, "moe_shared_expert_intermediate_size": 24, "n_group": 1, "topk_group": 1,
        "use_mamba_kernels": False, "tie_word_embeddings": False},
    "qwen3_next": {
        "model_type": "qwen3_next", "architectures": ["Qwen3NextForCausalLM"], "torch_dtype": "bfloat16",
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 4,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, **_LINEAR_ATTN,
        "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
        "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 16,
        "shared_expert_intermediate_size": 24, "decoder_sparse_step": 1, "mlp_only_layers": [0],
        "tie_word_embeddings": False},
    "qwen3_5": {
        "model_type": "qwen3_5", "architectures": ["Qwen3_5ForConditionalGeneration"], "torch_dtype": "bfloat16",
        "tie_word_embeddings": False, "vision_config": {**_VISION},
        "text_config": {"vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
                        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, **_LINEAR_ATTN,
                        "layer_types": ["linear_attention", "full_attention"], "tie_word_embeddings": False}},
    "qwen3_5_moe": {
        "model_type": "qwen3_5_moe", "architectures": ["Qwen3_5MoeForConditionalGeneration"],
        "torch_dtype": "bfloat16", "tie_word_embeddings": False, "vision_config": {**_VISION},
        "text_config": {"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2, "num_attention_heads": 4,
                        "num_key_value_heads": 2, "head_dim": 8, **_LINEAR_ATTN,
                        "layer_types": ["linear_attention", "full_attention"], "num_experts": 4,
                        "num_experts_per_tok": 2, "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24,
                        "tie_word_embeddings": False}},
    "deepseek_v32": {
        **{k: v for k, v in _MLA.items() if k != "topk_method"}, "model_type": "deepseek_v32",
        "architectures": ["DeepseekV32ForCausalLM"], "index_n_heads": 2, "index_head_dim": 8, "index_topk": 4},
    "glm4_moe": {
        "model_type": "glm4_moe", "architectures": ["Glm4MoeForCausalLM"], "torch_dtype": "bfloat16",
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 48, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "attention_bias": True,
        "use_qk_norm": True, "partial_rotary_factor": 0.5, "moe_intermediate_size": 16, "n_routed_experts": 4,
        "n_shared_experts": 1, "num_experts_per_tok": 2, "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1,
        "tie_word_embeddings": False},
    "minimax_m2": {
        "model_type": "minimax_m2", "architectures": ["MiniMaxM2ForCausalLM"], "torch_dtype": "bfloat16",
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4,
        "num_experts_per_tok": 2, "use_qk_norm": True, "tie_word_embeddings": False},
    "gpt_oss": {
        "model_type": "gpt_oss", "architectures": ["GptOssForCausalLM"], "torch_dtype": "bfloat16",
        "vocab_size": 64, "hidden_size": 32, "intermediate_size": 16, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 8, "num_local_experts": 4,
        "num_experts_per_tok": 2, "sliding_window": 8, "layer_types": ["sliding_attention", "full_attention"],
        "tie_word_embeddings": False},
}


def _model_class(config: dict):
    """What the test saves with: the `architectures` class (as from_pretrained would pick it), else the auto one."""
    if config.get("architectures"):
        return getattr(transformers, config["architectures"][0])
    return transformers.AutoModelForCausalLM._model_mapping[type(_hf_config(config))]


def _hf_config(config: dict):
    return transformers.CONFIG_MAPPING[config["model_type"]].from_dict(copy.deepcopy(config))


def _saved_by_transformers(config: dict, tmp_path) -> tuple[set, set]:
    """((name, shape) of a fresh tiny model's save_pretrained, (name, shape, dtype) after a reload + save).

    The reload is in the config's dtype, as a trainer would load it: that is when transformers applies its
    float32 rules (`_keep_in_fp32_modules*`)."""
    cls = _model_class(config)
    hf_config = _hf_config(config)
    torch.manual_seed(0)
    dtype = getattr(torch, config.get("torch_dtype", "bfloat16"))
    model = cls._from_config(hf_config, dtype=dtype)
    model.save_pretrained(tmp_path / "first")
    first = {(t.name, t.shape) for t in manifest_from_safetensors(tmp_path / "first").tensors}
    reloaded = cls.from_pretrained(tmp_path / "first", dtype=dtype)
    reloaded.save_pretrained(tmp_path / "second")
    second = {(t.name, t.shape, t.dtype) for t in manifest_from_safetensors(tmp_path / "second").tensors}
    return first, second


# gpt-oss in fp16: its norms are in `_keep_in_fp32_modules`, which applies to fp16 checkpoints only
NEW_FAMILY_CONFIGS["gpt_oss-fp16"] = {**NEW_FAMILY_CONFIGS["gpt_oss"], "torch_dtype": "float16"}

# Hand-table families checked the same way: Mixtral (renamed and per-expert on disk), DeepSeek-V3 (fp32 bias), a
# tied Qwen3 (no lm_head).
SAVE_CHECKED = {**NEW_FAMILY_CONFIGS, **{k: HAND_TABLE_CONFIGS[k] for k in ("mixtral", "deepseek_v3", "qwen3")}}


@pytest.mark.parametrize("family", sorted(SAVE_CHECKED))
def test_matches_save_pretrained(family, tmp_path):
    config = SAVE_CHECKED[family]
    learnt = _as_set(tensors_from_transformers(copy.deepcopy(config), family))
    first, second = _saved_by_transformers(config, tmp_path)
    assert learnt == second
    assert {(n, s) for n, s, _ in learnt} == first


def test_dtypes():
    """The float32 exceptions, as transformers' loader makes them (see hf_meta's module doc)."""
    def dtypes(key):
        return {n: d for n, _, d in tensors_from_transformers(copy.deepcopy(NEW_FAMILY_CONFIGS[key]), key)}

    ds = dtypes("deepseek_v32")
    assert ds["model.layers.1.mlp.gate.e_score_correction_bias"] == "float32"    # explicit + strict
    assert ds["model.layers.1.mlp.gate.weight"] == "bfloat16"
    assert dtypes("glm4_moe")["model.layers.1.mlp.gate.e_score_correction_bias"] == "float32"
    assert dtypes("nemotron_h")["backbone.layers.1.mixer.gate.e_score_correction_bias"] == "float32"
    # MiniMax-M2 declares no float32 module: transformers saves its correction bias in the checkpoint dtype
    assert dtypes("minimax_m2")["model.layers.0.block_sparse_moe.e_score_correction_bias"] == "bfloat16"
    assert dtypes("gpt_oss")["model.norm.weight"] == "bfloat16"
    fp16 = dtypes("gpt_oss-fp16")
    assert fp16["model.norm.weight"] == fp16["model.layers.0.input_layernorm.weight"] == "float32"
    assert fp16["model.layers.0.self_attn.q_proj.weight"] == "float16"


def test_names_on_disk():
    """Fused in-memory experts come back per expert, under the checkpoint's own module names."""
    names = {n for n, _, _ in tensors_from_transformers(copy.deepcopy(NEW_FAMILY_CONFIGS["nemotron_h"]), "n")}
    assert "backbone.layers.1.mixer.experts.3.up_proj.weight" in names and "lm_head.weight" in names
    assert not any(n.startswith("model.") or n.endswith("experts.up_proj") for n in names)
    mm = {n for n, _, _ in tensors_from_transformers(copy.deepcopy(NEW_FAMILY_CONFIGS["minimax_m2"]), "m")}
    assert "model.layers.1.block_sparse_moe.experts.3.w3.weight" in mm and not any(".mlp." in n for n in mm)
    # Qwen3.5 is saved by its ...ForConditionalGeneration: language model under model.language_model, vision tower
    q = {n for n, _, _ in tensors_from_transformers(copy.deepcopy(NEW_FAMILY_CONFIGS["qwen3_5_moe"]), "q")}
    assert "model.language_model.layers.0.mlp.experts.3.gate_proj.weight" in q
    assert any(n.startswith("model.visual.") for n in q)
    # tied embeddings: no lm_head
    tied = {**NEW_FAMILY_CONFIGS["glm4_moe"], "tie_word_embeddings": True}
    assert "lm_head.weight" not in {n for n, _, _ in tensors_from_transformers(tied, "g")}
    # natural order: layer 2 before layer 10
    order = [n for n, _, _ in tensors_from_transformers({**HAND_TABLE_CONFIGS["llama"], "num_hidden_layers": 11}, "l")]
    assert order.index("model.layers.2.mlp.up_proj.weight") < order.index("model.layers.10.mlp.up_proj.weight")


def test_errors():
    with pytest.raises(ConfigError, match="kimi_k2.*unknown to transformers"):
        tensors_from_transformers({**_MLA, "model_type": "kimi_k2"}, "k.json")
    with pytest.raises(ConfigError, match="dtype"):
        tensors_from_transformers({**HAND_TABLE_CONFIGS["llama"], "torch_dtype": "int8"}, "l.json")


def test_a_family_without_a_table_plans_runs_and_checks_in_checkpoint_format(tmp_path):
    """A Nemotron-H (hybrid Mamba-2 / attention / MoE) config, listed from transformers' own class, moves from an
    FSDP-style dp 2 layout to a tp-style 2-rank layout with `reshard run` (torchrun, gloo) and `reshard check`
    proves every element; `format: megatron` refuses it in one line, since where Megatron keeps a Mamba mixer's
    tensors is not known for it (never default rules, which would be wrong), and `format: vllm`, which learns it
    from vLLM's loaders, in one line naming why it cannot (vLLM 0.32's CPU build cannot build Nemotron 3's MoE
    layers; without vLLM, no map is cached)."""
    import json
    import os
    import subprocess
    import sys

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    (tmp_path / "nh").mkdir()
    (tmp_path / "nh" / "config.json").write_text(json.dumps(NEW_FAMILY_CONFIGS["nemotron_h"]))
    (tmp_path / "train.yaml").write_text("model: nh/config.json\nmesh: {dp: 2}\nplacements:\n"
                                         "  - {match: '.*', shard: {dp: 0}}\n")
    (tmp_path / "infer.yaml").write_text("model: nh/config.json\nmesh: {tp: 2}\nplacements:\n"
                                         "  - {match: 'mixer\\.(in_proj|up_proj)', shard: {tp: 0}}\n"
                                         "  - {match: 'mixer\\.(out_proj|down_proj)', shard: {tp: 1}}\n")
    for fmt in ("vllm", "megatron"):
        (tmp_path / f"{fmt}.yaml").write_text(f"model: nh/config.json\nformat: {fmt}\nmesh: {{tp: 2}}\n")

    def reshard(*args):
        return subprocess.run([sys.executable, "-m", "reshard_cli", *args], cwd=tmp_path, capture_output=True,
                              text=True, timeout=600, env=dict(os.environ, CI="true", PYTHONPATH=root))

    r = reshard("run", "--src", "train.yaml", "--dst", "infer.yaml", "--out", "out", "--quiet", "--no-link-test")
    assert r.returncode == 0, r.stderr
    r = reshard("check", "--src", "train.yaml", "--dst", "infer.yaml", "--out", "out", "--json", "check.json")
    assert r.returncode == 0, r.stdout + r.stderr
    doc = json.loads((tmp_path / "check.json").read_text())
    listed = len(tensors_from_transformers(copy.deepcopy(NEW_FAMILY_CONFIGS["nemotron_h"]), "n"))
    assert doc["ok"] and doc["tensors"] == 2 * listed  # every tensor, a part or a replica on each rank
    for fmt, key in (("vllm", "model"), ("megatron", "format")):
        r = reshard("plan", "--src", "train.yaml", "--dst", f"{fmt}.yaml")
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert f"{fmt}.yaml: {key}:" in r.stderr and "'nemotron_h'" in r.stderr, r.stderr


def test_tensor_lists_are_cached(tmp_path, monkeypatch):
    """A listed model is remembered per config in reshard's cache: the next listing neither builds the model
    nor needs transformers' classes; another config is listed afresh; an unreadable cache file is one line
    naming it."""
    monkeypatch.setenv("RESHARD_CACHE", str(tmp_path))
    config = copy.deepcopy(NEW_FAMILY_CONFIGS["nemotron_h"])
    first = hf_meta.listed(config, "n.json")
    assert first == tensors_from_transformers(copy.deepcopy(config), "n.json")
    (cached,) = (tmp_path / "manifests").glob("nemotron_h-*.json")

    def refuse(*_a):
        raise AssertionError("listed again")
    monkeypatch.setattr(hf_meta, "tensors_from_transformers", refuse)
    assert hf_meta.listed(copy.deepcopy(config), "n.json") == first
    with pytest.raises(AssertionError, match="listed again"):
        hf_meta.listed({**config, "num_attention_heads": 2}, "n.json")
    cached.write_text("{not json")
    with pytest.raises(ConfigError, match=re.escape(str(cached)) + ": unreadable cached tensor list .*delete it"):
        hf_meta.listed(copy.deepcopy(config), "n.json")
    cached.write_text('{"tensors": [["a.weight", [2]]]}')  # JSON, but not a tensor list
    with pytest.raises(ConfigError, match=re.escape(str(cached)) + ": unreadable cached tensor list .*delete it"):
        hf_meta.listed(copy.deepcopy(config), "n.json")
