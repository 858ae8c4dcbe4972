"""FP8 quantization (reshard_cli/base/fp8.py) against vLLM's own: bit for bit, on whole tensors, on shards that
hold whole blocks, and on random source layouts where blocks split between shards are assembled first.

vLLM's block reference is `vllm.utils.deep_gemm.per_block_cast_to_fp8`, which vLLM runs through torch.compile.
Most cases call its function body eagerly (`_torchdynamo_orig_callable`: compiling every shape class takes
seconds); `test_blocks_equal_vllm_compiled` checks a few against the compiled function as vLLM calls it.
"""
from __future__ import annotations

import itertools
import random

import pytest
import torch

from reshard_cli.base import fp8
from reshard_cli.base.fp8 import (blocks_of, quantize_blocks, quantize_region, quantize_tensor, scale_offset,
                                  tensor_amax, whole_blocks)
from reshard_cli.base.geometry import Box, shard_box

BF16, F16, F32 = torch.bfloat16, torch.float16, torch.float32


@pytest.fixture(scope="module")
def vllm_blocks():
    """vLLM's per_block_cast_to_fp8 as vLLM runs it (compiled)."""
    deep_gemm = pytest.importorskip("vllm.utils.deep_gemm", reason="vLLM's reference quantizer")
    return deep_gemm.per_block_cast_to_fp8


@pytest.fixture(scope="module")
def vllm_eager(vllm_blocks):
    """The same function's body, run eagerly."""
    return getattr(vllm_blocks, "_torchdynamo_orig_callable", vllm_blocks)


def reference(fn, x, block=(128, 128)):
    """vLLM's block quantization of x; leading dims one 2-D slice at a time, as vLLM's MoE path does."""
    if x.dim() == 2:
        return fn(x, list(block), use_ue8m0=False)
    outs = [reference(fn, t, block) for t in x]
    return torch.stack([q for q, _ in outs]), torch.stack([s for _, s in outs])


def assert_bits_equal(got, want):
    (q, s), (wq, ws) = got, want
    assert q.dtype == torch.float8_e4m3fn and s.dtype == torch.float32
    assert q.shape == wq.shape and s.shape == ws.shape
    assert torch.equal(q.view(torch.uint8), wq.view(torch.uint8)), \
        f"{(q.view(torch.uint8) != wq.view(torch.uint8)).sum().item()} fp8 values differ"
    assert torch.equal(s.view(torch.int32), ws.view(torch.int32)), \
        f"{(s.view(torch.int32) != ws.view(torch.int32)).sum().item()} scales differ"


