"""Real vLLM FP8 (block 128x128, DeepSeek-V3 style) models on a CPU: the ground truth for refitting FP8 engines.

The tests import it (tests/test_vllm_fp8_*.py), and `python examples/vllm_refit.py --fp8-storage` runs
`run_storage` below: a real refit into such a model, judged by vLLM's own loader. What it gives:

- `fp8_config(config)`: an HF config with DeepSeek-V3's `quantization_config` (`fp8`, `e4m3`, dynamic
  activations, `weight_block_size: [128, 128]`).
- `fp8_checkpoint(full)`: the FP8 checkpoint of BF16 weights, as vLLM's quantizer writes it: every weight that
  loads into a linear layer or the routed experts (`LINEAR`: attention and MLA projections, dense MLPs,
  experts, shared experts) becomes `float8_e4m3fn` per 128x128 block beside its float32
  `*.weight_scale_inv` (`vllm.utils.deep_gemm.per_block_cast_to_fp8(x, [128, 128], use_ue8m0=False)`);
  embeddings, norms, `lm_head`, the router `mlp.gate` and biases stay as they are.
- `build_fp8_model(config)`: vLLM's own model classes, weight loaders, parameters (`ModelWeightParameter`,
  `BlockQuantScaleParameter`, FusedMoE's `w13_weight`/`w2_weight` and their `*_weight_scale_inv`) and
  quantization methods (`Fp8LinearMethod`, `Fp8MoEMethod`), built as the other vLLM tests build a model on CPU
  (vLLM's config objects, `set_current_vllm_config`, here a world of one, TP1). Only the kernel choice may be
  a stand-in, see below. `model.load_weights` is vLLM's.
- The other FP8 schemes of vLLM 0.32: `fp8_tensor_config` / `fp8_tensor_checkpoint` (a per-tensor FP8
  checkpoint: `*.weight_scale` [1] per tensor, vLLM's scale and static per-tensor kernel, `per_tensor_quantize`),
  and `build_fp8_model(config, quantization="fp8_per_tensor" | "fp8_per_block", tp=...)` (vLLM's online
  quantization of a BF16 checkpoint, its `Fp8PerTensorOnline*` / `Fp8PerBlockOnline*` methods; at TP > 1 in a
  world the caller started). The online MoE methods select their backend through the same
  `select_fp8_moe_backend` (their module's binding is wrapped too); the per-tensor linear layers get vLLM's
  real `PerTensorTorchFP8ScaledMMLinearKernel` here. vLLM's CPU build registers its static per-tensor
  quantization op without an implementation: `install_quant_stand_in` hands it to vLLM's torch reference.
- `storage(model)`: every parameter and buffer by its vLLM name, in checkpoint format until
  `process_weights_after_loading` runs; `bit_differences(a, b)` compares two of them bit for bit.
- `fp8_kernels_available()` / `kernels(model)`: whether vLLM finds real FP8 kernels here, and which kernel each
  FP8 layer of a model got.

What vLLM's CPU build refuses without AMX (vLLM 0.32; `torch.cpu._is_amx_tile_supported()` is False):

- Linear layers, at construction: `Fp8LinearMethod.create_weights` (quantization/fp8.py) calls
  `init_fp8_linear_kernel` -> `choose_scaled_mm_linear_kernel` (model_executor/kernels/linear/__init__.py),
  which raises `ValueError: Failed to find a kernel that can implement the ScaledMM linear layer`: the two CPU
  block kernels in `_POSSIBLE_FP8_BLOCK_KERNELS[PlatformEnum.CPU]`, `CPUFp8W8A8BlockScaledMMKernel` and
  `CPUFp8BlockScaledMMKernel` (kernels/linear/scaled_mm/cpu.py), both answer `is_supported() == False`
  ("requires AMX tile support"). Without AVX-512 the build loads `vllm._C_AVX2`, which has neither
  `fp8_scaled_mm_cpu` nor `convert_weight_packed` at all.
- Routed experts, after loading: `Fp8MoEMethod.__init__` calls `select_fp8_moe_backend`
  (fused_moe/oracle/fp8.py), whose CPU candidates `CPUExpertsFp8W8A8`/`CPUExpertsFp8` (fused_moe/experts/
  cpu_moe.py) need AMX; on a CPU it does not raise but returns `(Fp8MoeBackend.NONE, None)`, and
  `Fp8MoEMethod.process_weights_after_loading` then fails in `convert_to_fp8_moe_kernel_format`
  (`ValueError: Unsupported FP8 MoE backend: NONE`); `_init_moe_kernel` and forward need an experts class.

The replacement points (both patched with `unittest.mock.patch` only while `build_fp8_model` builds the
model, since vLLM chooses kernels while constructing layers; the kernel objects chosen stay in the model):

- Linear: `_POSSIBLE_FP8_BLOCK_KERNELS[current platform]` gets `StandInFp8BlockKernel` appended (`patch.dict`).
  vLLM's own `init_fp8_linear_kernel` and `choose_scaled_mm_linear_kernel` run unchanged and still try the
  platform's real kernels first; the stand-in is chosen only where all of them refuse. It is the narrowest
  point: no vLLM function is replaced, only the candidate list gains a last entry, and on a machine with AMX
  (or a GPU) the real kernel wins by vLLM's own rules.
- Routed experts: `select_fp8_moe_backend` as `vllm.model_executor.layers.quantization.fp8` binds it (its only
  caller is `Fp8MoEMethod.__init__`) is wrapped: vLLM's selection runs first and its answer is kept whenever
  it names an experts class; only `(NONE, None)` becomes `(Fp8MoeBackend.TRITON, StandInFp8Experts)`. The
  backend enum cannot gain a member, so the stand-in borrows the tag of the backend whose kernel format is the
  checkpoint format: for TRITON, `convert_to_fp8_moe_kernel_format` keeps w13/w2 and their block scales as
  loaded and `make_fp8_moe_quant_config` builds the plain block-FP8 w8a8 config. No Triton code runs.

The stand-ins compute in float32 from the dequantized operands (a reference, not a fast kernel): their
`process_weights_after_loading` leaves the checkpoint-format parameters as vLLM loaded them (the real CPU kernels
would VNNI-pack the weights there); the linear one reads the layer's weight and scales as vLLM's block kernels
do, the experts one the FP8 weights vLLM passes and the scales of its own quant config (`moe_quant_config`),
where vLLM's experts kernels read them, so what a model computes through them depends on exactly what vLLM's
processing left where (`examples/vllm_probe.py` runs them module by module). Everything else in
`process_weights_after_loading` is vLLM's (FusedMoE builds its modular kernel around the stand-in experts; MLA
dequantizes the FP8 `kv_b_proj` into W_UK/W_UV in torch).
"""
from __future__ import annotations

