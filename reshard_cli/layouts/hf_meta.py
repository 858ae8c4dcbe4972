"""A checkpoint's tensor list learnt from transformers' own model classes, built on the meta device.

`models.manifest_from_hf_config` restates a handful of architectures by hand. Every other architecture
transformers knows (Nemotron-H, Qwen3-Next, Qwen3.5, DeepSeek-V3.2, GLM-4 MoE, MiniMax-M2, gpt-oss, ...) can be
listed instead by asking transformers itself, the way `save_pretrained` would write it:

1. the config class registered for `model_type` reads the config.json dict (`quantization_config` dropped: a
   refit moves the trainer's unquantized weights, as in the hand tables);
2. the model class is built on the meta device (shapes and dtypes, no memory, no init): the class named by
   `architectures[0]` when transformers has it (what `from_pretrained` and vLLM pick: Qwen3.5's checkpoints are
   saved by its `...ForConditionalGeneration`, with `model.language_model.*` and the vision tower), else the one
   `AutoModelForCausalLM` maps the config to;
3. its state dict (parameters and persistent buffers, e.g. DeepSeek's `e_score_correction_bias`) goes through
   the steps `save_pretrained` applies before writing: `_keys_to_ignore_on_save` dropped, tied weights dropped
   (no `lm_head.weight` under `tie_word_embeddings`), and `revert_weight_conversion`, which turns transformers 5's
   in-memory layout back into the on-disk one (fused 3-D `mlp.experts.gate_up_proj` -> per-expert
   `mlp.experts.{e}.gate_proj.weight` ..., Mixtral's `mlp` -> `block_sparse_moe`, Nemotron-H's `model` ->
   `backbone`). The reverse ops (split, chunk, rename) run on meta tensors: nothing is allocated.

Dtypes follow what `from_pretrained(dtype=<checkpoint dtype>)` then `save_pretrained` would write: every
tensor in the checkpoint dtype (config `torch_dtype` / `dtype`, default bfloat16), except

- tensors the modelling code creates with an explicit dtype (kept, as the loader keeps `empty_param.dtype`:
  GLM-4 MoE's and DeepSeek-V3.2's `e_score_correction_bias` are created float32);
- tensors matching the model's `_keep_in_fp32_modules_strict` (float32 when the checkpoint is bf16 or fp16:
  DeepSeek-V3's, Nemotron-H's `e_score_correction_bias`) or `_keep_in_fp32_modules` (float32 only when the
  checkpoint is fp16: gpt-oss's norms), matched as transformers' loader matches them (regex search, `*` = `.*`).

Not listed, because transformers' model has no such module: multi-token-prediction layers (DeepSeek's
`num_nextn_predict_layers` layer `model.layers.<num_hidden_layers>`, Qwen3-Next / Qwen3.5 `mtp.*`, Nemotron-H
`mtp.*`), quantization scales (`weight_scale_inv`, gpt-oss MXFP4 `*_blocks` / `*_scales`: a bf16 gpt-oss lists
its fused `mlp.experts.gate_up_proj` [E, H, 2I] as saved by transformers, which vLLM's bf16 path loads).

Order: natural (dotted parts, numbers as numbers: `layers.2` before `layers.10`), the order `save_pretrained`
shards in when it converts; not module order (`lm_head.weight` comes first).

These are transformers' dtypes, which a published checkpoint may not share: MiniMax-M2 declares no float32
module, so its router (`gate.weight`, `e_score_correction_bias`) is listed in bf16, though its released
checkpoints store both in float32. Where a checkpoint is at hand, its safetensors headers are the better source.

Cost: a full-size DeepSeek-V3 (45,395 tensors) lists in 0.6-2 s once torch and transformers are imported
(5-6 s, paid once per process), allocating no tensor memory: experts stay fused until the split on meta.
`listed` remembers each list in reshard's cache (`manifests/`, one JSON file per config, transformers version
and text of this module), so a later plan of the same model imports neither.
"""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Any