def values(kind: str, shape, dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    if kind == "normal":  # weight-like
        x = x * 0.02
    elif kind == "wide":  # every magnitude, per element (fp16: within its range)
        lo, hi = (-18, 9) if dtype == F16 else (-40, 20)
        x = x * torch.exp(torch.empty(shape, dtype=torch.float64).uniform_(lo, hi, generator=g))
    elif kind == "tiny":  # blocks whose max is below the 1e-4 clamp; fp8 subnormals
        x = x * torch.exp(torch.empty(shape, dtype=torch.float64).uniform_(-35, -9, generator=g))
    elif kind == "ints":  # exact fp8 midpoints (232 between 224 and 240 when a block's max is 448)
        x = torch.randint(-448, 449, shape, generator=g).double()
    x = x.to(dtype)
    if kind in ("zeros", "huge", "ints"):
        flat = x.view(-1, *x.shape[-2:])
        if kind == "zeros":  # a block of zeros, a block of negative zeros, a block mixing both
            flat[:, :128, :128] = 0.0
            flat[:, 128:256, :128] = -0.0
            flat[:, :64, 128:256] = -0.0
            flat[:, 64:128, 128:256] = 0.0
        elif kind == "huge":  # one huge value in a block of small ones, the dtype's largest elsewhere
            flat[:, min(3, flat.shape[1] - 1), min(5, flat.shape[2] - 1)] = 1e30 if dtype != F16 else 6e4
            flat[:, -1, -1] = -torch.finfo(dtype).max
        else:
            flat[:, 0, 0] = 448.0
    return x


SHAPES = [(128, 128), (256, 384), (300, 200), (576, 448), (1, 1), (127, 129), (4, 256, 130), (130, 1), (1, 300),
          (2, 3, 129, 5)]
KINDS = ["normal", "wide", "tiny", "zeros", "huge", "ints"]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("kind", KINDS)
def test_blocks_equal_vllm(vllm_eager, shape, kind):
    x = values(kind, shape, BF16, seed=len(shape) * 1000 + shape[-1])
    assert_bits_equal(quantize_blocks(x), reference(vllm_eager, x))


@pytest.mark.parametrize("dtype", [F16, F32], ids=str)
@pytest.mark.parametrize("kind", KINDS)
def test_blocks_equal_vllm_fp16_fp32(vllm_eager, dtype, kind):
    for shape in [(300, 200), (3, 129, 257)]:
        x = values(kind, shape, dtype, seed=7)
        assert_bits_equal(quantize_blocks(x), reference(vllm_eager, x))


@pytest.mark.parametrize("block", [(16, 32), (64, 128), (1, 128), (128, 1), (7, 5)], ids=str)
def test_other_block_shapes(vllm_eager, block):
    x = values("wide", (3, 150, 97), BF16, seed=3)
    q, s = quantize_blocks(x, block)
    assert s.shape == blocks_of(x.shape, block) == (3, -(-150 // block[0]), -(-97 // block[1]))
    assert_bits_equal((q, s), reference(vllm_eager, x, block))


def test_blocks_equal_vllm_compiled(vllm_blocks):
    """vLLM compiles per_block_cast_to_fp8 (inductor); on CPU its kernels divide exactly as eager torch does."""
    for shape in [(256, 384), (300, 200)]:
        x = torch.cat([values(k, shape, BF16, seed=11) for k in ("normal", "zeros", "huge", "tiny")], dim=1)
        assert_bits_equal(quantize_blocks(x), reference(vllm_blocks, x))


def test_nan_and_inf_propagate_as_in_vllm(vllm_eager):
    """The same NaN and infinite scales and NaN positions; NaNs' sign bits differ between vLLM's own eager and
    compiled runs, so only the other values are compared bit for bit."""
    x = values("normal", (256, 256), BF16, seed=5)
    x[3, 3], x[130, 7], x[7, 200] = float("nan"), float("inf"), float("-inf")
    (q, s), (wq, ws) = quantize_blocks(x), reference(vllm_eager, x)
    assert torch.equal(s.isnan(), ws.isnan()) and torch.equal(q.float().isnan(), wq.float().isnan())
    keep = ~q.float().isnan()
    assert torch.equal(q.view(torch.uint8)[keep], wq.view(torch.uint8)[keep])


@pytest.mark.parametrize("chunk", [1, 128 * 130, 3 * 128 * 130])
def test_slabs_of_any_size_give_the_same_bits(vllm_eager, monkeypatch, chunk):
    """The slab loop (by leading index, by rows of blocks, ragged row last) never changes a bit."""
    monkeypatch.setattr(fp8, "_CHUNK", chunk)
    for shape in [(4, 300, 130), (600, 130), (2, 2, 128, 256)]:
        x = values("wide", shape, BF16, seed=shape[0])
        assert_bits_equal(quantize_blocks(x), reference(vllm_eager, x))


def test_non_contiguous_input(vllm_eager):
    x = values("normal", (200, 300), BF16, seed=9).t()
    assert not x.is_contiguous()
    assert_bits_equal(quantize_blocks(x), reference(vllm_eager, x))
    e = values("normal", (130, 3, 260), BF16, seed=9).transpose(0, 1)  # experts as a strided view
    assert_bits_equal(quantize_blocks(e), reference(vllm_eager, e))


def test_input_is_left_alone_and_fp32_is_copied():
    x = values("wide", (130, 260), F32, seed=2)
    before = x.clone()
    quantize_blocks(x)
    assert torch.equal(x, before)


def test_shapes_and_empty_tensors():
    assert blocks_of((7168, 18432), (128, 128)) == (56, 144)
    assert blocks_of((256, 300, 129), (128, 128)) == (256, 3, 2)
    for shape in [(0, 5), (5, 0), (0, 0), (3, 0, 200)]:
        q, s = quantize_blocks(torch.zeros(shape, dtype=BF16))
        assert q.shape == shape and q.dtype == torch.float8_e4m3fn and s.shape == blocks_of(shape, (128, 128))
    with pytest.raises(ValueError, match="at least 2 dims"):
        quantize_blocks(torch.zeros(5))
    with pytest.raises(ValueError, match="block"):
        quantize_blocks(torch.zeros(5, 5), (0, 128))


# ---------------------------------------------------------------------------------------------- regions


def test_whole_blocks():
    full = (300, 200)
    assert whole_blocks((0, 0), (300, 200), full)
    assert whole_blocks((128, 128), (172, 72), full)  # ragged edges at the end of the tensor
    assert whole_blocks((256, 0), (44, 128), full)
    assert not whole_blocks((0, 0), (100, 200), full)  # ends inside a block
    assert not whole_blocks((0, 64), (128, 136), full)  # starts inside a block
    assert whole_blocks((0, 0), (0, 200), full)  # empty
    assert whole_blocks((1, 0, 0), (2, 128, 130), (4, 256, 130))  # experts cut anywhere
    assert not whole_blocks((1, 0, 0), (2, 128, 129), (4, 256, 130))
    with pytest.raises(ValueError, match="outside"):
        whole_blocks((200, 0), (128, 200), full)


def test_region_rejects_a_shard_that_splits_blocks():
    x = values("normal", (300, 200), BF16)
    with pytest.raises(ValueError, match="dim 0: end 100"):
        quantize_region(x[:100], (0, 0), (300, 200))
    with pytest.raises(ValueError, match="dim 1: offset 64"):
        quantize_region(x[:, 64:], (0, 64), (300, 200))
    with pytest.raises(ValueError, match="dim 2: end 129"):
        quantize_region(torch.zeros(2, 128, 129, dtype=BF16), (0, 0, 0), (2, 256, 130))
    with pytest.raises(ValueError, match="dims"):
        quantize_region(x, (0,), (300, 200))


def test_regions_tile_the_full_result(vllm_eager):
    x = values("wide", (3, 300, 260), BF16, seed=4)
    q, s = reference(vllm_eager, x)
    for lead, rows, cols in itertools.product([(0, 1), (1, 2)], [(0, 128), (128, 300), (256, 300)],
                                              [(0, 256), (128, 260), (256, 260)]):
        off = (lead[0], rows[0], cols[0])
        part = x[lead[0]:lead[1], rows[0]:rows[1], cols[0]:cols[1]]
        rq, rs = quantize_region(part, off, x.shape)
        so = scale_offset(off)
        assert so == (lead[0], rows[0] // 128, cols[0] // 128)
        want_s = s[tuple(slice(o, o + n) for o, n in zip(so, rs.shape))]
        assert_bits_equal((rq, rs), (q[lead[0]:lead[1], rows[0]:rows[1], cols[0]:cols[1]], want_s))


# ------------------------------------------------------------------------------------------- layout pairs


def source_boxes(shape, rng, experts: bool) -> list[Box]:
    """A random DTensor layout of `shape` (a 1-D or 2-D mesh, uneven and nested shards), one box per distinct
    non-empty shard (replicas send once)."""
    nd = len(shape)
    mesh = tuple(rng.randint(1, 5) for _ in range(rng.choice([1, 2])))
    placements = [rng.choice([None] + list(range(nd))) for _ in mesh]
    if experts:
        placements[0] = 0  # experts sharded along the expert dim (and maybe more)
    boxes = {shard_box(shape, mesh, c, tuple(placements)) for c in itertools.product(*(range(k) for k in mesh))}
    return sorted(b for b in boxes if not b.empty)


def whole_block_part(box: Box, shape, block) -> Box | None:
    """The largest sub-box of `box` made of whole blocks (the sender's part), or None."""
    offs, sizes = list(box.offsets), list(box.sizes)
    nd = len(shape)
    for d, b in zip((nd - 2, nd - 1), block):
        lo = -(-box.offsets[d] // b) * b
        end = box.offsets[d] + box.sizes[d]
        hi = end if end == shape[d] else end // b * b
        if hi <= lo:
            return None
        offs[d], sizes[d] = lo, hi - lo
    return Box(tuple(offs), tuple(sizes))


def refit(full: torch.Tensor, boxes: list[Box], block) -> tuple[torch.Tensor, torch.Tensor, int, int]:
    """Quantize `full` from its shards: whole blocks on the sender, blocks split between shards on the receiver
    after assembling their BF16. Returns q, scale and how many blocks each side quantized."""
    shape = tuple(full.shape)
    shards = [(b, full[b.slices()].clone()) for b in boxes]
    sshape = blocks_of(shape, block)
    q = torch.full(shape, 0x7F, dtype=torch.uint8).view(torch.float8_e4m3fn)  # NaN: anything left is seen
    scale = torch.full(sshape, float("nan"))
    written = torch.zeros(sshape, dtype=torch.int32)

    def put(off, rq, rs):
        q[tuple(slice(o, o + n) for o, n in zip(off, rq.shape))] = rq
        region = tuple(slice(o, o + n) for o, n in zip(scale_offset(off, block), rs.shape))
        scale[region] = rs
        written[region] += 1

    sent = 0
    for box, local in shards:  # senders
        part = whole_block_part(box, shape, block)
        if part is None:
            continue
        assert whole_blocks(part.offsets, part.sizes, shape, block)
        put(part.offsets, *quantize_region(local[part.local_slices(box)], part.offsets, shape, block))
        sent += int(torch.tensor(blocks_of(part.sizes, block)).prod())
    assembled = 0
    bm, bn = block
    for idx in zip(*torch.nonzero(written == 0, as_tuple=True)):  # receivers: blocks split between shards
        *lead, i, j = (int(v) for v in idx)
        blk = Box((*lead, i * bm, j * bn), (*(1 for _ in lead), min(bm, shape[-2] - i * bm),
                                          min(bn, shape[-1] - j * bn)))
        assert not any(whole_blocks(blk.offsets, blk.sizes, shape, block) and blk.intersect(b) == blk
                       for b in boxes), "a block one shard holds whole was left to the receiver"
        buf = torch.full(blk.sizes, float("nan"), dtype=full.dtype)
        for box, local in shards:
            common = blk.intersect(box)
            if common is not None:
                buf[common.local_slices(blk)] = local[common.local_slices(box)]
        put(blk.offsets, *quantize_region(buf, blk.offsets, shape, block))
        assembled += 1
    assert torch.equal(written, torch.ones_like(written)), "every block quantized exactly once"
    return q, scale, sent, assembled


@pytest.mark.parametrize("seed", range(50))
def test_random_layouts_quantize_to_vllm_bits(vllm_eager, seed):
    rng = random.Random(seed)
    block = rng.choice([(128, 128), (128, 128), (16, 32), (8, 8)])
    experts = seed % 4 == 3
    bm, bn = block
    if rng.random() < 0.5:  # block-aligned dims split evenly: mostly the senders' work
        dims = [bm * rng.randint(1, 6), bn * rng.randint(1, 6)]
    else:  # anything: ragged edges, shards ending inside blocks
        dims = [rng.randint(1, 6 * bm + 7), rng.randint(1, 6 * bn + 7)]
    shape = tuple(([rng.randint(1, 6)] if experts else []) + dims)
    full = values(rng.choice(["normal", "wide", "ints"]), shape, BF16, seed=seed)
    boxes = source_boxes(shape, rng, experts)
    q, scale, sent, assembled = refit(full, boxes, block)
    assert_bits_equal((q, scale), reference(vllm_eager, full, block))
    if len(boxes) == 1:
        assert assembled == 0


def test_a_layout_with_both_kinds_of_blocks(vllm_eager):
    """TP 3 over 300 rows: shards [0,100) [100,200) [200,300) split the blocks of rows 0-127 and 128-255."""
    shape = (300, 260)
    full = values("wide", shape, BF16, seed=1)
    boxes = [shard_box(shape, (3,), (i,), (0,)) for i in range(3)]
    q, scale, sent, assembled = refit(full, boxes, (128, 128))
    assert assembled == 2 * 3 and sent == 3  # rows 0-255 assembled; rows 256-299 lie inside the last shard
    assert_bits_equal((q, scale), reference(vllm_eager, full))


# ------------------------------------------------------------------------------------------- per tensor


@pytest.mark.parametrize("seed", range(3))
def test_parts_of_a_block_quantize_to_its_bits(seed):
    """A block split between holders: each part's max |x| (`region_amax`), merged, gives the block's scale
    (`block_scales`), and each part quantized with it (`quantize_part`) is the full tensor's FP8 bytes there,
    bit for bit; ragged blocks, leading dims (stacked experts) and blocks of zeros included."""
    rng = random.Random(seed)
    for it in range(60):
        shape = (rng.randint(1, 3), rng.randint(1, 400), rng.randint(1, 400)) if it % 2 else \
            (rng.randint(1, 400), rng.randint(1, 400))
        x = (torch.randn(shape) * rng.choice([1e-6, 1.0, 100.0])).to(torch.bfloat16)
        x[..., :rng.randint(0, 130), :] = 0
        q, scale = quantize_blocks(x)
        (m, n), lead = shape[-2:], (0,) * (len(shape) - 2)
        rows, cols = sorted({0, m, rng.randint(0, m)}), sorted({0, n, rng.randint(0, n)})
        parts = [Box((*lead, r0, c0), (*shape[:-2], r1 - r0, c1 - c0)) for r0, r1 in zip(rows, rows[1:])
                 for c0, c1 in zip(cols, cols[1:])]
        amax = torch.full(blocks_of(shape), -float("inf"))
        for p in parts:
            a = fp8.region_amax(x[p.slices()], p.offsets)
            at = amax[..., p.offsets[-2] // 128:, p.offsets[-1] // 128:][..., :a.shape[-2], :a.shape[-1]]
            at.copy_(torch.maximum(at, a))
        assert torch.equal(fp8.block_scales(amax).view(torch.int32), scale.view(torch.int32)), (shape, it)
        for p in parts:
            a = amax[..., p.offsets[-2] // 128:, p.offsets[-1] // 128:][
                ..., :-(-(p.offsets[-2] % 128 + p.sizes[-2]) // 128), :-(-(p.offsets[-1] % 128 + p.sizes[-1]) // 128)]
            got = fp8.quantize_part(x[p.slices()], p.offsets, a)
            assert torch.equal(got.view(torch.uint8), q[p.slices()].view(torch.uint8)), (shape, p)


def test_per_tensor_scale_equals_vllm():
    """The scale is vLLM's own torch code (online fp8_per_tensor: weight_amax, then _fp8_scale)."""
    online = pytest.importorskip("vllm.model_executor.layers.quantization.online.fp8", reason="vLLM")
    qu = pytest.importorskip("vllm.model_executor.layers.quantization.utils.quant_utils", reason="vLLM")
    for kind in ["normal", "wide", "tiny", "huge"]:
        x = values(kind, (300, 200), BF16, seed=2)
        _, s = quantize_tensor(x)
        want = online._fp8_scale(qu.weight_amax(x).reshape(1))
        assert torch.equal(s.view(torch.int32), want.view(torch.int32))
        e = values(kind, (4, 30, 20), BF16, seed=3)  # MoE: one scale per expert
        _, s = quantize_tensor(e, per_expert=True)
        want = online._fp8_scale(qu.weight_amax(e.flatten(1), dim=-1))
        assert torch.equal(s.view(torch.int32), want.view(torch.int32))


def test_per_tensor_equals_vllm_kernel_where_it_runs():
    """vLLM's quantization kernel (ops.scaled_fp8_quant); its CPU build registers no implementation."""
    ops = pytest.importorskip("vllm._custom_ops", reason="vLLM")
    x = values("wide", (300, 200), BF16, seed=6)
    q, s = quantize_tensor(x)
    try:
        want, _ = ops.scaled_fp8_quant(x, scale=s)
    except (RuntimeError, NotImplementedError, AttributeError) as e:
        pytest.skip(f"vLLM's static_scaled_fp8_quant does not run on CPU here: {str(e).splitlines()[0]}")
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))


def test_per_tensor_formula():
    x = values("wide", (300, 200), BF16, seed=8)
    q, s = quantize_tensor(x)
    amax = x.float().abs().max()
    assert s.shape == (1,) and s.item() == (amax / torch.tensor(448.0)).item()
    inv = 1.0 / s
    want = (x.float() * inv).clamp(-448, 448).to(torch.float8_e4m3fn)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    assert q.float().abs().max().item() == 448.0
    # an all-zero tensor: scale 0, and the kernel's fminf/fmaxf turn 0 * inf = NaN into 448
    q0, s0 = quantize_tensor(torch.zeros(4, 4, dtype=BF16))
    assert s0.item() == 0.0 and (q0.float() == 448.0).all()


def test_per_tensor_shards_quantize_locally():
    x = values("wide", (5, 300, 200), BF16, seed=9)
    full_q, full_s = quantize_tensor(x)
    shards = [x[:, :128], x[:, 128:], x[:2], x[2:, 7:]]  # any cut: the scale is global
    amax = torch.stack([tensor_amax(t) for t in shards]).max(dim=0).values  # the all-reduce (MAX)
    for t, (sl) in zip(shards, [(slice(None), slice(0, 128)), (slice(None), slice(128, None)), (slice(0, 2),),
                                (slice(2, None), slice(7, None))]):
        q, s = quantize_tensor(t, amax)
        assert torch.equal(s, full_s)
        assert torch.equal(q.view(torch.uint8), full_q[sl].view(torch.uint8))
    per_q, per_s = quantize_tensor(x, per_expert=True)
    q1, s1 = quantize_tensor(x[1:3], tensor_amax(x[1:3], per_expert=True), per_expert=True)
    assert torch.equal(s1, per_s[1:3]) and torch.equal(q1.view(torch.uint8), per_q[1:3].view(torch.uint8))


# ------------------------------------------------------------------------------------------------- CUDA


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_equals_vllm_on_cuda(vllm_blocks):
    """On a GPU vLLM's compiled quantizer rounds its scales differently from CPU (`/ 448.0` becomes a product
    with float32(1/448), `1.0 / scale` Triton's division), so the CUDA result is compared with vLLM on CUDA."""
    for shape, kind in [((576, 448), "normal"), ((300, 200), "wide"), ((4, 256, 130), "ints"),
                        ((7168, 2048), "normal")]:
        x = values(kind, shape, BF16, seed=1).cuda()
        want_q, want_s = reference(vllm_blocks, x)
        assert_bits_equal(quantize_blocks(x), (want_q, want_s))
        rq, rs = quantize_region(x[..., 128:, :], (0,) * (x.dim() - 2) + (128, 0), x.shape)
        assert_bits_equal((rq, rs), (want_q[..., 128:, :], want_s[..., 1:, :]))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_per_tensor_equals_vllm_kernel():
    ops = pytest.importorskip("vllm._custom_ops", reason="vLLM")
    x = values("wide", (300, 200), BF16, seed=6).cuda()
    q, s = quantize_tensor(x)
    want, _ = ops.scaled_fp8_quant(x, scale=s)
    assert torch.equal(q.view(torch.uint8), want.view(torch.uint8))
    cq, cs = quantize_tensor(x.cpu())  # true divisions on both devices: the same bits
    assert torch.equal(cs, s.cpu()) and torch.equal(cq.view(torch.uint8), q.cpu().view(torch.uint8))
