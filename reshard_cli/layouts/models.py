"""Model manifests: the ordered list of tensors (name, shape, dtype) that make up a model's weights.

A manifest comes from one of four places, chosen by `load_manifest(spec)`:

- a bundled HF config (`layouts/models/<name>.json`, e.g. `deepseek-v3`),
- an HF `config.json` (tensor names and shapes derived from the architecture),
- safetensors checkpoint headers (a file, a directory, or a `*.safetensors.index.json`; no tensor data is read),
- a YAML tensor list (`tensors: [{name: w1, shape: [1024, 512]}]`).
"""
from __future__ import annotations

import json
import math
import struct
from dataclasses import dataclass, field, replace
from functools import cached_property
from pathlib import Path
from typing import Any, Callable

from reshard_cli.errors import ConfigError
from reshard_cli.layouts import bundled
from reshard_cli.layouts.hf_meta import listed
from reshard_cli.layouts.yamlio import check_keys, line_of, load_yaml


DTYPE_SIZES: dict[str, int] = {
    "bfloat16": 2, "float16": 2, "float32": 4, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1,
    "int8": 1, "uint8": 1, "int16": 2, "int32": 4, "int64": 8, "bool": 1,
}

# safetensors header dtype codes -> torch dtype names.
_SAFETENSORS_DTYPES: dict[str, str] = {
    "BF16": "bfloat16", "F16": "float16", "F32": "float32", "F64": "float64", "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2", "I8": "int8", "U8": "uint8", "I16": "int16", "I32": "int32", "I64": "int64",
    "BOOL": "bool",
}

# Lower-cased aliases (safetensors codes, torch short names, common abbreviations) -> torch dtype name.
_DTYPE_ALIASES: dict[str, str] = {
    **{code.lower(): name for code, name in _SAFETENSORS_DTYPES.items()},
    "bf16": "bfloat16", "fp16": "float16", "half": "float16", "fp32": "float32", "float": "float32",
    "fp64": "float64", "double": "float64", "fp8": "float8_e4m3fn", "e4m3": "float8_e4m3fn",
    "float8_e4m3": "float8_e4m3fn", "fp8_e4m3": "float8_e4m3fn", "e5m2": "float8_e5m2", "fp8_e5m2": "float8_e5m2",
    "short": "int16", "int": "int32", "long": "int64",
}


def normalize_dtype(name: str) -> str:
    """The torch dtype name ("bfloat16") for "bf16", "torch.bfloat16", "F32", "fp8", ...; ValueError if unknown."""
    text = str(name).strip().lower().removeprefix("torch.")
    text = _DTYPE_ALIASES.get(text, text)
    if text not in DTYPE_SIZES:
        raise ValueError(f"unknown dtype {name!r} (known: {', '.join(DTYPE_SIZES)})")
    return text


@dataclass(frozen=True, slots=True)
class TensorSpec:
    """One weight tensor: its checkpoint name, shape and (canonical) dtype name."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    def __post_init__(self) -> None:
        object.__setattr__(self, "shape", tuple(map(int, self.shape)))
        if self.dtype not in DTYPE_SIZES:
            raise ValueError(f"{self.name}: dtype {self.dtype!r} is not canonical (use normalize_dtype)")

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def itemsize(self) -> int:
        """Bytes per element."""
        return DTYPE_SIZES[self.dtype]

    @property
    def nbytes(self) -> int:
        return self.numel * DTYPE_SIZES[self.dtype]


@dataclass(frozen=True)
class Manifest:
    """A model's tensors in checkpoint order, plus where they came from."""

    name: str
    tensors: tuple[TensorSpec, ...]
    source: str = ""
    config: dict = field(default_factory=dict, hash=False)
    _positions: dict[str, int] = field(init=False, repr=False, compare=False, hash=False)

    def __post_init__(self) -> None:
        positions: dict[str, int] = {}
        for i, t in enumerate(self.tensors):
            if positions.setdefault(t.name, i) != i:
                raise ValueError(f"{self.name}: tensor {t.name!r} is listed twice")
        object.__setattr__(self, "_positions", positions)

    @cached_property
    def params(self) -> int:
        return sum(t.numel for t in self.tensors)

    @cached_property
    def nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    def index(self, name: str) -> int:
        """Position of tensor `name`; KeyError if absent."""
        return self._positions[name]

    def get(self, name: str) -> TensorSpec | None:
        i = self._positions.get(name)
        return None if i is None else self.tensors[i]

    def diff(self, other: Manifest, limit: int = 3) -> list[str]:
        """Up to `limit` lines on how `other` differs by name, shape or dtype (order is ignored); [] if equal.

        When there are more differences a last line says how many were left out.
        """
        if other is self:  # both layouts of a pair usually share one (cached) manifest
            return []
        lines: list[str] = []
        for t in self.tensors:
            o = other.get(t.name)
            if o is None:
                lines.append(f"{t.name}: missing in {other.name} (in {self.name}: {_fmt(t)})")
            elif o.shape != t.shape:
                lines.append(f"{t.name}: shape {list(t.shape)} in {self.name} vs {list(o.shape)} in {other.name}")
            elif o.dtype != t.dtype:
                lines.append(f"{t.name}: dtype {t.dtype} in {self.name} vs {o.dtype} in {other.name}")
        lines += [f"{o.name}: extra in {other.name} ({_fmt(o)}; not in {self.name})"
                  for o in other.tensors if o.name not in self._positions]
        if len(lines) > limit:
            return lines[:limit] + [f"... and {len(lines) - limit} more differences"]
        return lines


