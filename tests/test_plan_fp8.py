"""Planning a refit into an FP8 engine (`plan.fp8`): which blocks the senders can quantize, the wire it costs
(checked against a sum over the plan's own pieces, block by block), and the layouts vLLM refuses."""
import json
import math
import random

import pytest

from reshard_cli.base.geometry import Box
from reshard_cli.errors import ConfigError
from reshard_cli.formats import load_pair
from reshard_cli.layouts.quant import Quantization
from reshard_cli.layouts.topology import Topology
from reshard_cli.plan.fp8 import fp8_figures, whole_block_share
from reshard_cli.plan.planner import Plan

# a Qwen3-MoE served in DeepSeek-style block FP8, small enough to plan piece by piece
CONFIG = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=512, hidden_size=256,
              intermediate_size=512, moe_intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=128, num_experts=4, num_experts_per_tok=2, norm_topk_prob=True,
              decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, torch_dtype="bfloat16",
              quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]})
TP_SRC = """mesh: {tp: 2}
placements:
  - {match: 'q_proj|k_proj|v_proj|gate_proj|up_proj|embed|lm_head', shard: {tp: 0}}
  - {match: 'o_proj|down_proj', shard: {tp: 1}}
"""
FSDP_SRC = """mesh: {fsdp: 3}
placements:
  - {match: '.', shard: {fsdp: 0}}
"""


def _pair(tmp_path, src_body, mesh="{dp: 2, tp: 2}", quantization="fp8"):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    src = tmp_path / "src.yaml"
    src.write_text(f"model: config.json\n{src_body}")
    dst = tmp_path / "dst.yaml"
    dst.write_text(f"model: config.json\nformat: vllm\nmesh: {mesh}\nengine: {{quantization: {quantization}}}\n")
    return load_pair(src, dst)