import contextlib
import json
import re
import shutil
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import torch

BLOCK = [128, 128]

# DeepSeek-V3's own quantization_config (its config.json).
DEEPSEEK_V3_QUANT = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                     "weight_block_size": [128, 128]}

# Tiny models (TP1) whose every FP8 layer passes vLLM's block validation: `validate_fp8_block_shape` (at TP1
# only the parts of a merged layer but its last must be whole 128-row blocks) and
# `validate_fp8_block_shape_moe` (the experts' intermediate size must be a multiple of 128). At TP2 more would
# have to be (every column shard, every row shard's input): o_proj's input, k/v and the experts would not.
# MLA: fused_qkv_a_proj merges q_a_proj (q_lora_rank 128) and kv_a_proj_with_mqa (kv_lora_rank 128 +
# qk_rope_head_dim 32 = 160: a partial last block, as DeepSeek-V3's 512 + 64 = 576 is).
DEEPSEEK_V3_FP8 = dict(
    architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", vocab_size=1000, hidden_size=256,
    intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=4, kv_lora_rank=128, q_lora_rank=128, qk_nope_head_dim=32, qk_rope_head_dim=32,
    v_head_dim=32, n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
    moe_layer_freq=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, scoring_func="sigmoid",
    topk_method="noaux_tc", norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6,
    rope_theta=10000.0, tie_word_embeddings=False, torch_dtype="bfloat16")
# Qwen3-MoE: q 4 x 64 = 256, k = v = 2 x 64 = 128 (qkv_proj's parts before the last must be whole blocks).
QWEN3_MOE_FP8 = dict(
    architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=1000, hidden_size=256,
    intermediate_size=256, moe_intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
    num_key_value_heads=2, head_dim=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
    mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
    tie_word_embeddings=False, torch_dtype="bfloat16")


def _router_gates(config: dict) -> list[str]:
    """The MoE router gates (`model.layers.N.mlp.gate`) of a model whose vLLM class hands the gate its
    quantization config (Qwen3-MoE's `GateLinear(..., quant_config=quant_config)`; DeepSeek-V3's gate gets
    none). Qwen's FP8 checkpoints list them in `modules_to_not_convert`, as the gate stays BF16."""
    if config.get("model_type") != "qwen3_moe":
        return []
    dense = set(config.get("mlp_only_layers", []))
    step = config.get("decoder_sparse_step", 1)
    # transformers 5 saves Qwen3-MoE's num_experts as num_local_experts: missing it listed no gate, and vLLM
    # then quantized every router while the checkpoint held it in BF16 (loaded by a silent cast, scales unset)
    experts = config.get("num_experts") or config.get("num_local_experts") or 0
    return [f"model.layers.{i}.mlp.gate" for i in range(config["num_hidden_layers"])
            if i not in dense and experts > 0 and (i + 1) % step == 0]


def fp8_config(config: dict) -> dict:
    """`config` (an HF config.json dict) with DeepSeek-V3's block-FP8 `quantization_config` added; for a
    Qwen3-MoE also `modules_to_not_convert` naming its router gates (see `_router_gates`): without it vLLM
    quantizes Qwen3-MoE's `mlp.gate` too (FP8 [E, H], `weight_scale_inv` [ceil(E/128), H/128])."""
    quant = dict(DEEPSEEK_V3_QUANT, weight_block_size=list(BLOCK))
    gates = _router_gates(config)
    if gates:
        quant["modules_to_not_convert"] = gates
    return {**config, "quantization_config": quant}


