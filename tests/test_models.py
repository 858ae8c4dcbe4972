"""Tests for reshard_cli.layouts.models: HF-config manifests, safetensors headers, YAML tensor lists, diff()."""
from __future__ import annotations

import functools
import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from reshard_cli.errors import ConfigError
from reshard_cli.layouts.models import (
    DTYPE_SIZES,
    Manifest,
    TensorSpec,
    bundled_models,
    load_manifest,
    manifest_from_hf_config,
    manifest_from_safetensors,
    normalize_dtype,
    read_safetensors_header,
)


@functools.lru_cache(maxsize=None)
def _bundled(name: str) -> Manifest:
    """Bundled manifests are built once per test run (the big MoE ones take a few tenths of a second)."""
    return load_manifest(name)


# ---------------------------------------------------------------------------------------------- dtypes


@pytest.mark.parametrize("alias,name", [
    ("bf16", "bfloat16"), ("BF16", "bfloat16"), ("torch.bfloat16", "bfloat16"), ("F32", "float32"),
    ("fp8", "float8_e4m3fn"), ("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"), ("half", "float16"),
    ("I64", "int64"), ("BOOL", "bool"), ("U8", "uint8"), ("float8_e4m3fn", "float8_e4m3fn"),
])
def test_normalize_dtype(alias, name):
    assert normalize_dtype(alias) == name
    assert normalize_dtype(str(getattr(torch, name))) == name
    assert getattr(torch, name).itemsize == DTYPE_SIZES[name]


def test_normalize_dtype_unknown():
    with pytest.raises(ValueError, match="bfloat17"):
        normalize_dtype("bfloat17")


def test_tensor_spec():
    t = TensorSpec("w", [3, 4], "bfloat16")
    assert t.shape == (3, 4) and t.numel == 12 and t.nbytes == 24
    assert TensorSpec("s", (), "float32").numel == 1
    with pytest.raises(ValueError):
        TensorSpec("w", (1,), "bf16")


# ---------------------------------------------------------------------------------------------- bundled configs


@pytest.mark.parametrize("name,published,tol", [
    ("qwen3-235b-a22b", 235e9, 0.01),
    ("deepseek-v3", 671e9, 0.01),        # main model; the 14B MTP layer is not listed
    # Kimi-K2's headline is 1.04T; the released 61-layer main model (no MTP layer) counts 1.026T,
    # matching the model card's "1T". That is 1.3 % under 1.04e12, so this one gets 1.5 %.
    ("kimi-k2", 1.04e12, 0.015),
    ("llama-3.1-70b", 70.6e9, 0.01),
    ("llama-3.1-8b", 8.03e9, 0.02),
    ("qwen3-30b-a3b", 30.5e9, 0.02),
    ("qwen3-0.6b", 0.6e9, 0.02),
])
def test_param_counts(name, published, tol):
    m = _bundled(name)
    assert abs(m.params - published) / published < tol, m.params
    assert m.source == f"bundled:{name}" and m.config["model_type"]


def test_bundled_list():
    assert {"qwen3-0.6b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "kimi-k2", "llama-3.1-8b",
            "llama-3.1-70b", "tiny-moe"} <= set(bundled_models())


def test_llama_names_and_shapes():
    m = _bundled("llama-3.1-8b")
    assert m.tensors[0] == TensorSpec("model.embed_tokens.weight", (128256, 4096), "bfloat16")
    assert m.tensors[-1].name == "lm_head.weight" and m.tensors[-2].name == "model.norm.weight"
    layer = [t for t in m.tensors if t.name.startswith("model.layers.0.")]
    assert [t.name.removeprefix("model.layers.0.") for t in layer] == [
        "input_layernorm.weight", "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
        "self_attn.o_proj.weight", "post_attention_layernorm.weight", "mlp.gate_proj.weight",
        "mlp.up_proj.weight", "mlp.down_proj.weight"]
    shape = {t.name: t.shape for t in m.tensors}
    assert shape["model.layers.31.self_attn.k_proj.weight"] == (1024, 4096)
    assert shape["model.layers.31.mlp.down_proj.weight"] == (4096, 14336)
    assert "model.layers.32.input_layernorm.weight" not in shape


def test_qwen3_tied_and_qk_norm():
    m = _bundled("qwen3-0.6b")
    names = {t.name for t in m.tensors}
    assert "lm_head.weight" not in names
    assert m.tensors[m.index("model.layers.5.self_attn.q_norm.weight")].shape == (128,)
    assert m.tensors[m.index("model.layers.5.self_attn.q_proj.weight")].shape == (2048, 1024)
    assert m.tensors[m.index("model.layers.5.self_attn.o_proj.weight")].shape == (1024, 2048)