def _fmt(t: TensorSpec) -> str:
    return f"{list(t.shape)} {t.dtype}"


# ---- Resolution ------------------------------------------------------------------------------------------------------


def bundled_models() -> list[str]:
    """Names of the bundled HF configs (`layouts/models/*.json`)."""
    return bundled.names("model")


def load_manifest(spec: str, *, base_dir: Path | None = None, dtype: str | None = None,
                  file: str | None = None, key: str = "model", scale: int = 1) -> Manifest:
    """A bundled model name or a path (relative to `base_dir`); `dtype` overrides every tensor's dtype.

    `file` and `key` say where `spec` was written, for error messages. `scale` (bundled models only, for
    benchmarks) multiplies the FFN and expert widths, so the model grows about `scale`-fold while every
    layout that fits it still fits.
    """
    override = None
    if dtype is not None:
        try:
            override = normalize_dtype(dtype)
        except ValueError as e:
            raise ConfigError(str(e), file=file, key=_sibling(key, "dtype")) from None
    if not isinstance(spec, str) or not spec.strip():
        raise ConfigError(f"expected a model name or path, got {spec!r}", file=file, key=key)
    if spec in bundled_models():
        path = bundled.data_dir() / "models" / f"{spec}.json"
    else:
        path = Path(spec).expanduser()
        if base_dir is not None and not path.is_absolute():
            path = Path(base_dir) / path
        if not path.exists():
            raise ConfigError(f"unknown model {spec!r} (bundled: {', '.join(bundled_models())}) and no such file",
                              file=file, key=key)
    if spec in bundled_models():
        # Both layouts of a pair usually name the same bundled model: build it once (manifests are immutable).
        cache_key = (spec, override, scale)
        if cache_key not in _CACHE:
            config = dict(_read_json(path))
            name = spec
            if scale != 1:
                for k in ("intermediate_size", "moe_intermediate_size"):
                    if k in config:
                        config[k] = config[k] * scale
                name = f"{spec}-x{scale}"
            _CACHE[cache_key] = manifest_from_hf_config(config, name=name, dtype=override,
                                                        source=f"bundled:{spec}")
        return _CACHE[cache_key]
    if scale != 1:
        raise ConfigError("--scale works only with bundled models", file=file, key=key)
    manifest = _manifest_from_path(path)
    if override is not None:
        manifest = replace(manifest, tensors=tuple(replace(t, dtype=override) for t in manifest.tensors))
    return manifest


_CACHE: dict[tuple, Manifest] = {}


def _sibling(key: str, name: str) -> str:
    """'source.model' -> 'source.dtype'."""
    return key.rsplit(".", 1)[0] + "." + name if "." in key else name