from reshard_cli.base.files import cache_read, cache_write, installed_version
from reshard_cli.errors import ConfigError

# The torch dtypes a checkpoint's config may name (torch_dtype / dtype), and their torch attribute names.
_DTYPES = {"bfloat16": "bfloat16", "bf16": "bfloat16", "float16": "float16", "fp16": "float16", "half": "float16",
           "float32": "float32", "fp32": "float32", "float": "float32"}

Tensor = tuple[str, tuple[int, ...], str]


def listed(config: dict, file: str) -> list[Tensor]:
    """`tensors_from_transformers`, from reshard's cache when this config was listed before by the installed
    transformers (or, with none installed, by any) and this module's text; else listed and cached."""
    version = installed_version("transformers")
    key = hashlib.sha256(json.dumps(config, sort_keys=True, default=str).encode()
                         + Path(__file__).read_bytes()).hexdigest()[:20]
    key = f"{config.get('model_type')}-{key}"
    found = cache_read("manifests", key, "transformers", version, "cached tensor list",
                       lambda obj: [(n, tuple(shape), d) for n, shape, d in obj["tensors"]])
    if found is not None:
        return found
    out = tensors_from_transformers(config, file)
    try:
        cache_write("manifests", key, "transformers", version, {"tensors": out})
    except OSError:
        pass  # a read-only cache only costs the next plan the listing again
    return out