def _by_pieces(plan, q):
    """The FP8 refit's wire, summed over the plan's network pieces block by block: a block inside the piece's
    sender's own box moves as FP8 (1 byte, plus its scale pro rata), a block cut by it as the source dtype."""
    man, src = plan.src.manifest.tensors, plan.src
    dom = plan.topology.domain_of
    total = 0.0
    for p in plan.pieces():
        if dom(p.src) == dom(p.dst):
            continue
        spec = man[p.tensor]
        if not q.quantizes(spec.name, spec.shape):
            total += p.box.numel * spec.itemsize
            continue
        own = src.placements[p.tensor].box_of(spec.shape, p.src)
        per = 1 + q.scale_bytes(spec.shape) / spec.numel
        (bm, bn), (r0, c0), (nr, nc) = q.block, p.box.offsets, p.box.sizes
        for i in range(r0 // bm, math.ceil((r0 + nr) / bm)):
            for j in range(c0 // bn, math.ceil((c0 + nc) / bn)):
                block = Box((i * bm, j * bn), (min(bm, spec.shape[0] - i * bm), min(bn, spec.shape[1] - j * bn)))
                part = block.intersect(p.box).numel
                inside = block.intersect(own) == block
                total += part * (per if inside else spec.itemsize)
    return total


@pytest.mark.parametrize("src_body,share", [(TP_SRC, 1.0), (FSDP_SRC, None)])
def test_fp8_wire_equals_a_sum_over_the_pieces(tmp_path, src_body, share):
    """Tensor-parallel sources hold whole blocks (every block quantized on the sender, the wire about half a
    BF16 refit's); FSDP's uneven row shards (86, 85, 85 of 256) cut blocks, which move as BF16."""
    src, dst = _pair(tmp_path, src_body)
    plan = Plan(src, dst, Topology(name="pairs", ranks_per_domain=2), mode="reshard")
    stats = plan.stats()
    f = fp8_figures(plan, stats)
    assert f["block"] == [128, 128] and f["quantized_tensors"] > 0
    assert f["wire_bytes"] == f["sender_quantized_bytes"] + f["receiver_quantized_bytes"] + f["unquantized_bytes"]
    assert abs(f["wire_bytes"] - _by_pieces(plan, dst.quantization)) <= 1 + 1e-9 * f["wire_bytes"], f
    if share == 1.0:
        assert f["sender_share"] == 1.0 and f["receiver_quantized_bytes"] == 0
        assert f["wire_ratio"] < 0.6, f  # the BF16 embeddings weigh more in a model this small
    else:
        assert 0 < f["sender_share"] < 1 and f["receiver_quantized_bytes"] > 0, f
        assert f["wire_ratio"] > 0.6, f


def test_a_destination_that_cuts_blocks_is_refused_as_vllm_would(tmp_path):
    """tp 4 splits down_proj's 512 columns into 128 (fine) but the experts' 256 into 64: vLLM refuses it."""
    src, dst = _pair(tmp_path, TP_SRC, mesh="{tp: 4}")
    plan = Plan(src, dst, mode="reshard")
    with pytest.raises(ConfigError, match=r"64 .*cuts its 128-wide FP8 blocks: vLLM refuses"):
        fp8_figures(plan, plan.stats())


def test_bf16_destination_has_no_fp8_figures(tmp_path):
    src, dst = _pair(tmp_path, TP_SRC, quantization="none")
    plan = Plan(src, dst, mode="reshard")
    assert dst.quantization is None and fp8_figures(plan, plan.stats()) is None


def test_quantized_tensors_follow_vllm():
    q = Quantization(block=(128, 128), ignored=("model.layers.1.mlp",))
    assert q.quantizes("model.layers.0.self_attn.kv_a_proj_with_mqa.weight", (576, 7168))
    assert q.quantizes("model.layers.0.mlp.experts.7.down_proj.weight", (7168, 2048))
    assert not q.quantizes("model.layers.0.mlp.gate.weight", (256, 7168))  # the router
    assert not q.quantizes("model.embed_tokens.weight", (129280, 7168))
    assert not q.quantizes("lm_head.weight", (129280, 7168))
    assert not q.quantizes("model.layers.0.input_layernorm.weight", (7168,))
    assert not q.quantizes("model.layers.1.mlp.down_proj.weight", (7168, 18432))  # ignored_layers
    assert q.scale_shape((576, 7168)) == (5, 56) and q.scale_name("a.weight") == "a.weight_scale_inv"


def test_whole_block_share_against_brute_force():
    rng = random.Random(7)
    for _ in range(40):
        shape = (rng.randint(1, 700), rng.randint(1, 700))
        block = (rng.choice([16, 64, 128]), rng.choice([16, 128]))
        rows = sorted({0, shape[0], *(rng.randint(0, shape[0]) for _ in range(rng.randint(0, 3)))})
        cols = sorted({0, shape[1], *(rng.randint(0, shape[1]) for _ in range(rng.randint(0, 2)))})
        boxes = [(Box((r0, c0), (r1 - r0, c1 - c0)), (0,)) for r0, r1 in zip(rows, rows[1:])
                 for c0, c1 in zip(cols, cols[1:])]
        inside = 0
        for i in range(0, shape[0], block[0]):
            for j in range(0, shape[1], block[1]):
                b = Box((i, j), (min(block[0], shape[0] - i), min(block[1], shape[1] - j)))
                if any(b.intersect(box) == b for box, _ in boxes):
                    inside += b.numel
        assert whole_block_share(shape, boxes, block) == pytest.approx(inside / (shape[0] * shape[1])), (shape, rows,
                                                                                                          cols)


def test_bundled_fp8_layouts_plan():
    """DeepSeek-V3 from Megatron PP16 EP16 into 16 TP16 FP8 replicas: every block quantized on the sender,
    about half a BF16 refit's wire."""
    from reshard_cli.layouts.topology import load_topology

    src, dst = load_pair("deepseek-v3/megatron-pp16-ep16", "deepseek-v3/vllm-tp16-dp16-fp8")
    plan = Plan(src, dst, load_topology("dgx-h100"), mode="reshard")
    f = fp8_figures(plan, plan.stats())
    assert f["sender_share"] == 1.0 and f["wire_ratio"] <= 0.55, f


def test_moving_into_an_fp8_engine_is_refused_in_one_line(tmp_path):
    """`reshard run --out` into an FP8 layout says it cannot write an FP8 checkpoint yet, instead of writing BF16."""
    import subprocess
    import sys

    _pair(tmp_path, TP_SRC)
    r = subprocess.run([sys.executable, "-m", "reshard_cli", "run", "--src", tmp_path / "src.yaml", "--dst",
                        tmp_path / "dst.yaml", "--out", tmp_path / "out", "--quiet"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "engine.quantization" in lines[0] and "not built yet" in lines[0] and "FP8" in lines[0], r.stderr