def _manifest_from_path(path: Path) -> Manifest:
    """Dispatch on what `path` is: a checkpoint directory, config/index JSON, safetensors or YAML."""
    if path.is_dir():
        if (path / "model.safetensors.index.json").is_file() or any(path.glob("*.safetensors")):
            manifest = manifest_from_safetensors(path)
            if not manifest.config and (path / "config.json").is_file():  # a checkpoint dir: its config too
                manifest = replace(manifest, config=dict(_read_json(path / "config.json")))
            return manifest
        if not (path / "config.json").is_file():
            raise ConfigError("directory has no *.safetensors and no config.json", file=str(path))
        path = path / "config.json"
    if path.suffix == ".safetensors":
        return manifest_from_safetensors(path)
    if path.suffix in (".yaml", ".yml"):
        return manifest_from_yaml(path)
    if path.suffix == ".json":
        data = _read_json(path)
        if "weight_map" in data:
            return manifest_from_safetensors(path)
        if "model_type" in data:
            name = path.parent.name if path.name == "config.json" else path.stem
            return manifest_from_hf_config(data, name=name, source=str(path))
        raise ConfigError("neither an HF config (no model_type) nor a safetensors index (no weight_map)",
                          file=str(path))
    raise ConfigError("not a model file (expected config.json, *.safetensors, *.safetensors.index.json, "
                      "a directory of them, or a *.yaml tensor list)", file=str(path))


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise ConfigError("file not found", file=str(path)) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"cannot read JSON: {e}", file=str(path)) from None
    if not isinstance(data, dict):
        raise ConfigError("expected a JSON object", file=str(path))
    return data


# ---- HF config -> tensor list (names as in each model's published safetensors checkpoint) ---------------------------


class _Config:
    """Checked access to an HF config dict; errors name the file and the key."""

    def __init__(self, config: dict, file: str):
        self.raw, self.file = config, file

    def size(self, key: str, default: int | None = None) -> int:
        """A non-negative integer; `default` when absent or null (required when there is no default)."""
        value = self.raw.get(key)
        if value is None:
            if default is None:
                raise ConfigError("missing required key", file=self.file, key=key)
            return default
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ConfigError(f"expected a non-negative integer, got {value!r}", file=self.file, key=key)
        return value

    def opt_size(self, key: str) -> int | None:
        return self.size(key) if self.raw.get(key) is not None else None

    def head_dim(self) -> int:
        """`head_dim`, else hidden_size / num_attention_heads."""
        if self.raw.get("head_dim") is not None:
            return self.size("head_dim")
        hidden, heads = self.size("hidden_size"), self.size("num_attention_heads")
        if heads == 0 or hidden % heads:
            raise ConfigError(f"hidden_size {hidden} is not divisible by num_attention_heads {heads}",
                              file=self.file, key="num_attention_heads")
        return hidden // heads


_new_spec, _set = object.__new__, object.__setattr__


class _Builder:
    """Collects TensorSpecs in order, all in the default dtype unless told otherwise."""

    def __init__(self, dtype: str, force: bool):
        self.dtype, self.force, self.specs = dtype, force, []

    def add(self, name: str, *shape: int, dtype: str | None = None) -> None:
        # shapes come from _Config.size (checked ints) and dtypes are canonical: skip TensorSpec's checks
        spec = _new_spec(TensorSpec)
        _set(spec, "name", name)
        _set(spec, "shape", shape)
        _set(spec, "dtype", self.dtype if self.force or dtype is None else dtype)
        self.specs.append(spec)

    def mlp(self, prefix: str, hidden: int, inter: int, names: str = "gate_proj up_proj down_proj") -> None:
        """A gated MLP: gate and up [inter, hidden], then down [hidden, inter]."""
        gate, up, down = names.split()
        self.add(f"{prefix}.{gate}.weight", inter, hidden)
        self.add(f"{prefix}.{up}.weight", inter, hidden)
        self.add(f"{prefix}.{down}.weight", hidden, inter)


def _gqa_attention(b: _Builder, c: _Config, p: str, model_type: str) -> None:
    """Llama-style q/k/v/o; qwen2 adds q/k/v biases, qwen3 adds per-head q/k RMSNorms."""
    hidden, hd = c.size("hidden_size"), c.head_dim()
    nh = c.size("num_attention_heads")
    nkv = c.size("num_key_value_heads", nh)
    qkv_bias = model_type == "qwen2" or bool(c.raw.get("attention_bias"))
    for proj, rows in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
        b.add(f"{p}.self_attn.{proj}.weight", rows, hidden)
        if qkv_bias:
            b.add(f"{p}.self_attn.{proj}.bias", rows)
    b.add(f"{p}.self_attn.o_proj.weight", hidden, nh * hd)
    if model_type != "qwen2" and c.raw.get("attention_bias"):
        b.add(f"{p}.self_attn.o_proj.bias", hidden)
    if model_type in ("qwen3", "qwen3_moe"):
        b.add(f"{p}.self_attn.q_norm.weight", hd)
        b.add(f"{p}.self_attn.k_norm.weight", hd)