def tensors_from_transformers(config: dict, file: str) -> list[Tensor]:
    """(name, shape, dtype name) of every tensor `save_pretrained` would write for `config`, listed on meta.

    `file` names the config in errors. ConfigError when transformers is missing or too old, does not know
    `model_type`, or cannot build the model from this config.
    """
    torch, transformers = _import(file)
    from transformers.core_model_loading import revert_weight_conversion
    from transformers.utils import logging

    verbosity = logging.get_verbosity()
    logging.set_verbosity_error()  # a tiny or partial config draws warnings that say nothing about the tensor list
    try:
        model = build_meta_model(config, file)
        state = saved_state_dict(model, _checkpoint_dtype(torch, config, file))
        try:
            on_disk = revert_weight_conversion(model, state)
        except Exception as e:  # a transformers bug for this architecture: say which, do not guess names
            raise ConfigError(f"transformers could not revert its weight conversion for {type(model).__name__}: "
                              f"{type(e).__name__}: {e}", file=file, key="model_type") from None
    finally:
        logging.set_verbosity(verbosity)
    out = [(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in on_disk.items()]
    return sorted(out, key=lambda t: _natural(t[0]))


def _natural(name: str) -> tuple:
    """Sort key: dotted parts, numbers as numbers (`layers.2` before `layers.10`), like transformers' saving."""
    return tuple((0, int(p), "") if p.isdigit() else (1, 0, p) for p in name.split("."))


def _import(file: str) -> tuple[Any, Any]:
    """torch and transformers >= 5 (the first with `revert_weight_conversion`), or a ConfigError that says so."""
    try:
        import torch
        import transformers
        from transformers.core_model_loading import revert_weight_conversion  # noqa: F401
        from transformers.modeling_utils import remove_tied_weights_from_state_dict  # noqa: F401
    except ImportError as e:
        raise ConfigError(f"listing this model_type needs transformers >= 5 ({e})", file=file,
                          key="model_type") from None
    return torch, transformers


def _checkpoint_dtype(torch: Any, config: dict, file: str) -> Any:
    """The dtype the checkpoint is saved in: torch_dtype / dtype, at the top or in text_config; bfloat16 if none."""
    text = config.get("text_config") if isinstance(config.get("text_config"), dict) else {}
    for where, d in (("", config), ("text_config.", text)):
        for key in ("torch_dtype", "dtype"):
            if d.get(key) is not None:
                name = _DTYPES.get(str(d[key]).lower().removeprefix("torch."))
                if name is None:
                    raise ConfigError(f"unsupported checkpoint dtype {d[key]!r} (expected one of "
                                      f"{', '.join(sorted(set(_DTYPES.values())))})", file=file, key=where + key)
                return getattr(torch, name)
    return torch.bfloat16


_FLOATS = {"NaN": float("nan"), "Infinity": float("inf"), "-Infinity": float("-inf")}


def _special_floats(obj: Any) -> Any:
    """A config.json as transformers' `save_pretrained` writes it, with the floats JSON cannot hold written as
    `{"__float__": "Infinity"}` (a NemotronH's `time_step_limit`), read back as floats, as its loader does."""
    if isinstance(obj, dict):
        if set(obj) == {"__float__"} and obj["__float__"] in _FLOATS:
            return _FLOATS[obj["__float__"]]
        return {k: _special_floats(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_special_floats(v) for v in obj]
    return obj


def build_meta_model(config: dict, file: str) -> Any:
    """The transformers model for a config.json dict, on the meta device, in the checkpoint dtype, not initialized.

    The class is `architectures[0]` when transformers exports it with this config class, else the one
    `AutoModelForCausalLM` maps the config to.
    """
    torch, transformers = _import(file)
    from transformers import CONFIG_MAPPING, AutoModelForCausalLM, initialization

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        raise ConfigError(f"model_type {model_type!r} is unknown to transformers {transformers.__version__}",
                          file=file, key="model_type")
    config_class = CONFIG_MAPPING[model_type]
    raw = _special_floats({k: v for k, v in config.items() if k != "quantization_config"})
    try:
        hf_config = config_class.from_dict(raw)
    except Exception as e:  # the config class validates: bad values come back as TypeError / ValueError
        raise ConfigError(f"transformers' {config_class.__name__} rejects this config: {e}", file=file) from None
    dtype = _checkpoint_dtype(torch, config, file)
    archs = config.get("architectures") or []
    cls = getattr(transformers, archs[0], None) if archs and isinstance(archs[0], str) else None
    if not (isinstance(cls, type) and issubclass(cls, transformers.PreTrainedModel)
            and isinstance(hf_config, cls.config_class)):
        cls = None
    try:
        with torch.device("meta"), initialization.no_init_weights():
            model = cls._from_config(hf_config, dtype=dtype) if cls is not None \
                else AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
            model.tie_weights()  # skipped with the init; ties lm_head to the embedding under tie_word_embeddings
    except Exception as e:
        raise ConfigError(f"transformers cannot build {model_type!r} from this config: {type(e).__name__}: {e}",
                          file=file) from None
    return model


def saved_state_dict(model: Any, dtype: Any) -> dict[str, Any]:
    """The model-named meta tensors `save_pretrained` hands to `revert_weight_conversion`, with load-time dtypes.

    Parameters and persistent buffers (what `state_dict()` holds), less `_keys_to_ignore_on_save` and tied
    aliases (transformers' own `remove_tied_weights_from_state_dict`, which keys meta tensors by their module
    attribute). Each tensor gets the dtype `from_pretrained(dtype=dtype)` would give it (see the module doc).
    """
    import torch
    from transformers.modeling_utils import remove_tied_weights_from_state_dict

    state = model.state_dict()
    for key in getattr(model, "_keys_to_ignore_on_save", None) or ():
        state.pop(key, None)
    state = remove_tied_weights_from_state_dict(state, model)
    fp32 = set(getattr(model, "_keep_in_fp32_modules_strict", None) or ()) \
        if dtype in (torch.float16, torch.bfloat16) else set()
    if dtype == torch.float16:
        fp32 |= set(getattr(model, "_keep_in_fp32_modules", None) or ())
    keep = re.compile("|".join(f"(?:{p.replace('*', '.*')})" for p in sorted(fp32))) if fp32 else None
    for name, t in state.items():
        if keep is not None and t.is_floating_point() and keep.search(name):
            state[name] = t.to(torch.float32)
    return state