def test_qwen2_biases():
    cfg = {"model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
           "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1, "torch_dtype": "float32"}
    m = manifest_from_hf_config(cfg, name="q2")
    shape = {t.name: t.shape for t in m.tensors}
    assert shape["model.layers.0.self_attn.k_proj.bias"] == (4,)
    assert shape["model.layers.0.self_attn.q_proj.bias"] == (8,)
    assert "model.layers.0.self_attn.o_proj.bias" not in shape
    assert {t.dtype for t in m.tensors} == {"float32"}


def test_qwen3_moe_sparse_and_dense_layers():
    m = _bundled("tiny-moe")
    names = {t.name for t in m.tensors}
    assert "model.layers.0.mlp.gate_proj.weight" in names              # mlp_only_layers: [0]
    assert "model.layers.0.mlp.gate.weight" not in names
    assert m.tensors[m.index("model.layers.0.mlp.down_proj.weight")].shape == (256, 512)
    assert m.tensors[m.index("model.layers.1.mlp.gate.weight")].shape == (8, 256)
    assert m.tensors[m.index("model.layers.3.mlp.experts.7.down_proj.weight")].shape == (256, 256)
    assert m.index("model.layers.1.mlp.experts.0.gate_proj.weight") < m.index("model.layers.1.mlp.experts.1.gate_proj.weight")
    assert m.tensors[m.index("model.layers.2.self_attn.k_proj.weight")].shape == (128, 256)
    big = _bundled("qwen3-30b-a3b")
    assert big.tensors[big.index("model.layers.47.mlp.experts.127.up_proj.weight")].shape == (768, 2048)


def test_qwen3_moe_sparse_step():
    cfg = dict(json.loads((Path(__file__).parent.parent / "layouts/models/tiny-moe.json").read_text()),
               decoder_sparse_step=2, mlp_only_layers=[])
    names = {t.name for t in manifest_from_hf_config(cfg, name="x").tensors}
    assert "model.layers.1.mlp.gate.weight" in names and "model.layers.3.mlp.gate.weight" in names
    assert "model.layers.0.mlp.gate_proj.weight" in names and "model.layers.2.mlp.gate_proj.weight" in names


def test_deepseek_v3():
    m = _bundled("deepseek-v3")
    shape = {t.name: t.shape for t in m.tensors}
    assert "model.layers.2.mlp.gate_proj.weight" in shape and "model.layers.2.mlp.gate.weight" not in shape
    assert shape["model.layers.3.mlp.gate.weight"] == (256, 7168)
    assert shape["model.layers.3.mlp.experts.255.down_proj.weight"] == (7168, 2048)
    assert shape["model.layers.3.mlp.shared_experts.up_proj.weight"] == (2048, 7168)
    assert shape["model.layers.0.self_attn.q_b_proj.weight"] == (128 * 192, 1536)
    assert shape["model.layers.0.self_attn.kv_a_proj_with_mqa.weight"] == (576, 7168)
    assert shape["model.layers.0.self_attn.kv_b_proj.weight"] == (128 * 256, 512)
    assert shape["model.layers.0.self_attn.o_proj.weight"] == (7168, 128 * 128)
    assert "model.layers.60.input_layernorm.weight" in shape and "model.layers.61.input_layernorm.weight" not in shape
    assert not any("scale_inv" in n for n in shape)
    bias = m.tensors[m.index("model.layers.3.mlp.gate.e_score_correction_bias")]
    assert bias.shape == (256,) and bias.dtype == "float32"
    assert m.tensors[m.index("model.layers.3.mlp.gate.weight")].dtype == "bfloat16"
    # a dtype override applies to every tensor, the fp32 bias included
    fp32 = load_manifest("deepseek-v3", dtype="fp32")
    assert {t.dtype for t in fp32.tensors} == {"float32"}


def test_kimi_k2():
    m = _bundled("kimi-k2")
    shape = {t.name: t.shape for t in m.tensors}
    assert "model.layers.0.mlp.down_proj.weight" in shape and "model.layers.1.mlp.experts.383.gate_proj.weight" in shape
    assert shape["model.layers.1.mlp.gate.e_score_correction_bias"] == (384,)
    assert shape["model.layers.0.self_attn.q_b_proj.weight"] == (64 * 192, 1536)
    assert shape["lm_head.weight"] == (163840, 7168)


def test_mla_without_q_lora():
    cfg = {"model_type": "deepseek_v3", "vocab_size": 32, "hidden_size": 16, "intermediate_size": 24,
           "moe_intermediate_size": 8, "num_hidden_layers": 2, "num_attention_heads": 2, "q_lora_rank": None,
           "kv_lora_rank": 4, "qk_nope_head_dim": 3, "qk_rope_head_dim": 2, "v_head_dim": 5,
           "n_routed_experts": 4, "n_shared_experts": 2, "first_k_dense_replace": 1, "topk_method": "greedy"}
    shape = {t.name: t.shape for t in manifest_from_hf_config(cfg, name="mini").tensors}
    assert shape["model.layers.0.self_attn.q_proj.weight"] == (10, 16)
    assert "model.layers.0.self_attn.q_a_proj.weight" not in shape
    assert "model.layers.1.mlp.gate.e_score_correction_bias" not in shape
    assert shape["model.layers.1.mlp.shared_experts.down_proj.weight"] == (16, 16)


def test_mixtral_names():
    cfg = {"model_type": "mixtral", "vocab_size": 100, "hidden_size": 64, "intermediate_size": 96,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "num_local_experts": 3,
           "torch_dtype": "bfloat16"}
    m = manifest_from_hf_config(cfg, name="mx")
    shape = {t.name: t.shape for t in m.tensors}
    assert shape["model.layers.1.block_sparse_moe.gate.weight"] == (3, 64)
    assert shape["model.layers.1.block_sparse_moe.experts.2.w1.weight"] == (96, 64)
    assert shape["model.layers.1.block_sparse_moe.experts.2.w3.weight"] == (96, 64)
    assert shape["model.layers.1.block_sparse_moe.experts.2.w2.weight"] == (64, 96)
    assert shape["model.layers.0.self_attn.k_proj.weight"] == (32, 64)
    assert not any(".mlp." in n for n in shape)


def test_config_errors(tmp_path):
    bad = tmp_path / "config.json"
    bad.write_text(json.dumps({"model_type": "no_such_arch", "vocab_size": 3}))
    with pytest.raises(ConfigError, match=r"config\.json: model_type: .*no_such_arch.*llama") as e:
        load_manifest(str(tmp_path))
    assert e.value.key == "model_type"
    bad.write_text(json.dumps({"model_type": "llama", "vocab_size": 3, "hidden_size": 4}))
    with pytest.raises(ConfigError, match="num_hidden_layers: missing required key"):
        load_manifest(str(bad))
    bad.write_text(json.dumps({"hello": 1}))
    with pytest.raises(ConfigError, match="model_type"):
        load_manifest(str(bad))


def test_config_file_and_base_dir(tmp_path):
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    (ckpt / "config.json").write_text((Path(__file__).parent.parent / "layouts/models/tiny-moe.json").read_text())
    m = load_manifest("ckpt", base_dir=tmp_path)
    assert m.name == "ckpt" and m.tensors == _bundled("tiny-moe").tensors
    assert load_manifest("ckpt/config.json", base_dir=tmp_path, dtype="F16").tensors[0].dtype == "float16"


def test_unknown_model():
    with pytest.raises(ConfigError, match="unknown model 'nope'.*deepseek-v3.*no such file") as e:
        load_manifest("nope", file="job.yaml", key="source.model")
    assert str(e.value).startswith("job.yaml: source.model: ")
    with pytest.raises(ConfigError, match="source.dtype"):
        load_manifest("tiny-moe", dtype="fp7", file="job.yaml", key="source.model")


# ---------------------------------------------------------------------------------------------- safetensors


def _write(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    save_file(tensors, str(path))


def _small() -> dict[str, torch.Tensor]:
    return {"a.weight": torch.ones(4, 3, dtype=torch.bfloat16), "b.bias": torch.zeros(5, dtype=torch.float32),
            "empty": torch.zeros(0, 2, dtype=torch.bfloat16)}


def test_safetensors_file(tmp_path):
    _write(tmp_path / "m.safetensors", _small())
    m = load_manifest(str(tmp_path / "m.safetensors"))
    expected = {TensorSpec("a.weight", (4, 3), "bfloat16"), TensorSpec("b.bias", (5,), "float32"),
                TensorSpec("empty", (0, 2), "bfloat16")}
    assert set(m.tensors) == expected and m.name == "m" and m.config == {}
    assert m.params == 17 and m.nbytes == 24 + 20
    entries, start = read_safetensors_header(tmp_path / "m.safetensors")
    assert set(entries) == {"a.weight", "b.bias", "empty"} and entries["b.bias"]["dtype"] == "F32"
    raw = (tmp_path / "m.safetensors").read_bytes()
    assert start == 8 + int.from_bytes(raw[:8], "little")
    b, e = entries["b.bias"]["data_offsets"]
    assert torch.frombuffer(bytearray(raw[start + b:start + e]), dtype=torch.float32).tolist() == [0.0] * 5
    assert {t.dtype for t in load_manifest(str(tmp_path / "m.safetensors"), dtype="fp32").tensors} == {"float32"}


def test_safetensors_directory_and_index(tmp_path):
    _write(tmp_path / "model-00001-of-00002.safetensors", {"x": torch.zeros(2, 2), "y": torch.zeros(3)})
    _write(tmp_path / "model-00002-of-00002.safetensors", {"z": torch.zeros(4, dtype=torch.int64)})
    m = load_manifest(str(tmp_path))
    assert m.name == tmp_path.name
    assert [(t.name, t.shape, t.dtype) for t in m.tensors] == [
        ("x", (2, 2), "float32"), ("y", (3,), "float32"), ("z", (4,), "int64")]
    index = {"metadata": {"total_size": 44}, "weight_map": {
        "z": "model-00002-of-00002.safetensors", "x": "model-00001-of-00002.safetensors",
        "y": "model-00001-of-00002.safetensors"}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    by_index = manifest_from_safetensors(tmp_path / "model.safetensors.index.json")
    assert [t.name for t in by_index.tensors] == ["z", "x", "y"]
    assert by_index.diff(m) == [] and load_manifest(str(tmp_path)).tensors == by_index.tensors
    index["weight_map"]["w"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ConfigError, match=r"weight_map\.w: tensor is not in"):
        load_manifest(str(tmp_path))


def test_safetensors_duplicate_across_files(tmp_path):
    _write(tmp_path / "a.safetensors", {"x": torch.zeros(1)})
    _write(tmp_path / "b.safetensors", {"x": torch.zeros(1)})
    with pytest.raises(ConfigError, match="also in a.safetensors"):
        manifest_from_safetensors(tmp_path)


def test_safetensors_corrupt(tmp_path):
    path = tmp_path / "m.safetensors"
    _write(path, _small())
    raw = path.read_bytes()
    cases = {
        "cut_data.safetensors": raw[:-4],                                        # data shorter than offsets
        "cut_header.safetensors": raw[:20],                                      # header length past the end
        "tiny.safetensors": raw[:5],                                             # not even a length
        "badjson.safetensors": (6).to_bytes(8, "little") + b"{nope}",
    }
    for name, data in cases.items():
        (tmp_path / name).write_bytes(data)
        with pytest.raises(ConfigError, match=name.replace(".", r"\.")):
            load_manifest(str(tmp_path / name))
    with pytest.raises(ConfigError, match="not found"):
        manifest_from_safetensors(tmp_path / "missing.safetensors")


# ---------------------------------------------------------------------------------------------- YAML


def _yaml(tmp_path: Path, text: str) -> str:
    path = tmp_path / "tensors.yaml"
    path.write_text(text)
    return str(path)


def test_yaml_good(tmp_path):
    path = _yaml(tmp_path, "name: my-model\ndtype: bf16\ntensors:\n"
                           "  - {name: w1, shape: [1024, 512]}\n  - {name: b1, shape: [1024], dtype: float32}\n"
                           "  - {name: s, shape: []}\n")
    m = load_manifest(path)
    assert m.name == "my-model" and m.source == path
    assert m.tensors == (TensorSpec("w1", (1024, 512), "bfloat16"), TensorSpec("b1", (1024,), "float32"),
                         TensorSpec("s", (), "bfloat16"))
    assert load_manifest("tensors.yaml", base_dir=tmp_path, dtype="float16").tensors[1].dtype == "float16"


@pytest.mark.parametrize("body,match", [
    ("tensors:\n  - {name: w1, shape: [2]}\n  - {name: w2, shpe: [2]}\n", r"tensors\.yaml:3: tensors\[1\]\.shpe: unknown key.*'shape'"),
    ("tensors:\n  - {name: w1, shape: [2]}\n  - {name: w1, shape: [3]}\n", r":3: tensors\[1\]\.name: duplicate tensor name 'w1'"),
    ("tensors:\n  - name: w1\n    shape: [2, -1]\n", r":3: tensors\[0\]\.shape: expected a list of non-negative"),
    ("tensors:\n  - {name: w1, shape: 7}\n", r"tensors\[0\]\.shape"),
    ("tensors:\n  - {name: w1, shape: [2], dtype: bf17}\n", r"tensors\[0\]\.dtype: unknown dtype"),
    ("tensors: []\n", r"tensors: expected a non-empty list"),
    ("name: x\n", r"tensors: missing required key"),
    ("tensor:\n  - {name: w1, shape: [2]}\n", r":1: tensor: unknown key"),
])
def test_yaml_errors(tmp_path, body, match):
    with pytest.raises(ConfigError, match=match):
        load_manifest(_yaml(tmp_path, body))


# ---------------------------------------------------------------------------------------------- diff


def test_diff():
    a = Manifest("a", (TensorSpec("x", (2, 2), "bfloat16"), TensorSpec("y", (3,), "bfloat16"),
                       TensorSpec("z", (4,), "float32")), "test", {})
    b = Manifest("b", (TensorSpec("x", (2, 3), "bfloat16"), TensorSpec("z", (4,), "bfloat16"),
                       TensorSpec("w", (1,), "bfloat16")), "test", {})
    lines = a.diff(b, limit=10)
    assert lines == [
        "x: shape [2, 2] in a vs [2, 3] in b",
        "y: missing in b (in a: [3] bfloat16)",
        "z: dtype float32 in a vs bfloat16 in b",
        "w: extra in b ([1] bfloat16; not in a)",
    ]
    assert a.diff(b, limit=2) == lines[:2] + ["... and 2 more differences"]
    assert a.diff(a) == []
    reordered = Manifest("r", tuple(reversed(a.tensors)), "test", {})
    assert a.diff(reordered) == [] and reordered.index("x") == 2
    with pytest.raises(ValueError, match="twice"):
        Manifest("d", (a.tensors[0], a.tensors[0]), "test", {})


def test_multi_token_prediction_layers_are_named_not_refit(tmp_path):
    """A checkpoint's MTP layers are not in the refit's manifest (vLLM loads them into its speculative draft):
    `reshard plan` names them, in its text and its JSON, instead of leaving them out silently."""
    import subprocess
    import sys
    from pathlib import Path

    from reshard_cli.layouts.models import not_refit

    assert not_refit({"num_nextn_predict_layers": 1, "num_hidden_layers": 61}) == [
        "1 multi-token-prediction layer(s) (num_nextn_predict_layers: model.layers.61): not in the refit's manifest; "
        "a vLLM engine that speculates with them keeps the draft's weights from its own load"]
    assert "model.layers.61-63" in not_refit({"num_nextn_predict_layers": 3, "num_hidden_layers": 61})[0]
    assert "mtp.*" in not_refit({"mtp_num_hidden_layers": 1})[0] and "model.mtp.*" in not_refit({"num_mtp_modules": 3})[0]
    assert not_refit({"num_nextn_predict_layers": 0}) == not_refit(None) == not_refit({"num_mtp_modules": True}) == []
    root = Path(__file__).resolve().parents[1]
    assert json.loads((root / "layouts/models/deepseek-v3.json").read_text())["num_nextn_predict_layers"] == 1
    js = tmp_path / "plan.json"
    r = subprocess.run([sys.executable, "-m", "reshard_cli", "plan", "--src", "layouts/demo/train.yaml", "--dst",
                        "layouts/demo/infer.yaml", "--json", js], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and "not refit" not in r.stdout and json.loads(js.read_text())["not_refit"] == []
    model = tmp_path / "mtp.json"  # a tiny DeepSeek-V3 with one MTP layer
    model.write_text(json.dumps({"model_type": "deepseek_v3", "architectures": ["DeepseekV3ForCausalLM"],
                                 "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
                                 "num_hidden_layers": 2, "first_k_dense_replace": 1, "n_routed_experts": 4,
                                 "n_shared_experts": 1, "num_experts_per_tok": 2, "num_attention_heads": 4,
                                 "num_key_value_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16,
                                 "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16, "vocab_size": 256,
                                 "num_nextn_predict_layers": 1, "tie_word_embeddings": False}))
    for name in ("src.yaml", "dst.yaml"):
        (tmp_path / name).write_text(f"model: {model}\nmesh: {{tp: 2}}\n")
    r = subprocess.run([sys.executable, "-m", "reshard_cli", "plan", "--src", tmp_path / "src.yaml", "--dst",
                        tmp_path / "dst.yaml", "--json", js], cwd=root, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert "not refit     1 multi-token-prediction layer(s) (num_nextn_predict_layers: model.layers.2)" in r.stdout
    assert json.loads(js.read_text())["not_refit"] == not_refit({"num_nextn_predict_layers": 1, "num_hidden_layers": 2})