def _mla_attention(b: _Builder, c: _Config, p: str, model_type: str) -> None:
    """DeepSeek multi-head latent attention (low-rank q and compressed kv)."""
    hidden, nh = c.size("hidden_size"), c.size("num_attention_heads")
    nope, rope, v = c.size("qk_nope_head_dim"), c.size("qk_rope_head_dim"), c.size("v_head_dim")
    kv_rank, q_rank = c.size("kv_lora_rank"), c.opt_size("q_lora_rank")
    if q_rank is not None:
        b.add(f"{p}.self_attn.q_a_proj.weight", q_rank, hidden)
        b.add(f"{p}.self_attn.q_a_layernorm.weight", q_rank)
        b.add(f"{p}.self_attn.q_b_proj.weight", nh * (nope + rope), q_rank)
    else:
        b.add(f"{p}.self_attn.q_proj.weight", nh * (nope + rope), hidden)
    b.add(f"{p}.self_attn.kv_a_proj_with_mqa.weight", kv_rank + rope, hidden)
    b.add(f"{p}.self_attn.kv_a_layernorm.weight", kv_rank)
    b.add(f"{p}.self_attn.kv_b_proj.weight", nh * (nope + v), kv_rank)
    b.add(f"{p}.self_attn.o_proj.weight", hidden, nh * v)


def _dense_mlp(b: _Builder, c: _Config, p: str, i: int) -> None:
    """gate/up/down; with `mlp_bias` (Llama's, honoured by transformers' and vLLM's LlamaMLP) their biases."""
    hidden, inter = c.size("hidden_size"), c.size("intermediate_size")
    b.mlp(f"{p}.mlp", hidden, inter)
    if c.raw.get("mlp_bias"):
        for proj, rows in (("gate_proj", inter), ("up_proj", inter), ("down_proj", hidden)):
            b.add(f"{p}.mlp.{proj}.bias", rows)


def _qwen3_moe_mlp(b: _Builder, c: _Config, p: str, i: int) -> None:
    """Sparse when i is not in mlp_only_layers and (i+1) % decoder_sparse_step == 0; else a dense MLP."""
    # transformers >= 5 writes Qwen3-MoE's `num_experts` as `num_local_experts` (its attribute map)
    experts = c.size("num_experts") if c.raw.get("num_experts") is not None else c.size("num_local_experts")
    hidden, step = c.size("hidden_size"), c.size("decoder_sparse_step", 1)
    mlp_only = c.raw.get("mlp_only_layers") or []
    if not isinstance(mlp_only, list):
        raise ConfigError("expected a list of layer indices", file=c.file, key="mlp_only_layers")
    if i in mlp_only or experts == 0 or step == 0 or (i + 1) % step:
        _dense_mlp(b, c, p, i)
        return
    inter = c.size("moe_intermediate_size")
    b.add(f"{p}.mlp.gate.weight", experts, hidden)
    for e in range(experts):
        b.mlp(f"{p}.mlp.experts.{e}", hidden, inter)


def _mixtral_moe(b: _Builder, c: _Config, p: str, i: int) -> None:
    hidden, inter, experts = c.size("hidden_size"), c.size("intermediate_size"), c.size("num_local_experts")
    b.add(f"{p}.block_sparse_moe.gate.weight", experts, hidden)
    for e in range(experts):
        b.mlp(f"{p}.block_sparse_moe.experts.{e}", hidden, inter, names="w1 w3 w2")  # mixtral's own names


def _deepseek_mlp(b: _Builder, c: _Config, p: str, i: int) -> None:
    """Dense for the first `first_k_dense_replace` layers, then MoE every `moe_layer_freq` layers."""
    freq = c.size("moe_layer_freq", 1)
    experts = c.opt_size("n_routed_experts")
    if not experts or i < c.size("first_k_dense_replace", 0) or (freq and i % freq):
        _dense_mlp(b, c, p, i)
        return
    hidden, inter = c.size("hidden_size"), c.size("moe_intermediate_size")
    b.add(f"{p}.mlp.gate.weight", experts, hidden)
    if c.raw.get("topk_method") == "noaux_tc":
        b.add(f"{p}.mlp.gate.e_score_correction_bias", experts, dtype="float32")  # float32 in the checkpoint
    for e in range(experts):
        b.mlp(f"{p}.mlp.experts.{e}", hidden, inter)
    shared = c.size("n_shared_experts", 0)
    if shared:
        b.mlp(f"{p}.mlp.shared_experts", hidden, inter * shared)


