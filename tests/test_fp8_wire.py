"""Quantizing on the sender: a refit into a block-FP8 engine moves the blocks a source shard holds whole as FP8
bytes and scales, and the rest (blocks a shard boundary cuts, broadcast tensors) in BF16, quantized by the
destination. Checked on gloo against vLLM's own quantizer on the full tensor, bit for bit, with every
destination buffer a sentinel first; the wire against the plan's FP8 figures; corruption against checksums."""
import itertools
import json
import random

import pytest
import torch

from dist_util import run_ranks
from reshard_cli.base.blocks import grid_split, split_whole, whole_blocks
from reshard_cli.base.geometry import Box

# a Qwen3-MoE served in block FP8, with rows that FSDP over 3 ranks cuts mid-block
CONFIG = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=512, hidden_size=640,
              intermediate_size=384, moe_intermediate_size=384, num_hidden_layers=1, num_attention_heads=5,
              num_key_value_heads=1, head_dim=128, num_experts=2, num_experts_per_tok=1, norm_topk_prob=True,
              decoder_sparse_step=1, mlp_only_layers=[], tie_word_embeddings=False, torch_dtype="bfloat16",
              quantization_config={"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                   "weight_block_size": [128, 128]})
SRC = """mesh: {fsdp: 3}
placements:
  - {match: '.', shard: {fsdp: 0}}
"""
SENTINEL = 0xA5


def _pair(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(CONFIG))
    (tmp_path / "src.yaml").write_text(f"model: config.json\n{SRC}")
    (tmp_path / "dst.yaml").write_text("model: config.json\nformat: vllm\nmesh: {dp: 2, tp: 1}\n"
                                       "engine: {quantization: fp8}\n")
    return tmp_path / "src.yaml", tmp_path / "dst.yaml"


def _reference(manifest):
    out = []
    for t, spec in enumerate(manifest.tensors):
        g = torch.Generator().manual_seed(77 + t)
        out.append((torch.randn(spec.shape, generator=g) * (1 + t % 5)).to(getattr(torch, spec.dtype)))
    return out


def test_parts_and_grid_splits_keep_blocks_whole():
    """`split_whole` gives the whole-block inner part and a rim with no whole block (every block the box cuts
    lies in the rim); `grid_split` keeps a whole-block box whole-block in every part."""
    rng = random.Random(3)
    for _ in range(3000):
        full = (rng.randint(1, 600), rng.randint(1, 600))
        o = [rng.randrange(f) for f in full]
        box = Box(tuple(o), tuple(rng.randint(1, f - x) for f, x in zip(full, o)))
        inner, rim = split_whole(box, full, (128, 128))
        parts = ([inner] if inner else []) + rim
        assert sum(p.numel for p in parts) == box.numel
        assert all(p.intersect(box) == p for p in parts)
        assert all(a.intersect(b) is None for a, b in itertools.combinations(parts, 2))
        assert inner is None or whole_blocks(inner.offsets, inner.sizes, full, (128, 128))
        assert not any(whole_blocks(r.offsets, r.sizes, full, (128, 128)) for r in rim)
        k = rng.randint(2, 5)
        subs = grid_split(box, k, full, (128, 128))
        assert len(subs) == k and sum(s.numel for s in subs) == box.numel
        if inner is not None:
            assert all(whole_blocks(s.offsets, s.sizes, full, (128, 128)) for s in grid_split(inner, k, full))


def _shards(rank, plan, ref):
    """This rank's source shards of the reference tensors, and its destination buffers, every byte a sentinel
    (a block-FP8 weight's FP8 storage and scales too)."""
    from reshard_cli.base.blocks import blocks_of
    from reshard_cli.codecs.fp8 import FP8Landing
    from reshard_cli.transfer.shards import LocalShard

    src_shards, dst_shards = {}, {}
    for t, spec in enumerate(plan.src.manifest.tensors):
        if rank in plan.src.placements[t].holder_set:
            box = plan.src.placements[t].box_of(spec.shape, rank)
            src_shards[t] = LocalShard(box, ref[t][box.slices()].clone())
        if rank in plan.dst.placements[t].holder_set:
            box = plan.dst.placements[t].box_of(spec.shape, rank)
            data = torch.empty(box.sizes, dtype=ref[t].dtype)
            data.view(torch.uint8).fill_(SENTINEL)
            stored = None
            if t in plan.wire.quantized:
                stored = FP8Landing(torch.full(box.sizes, SENTINEL, dtype=torch.uint8).view(torch.float8_e4m3fn),
                                    torch.full(blocks_of(box.sizes), -1.0), data)
            dst_shards[t] = LocalShard(box, data, stored)
    return src_shards, dst_shards


def _refit(rank, world, src_path, dst_path, cases, bucket_bytes):
    from reshard_cli.formats import load_pair
    from reshard_cli.layouts.topology import Topology
    from reshard_cli.plan.planner import Plan
    from reshard_cli.plan.schedule import TransferOptions
    from reshard_cli.transfer import verify
    from reshard_cli.transfer.engine import Engine

    src, dst = load_pair(src_path, dst_path)
    ref = _reference(src.manifest)
    man = src.manifest.tensors
    out = {}
    for mode, domains in cases:
        plan = Plan(src, dst, Topology(name="t", domains=domains), mode=mode)
        wire = plan.wire
        src_shards, dst_shards = _shards(rank, plan, ref)
        engine = Engine(plan, rank, src_shards, dst_shards, options=TransferOptions(bucket_bytes=bucket_bytes))
        engine.setup_groups()
        engine.run_reshard()
        engine.run_broadcast()
        quantized_here = engine.finish_received()
        _actual, bad, _ = verify.mismatched_checksums(plan, rank, src_shards, dst_shards)
        held = {}
        for t, sh in dst_shards.items():
            if sh.stored is not None:
                held[man[t].name] = (sh.box.offsets, sh.stored.fp8.view(torch.uint8).numpy().copy(), sh.stored.scale.numpy().copy())
            else:  # numpy arrays: a tensor would travel as a handle into this process's memory
                held[man[t].name] = (sh.box.offsets, sh.data.view(torch.uint8).numpy().copy(), None)
        corrupted = None
        if rank == world - 1:  # one FP8 byte flipped: the checksums must say so
            t = next(t for t in dst_shards if t in wire.quantized)
            dst_shards[t].stored.fp8.view(torch.uint8).view(-1)[5] ^= 1
            corrupted = man[t].name
        _a, bad_after, _ = verify.mismatched_checksums(plan, rank, src_shards, dst_shards)
        fp8_items = sum(1 for op in engine.ops if not op.send for t, b, _ in op.items if wire.fp8(t, b))
        out[(mode, bool(domains))] = {
            "held": held, "bad": [man[t].name for t in bad], "bad_after": [man[t].name for t in bad_after],
            "corrupted": corrupted, "sent": engine.bytes_sent, "quantized_here": quantized_here,
            "fp8_items_received": fp8_items}
    return out


def test_sender_quantized_refit_equals_vllm_quantizer(tmp_path):
    """FSDP over 3 ranks (its cuts at rows 128 and 256 of the experts' 384-row gate/up fall on the block grid;
    those at 214 and 428 of the 640-row tensors and at 43 and 86 of k/v do not) into two FP8 replicas: with forwarding inside their domain and without, and with
    the non-FFN tensors broadcast (hybrid). Every FP8 byte and scale equals vLLM's per_block_cast_to_fp8 of
    the full BF16 tensor; the other tensors equal the source; the checksums agree, and catch one flipped FP8
    byte; FP8 moved on the wire and the destinations quantized only what arrived cut."""
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm", reason="vLLM's reference quantizer")
    from reshard_cli.formats import load_pair
    from reshard_cli.layouts.topology import Topology
    from reshard_cli.plan.fp8 import fp8_figures, on_wire
    from reshard_cli.plan.planner import Plan

    src_path, dst_path = _pair(tmp_path)
    cases = (("reshard", ((3, 4),)), ("reshard", ()), ("hybrid", ((3, 4),)))
    results = run_ranks(5, _refit, str(src_path), str(dst_path), cases, 64 << 10)
    src, dst = load_pair(src_path, dst_path)
    ref = {spec.name: x for spec, x in zip(src.manifest.tensors, _reference(src.manifest))}
    q = dst.quantization
    expected = {}
    for name, x in ref.items():
        if q.quantizes(name, x.shape):
            fq, fs = deep_gemm.per_block_cast_to_fp8(x, [128, 128], use_ue8m0=False)
            expected[name] = (fq.view(torch.uint8), fs)
    assert expected
    for case in ((m, bool(d)) for m, d in cases):
        for rank in (3, 4):
            got = results[rank][case]
            assert got["bad"] == [], (case, rank, got["bad"])
            assert got["bad_after"] == [got["corrupted"]] if rank == 4 else got["bad_after"] == []
            for name, (offsets, data, scale) in got["held"].items():
                data = torch.from_numpy(data)
                scale = None if scale is None else torch.from_numpy(scale)
                box = Box(tuple(offsets), tuple(ref[name][tuple(slice(o, None) for o in offsets)].shape)
                          if data.dim() == 0 else tuple(data.shape))
                if name in expected:
                    fq, fs = expected[name]
                    assert torch.equal(data, fq[box.slices()]), (case, rank, name)
                    rows = slice(offsets[0] // 128, offsets[0] // 128 + scale.shape[0])
                    assert torch.equal(scale, fs[rows, offsets[1] // 128:][:, :scale.shape[1]]), (case, rank, name)
                else:
                    want = ref[name][box.slices()].contiguous()
                    assert torch.equal(data, want.view(torch.uint8)), (case, rank, name)
            assert got["fp8_items_received"] > 0, case
            assert got["quantized_here"] > 0, case  # cut blocks (and broadcast tensors in hybrid)
    # the wire: what the senders and forwarders sent, against the plan's FP8 figures (no topology: every
    # message crosses domains), byte for byte, and against the BF16 refit
    plan = Plan(src, dst, Topology(name="t"), mode="reshard")
    fig = fp8_figures(plan, plan.stats())
    sent = sum(results[r][("reshard", False)]["sent"] for r in results)
    assert sent < 0.75 * fig["bf16_wire_bytes"]
    assert sent == fig["wire_bytes"] == on_wire(plan)["wire_bytes"], (sent, fig["wire_bytes"])  # FP8, scales, BF16


def _cut_block(plan, t, box):
    """The first block of destination box `box` of tensor `t` that a source shard boundary cuts, as a Box."""
    shape = plan.src.manifest.tensors[t].shape
    for a, _h in plan.unique_boxes(shape, plan.src.placements[t]):
        r = a.intersect(box)
        rims = split_whole(r, shape, plan.wire.block)[1] if r is not None else []
        if rims:
            (r0, c0), (nr, nc) = rims[0].offsets, rims[0].sizes
            o = (r0 // 128 * 128, c0 // 128 * 128)
            return Box(o, (min(128, shape[0] - o[0]), min(128, shape[1] - o[1])))
    return None


def _corrupted(rank, world, src_path, dst_path):
    """A refit into two FP8 replicas (FSDP's cuts at rows 214 and 428 leave blocks to the destinations), then
    faults on the last rank, each undone before the next, verified after each: one FP8 byte of a block the
    destination quantized, flipped after quantizing; such a block quantized wrongly (bytes and scale of twice its
    max |x|, consistent with each other); one BF16 byte of it as it landed."""
    from reshard_cli.base.fp8 import block_scales, quantize_part
    from reshard_cli.formats import load_pair
    from reshard_cli.layouts.topology import Topology
    from reshard_cli.plan.planner import Plan
    from reshard_cli.transfer import verify
    from reshard_cli.transfer.engine import Engine

    src, dst = load_pair(src_path, dst_path)
    ref = _reference(src.manifest)
    man = src.manifest.tensors
    plan = Plan(src, dst, Topology(name="t", domains=((3, 4),)), mode="reshard")
    src_shards, dst_shards = _shards(rank, plan, ref)
    engine = Engine(plan, rank, src_shards, dst_shards)
    engine.setup_groups()
    engine.run_reshard()
    quantized_here = engine.finish_received()
    out = {"quantized_here": quantized_here, "cut": sorted(man[t].name for t in plan.wire.cut),
           "held": {man[t].name: (sh.box.offsets, sh.stored.fp8.view(torch.uint8).numpy().copy(), sh.stored.scale.numpy().copy())
                    for t, sh in dst_shards.items() if sh.stored is not None}}
    out["bad"] = [man[t].name for t in verify.mismatched_checksums(plan, rank, src_shards, dst_shards)[1]]
    mine = [t for t in sorted(dst_shards) if t in plan.wire.cut]
    for fault in ("fp8 byte", "quantization", "bf16 byte"):
        undo, t = None, None
        if rank == world - 1:
            t = mine[{"fp8 byte": 0, "quantization": 1, "bf16 byte": 2}[fault] % len(mine)]
            sh = dst_shards[t]
            block = _cut_block(plan, t, sh.box)
            at = block.local_slices(sh.box)
            kept = (sh.stored.fp8.clone(), sh.stored.scale.clone(), sh.data.clone())
            undo = lambda sh=sh, kept=kept: (sh.stored.fp8.copy_(kept[0]), sh.stored.scale.copy_(kept[1]), sh.data.copy_(kept[2]))
            if fault == "fp8 byte":
                sh.stored.fp8[at].view(torch.uint8)[1, 2] ^= 1
            elif fault == "quantization":
                amax = 2 * sh.data[at].float().abs().amax().reshape(1, 1)
                sh.stored.fp8[at].copy_(quantize_part(sh.data[at], block.offsets, amax))
                sh.stored.scale[block.offsets[0] // 128 - sh.box.offsets[0] // 128,
                         block.offsets[1] // 128 - sh.box.offsets[1] // 128] = block_scales(amax)[0, 0]
            else:
                sh.data[at].view(torch.int16)[1, 2] ^= 1
        bad = verify.mismatched_checksums(plan, rank, src_shards, dst_shards)[1]
        out[fault] = ([man[t].name for t in bad], man[t].name if t is not None else None)
        if undo is not None:
            undo()
    return out


def test_blocks_the_destination_quantizes_are_verified_as_stored(tmp_path):
    """The blocks a source shard boundary cuts arrive in BF16 and the destinations quantize them: what they store
    equals `base.fp8`'s quantizer on the full tensor, element for element, and the checksums cover it (the
    sources agree on each such block's max |x| and quantize their parts of it): an FP8 byte flipped after
    quantizing, a block quantized with a wrong scale, a BF16 byte of it as it landed are each named, on the
    rank that holds it only."""
    from reshard_cli.base.fp8 import quantize_blocks
    from reshard_cli.formats import load_pair

    src_path, dst_path = _pair(tmp_path)
    results = run_ranks(5, _corrupted, str(src_path), str(dst_path))
    src, _dst = load_pair(src_path, dst_path)
    ref = {spec.name: x for spec, x in zip(src.manifest.tensors, _reference(src.manifest))}
    assert results[3]["cut"] and "model.layers.0.self_attn.q_proj.weight" in results[3]["cut"]
    for rank in (3, 4):
        got = results[rank]
        assert got["quantized_here"] > 0 and got["bad"] == []
        for name, (offsets, data, scale) in got["held"].items():
            fq, fs = quantize_blocks(ref[name])
            box = Box(tuple(offsets), tuple(data.shape))
            assert torch.equal(torch.from_numpy(data), fq.view(torch.uint8)[box.slices()]), name
            assert torch.equal(torch.from_numpy(scale), fs[offsets[0] // 128:, offsets[1] // 128:][
                :scale.shape[0], :scale.shape[1]]), name
    for fault in ("fp8 byte", "quantization", "bf16 byte"):
        bad, name = results[4][fault]
        assert name in results[3]["cut"] and bad == [name], (fault, bad, name)
        assert results[3][fault][0] == [], fault


def _staged(rank, world, src_path, dst_path):
    """A Refit in groups of whole layers into a stage that hands out FP8Landings without BF16 buffers (as the
    vLLM backend does): returns what landed, which boxes got a BF16 buffer, and whether any buffer of a
    finished group is still alive once the stage let go of it."""
    import gc
    import weakref

    from reshard_cli.base.blocks import blocks_of
    from reshard_cli.formats import load_pair
    from reshard_cli.transfer.live import Refit, Stage
    from reshard_cli.codecs.fp8 import FP8Landing

    src, dst = load_pair(src_path, dst_path)
    man = src.manifest.tensors
    ref = _reference(src.manifest)
    refit = Refit("src" if rank in src.ranks else "dst", src=src, dst=dst, mode="reshard", stage_mb=0.5)
    if rank in src.ranks:
        tensors = {s.name: ref[t][src.placements[t].box_of(s.shape, rank).slices()].clone() for t, s in enumerate(man)
                   if rank in src.placements[t].holder_set}
        stats = refit(tensors, verify_checksums=True)
        return {"ok": stats.checksums_ok, "groups": stats.groups}

    class Into(Stage):
        def __init__(self):
            self.out, self.bf16, self.alive = {}, {}, []

        def open(self, group, layout):
            self.cur = {}
            for t in group.tensors:
                spec, box = man[t], dst.placements[t].box_of(man[t].shape, rank)
                if layout.quantization.quantizes(spec.name, spec.shape):
                    self.cur[spec.name] = FP8Landing(
                        torch.full(box.sizes, SENTINEL, dtype=torch.uint8).view(torch.float8_e4m3fn),
                        torch.full(blocks_of(box.sizes), -1.0))
                else:
                    self.cur[spec.name] = torch.full(box.sizes, float("nan"), dtype=getattr(torch, spec.dtype))
            return self.cur

        def commit(self, group):
            for name, x in self.cur.items():
                if isinstance(x, FP8Landing):
                    self.out[name] = (x.fp8.view(torch.uint8).numpy().copy(), x.scale.numpy().copy())
                    self.bf16[name] = [tuple(b.shape) for b in x.held]
                    self.alive += [weakref.ref(b) for b in (x.fp8, *x.held)]
                else:
                    self.out[name] = (x.view(torch.uint8).numpy().copy(), None)
                    self.alive.append(weakref.ref(x))
            self.cur = None

    stage = Into()
    stats = refit(verify_checksums=True, stage=stage)
    gc.collect()
    return {"ok": stats.checksums_ok, "groups": stats.groups, "out": stage.out, "bf16": stage.bf16,
            "alive": sum(1 for r in stage.alive if r() is not None)}


def test_staged_refit_lands_in_fp8_views_and_lets_go_of_each_group(tmp_path):
    """Through `Refit` in staging groups, into FP8Landings without BF16 buffers: the refit allocates one only
    for boxes that receive cut blocks (the 640-row tensors, cut at rows 214 and 428), none for those the
    senders quantize whole (the experts' 384-row gate/up, cut on the grid); the result equals vLLM's
    quantizer; and once a group is committed nothing of the refit keeps its buffers alive."""
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm", reason="vLLM's reference quantizer")
    src_path, dst_path = _pair(tmp_path)
    (tmp_path / "dst.yaml").write_text("model: config.json\nformat: vllm\nmesh: {tp: 1}\n"
                                       "engine: {quantization: fp8}\n")
    results = run_ranks(4, _staged, str(src_path), str(dst_path))
    got = results[3]
    assert all(r["ok"] for r in results.values()) and got["groups"] > 1
    assert got["alive"] == 0
    from reshard_cli.formats import load_pair

    src, _dst = load_pair(src_path, dst_path)
    ref = {spec.name: x for spec, x in zip(src.manifest.tensors, _reference(src.manifest))}
    for name, (data, scale) in got["out"].items():
        if scale is None:
            assert torch.equal(torch.from_numpy(data), ref[name].view(torch.uint8) if ref[name].dim() else
                               ref[name].reshape(1).view(torch.uint8).reshape(())), name
            continue
        fq, fs = deep_gemm.per_block_cast_to_fp8(ref[name], [128, 128], use_ue8m0=False)
        assert torch.equal(torch.from_numpy(data), fq.view(torch.uint8)), name
        assert torch.equal(torch.from_numpy(scale), fs), name
    bf16 = got["bf16"]
    assert bf16["model.layers.0.mlp.experts.0.gate_proj.weight"] == [(0, 0)]  # no buffer: all sent as FP8
    assert bf16["model.layers.0.self_attn.q_proj.weight"] == [(640, 640)]  # blocks cut at rows 214 and 428
