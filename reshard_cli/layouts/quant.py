"""FP8 inference engines: which checkpoint tensors such an engine keeps quantized, and how.

A destination layout names the engine's quantization as vLLM (0.32) names it, `engine: {quantization: ...}`:

- `fp8`: an FP8-*serialized* checkpoint (vLLM's `--quantization fp8`, or a checkpoint whose config says so),
  whose scheme follows the model's `quantization_config` as vLLM's loader does:
  - with `weight_block_size: [bm, bn]` (DeepSeek-V3, Kimi-K2): every linear layer's `weight` is
    `float8_e4m3fn`, with a float32 `weight_scale_inv` of shape `[ceil(m / bm), ceil(n / bn)]`, one scale per
    block of the full tensor (the last block of a ragged dim is smaller);
  - without: per-tensor FP8, a float32 `weight_scale` per checkpoint tensor (a fused engine tensor keeps one
    per member, `qkv_proj.weight_scale [3]`; stacked experts `w13_weight_scale [E, 2]`, `w2_weight_scale [E]`).
  A config without `quantization_config` is a BF16 checkpoint: vLLM refuses `fp8` there ("use --quantization
  fp8_per_tensor"), and so does reshard, in one line.
- `fp8_per_tensor`, `fp8_per_block`: vLLM's *online* quantization of a BF16 checkpoint (its shorthands; the
  model's config has no `quantization_config`): vLLM loads BF16 and quantizes each module itself after
  loading, one scale per (fused, local) tensor, or per 128x128 block of each rank's local fused tensor.

Anything else vLLM names (`mxfp8`, `fp8_per_channel`, `modelopt_fp4`, `mxfp4`, ...) is refused in one line.

Where each scheme is quantized during a refit (`plan.fp8`, `engines/vllm/target.py`): block scales depend on
their block only, so the senders quantize whole blocks (`fp8`, `fp8_per_block`); a per-tensor scale depends on
the whole tensor's max |x|, which no sender holding a shard knows: BF16 travels, and the destination quantizes
after the refit group agreed each tensor's max |x| (`amax_names`, `Stage.local_max`) — reshard into the FP8
storage for `fp8`, vLLM's own processing for `fp8_per_tensor` (given the agreed value instead of its TP
all-reduce).

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


SERIALIZED = "fp8"  # an FP8 checkpoint, as its quantization_config says
ONLINE = {"fp8_per_tensor": None, "fp8_per_block": (128, 128)}  # vLLM's online shorthands reshard refits
SUPPORTED = ("fp8 (an FP8 checkpoint: block or per-tensor scales, as its quantization_config says), "
             "fp8_per_tensor, fp8_per_block (vLLM's online quantization of a BF16 checkpoint), or none")


@dataclass(frozen=True)
class Quantization:
    method: str = SERIALIZED  # `fp8` (a serialized checkpoint) or an online shorthand (`ONLINE`)
    block: tuple[int, int] | None = (128, 128)  # None: one scale per tensor
    ignored: tuple[str, ...] = ()  # module prefixes left unquantized
    router: bool = False  # the MoE router is quantized too

    @property
    def online(self) -> bool:
        """vLLM quantizes a BF16 checkpoint itself after loading (`fp8_per_tensor`, `fp8_per_block`)."""
        return self.method != SERIALIZED

    @property
    def stored_fp8(self) -> bool:
        """The engine's storage a refit writes is FP8 with its scales (a serialized checkpoint, or
        `fp8_per_block`, whose blocks the senders quantize); `fp8_per_tensor`'s stays BF16."""
        return not (self.online and self.block is None)

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

    @property
    def format_name(self) -> str:
        """What the engine stores, in a user's words ("FP8")."""
        return "FP8"

    def describe(self) -> str:
        grid = f"{self.block[0]}x{self.block[1]} blocks" if self.block else "one scale per tensor"
        if self.method == "fp8_per_block":
            return (f"fp8_per_block e4m3 (vLLM's online quantization), {grid} of each engine shard: whole blocks "
                    f"quantized by the senders, experts included")
        if self.block is None:
            where = "vLLM quantizes" if self.online else "the workers quantize"
            return (f"{self.method} e4m3{' (vLLM online)' if self.online else ' checkpoint'}, {grid}: BF16 on the "
                    f"wire, {where} after a max |x| agreed over the refit group")
        return f"{self.method} e4m3, {grid}"


def amax_names(layout) -> list[str]:
    """The checkpoint tensors of `layout` (a destination, or one staging group of it) whose FP8 scale is one per
    tensor: each one's max |x| over all its shards must be agreed before the engine quantizes it (a refit's
    guarded reduction, `transfer.live.Stage.local_max`); [] for any other destination."""
    q = layout.quantization
    if q is None or q.block is not None:
        return []
    return [t.name for t in layout.manifest.tensors if q.quantizes(t.name, t.shape)]


def quantization_of(value, config: dict | None, *, file: str, key: str, line: int | None) -> Quantization | None:
    """The destination's quantization from its layout value (`fp8`, `fp8_per_tensor`, `fp8_per_block`, or
    none) and the model's HF config; every other value, and each value the model's config contradicts, is one
    ConfigError naming the file and key."""
    if value in (None, "none", False):
        return None
    where = dict(file=file, key=key, line=line)
    if not isinstance(value, str) or (value != SERIALIZED and value not in ONLINE):
        raise ConfigError(f"{value!r} is not supported: reshard refits {SUPPORTED}", **where)
    config = config or {}
    qc = config.get("quantization_config") or {}
    router = config.get("model_type") in ROUTER_QUANTIZED
    if value in ONLINE:
        if qc:
            raise ConfigError(f"{value} is vLLM's online quantization of a BF16 checkpoint, but the model's config "
                              f"has a quantization_config (quant_method {qc.get('quant_method')!r}): a quantized "
                              f"checkpoint; for an FP8 one use fp8", **where)
        return Quantization(method=value, block=ONLINE[value], router=router)
    if not qc:
        raise ConfigError("fp8 means an FP8-serialized checkpoint, and the model's config has no "
                          "quantization_config: vLLM refuses it (\"use --quantization fp8_per_tensor\"); for "
                          "vLLM's online quantization of a BF16 checkpoint use fp8_per_tensor or fp8_per_block",
                          **where)
    return _serialized(qc, router, where)


def _serialized(qc: dict, router: bool, where: dict) -> Quantization:
    """An FP8 checkpoint's scheme from its `quantization_config`, as vLLM's `Fp8Config.from_config` reads it."""
    if qc.get("quant_method") != "fp8":
        raise ConfigError(f"the model's quantization_config is {qc.get('quant_method')!r}, not fp8: reshard "
                          f"refits {SUPPORTED}", **where)
    if qc.get("fmt", "e4m3") != "e4m3":
        raise ConfigError(f"FP8 format {qc.get('fmt')!r} is not supported (e4m3 only)", **where)
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        raise ConfigError(f"quantization_config.activation_scheme {qc.get('activation_scheme')!r}: static input "
                          f"scales are not refitted (dynamic only)", **where)
    block = qc.get("weight_block_size")
    if block is not None:
        if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(isinstance(b, int) and b > 0
                                                                             for b in block)):
            raise ConfigError(f"quantization_config.weight_block_size must be two positive integers, got {block!r}",
                              **where)
        block = (int(block[0]), int(block[1]))
    ignored = tuple(qc.get("ignored_layers") or qc.get("modules_to_not_convert") or ())
    return Quantization(block=block, ignored=ignored, router=router)