_Part = Callable[[_Builder, _Config, str, Any], None]
ARCHITECTURES: dict[str, tuple[_Part, _Part]] = {
    "llama": (_gqa_attention, _dense_mlp),
    "qwen2": (_gqa_attention, _dense_mlp),
    "qwen3": (_gqa_attention, _dense_mlp),
    "qwen3_moe": (_gqa_attention, _qwen3_moe_mlp),
    "mixtral": (_gqa_attention, _mixtral_moe),
    "deepseek_v3": (_mla_attention, _deepseek_mlp),
    "kimi_k2": (_mla_attention, _deepseek_mlp),
}


MTP_KEYS = {  # config key -> where a family keeps its multi-token-prediction modules in the checkpoint
    "num_nextn_predict_layers": None,  # model.layers.<num_hidden_layers>..: DeepSeek-V3/V3.2, Kimi-K2, GLM-4 MoE
    "mtp_num_hidden_layers": "mtp.*",  # Qwen3-Next, Qwen3.5
    "num_mtp_modules": "model.mtp.*",  # MiniMax-M2
}


def not_refit(config: dict | None) -> list[str]:
    """What a checkpoint of `config` holds that a refit does not move, each as one line: its multi-token
    prediction modules (vLLM loads them into its speculative draft model, which then keeps its own weights).
    Named in `reshard plan` and in an engine's refit report, never dropped silently."""
    config, out = config or {}, []
    for key, where in MTP_KEYS.items():
        n = config.get(key)
        if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
            continue
        if where is None:
            first = int(config.get("num_hidden_layers") or 0)
            where = f"model.layers.{first}" + (f"-{first + n - 1}" if n > 1 else "")
        out.append(f"{n} multi-token-prediction layer(s) ({key}: {where}): not in the refit's manifest; a vLLM "
                   f"engine that speculates with them keeps the draft's weights from its own load")
    return out


def manifest_from_hf_config(config: dict, *, name: str, dtype: str | None = None, source: str = "") -> Manifest:
    """The tensors of the HF checkpoint described by `config` (a config.json dict).

    `quantization_config` is ignored on purpose: DeepSeek-V3 / Kimi-K2 publish fp8 block-scaled checkpoints,
    but a refit moves the trainer's bf16 weights, so no `weight_scale_inv` tensors are emitted.
    Only the main model is listed: DeepSeek's MTP layer (`num_nextn_predict_layers`) is not part of it.
    """
    is_bundled = source.startswith("bundled:")
    file = str(bundled.data_dir() / "models" / f"{source.removeprefix('bundled:')}.json") if is_bundled \
        else (source or name)
    c = _Config(config, file)
    model_type = config.get("model_type")
    if not isinstance(model_type, str) or not model_type:
        raise ConfigError(f"expected a model type, got {model_type!r}", file=file, key="model_type")
    if dtype is not None:
        default, force = normalize_dtype(dtype), True
    else:
        raw_dtype = config.get("torch_dtype") or config.get("dtype") or "bfloat16"
        try:
            default, force = normalize_dtype(raw_dtype), False
        except ValueError as e:
            raise ConfigError(str(e), file=file, key="torch_dtype" if "torch_dtype" in config else "dtype") from None
    if model_type not in ARCHITECTURES:  # no table here: transformers' own model class lists it (`hf_meta`)
        try:
            learnt = listed(config, file)
        except ConfigError as e:
            why = str(e).removeprefix(f"{file}: model_type: ")
            raise ConfigError(f"unsupported model_type {model_type!r} (tables: {', '.join(ARCHITECTURES)}; "
                              f"transformers: {why})", file=file, key="model_type") from None
        specs = tuple(TensorSpec(n, tuple(shape), default if force else d) for n, shape, d in learnt)
        return Manifest(name=name, tensors=specs, source=source, config=dict(config))
    attention, mlp = ARCHITECTURES[model_type]
    hidden, vocab = c.size("hidden_size"), c.size("vocab_size")
    b = _Builder(default, force)
    b.add("model.embed_tokens.weight", vocab, hidden)
    for i in range(c.size("num_hidden_layers")):
        p = f"model.layers.{i}"
        b.add(f"{p}.input_layernorm.weight", hidden)
        attention(b, c, p, model_type)
        b.add(f"{p}.post_attention_layernorm.weight", hidden)
        mlp(b, c, p, i)
    b.add("model.norm.weight", hidden)
    if not config.get("tie_word_embeddings", False):
        b.add("lm_head.weight", vocab, hidden)
    return Manifest(name=name, tensors=tuple(b.specs), source=source, config=dict(config))