# The linear layers of these architectures, by their HF names: what vLLM gives `Fp8LinearMethod` (every
# `LinearBase` not skipped) or, for experts.N.*, `Fp8MoEMethod`.
LINEAR = re.compile(r"\.(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj|q_a_proj|q_b_proj|"
                    r"kv_a_proj_with_mqa|kv_b_proj)\.weight$")


def is_fp8_weight(name: str, tensor: torch.Tensor) -> bool:
    """Whether vLLM's FP8 method quantizes this checkpoint tensor: the 2-D weights of linear layers and routed
    experts (`LINEAR`: q/k/v/o_proj, MLA's q_a_proj/q_b_proj/kv_a_proj_with_mqa/kv_b_proj, dense and
    shared-expert gate/up/down_proj, experts.N.gate/up/down_proj). Not embed_tokens, lm_head (a
    `ParallelLMHead`, no `LinearBase`), norms, the router `mlp.gate` (DeepSeek-V3's gets no quantization
    config; Qwen3-MoE's is listed in `modules_to_not_convert`), e_score_correction_bias, biases.

    Mind the rule: vLLM's loader does not check dtypes. A BF16 tensor loaded into an FP8 parameter is cast
    silently (`copy_`) and the layer's `weight_scale_inv` keeps what it held (an earlier rule here missed
    `kv_a_proj_with_mqa` and vLLM loaded that checkpoint without a word)."""
    return tensor.dim() == 2 and LINEAR.search(name) is not None


