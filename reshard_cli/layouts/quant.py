"""FP8 inference engines: which checkpoint tensors such an engine keeps quantized, and how.

A destination layout opts in with `engine: {quantization: fp8}` (vLLM's `--quantization fp8`, or a checkpoint
whose config says so). The scheme then follows the model's `quantization_config` as vLLM's loader does:

- `quant_method: fp8` with `weight_block_size: [bm, bn]` (DeepSeek-V3, Kimi-K2): every linear layer's `weight`
  is `float8_e4m3fn`, with a float32 `weight_scale_inv` of shape `[ceil(m / bm), ceil(n / bn)]`, one scale per
  block of the full tensor (the last block of a ragged dim is smaller);
- no such config: per-tensor FP8, vLLM's online quantization of a BF16 checkpoint: the engine loads BF16
  into checkpoint-format storage and quantizes it itself, one scale per tensor.

Linear layers are the attention and MLP projections (routed and shared experts included); embeddings, norms
and `lm_head` stay in the model's dtype, and so does any module the config lists in `ignored_layers` /
`modules_to_not_convert`. The MoE router (`mlp.gate`) is quantized where vLLM's model class hands it the
quantization config (Qwen3-MoE; Qwen's FP8 checkpoints list their routers as not converted), not elsewhere
(DeepSeek-V3, Kimi-K2, Mixtral). Plans stay in checkpoint space: a quantized tensor keeps its
name, shape and placement; its scale travels with its blocks (`plan.fp8`).
"""
from __future__ import annotations

import math
import re
from dataclasses import dataclass

from reshard_cli.errors import ConfigError

# the linear layers of the architectures reshard lists (HF names), dense, MoE experts and MLA alike
LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|q_a_proj|q_b_proj|"
                    r"kv_a_proj_with_mqa|kv_b_proj)\.weight$")
# the ones vLLM fuses along their rows with another (qkv_proj, gate_up_proj / w13, fused_qkv_a_proj)
ROUTER = re.compile(r"\.mlp\.gate\.weight$")
ROUTER_QUANTIZED = ("qwen3_moe",)  # model types whose vLLM router (GateLinear) takes the quantization config
MERGED = re.compile(r"\.(q_proj|k_proj|v_proj|gate_proj|up_proj|q_a_proj|kv_a_proj_with_mqa)\.weight$")
SCALE_BYTES = 4  # float32


@dataclass(frozen=True)
class Quantization:
    method: str = "fp8"
    block: tuple[int, int] | None = (128, 128)  # None: one scale per tensor
    ignored: tuple[str, ...] = ()  # module prefixes left unquantized
    router: bool = False  # the MoE router is quantized too

    def quantizes(self, name: str, shape: tuple) -> bool:
        """Whether the engine keeps checkpoint tensor `name` in FP8."""
        if len(shape) != 2 or not (LINEAR.search(name) or (self.router and ROUTER.search(name))):
            return False
        module = name.removesuffix(".weight")
        return not any(module == p or module.startswith(p + ".") for p in self.ignored)

    def scale_name(self, name: str) -> str:
        return name.removesuffix("weight") + ("weight_scale_inv" if self.block else "weight_scale")

    def scale_shape(self, shape: tuple) -> tuple:
        """The scale tensor's shape for a quantized tensor of `shape`."""
        if self.block is None:
            return ()
        return tuple(math.ceil(n / b) for n, b in zip(shape[-2:], self.block))

    def scale_bytes(self, shape: tuple) -> int:
        return SCALE_BYTES * math.prod(self.scale_shape(shape))

    def describe(self) -> str:
        grid = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "one scale per tensor"
        return f"{self.method} e4m3, {grid}"


def quantization_of(value, config: dict | None, *, file: str, key: str, line: int | None) -> Quantization | None:
    """The destination's quantization from its layout value (`fp8`, or none) and the model's HF config."""
    if value in (None, "none", False):
        return None
    if value != "fp8":
        raise ConfigError(f"expected fp8 or none, got {value!r}", file=file, key=key, line=line)
    qc = (config or {}).get("quantization_config") or {}
    if qc and qc.get("quant_method") != "fp8":
        raise ConfigError(f"the model's quantization_config is {qc.get('quant_method')!r}, not fp8", file=file,
                          key=key, line=line)
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"FP8 format {qc.get('fmt')!r} is not supported (e4m3 only)", file=file, key=key,
                          line=line)
    block = qc.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                             for b in block)):
            raise ConfigError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}",
                              file=file, key=key, line=line)
        block = (int(block[0]), int(block[1]))
    ignored = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    return Quantization(block=block, ignored=ignored, router=(config or {}).get("model_type") in ROUTER_QUANTIZED)