# ---- safetensors headers ---------------------------------------------------------------------------------------------


def read_safetensors_header(path: Path) -> tuple[dict[str, dict], int]:
    """(name -> {dtype, shape, data_offsets}, without __metadata__; offset where tensor data starts = 8 + N)."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with path.open("rb") as f:
            head = f.read(8)
            if len(head) < 8:
                raise ConfigError("truncated safetensors file (no header length)", file=str(path))
            (n,) = struct.unpack("<Q", head)
            if 8 + n > size:
                raise ConfigError(f"corrupt safetensors header: length {n} runs past the end of the file "
                                  f"({size} bytes)", file=str(path))
            raw = f.read(n)
    except FileNotFoundError:
        raise ConfigError("file not found", file=str(path)) from None
    except OSError as e:
        raise ConfigError(f"cannot read: {e}", file=str(path)) from None
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"corrupt safetensors header: {e}", file=str(path)) from None
    if not isinstance(header, dict):
        raise ConfigError("corrupt safetensors header: not a JSON object", file=str(path))
    header.pop("__metadata__", None)
    data_size = size - 8 - n
    for name, entry in header.items():
        _check_entry(path, name, entry, data_size)
    return header, 8 + n


def _check_entry(path: Path, name: str, entry: Any, data_size: int) -> None:
    """Validate one header entry, including that its bytes lie inside the file."""
    ok = (isinstance(entry, dict) and isinstance(entry.get("dtype"), str) and isinstance(entry.get("shape"), list)
          and all(isinstance(d, int) and d >= 0 for d in entry["shape"])
          and isinstance(entry.get("data_offsets"), list) and len(entry["data_offsets"]) == 2
          and all(isinstance(o, int) for o in entry["data_offsets"]))
    if not ok:
        raise ConfigError("corrupt safetensors header entry", file=str(path), key=name)
    if entry.get("dtype") not in _SAFETENSORS_DTYPES:
        raise ConfigError(f"unsupported safetensors dtype {entry.get('dtype')!r}", file=str(path), key=name)
    begin, end = entry["data_offsets"]
    if end - begin != math.prod(entry["shape"]) * DTYPE_SIZES[_SAFETENSORS_DTYPES[entry["dtype"]]]:
        raise ConfigError(f"data_offsets {entry['data_offsets']} do not match shape {entry['shape']}",
                          file=str(path), key=name)
    if not 0 <= begin <= end <= data_size:
        raise ConfigError(f"truncated safetensors file: {name!r} needs bytes up to {end}, "
                          f"data holds {data_size}", file=str(path), key=name)


def _spec(name: str, entry: dict) -> TensorSpec:
    return TensorSpec(name, tuple(entry["shape"]), _SAFETENSORS_DTYPES[entry["dtype"]])


def manifest_from_safetensors(path: Path) -> Manifest:
    """Tensors from safetensors headers: a file, a directory of `*.safetensors`, or a `*.safetensors.index.json`."""
    path = Path(path)
    if path.is_dir():
        index = path / "model.safetensors.index.json"
        if index.is_file():
            return _from_index(index, path.name)
        files = sorted(path.glob("*.safetensors"))
        if not files:
            raise ConfigError("no *.safetensors files in directory", file=str(path))
        return _from_files(files, path.name, str(path))
    if path.name.endswith(".json"):
        return _from_index(path, path.parent.name)
    if not path.exists():
        raise ConfigError("file not found", file=str(path))
    return _from_files([path], path.stem, str(path))


def _from_files(files: list[Path], name: str, source: str) -> Manifest:
    """All tensors of `files`, each file's tensors in header order."""
    specs: list[TensorSpec] = []
    seen: dict[str, Path] = {}
    for f in files:
        header, _ = read_safetensors_header(f)
        for tname, entry in header.items():
            if tname in seen:
                raise ConfigError(f"tensor {tname!r} is also in {seen[tname].name}", file=str(f), key=tname)
            seen[tname] = f
            specs.append(_spec(tname, entry))
    return Manifest(name=name, tensors=tuple(specs), source=source)