def fp8_checkpoint(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The block-FP8 checkpoint of BF16 weights `full`: each tensor `is_fp8_weight` selects becomes
    float8_e4m3fn, and `name[:-len("weight")] + "weight_scale_inv"` its float32 scales
    [ceil(out/128), ceil(in/128)] (vLLM's `per_block_cast_to_fp8`, no UE8M0 rounding); others unchanged."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    out = {}
    for name, x in full.items():
        if is_fp8_weight(name, x):
            q, scale = per_block_cast_to_fp8(x, list(BLOCK), use_ue8m0=False)
            assert q.dtype == torch.float8_e4m3fn and scale.dtype == torch.float32, (q.dtype, scale.dtype)
            out[name] = q
            out[name[: -len("weight")] + "weight_scale_inv"] = scale
        else:
            out[name] = x
    return out


def fp8_tensor_config(config: dict) -> dict:
    """`config` with a per-tensor FP8 checkpoint's `quantization_config` (`fp8`, `e4m3`, dynamic activations,
    no `weight_block_size`: vLLM's `Fp8LinearMethod` / `Fp8MoEMethod` keep one float32 `weight_scale` per
    checkpoint tensor), the routers listed as not converted as in `fp8_config`."""
    quant = {k: v for k, v in DEEPSEEK_V3_QUANT.items() if k != "weight_block_size"}
    gates = _router_gates(config)
    if gates:
        quant["modules_to_not_convert"] = gates
    return {**config, "quantization_config": quant}


def per_tensor_quantize(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's per-tensor FP8 quantization of one tensor: the scale as its online `fp8_per_tensor` computes it
    (`_fp8_scale(weight_amax(x))`, float32 [1]) and the bytes of its static per-tensor kernel
    (`ops.scaled_fp8_quant(x, scale)`; on a CPU without it, `install_quant_stand_in`'s torch reference)."""
    from vllm import _custom_ops as ops
    from vllm.model_executor.layers.quantization.online.fp8 import _fp8_scale
    from vllm.model_executor.layers.quantization.utils.quant_utils import weight_amax

    scale = _fp8_scale(weight_amax(x).reshape(1))
    q, _ = ops.scaled_fp8_quant(x, scale=scale)
    return q, scale


def fp8_tensor_checkpoint(full: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The per-tensor FP8 checkpoint of BF16 weights `full`: each tensor `is_fp8_weight` selects becomes
    float8_e4m3fn beside its float32 `*.weight_scale` [1] (`per_tensor_quantize`); others unchanged."""
    out = {}
    for name, x in full.items():
        if is_fp8_weight(name, x):
            out[name], out[name[: -len("weight")] + "weight_scale"] = per_tensor_quantize(x)
        else:
            out[name] = x
    return out


def random_checkpoint(config: dict, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random weights under the model's HF names, shapes and dtypes (reshard's manifest of `config`:
    BF16 but DeepSeek-V3's float32 e_score_correction_bias), each tensor with its own magnitude."""
    from reshard_cli.layouts.models import manifest_from_hf_config

    man = manifest_from_hf_config(config, name=config.get("model_type", "model"))
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for t in man.tensors:
        scale = 0.02 * (1 + 10 * torch.rand((), generator=gen).item())
        out[t.name] = (torch.randn(t.shape, generator=gen) * scale).to(getattr(torch, t.dtype))
    return out


# ------------------------------------------------------------------------------------------ the stand-ins

def _dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """FP8 `q` [..., N, K] times its per-block scales [..., ceil(N/128), ceil(K/128)], or its one per-tensor
    scale (an expert's, under `fp8_per_tensor`), in float32."""
    if scale.numel() == 1:
        return q.float() * scale.float().reshape(())
    rows = scale.repeat_interleave(BLOCK[0], -2)[..., : q.shape[-2], :]
    return q.float() * rows.repeat_interleave(BLOCK[1], -1)[..., : q.shape[-1]]


def _stand_in_classes():
    """Built on first use: vLLM's kernel base classes import vLLM's config (and must be imported after it)."""
    global StandInFp8BlockKernel, StandInFp8Experts
    if "StandInFp8BlockKernel" in globals():
        return StandInFp8BlockKernel, StandInFp8Experts
    import torch.nn.functional as F
    import vllm.config  # noqa: F401  (fused_moe imported first hits a circular import in transformers)
    import vllm.model_executor.layers.fused_moe.modular_kernel as mk
    from vllm.model_executor.kernels.linear.scaled_mm.BlockScaledMMLinearKernel import (
        Fp8BlockScaledMMLinearKernel,
    )
    from vllm.model_executor.layers.fused_moe.topk_weight_and_reduce import TopKWeightAndReduceNoOP

    class StandInFp8BlockKernel(Fp8BlockScaledMMLinearKernel):
        """vLLM's block-FP8 linear kernel interface, chosen by vLLM's `choose_scaled_mm_linear_kernel` only
        after every real kernel of the platform refused. Keeps the layer's checkpoint-format `weight` [N, K]
        and `weight_scale_inv` [ceil(N/128), ceil(K/128)] as loaded; vLLM's own `apply_weights` quantizes the
        input per 128-element group and hands both to `apply_block_scaled_mm`, which computes the product in
        float32 from the dequantized operands (a reference, not a fast kernel)."""

        stand_in = True

        @classmethod
        def is_supported(cls, compute_capability=None):
            return True, None

        def process_weights_after_loading(self, layer):
            pass  # the real CPU kernels VNNI-pack `weight` here; the checkpoint format stays

        def apply_block_scaled_mm(self, A, B, As, Bs):
            a = A.float() * As.float().repeat_interleave(BLOCK[1], -1)[..., : A.shape[-1]]
            return (a @ _dequantize(B, Bs).T).to(self.config.out_dtype)

    class StandInFp8Experts(mk.FusedMoEExpertsModular):
        """vLLM's modular-experts interface for block-FP8 routed experts, computing the experts in float32
        from the FP8 weights vLLM passes and the scales of its own quant config (`quant_config.w1_scale`,
        `w2_scale`: where vLLM's experts kernels read them, not from the layer), on unquantized inputs."""

        stand_in = True

        @staticmethod
        def activation_format():
            return mk.FusedMoEActivationFormat.Standard

        @staticmethod
        def _supports_current_device():
            return True

        @staticmethod
        def _supports_no_act_and_mul():
            return False

        @staticmethod
        def _supports_activation(activation):
            return True

        @staticmethod
        def _supports_parallel_config(moe_parallel_config):
            return True

        @staticmethod
        def _supports_quant_scheme(weight_key, activation_key):
            return True

        @property
        def expects_unquantized_inputs(self):
            return True  # vLLM's input quantization needs Triton, absent on a CPU

        def workspace_shapes(self, M, N, K, topk, global_num_experts, local_num_experts, expert_tokens_meta,
                             activation):
            return (0,), (0,), (M, K)

        def finalize_weight_and_reduce_impl(self):
            return TopKWeightAndReduceNoOP()

        def apply(self, output, hidden_states, w1, w2, topk_weights, topk_ids, activation, global_num_experts,
                  expert_map, a1q_scale, a2_scale, workspace13, workspace2, expert_tokens_meta,
                  apply_router_weight_on_input):
            x, out = hidden_states.float(), torch.zeros(output.shape, dtype=torch.float32)
            local = topk_ids if expert_map is None else expert_map[topk_ids.long()]
            for e in range(w1.shape[0]):
                hit = local == e
                rows = hit.any(-1).nonzero().flatten()
                if not len(rows):
                    continue
                gate, up = (x[rows] @ _dequantize(w1[e], self.quant_config.w1_scale[e]).T).chunk(2, -1)
                y = (F.silu(gate) * up) @ _dequantize(w2[e], self.quant_config.w2_scale[e]).T
                weight = 1.0 if apply_router_weight_on_input else (topk_weights * hit).sum(-1)[rows, None]
                out[rows] += y * weight
            output.copy_(out.to(output.dtype))

    globals().update(StandInFp8BlockKernel=StandInFp8BlockKernel, StandInFp8Experts=StandInFp8Experts)
    return StandInFp8BlockKernel, StandInFp8Experts


def _real_linear_kernels() -> list:
    from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS
    from vllm.platforms import current_platform

    return list(_POSSIBLE_FP8_BLOCK_KERNELS.get(current_platform._enum, []))


def fp8_kernels_available() -> bool:
    """Whether vLLM's own selection finds a real block-FP8 linear kernel on this machine (the same
    `choose_scaled_mm_linear_kernel` call `Fp8LinearMethod` makes, for a 256x256 layer). Where it does, the
    platform's MoE kernels need the same hardware (AMX on x86 CPUs); `kernels(model)` tells per layer."""
    import vllm.config  # noqa: F401
    from vllm.model_executor.kernels.linear import (
        FP8ScaledMMLinearLayerConfig,
        _POSSIBLE_FP8_BLOCK_KERNELS,
        choose_scaled_mm_linear_kernel,
    )
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape, create_fp8_quant_key

    config = FP8ScaledMMLinearLayerConfig(
        weight_quant_key=create_fp8_quant_key(static=True, group_shape=GroupShape(*BLOCK)),
        activation_quant_key=create_fp8_quant_key(static=False, group_shape=GroupShape(1, BLOCK[1])),
        input_dtype=torch.bfloat16, out_dtype=torch.bfloat16, weight_shape=(256, 256))
    try:
        choose_scaled_mm_linear_kernel(config, _POSSIBLE_FP8_BLOCK_KERNELS, quantization="fp8_block_w8a8")
    except ValueError:
        return False
    return True


def quant_op_runs() -> bool:
    """Whether vLLM's static per-tensor FP8 quantization runs here: `ops.scaled_fp8_quant(x, scale)`, whose
    `_C` op `static_scaled_fp8_quant` vLLM's CPU build registers without an implementation (its schema takes
    no argument). `fp8_per_tensor`'s processing (and a per-tensor FP8 checkpoint's) calls it."""
    from vllm import _custom_ops as ops

    if getattr(ops.scaled_fp8_quant, "stand_in", False):
        return False
    try:
        ops.scaled_fp8_quant(torch.ones(1, 16, dtype=torch.bfloat16), scale=torch.ones(1))
    except (RuntimeError, NotImplementedError):
        return False
    return True


def install_quant_stand_in() -> bool:
    """Where `quant_op_runs` is False: `vllm._custom_ops.scaled_fp8_quant` replaced, for this process, by one
    that hands static per-tensor quantization to vLLM's own torch reference of that kernel
    (`QuantFP8(static=True, group_shape=PER_TENSOR).forward_native`: x * (1 / scale), clamped to +-448, cast)
    and every other call to vLLM's function. vLLM's callers reach it as `ops.scaled_fp8_quant` at call time
    (online/fp8.py, utils/w8a8_utils.py, utils/fp8_utils.py), so it serves processing as well as building.
    Returns whether the stand-in is in place."""
    from vllm import _custom_ops as ops

    if getattr(ops.scaled_fp8_quant, "stand_in", False):
        return True
    if quant_op_runs():
        return False
    from vllm.model_executor.layers.quantization.input_quant_fp8 import QuantFP8
    from vllm.model_executor.layers.quantization.utils.quant_utils import GroupShape

    real = ops.scaled_fp8_quant
    static = QuantFP8(static=True, group_shape=GroupShape.PER_TENSOR, compile_native=False)

    def scaled_fp8_quant(input, scale=None, num_token_padding=None, scale_ub=None,
                         use_per_token_if_dynamic=False, output=None, group_shape=None):
        if scale is None or scale.numel() != 1 or num_token_padding or group_shape not in (None, (-1, -1)):
            return real(input, scale, num_token_padding, scale_ub, use_per_token_if_dynamic, output, group_shape)
        q, _ = static.forward_native(input, scale.reshape(1))
        if output is not None:
            output.copy_(q)
            q = output
        return q, scale

    scaled_fp8_quant.stand_in = True
    ops.scaled_fp8_quant = scaled_fp8_quant
    return True


@contextmanager
def stand_in_kernels(always: bool = False, experts: bool = True):
    """While open, vLLM's FP8 kernel choice falls back to the stand-ins where it finds no real kernel
    (`always`: the stand-ins everywhere, even where real kernels run; `experts=False`: linear layers only, the
    routed experts keep vLLM's own answer). See the module's docstring."""
    from vllm.model_executor.kernels.linear import _POSSIBLE_FP8_BLOCK_KERNELS
    from vllm.model_executor.layers.fused_moe.oracle.fp8 import Fp8MoeBackend
    from vllm.model_executor.layers.quantization import fp8 as fp8_method
    from vllm.model_executor.layers.quantization.online import fp8 as online_method
    from vllm.platforms import current_platform

    stand_in_linear, stand_in_experts = _stand_in_classes()

    def selection(real_select):
        def select_fp8_moe_backend(*args, **kwargs):
            backend, experts_cls = (Fp8MoeBackend.NONE, None) if always else real_select(*args, **kwargs)
            if experts_cls is None:  # vLLM found none: on a CPU (Fp8MoeBackend.NONE, None)
                return Fp8MoeBackend.TRITON, stand_in_experts
            return backend, experts_cls
        return select_fp8_moe_backend

    candidates = [] if always else _real_linear_kernels()
    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.dict(_POSSIBLE_FP8_BLOCK_KERNELS,
                                            {current_platform._enum: [*candidates, stand_in_linear]}))
        if experts:  # the checkpoint's FP8 method and the online ones (`fp8_per_tensor`, `fp8_per_block`)
            for method in (fp8_method, online_method):
                stack.enter_context(mock.patch.object(method, "select_fp8_moe_backend",
                                                      selection(method.select_fp8_moe_backend)))
        yield


# ------------------------------------------------------------------------------------------ building

_OWN_WORLD = False


def _ensure_world() -> None:
    """vLLM's parallel state for a world of one (TP1) in this process, unless one exists already."""
    global _OWN_WORLD
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.distributed.parallel_state import model_parallel_is_initialized

    if model_parallel_is_initialized():
        return
    from reshard_cli.base.ports import free_port

    port = free_port("127.0.0.1")
    init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                 distributed_init_method=f"tcp://127.0.0.1:{port}")
    initialize_model_parallel(tensor_model_parallel_size=1)
    _OWN_WORLD = True


def release_world() -> None:
    """Tear down the world of one `build_fp8_model` started (nothing if the caller brought its own), so this
    process can start other process groups."""
    global _OWN_WORLD
    if not _OWN_WORLD:
        return
    from vllm.distributed.parallel_state import destroy_distributed_environment, destroy_model_parallel

    destroy_model_parallel()
    destroy_distributed_environment()
    _OWN_WORLD = False


def build_fp8_model(config_dir_or_config, *, stand_ins: str = "auto", dtype: str = "bfloat16",
                    fp8: bool = True, quantization: str | None = None, tp: int = 1):
    """A real vLLM model with FP8 quantization active, on CPU: `(vllm_config, model)` (`fp8=False`: the model
    as its config says, a BF16 one unquantized).

    `config_dir_or_config`: a model directory with a config.json that already has a `quantization_config`,
    or an HF config dict (without one: `fp8_config` adds it, block FP8). `quantization`: one of vLLM's online
    shorthands (`fp8_per_tensor`, `fp8_per_block`: vLLM quantizes the BF16 checkpoint itself after loading,
    `--quantization fp8_per_tensor`); the config then keeps no `quantization_config`. `stand_ins`: "auto"
    (vLLM's real FP8 kernels where it finds them, the stand-ins elsewhere), "always", "linear" (stand-ins for
    linear layers only: the routed experts get what vLLM selects, on a CPU without AMX nothing, and
    `process_weights_after_loading` fails) or "never" (vLLM as it is: without AMX the first FP8 linear layer
    refuses); with stand-ins, vLLM's static per-tensor quantization op gets its torch reference where the
    CPU build has none (`install_quant_stand_in`). `tp`: the tensor-parallel size of a world the caller
    started (vLLM's parallel state, `initialize_model_parallel`); at TP1 a world of one is started if none
    exists (`release_world` ends it). `load` and `process_weights_after_loading` below call vLLM's under
    `set_current_vllm_config(vllm_config)`."""
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    tmp = None
    if isinstance(config_dir_or_config, dict):
        config = config_dir_or_config
        if fp8 and quantization is None and "quantization_config" not in config:
            config = fp8_config(config)
        tmp = tempfile.mkdtemp(prefix="vllm-fp8-")
        Path(tmp, "config.json").write_text(json.dumps(config))
        model_dir = tmp
    else:
        model_dir = str(config_dir_or_config)
    try:
        mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype=dtype, enforce_eager=True,
                         quantization=quantization)
        vc = VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=tp),
                        device_config=DeviceConfig("cpu"))
        want = quantization or "fp8"
        assert mc.quantization == want or not fp8, f"{model_dir}: quantization {mc.quantization!r}, not {want}"
        patch = {"auto": stand_in_kernels, "always": lambda: stand_in_kernels(always=True),
                 "linear": lambda: stand_in_kernels(experts=False), "never": contextlib.nullcontext}[stand_ins]
        with set_current_vllm_config(vc):  # (the stand-in's QuantFP8 is a CustomOp: built under a config)
            if stand_ins != "never":
                install_quant_stand_in()
            if tp == 1:
                _ensure_world()
            with patch(), set_default_torch_dtype(mc.dtype), torch.device("cpu"):
                model = initialize_model(vllm_config=vc)
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
    return vc, model


