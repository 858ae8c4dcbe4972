"""Planning a refit into an FP8 engine (`plan.fp8`): which blocks the senders can quantize, the wire it costs
(checked against a sum over the plan's own pieces, block by block), and the layouts vLLM refuses."""
import json
import math
import random
from collections import defaultdict

import pytest

from reshard_cli.base.geometry import Box
from reshard_cli.errors import ConfigError
from reshard_cli.formats import load_pair
from reshard_cli.layouts.quant import Quantization
from reshard_cli.layouts.topology import Topology
from reshard_cli.plan.fp8 import fp8_figures, on_wire, whole_block_share
from reshard_cli.plan.planner import Plan
from reshard_cli.plan.terms import Traffic

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


def _blocks(shape, box, block):
    """The blocks of a tensor of `shape` (2-D) that `box` touches."""
    (bm, bn), (r0, c0), (nr, nc) = block, box.offsets, box.sizes
    for i in range(r0 // bm, math.ceil((r0 + nr) / bm)):
        for j in range(c0 // bn, math.ceil((c0 + nc) / bn)):
            yield Box((i * bm, j * bn), (min(bm, shape[0] - i * bm), min(bn, shape[1] - j * bn)))


def _bytes(plan, t, box, own):
    """What region `box` of tensor `t` weighs on the wire, block by block: a block inside the sender's own
    source box `own` moves as FP8 (a byte per element, 4 for its scale), a block it cuts in the source dtype."""
    spec, q = plan.src.manifest.tensors[t], plan.dst.quantization
    if not q.quantizes(spec.name, spec.shape):
        return box.numel * spec.itemsize
    total = 0
    for block in _blocks(spec.shape, box, q.block):
        part = block.intersect(box)
        if part is None:
            continue
        if block.intersect(own) == block:
            assert part == block  # the plan cuts its pieces on the block grid: a whole block is in one piece
            total += block.numel + 4
        else:
            total += part.numel * spec.itemsize
    return total


def _by_pieces(plan):
    """The FP8 refit's figures, summed over the plan's own pieces block by block (`_bytes`): network wire,
    in-domain and forwarded bytes, each rank's network bytes sent and received, per kind of traffic the bytes
    between each pair of ranks; broadcast tensors move whole in the source dtype."""
    dom, src = plan.topology.domain_of, plan.src
    out = {"wire_bytes": 0, "indomain_bytes": 0, "forwarded_bytes": 0, "send": defaultdict(int),
           "recv": defaultdict(int), "pairs": defaultdict(int)}
    for p in plan.pieces():
        shape = src.manifest.tensors[p.tensor].shape
        own = src.placements[p.tensor].box_of(shape, p.src) if p.phase == 0 else \
            next(a for a, hs in plan.unique_boxes(shape, src.placements[p.tensor]) if a.intersect(p.box) == p.box)
        n = _bytes(plan, p.tensor, p.box, own)
        kind = Traffic.FWD if p.phase else Traffic.NET if dom(p.src) != dom(p.dst) else Traffic.NVL0
        out["pairs"][(kind, p.src, p.dst)] += n
        if kind == Traffic.NET:
            out["wire_bytes"] += n
            out["send"][p.src] += n
            out["recv"][p.dst] += n
        else:
            out["indomain_bytes"] += n
            out["forwarded_bytes"] += n if p.phase else 0
    doms = {dom(r) for r in plan.dst.ranks}
    for b in plan.bcasts():  # gathered on the root, then into every other destination domain once
        spec = src.manifest.tensors[b.tensor]
        out["wire_bytes"] += sum(a.numel for s, a in b.gather if dom(s) != dom(b.root)) * spec.itemsize
        out["wire_bytes"] += spec.nbytes * len(doms - {dom(b.root)})
    return out


def _min_wire(plan):
    """Ground truth of the minimum: per destination box and domain, what no source rank in the domain holds,
    weighed block by block as it would travel from the source box holding it."""
    dom, total = plan.topology.domain_of, 0
    for t, spec in enumerate(plan.src.manifest.tensors):
        for b, holders in plan.unique_boxes(spec.shape, plan.dst.placements[t]):
            for d in {dom(h) for h in holders}:
                for a, senders in plan.unique_boxes(spec.shape, plan.src.placements[t]):
                    r = a.intersect(b)
                    if r is not None and d not in {dom(s) for s in senders}:
                        total += _bytes(plan, t, r, a)
    return total


def _seconds(pairs, links, half, world):
    """The reshard path's predicted seconds by hand (docs/design.md, the cost model): per kind of traffic, the
    busiest rank's max(bytes sent, received) / bandwidth + max(messages sent, received) x latency, a message per
    `half` bytes between a pair; phase 0's network and NVLink at once, then the forwards."""
    net, nvl, lat = links["network_gbps"] * 1e9, links["nvlink_gbps"] * 1e9, links["latency_us"] * 1e-6
    out = {}
    for kind, bw in ((Traffic.NET, net), (Traffic.NVL0, nvl), (Traffic.FWD, nvl)):
        loads = [[0, 0, 0, 0] for _ in range(world)]
        for (k, s, d), n in pairs.items():
            if k == kind and n:
                m = math.ceil(n / half)
                loads[s][0] += n
                loads[s][2] += m
                loads[d][1] += n
                loads[d][3] += m
        out[kind] = max((max(a, b) / bw + max(c, e) * lat for a, b, c, e in loads), default=0.0)
    return max(out[Traffic.NET], out[Traffic.NVL0]) + out[Traffic.FWD], out


LINKS = {"network_gbps": 0.5, "nvlink_gbps": 8.0, "latency_us": 5.0}
BUCKET = 64 << 10  # 32 KiB messages: several per pair


@pytest.mark.parametrize("rpd", [2, 4])
@pytest.mark.parametrize("src_body,share", [(TP_SRC, 1.0), (FSDP_SRC, None)])
def test_fp8_wire_equals_a_sum_over_the_pieces(tmp_path, src_body, share, rpd):
    """Tensor-parallel sources hold whole blocks (every block quantized on the sender, the wire about half a
    BF16 refit's); FSDP's uneven row shards (86, 85, 85 of 256, 171 of 512) cut blocks, which move as BF16.
    Every figure that weighs the wire (`on_wire`: network, minimum, in-domain, forwarded, busiest rank) equals
    the plan's own pieces summed block by block, the source dtype's are kept as bf16_<key>, and the FP8
    breakdown adds up to the same wire."""
    src, dst = _pair(tmp_path, src_body)
    plan = Plan(src, dst, Topology(name="pairs", ranks_per_domain=rpd), mode="reshard")
    stats = plan.stats()
    s = on_wire(plan, stats)
    f = fp8_figures(plan, s)
    truth = _by_pieces(plan)
    assert f["block"] == [128, 128] and f["quantized_tensors"] > 0
    for k in ("wire_bytes", "indomain_bytes", "forwarded_bytes"):
        assert s[k] == truth[k], k
        assert s["bf16_" + k] == stats[k], k
    assert s["max_rank_send_bytes"] == max(truth["send"].values())
    assert s["max_rank_recv_bytes"] == max(truth["recv"].values())
    assert {r: (v["send"], v["recv"]) for r, v in s["rank_bytes"].items()} == \
        {r: (truth["send"][r], truth["recv"][r]) for r in src.ranks + dst.ranks}
    assert s["min_wire_bytes"] == _min_wire(plan) == s["wire_bytes"] - (truth["forwarded_bytes"] and 0)
    assert s["broadcast_wire_bytes"] == stats["broadcast_wire_bytes"]  # the baseline moves BF16 full tensors
    assert f["wire_bytes"] == s["wire_bytes"] == f["sender_quantized_bytes"] + f["receiver_quantized_bytes"] + \
        f["unquantized_bytes"] and f["bf16_wire_bytes"] == stats["wire_bytes"]
    if share == 1.0:
        assert f["sender_share"] == 1.0 and f["receiver_quantized_bytes"] == 0
        assert f["wire_ratio"] < 0.6, f  # the BF16 embeddings weigh more in a model this small
    else:
        assert 0 < f["sender_share"] < 1 and f["receiver_quantized_bytes"] > 0, f
        assert f["wire_ratio"] > 0.6, f


@pytest.mark.parametrize("src_body", [TP_SRC, FSDP_SRC])
def test_hybrid_broadcasts_bf16(tmp_path, src_body):
    """Broadcast tensors move whole in the source dtype, and the engine quantizes them."""
    src, dst = _pair(tmp_path, src_body)
    plan = Plan(src, dst, Topology(name="pairs", ranks_per_domain=2), mode="hybrid")
    s = on_wire(plan)
    assert plan.paths.count("broadcast") > 0
    assert s["wire_bytes"] == _by_pieces(plan)["wire_bytes"] == fp8_figures(plan, s)["wire_bytes"]


@pytest.mark.parametrize("rpd", [2, 4])
@pytest.mark.parametrize("src_body", [TP_SRC, FSDP_SRC])
def test_predicted_seconds_weigh_the_fp8_wire(tmp_path, src_body, rpd):
    """The cost model's reshard-path seconds and its ingress bound against the same formula computed by hand
    on the plan's pieces, each weighed block by block as it travels; in mode auto (no route is broadcast with
    these links) for the routes auto chose, which the model chose weighing those bytes."""
    from reshard_cli.plan import cost

    src, dst = _pair(tmp_path, src_body)
    topo = Topology(name="pairs", ranks_per_domain=rpd, links=dict(LINKS))
    half = BUCKET // 2
    world = max(dst.ranks) + 1
    for mode in ("reshard", "auto"):
        plan = cost.with_auto_routes(Plan(src, dst, topo, mode=mode, bucket_bytes=BUCKET))
        assert "broadcast" not in plan.paths
        pred = cost.predict(plan, bucket_bytes=BUCKET)
        truth = _by_pieces(plan)
        seconds, per = _seconds(truth["pairs"], LINKS, half, world)
        c = pred.modes[mode]
        assert c.seconds == pytest.approx(seconds, rel=1e-12), mode
        assert (c.network_s, c.nvlink0_s, c.forward_s) == pytest.approx(
            (per[Traffic.NET], per[Traffic.NVL0], per[Traffic.FWD]), rel=1e-12)
        if mode == "reshard":  # each byte enters each destination domain once: the ingress bound
            into: dict = defaultdict(int)
            for (k, _s, d), n in truth["pairs"].items():
                if k == Traffic.NET:
                    into[topo.domain_of(d)] += n
            ranks = defaultdict(int)
            for r in src.ranks + dst.ranks:
                ranks[topo.domain_of(r)] += 1
            assert pred.bound.ingress_s == pytest.approx(max(n / (ranks[d] * LINKS["network_gbps"] * 1e9)
                                                             for d, n in into.items()),
                                                         rel=1e-12)
        bf16 = cost.predict(plan, bucket_bytes=BUCKET, on_wire=False).modes[mode]
        assert bf16.seconds >= c.seconds  # the same routes, every byte in BF16


@pytest.mark.parametrize("src_body,mesh", [(TP_SRC, "{dp: 2, tp: 2}"), (FSDP_SRC, "{dp: 2, tp: 2}"),
                                           (TP_SRC, "{tp: 4}")])
def test_auto_weighs_whole_bytes(tmp_path, src_body, mesh):
    """What auto compares are sums of whole bytes (exact in float64 in any order, so that every rank chooses
    alike), also where a piece of whole full-size blocks weighs 1 + 4 / 16384 bytes per element (TP sources)
    and where a destination cuts blocks (tp 4, which vLLM refuses: those tensors counted per block)."""
    import numpy as np

    from reshard_cli.plan import cost
    from reshard_cli.plan.fp8 import wire_weights

    src, dst = _pair(tmp_path, src_body, mesh=mesh)
    plan = Plan(src, dst, Topology(name="pairs", ranks_per_domain=2, links=dict(LINKS)), mode="auto")
    model = cost.model_for(plan, cost.links_of(plan.topology)[0])
    rows = model.class_rows()
    assert len(rows.nbytes) and np.array_equal(rows.nbytes, np.round(rows.nbytes))
    fractional = any(w != int(w) for w in wire_weights(plan.classes)[None])
    assert fractional == (src_body == TP_SRC)  # tp 4 too: the tensors whose blocks it leaves whole
    routes = cost.with_auto_routes(plan).routes
    for loads in model.reshard_loads(routes).values():
        assert all(np.array_equal(a, np.round(a)) for a in loads)


def test_counts_are_the_transports_bytes():
    """What the plan counts of a piece (`counter`: its whole blocks' elements; their bytes as quantized) against
    the transport's own split of it (`Wire.parts`, `Wire.payload`), on random boxes of ragged tensors."""
    from types import SimpleNamespace

    from reshard_cli.plan.fp8 import INNER, WHOLE, Wire, counter

    rng = random.Random(5)
    for _ in range(300):
        shape = (rng.randint(1, 3), rng.randint(1, 600), rng.randint(1, 600))
        spec = SimpleNamespace(name="x.weight", shape=shape, itemsize=2, dtype="bfloat16", numel=math.prod(shape))
        plan = SimpleNamespace(src=SimpleNamespace(manifest=SimpleNamespace(tensors=[spec])),
                               dst=SimpleNamespace(quantization=Quantization(block=(128, 128))))
        wire = Wire(plan)
        wire.quantized = frozenset({0})  # as a stacked weight would be: leading dims are cut anywhere
        o = [rng.randrange(n) for n in shape]
        box = Box(tuple(o), tuple(rng.randint(1, n - x) for n, x in zip(shape, o)))
        parts = wire.parts(0, box)
        assert counter(INNER, shape, (128, 128))(box) == sum(p.numel for p in parts if wire.fp8(0, p))
        assert counter(WHOLE, shape, (128, 128))(box) == sum(wire.payload(0, p) for p in parts if wire.fp8(0, p))


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


def test_reshard_plan_speaks_fp8(tmp_path):
    """`reshard plan` of DeepSeek-V3 into its FP8 layout: the headline figures and JSON keys are the FP8 wire's
    (the fp8 line's), the source dtype's beside them as bf16_<key>; the gather->broadcast baseline in BF16."""
    import subprocess
    import sys

    from conftest import ROOT
    from reshard_cli.base.text import fmt_bytes
    from reshard_cli.plan.fp8 import HEADLINE

    out = tmp_path / "p.json"
    r = subprocess.run([sys.executable, "-m", "reshard_cli", "plan", "--src",
                        "layouts/deepseek-v3/megatron-pp16-ep16.yaml", "--dst",
                        "layouts/deepseek-v3/vllm-tp16-dp16-fp8.yaml", "--topology", "dgx-h100", "--json", out],
                       cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    doc = json.loads(out.read_text())
    f = doc["fp8"]
    assert doc["wire_bytes"] == f["wire_bytes"] and doc["bf16_wire_bytes"] == f["bf16_wire_bytes"]
    assert f["wire_ratio"] < 0.55
    for k in HEADLINE:
        assert 0 < doc[k] < doc["bf16_" + k], k
    assert doc["fleet"]["wire_bytes"] == doc["wire_bytes"] and doc["fleet"]["min_wire_bytes"] == doc["min_wire_bytes"]
    assert doc["broadcast_wire_bytes"] >= doc["bytes"] * 32  # BF16 full tensors into each of the 32 domains
    for m, seconds in doc["predicted_seconds"].items():
        assert doc["lower_bound_seconds"] <= seconds <= doc["bf16_predicted_seconds"][m], m
    assert doc["predicted_seconds"]["auto"] < 0.7 * doc["bf16_predicted_seconds"]["auto"]
    assert doc["lower_bound_seconds"] < 0.6 * doc["bf16_lower_bound_seconds"]
    lines = r.stdout.splitlines()
    assert f"  network wire  {fmt_bytes(doc['wire_bytes'])}   minimum {fmt_bytes(doc['min_wire_bytes'])}" in r.stdout
    assert any("gather->broadcast sends BF16 full tensors" in x for x in lines)
    assert any(x.startswith("  in BF16       auto:") for x in lines)


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