def read_safetensors_index(index: Path) -> dict[str, Path]:
    """`weight_map` of a `*.safetensors.index.json`: tensor name -> shard file (beside the index), in order.

    A shard must be a plain file name: an index cannot point outside its own directory."""
    weight_map = _read_json(index).get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise ConfigError("expected a non-empty mapping", file=str(index), key="weight_map")
    out: dict[str, Path] = {}
    for tname, shard in weight_map.items():
        if not isinstance(shard, str) or not shard or Path(shard).name != shard:
            raise ConfigError(f"expected a file name, got {shard!r}", file=str(index), key=f"weight_map.{tname}")
        out[tname] = index.parent / shard
    return out


def _from_index(index: Path, name: str) -> Manifest:
    """Tensors in `weight_map` order, with shapes and dtypes from the headers of the shard files it names."""
    headers: dict[Path, dict[str, dict]] = {}
    specs: list[TensorSpec] = []
    for tname, shard in read_safetensors_index(index).items():
        if shard not in headers:
            if not shard.is_file():
                raise ConfigError(f"shard file {shard.name!r} not found", file=str(index),
                                  key=f"weight_map.{tname}")
            headers[shard] = read_safetensors_header(shard)[0]
        entry = headers[shard].get(tname)
        if entry is None:
            raise ConfigError(f"tensor is not in {shard.name}", file=str(index), key=f"weight_map.{tname}")
        specs.append(_spec(tname, entry))
    return Manifest(name=name, tensors=tuple(specs), source=str(index))


# ---- YAML tensor list ------------------------------------------------------------------------------------------------


def manifest_from_yaml(path: Path) -> Manifest:
    """`name:` (optional), `dtype:` (optional default), `tensors: [{name, shape, dtype?}, ...]`."""
    path = Path(path)
    file = str(path)
    doc = load_yaml(path)
    check_keys(doc, ("name", "dtype", "tensors"), file=file, where="", required=("tensors",))
    name = doc.get("name", path.stem)
    if not isinstance(name, str) or not name:
        raise ConfigError("expected a non-empty string", file=file, key="name", line=line_of(doc, "name"))
    default = _yaml_dtype(doc, "dtype", file, "dtype") if "dtype" in doc else "bfloat16"
    entries = doc["tensors"]
    if not isinstance(entries, list) or not entries:
        raise ConfigError("expected a non-empty list of tensors", file=file, key="tensors",
                          line=line_of(doc, "tensors"))
    specs: list[TensorSpec] = []
    first: dict[str, int] = {}
    for i, entry in enumerate(entries):
        where = f"tensors[{i}]"
        check_keys(entry, ("name", "shape", "dtype"), file=file, where=where, required=("name", "shape"))
        tname = entry["name"]
        if not isinstance(tname, str) or not tname:
            raise ConfigError("expected a non-empty string", file=file, key=f"{where}.name",
                              line=line_of(entry, "name"))
        if tname in first:
            raise ConfigError(f"duplicate tensor name {tname!r} (also tensors[{first[tname]}])", file=file,
                              key=f"{where}.name", line=line_of(entry, "name"))
        first[tname] = i
        shape = entry["shape"]
        if not isinstance(shape, list) or any(isinstance(d, bool) or not isinstance(d, int) or d < 0 for d in shape):
            raise ConfigError(f"expected a list of non-negative integers, got {shape!r}", file=file,
                              key=f"{where}.shape", line=line_of(entry, "shape"))
        dtype = _yaml_dtype(entry, "dtype", file, f"{where}.dtype") if "dtype" in entry else default
        specs.append(TensorSpec(tname, tuple(shape), dtype))
    return Manifest(name=name, tensors=tuple(specs), source=file)


def _yaml_dtype(mapping: dict, key: str, file: str, where: str) -> str:
    try:
        return normalize_dtype(str(mapping[key]))
    except ValueError as e:
        raise ConfigError(str(e), file=file, key=where, line=line_of(mapping, key)) from None