def process_weights_after_loading(vc, model) -> None:
    """vLLM's own post-processing of a loaded model into its kernels' format (what vLLM does after
    `load_weights` at start)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.utils import process_weights_after_loading as process

    with set_current_vllm_config(vc):
        process(model, vc.model_config, torch.device("cpu"))


def load(vc, model, checkpoint: dict[str, torch.Tensor]) -> set[str]:
    """vLLM's `model.load_weights` of `checkpoint`, under the model's config; the names it loaded."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(vc):
        return set(model.load_weights(iter(checkpoint.items())))


# ------------------------------------------------------------------------------------------ inspecting

def storage(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer of `model` by its vLLM name (the tensors themselves, not copies): the
    checkpoint-format storage until `process_weights_after_loading` runs. A module other modules share (MLA's
    `mla_attn` holds the projections too) is listed once, under the name `load_weights` uses."""
    out = {n: p.data for n, p in model.named_parameters()}  # the names `load_weights` looks up
    for n, b in model.named_buffers():
        out.setdefault(n, b)
    return out


def snapshot(model) -> dict[str, torch.Tensor]:
    return {n: t.detach().clone() for n, t in storage(model).items()}


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def bit_differences(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> dict[str, str]:
    """Name -> why, for every tensor not bit-identical between two storages (missing, shape, dtype, bytes)."""
    out = {}
    for n in sorted(set(a) | set(b)):
        if n not in a or n not in b:
            out[n] = "only in " + ("first" if n in a else "second")
        elif a[n].shape != b[n].shape or a[n].dtype != b[n].dtype:
            out[n] = f"{tuple(a[n].shape)} {a[n].dtype} vs {tuple(b[n].shape)} {b[n].dtype}"
        else:
            differ = int((_bytes(a[n]) != _bytes(b[n])).sum())
            if differ:
                out[n] = f"{differ} of {a[n].numel() * a[n].element_size()} bytes differ"
    return out


def fill(model, byte: int) -> None:
    """Every parameter's bytes set to `byte` (a sentinel: what no load writes keeps it)."""
    for p in model.parameters():
        assert p.data.is_contiguous(), "a strided parameter"
        p.data.reshape(-1).view(torch.uint8).fill_(byte)


def fp8_layers(model) -> dict[str, torch.nn.Module]:
    """The modules whose quantization method is vLLM's `Fp8LinearMethod` or `Fp8MoEMethod` (an FP8 checkpoint),
    or one of its online FP8 methods (`fp8_per_tensor`, `fp8_per_block`), by name."""
    from vllm.model_executor.layers.quantization.fp8 import Fp8LinearMethod, Fp8MoEMethod
    from vllm.model_executor.layers.quantization.online import fp8 as online

    methods = (Fp8LinearMethod, Fp8MoEMethod, online.OnlineLinearBase, online._Fp8OnlineMoEBase)
    return {n: m for n, m in model.named_modules() if isinstance(getattr(m, "quant_method", None), methods)}


def kernels(model) -> dict[str, str]:
    """Module name -> the FP8 kernel class vLLM chose for it (`fp8_linear` of a linear layer, the experts
    class of routed experts), `(stand-in)` marking the stand-ins."""
    out = {}
    for n, m in fp8_layers(model).items():
        qm = m.quant_method
        k = type(qm.fp8_linear) if hasattr(qm, "fp8_linear") else qm.experts_cls
        tag = " (stand-in)" if getattr(k, "stand_in", False) else ""
        backend = f" [{qm.fp8_backend.value}]" if hasattr(qm, "fp8_backend") else ""
        out[n] = f"{getattr(k, '__name__', 'none')}{backend}{tag}"
    return out


def uses_stand_ins(model) -> bool:
    return any("(stand-in)" in k for k in kernels(model).values())


# ------------------------------------------------------------------------------------------ a real refit

MODELS = {"deepseek-v3": DEEPSEEK_V3_FP8, "qwen3-moe": QWEN3_MOE_FP8}
STEPS = (1, 2)  # the seeds the trainer refits, one after the other


class Lockstep:
    """A client for the trainer engine when the engine processes drive their own worker engines (each calls
    init/start/update/finish as vLLM's worker would): the trainer's calls only need to happen, not travel
    (also the tests' client)."""

    def init_weight_transfer_engine(self, init_info):
        pass

    def start_weight_update(self):
        pass

    def update_weights(self, update_info):
        pass

    def finish_weight_update(self, weight_version=None):
        pass


def _trainer(rank: int, ports: dict, model_dir: str, stage_mb: float) -> dict:
    """Trainer rank `rank` of 2 (gloo): the model's BF16 weights as DTensors, Shard(0) over both ranks as FSDP
    shards them (an odd row count cuts a block: its BF16 moves and the engine quantizes it), refit into the
    engine through vLLM's trainer factory and the `reshard` backend, once per step."""
    import os

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from reshard_cli.engines import vllm as vb

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["trainer"]))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = DeviceMesh("cpu", [0, 1])
    config = json.loads(Path(model_dir, "config.json").read_text())
    current = {n: distribute_tensor(x, mesh, [Shard(0)]) for n, x in random_checkpoint(config, STEPS[0]).items()}
    info = vb.ReshardTrainerInitInfo(host="127.0.0.1", port=ports["refit"], dst=_dst_yaml(model_dir), rank=rank,
                                     timeout=120, stage_mb=stage_mb)
    engine = WeightTransferTrainerFactory.trainer_init(info, client=Lockstep(), source=vb.ReshardSource(lambda: current))
    out = []
    for seed in STEPS:
        current.update({n: distribute_tensor(x, mesh, [Shard(0)]) for n, x in random_checkpoint(config, seed).items()})
        report = engine.send_weights(weight_version=f"step-{seed}")
        out.append({"groups": report["trainer"]["groups"], "wire_bytes": report["wire_bytes"]})
    engine.shutdown()
    dist.destroy_process_group()
    return {"steps": out}


def _engine(ports: dict, model_dir: str, stage_mb: float) -> dict:
    """The engine: a real vLLM FP8 model (TP1) loaded from an FP8 checkpoint and processed, as at start, with
    the `reshard` worker backend vLLM's factory builds. After each step its storage is compared with a fresh
    model that vLLM's own loader filled from the FP8 checkpoint of the same BF16 weights and processed."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.plugins import load_general_plugins

    config = json.loads(Path(model_dir, "config.json").read_text())
    vc, model = build_fp8_model(model_dir)
    load(vc, model, fp8_checkpoint(random_checkpoint(config, 99)))
    process_weights_after_loading(vc, model)
    load_general_plugins()
    engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="reshard"), vc,
                                                       torch.device("cpu"), model)
    engine.init_transfer_engine(engine.parse_init_info(
        {"host": "127.0.0.1", "port": ports["refit"], "world_size": 3, "dst": _dst_yaml(model_dir),
         "trainer_size": 2, "timeout": 120, "stage_mb": stage_mb}))
    vocab = config["vocab_size"]

    def cut(s):  # vLLM zeroes the padded vocab rows at load; reshard's target at staging
        return {n: x[:vocab] if n.endswith(("embed_tokens.weight", "lm_head.weight")) else x for n, x in s.items()}
    out = []
    for seed in STEPS:
        engine.start_weight_update()
        engine.update_weights({"verify": True})
        engine.finish_weight_update()
        stats = engine.last_stats
        _vc, fresh = build_fp8_model(model_dir)
        load(_vc, fresh, fp8_checkpoint(random_checkpoint(config, seed)))
        process_weights_after_loading(_vc, fresh)
        differ = bit_differences(cut(storage(model)), cut(storage(fresh)))
        out.append({"seed": seed, "storage_identical": not differ, "differences": dict(list(differ.items())[:5]),
                    "groups": len(engine.refit.groups), "peak_staged_bytes": stats.get("peak_staged_bytes"),
                    "checksums_ok": stats.get("checksums_ok"), "error": stats.get("error")})
    out_kernels = "real" if fp8_kernels_available() else "stand-ins (no FP8 kernels in this vLLM build here)"
    engine.shutdown()
    release_world()
    return {"steps": out, "kernels": out_kernels}


def _dst_yaml(model_dir: str) -> str:
    return (f"model: {Path(model_dir, 'config.json')}\nformat: vllm\nmesh: {{tp: 1}}\n"
            f"engine: {{quantization: fp8}}\n")


def _entry(rank, ports, model_dir, stage_mb, queue):
    import traceback

    try:
        out = _trainer(rank, ports, model_dir, stage_mb) if rank < 2 else _engine(ports, model_dir, stage_mb)
        queue.put((rank, "ok", out))
    except BaseException:  # noqa: BLE001
        queue.put((rank, "error", traceback.format_exc()))


def quantizer_identical(config: dict) -> bool:
    """reshard's block quantizer (`reshard_cli.base.fp8`) against vLLM's `per_block_cast_to_fp8`, bit for bit,
    on every tensor the model keeps in FP8."""
    from vllm.utils.deep_gemm import per_block_cast_to_fp8

    from reshard_cli.base.fp8 import quantize_blocks

    for name, x in random_checkpoint(config, STEPS[0]).items():
        if is_fp8_weight(name, x):
            q, s = quantize_blocks(x, tuple(BLOCK))
            vq, vs = per_block_cast_to_fp8(x, list(BLOCK), use_ue8m0=False)
            if not (torch.equal(q.view(torch.uint8), vq.view(torch.uint8)) and torch.equal(s, vs)):
                return False
    return True


def run_storage(root: str) -> dict:
    """For each tiny model: a 2-process trainer refits a block-FP8 vLLM model twice, in groups of whole layers
    (a budget of 1.5 layers); per model `storage_identical` (every step's storage equals vLLM's own load of the
    FP8 checkpoint, processed), `quantizer_identical`, and what ran."""
    import torch.multiprocessing as mp

    from reshard_cli.base.ports import free_port
    from reshard_cli.formats import load_layout
    from reshard_cli.plan.groups import layer_groups

    results = {}
    for name, base in MODELS.items():
        config = fp8_config(base)
        model_dir = Path(root, name)
        model_dir.mkdir(parents=True, exist_ok=True)
        (model_dir / "config.json").write_text(json.dumps(config))
        (model_dir / "dst.yaml").write_text(_dst_yaml(str(model_dir)))
        largest = max(u.nbytes for u in layer_groups(load_layout(model_dir / "dst.yaml"), 1))
        stage_mb = 1.5 * largest / (1 << 20)
        ports = {"trainer": free_port(), "refit": free_port()}
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        procs = [ctx.Process(target=_entry, args=(r, ports, str(model_dir), stage_mb, queue)) for r in range(3)]
        t0 = time.monotonic()
        for p in procs:
            p.start()
        got, errors = {}, {}
        try:
            for _ in procs:
                rank, status, out = queue.get(timeout=600)
                (got if status == "ok" else errors)[rank] = out
        finally:
            for p in procs:
                p.join(timeout=10)
                if p.is_alive():
                    p.kill()
        if errors:
            raise RuntimeError("\n".join(f"rank {r} failed:\n{e}" for r, e in sorted(errors.items())))
        steps = got[2]["steps"]
        results[name] = {"storage_identical": all(s["storage_identical"] for s in steps),
                         "quantizer_identical": quantizer_identical(config), "kernels": got[2]["kernels"],
                         "steps": steps, "trainer_steps": got[0]["steps"], "seconds": round(time.monotonic() - t0, 1)}
        print(f"{name}: storage identical {results[name]['storage_identical']}, quantizer identical "
              f"{results[name]['quantizer_identical']}, {steps[0]['groups']} groups, kernels: {got[2]['kernels']}")
    return results
