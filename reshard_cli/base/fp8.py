"""FP8 (e4m3fn) weight quantization equal bit for bit to vLLM's, for refitting an FP8 inference engine from
BF16 (or FP16, FP32) trainer weights.

Block FP8 (checkpoints with `weight_block_size`, and vLLM's online block quantization) keeps one float32 scale
per block of the last two dims (128 x 128 by default); vLLM calls it `weight_scale_inv`. `quantize_blocks`
returns exactly what `vllm.utils.deep_gemm.per_block_cast_to_fp8(x, block, use_ue8m0=False)` returns — the
same fp8 bits and the same scale bits, ragged edge blocks, zeros of either sign and infinities included (a
NaN makes its block NaN, as in vLLM, whose own eager and compiled runs differ in the NaNs' sign bits) — by
doing the same arithmetic in the same order:

    amax  = max |x| over the block, in float32, clamped below at 1e-4     (a block of zeros gets 1e-4)
    scale = amax / 448.0                                                   (the e4m3fn maximum)
    q     = (float32(x) * (1.0 / scale)).to(float8_e4m3fn)

The device decides how the two divisions round, in vLLM as here. vLLM compiles that function (inductor): on
CPU both are IEEE divisions; on a GPU `/ 448.0` becomes a product with float32(1/448), which rounds a third of
all bf16 maxima to a different scale, and `1.0 / scale` becomes Triton's division, which is not IEEE-rounded.
So the per-block scales are computed the way vLLM computes them on the tensor's device (on a GPU through the
same compiler), and a weight must be quantized on the kind of device its engine quantizes on: an engine on
GPUs from CUDA tensors, vLLM's CPU build from CPU tensors. Checked against vLLM bit for bit on CPU.

vLLM pads the tensor to whole blocks with zeros first; zeros never raise a block's maximum, so no padded copy
is made here: the block-aligned interior is reduced as a view, the ragged last row and column of blocks on
their own, a bounded slab of block rows at a time, so the temporaries stay near one row of blocks in float32
whatever the tensor's size. Leading dims (stacked experts `[E, m, n]`) are independent 2-D tensors, each with
its own scales (`[E, ceil(m/bm), ceil(n/bn)]`), as vLLM's MoE path quantizes them one expert at a time.

A block depends on nothing but its own elements, so a shard that holds whole blocks — offsets on the block
grid, ends on the grid or at the end of the full tensor — quantizes on its own (`quantize_region`), and the
shards' results tile the full tensor's exactly. A block split between shards must be assembled first.

Per-tensor FP8 (vLLM's online `fp8_per_tensor`; `fp8` no longer quantizes online) is `quantize_tensor`: one
scale, amax / 448 from the global max |x| (given, after an all-reduce, so that each shard quantizes locally),
and the conversion of vLLM's static quantization kernel, `clamp(x * (1 / scale), -448, 448)` with C's
fmin/fmax. Its scale is checked against vLLM's own code; its conversion is written from vLLM's CUDA source,
since vLLM's CPU build has no implementation of that kernel to compare with.
"""
from __future__ import annotations

from typing import Sequence

import torch

from reshard_cli.base.blocks import (BLOCK, _cdiv, _check_block, _misaligned, blocks_of, scale_offset,  # noqa: F401
                                      whole_blocks)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)  # 448.0
MIN_AMAX = 1e-4  # vLLM's clamp of a block's max |x|
_CHUNK = 1 << 22  # elements per step (16 MiB of float32), at least one row of blocks


def _amax(v: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    # max |v| without a full-size abs(): max(max v, -min v) is exact, NaN included; a block of zeros of
    # either sign gives ±0, which the clamp turns into MIN_AMAX either way.
    return torch.maximum(v.amax(dim=dims), v.amin(dim=dims).neg())


def _scales_of(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    # vLLM's expressions, the Python scalars included: the device's kernels then round as vLLM's do
    sf = amax.clamp(MIN_AMAX) / FP8_MAX
    return sf, 1.0 / sf


_compiled_scales = None


def _scales(amax: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, 1 / scale) per block, as vLLM's `per_block_cast_to_fp8` computes them on amax's device.

    vLLM runs that function through torch.compile (inductor). On CPU inductor's C++ divides exactly as eager
    torch does. On a GPU it lowers `/ 448.0` to a multiplication by float32(1/448) (eager CUDA does the same)
    and `1.0 / scale` to Triton's division, which is not IEEE-rounded, so these few values (one per block) go
    through the same compiler there. The per-element work stays eager: a float32 product and a cast that
    rounds to nearest even, as Triton's does, for every value a finite block's product can take."""
    if amax.device.type == "cpu":
        return _scales_of(amax)
    global _compiled_scales
    if _compiled_scales is None:
        _compiled_scales = torch.compile(_scales_of, dynamic=True, backend="inductor")
    shape = amax.shape
    sf, inv = _compiled_scales(amax.reshape(-1))
    return sf.view(shape), inv.view(shape)


def _quantize_slab(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bn: int) -> None:
    """x, q: [G, k, h, n] (k rows of blocks, h rows each); scale: [G, k, ceil(n/bn)]."""
    n = x.shape[-1]
    nf = n // bn * bn  # columns in whole blocks
    nbf = nf // bn
    xf = x.to(torch.float32, copy=True)  # exact; the only full-size temporary of the slab
    parts = []
    if nf:
        parts.append(_amax(xf[..., :nf].unflatten(-1, (nbf, bn)), (2, 4)))
    if nf < n:
        parts.append(_amax(xf[..., nf:], (2, 3)).unsqueeze(-1))
    amax = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
    sf, inv = _scales(amax)
    if nf:
        xf[..., :nf].unflatten(-1, (nbf, bn)).mul_(inv[:, :, None, :nbf, None])
    if nf < n:
        xf[..., nf:].mul_(inv[:, :, None, nbf:])
    q.copy_(xf)  # float32 -> fp8: the same conversion as .to()
    scale.copy_(sf)


def _quantize_rows(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bn: int) -> None:
    """x, q: [B, K, h, n]; scale: [B, K, nb]. Slabs of at most _CHUNK elements (or one row of blocks)."""
    B, K, h, n = x.shape
    row = h * n
    if K * row <= _CHUNK:
        step = max(1, _CHUNK // (K * row))
        for b in range(0, B, step):
            _quantize_slab(x[b:b + step], q[b:b + step], scale[b:b + step], bn)
        return
    step = max(1, _CHUNK // row)
    for b in range(B):
        for k in range(0, K, step):
            s = (slice(b, b + 1), slice(k, k + step))
            _quantize_slab(x[s], q[s], scale[s], bn)


def quantize_blocks(x: torch.Tensor, block: Sequence[int] = BLOCK,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Block FP8 quantization of `x` ([..., m, n], any float dtype, any device): (q, scale) with q float8_e4m3fn
    of x's shape (contiguous) and scale float32 `blocks_of(x.shape, block)`. Bit for bit vLLM's
    `per_block_cast_to_fp8(x, list(block), use_ue8m0=False)` for 2-D x, and that per 2-D slice otherwise.
    `out`: (q, scale) to write into instead (contiguous), e.g. a message's buffer."""
    bm, bn = _check_block(block)
    sshape = blocks_of(x.shape, block)
    if out is None:
        q = torch.empty(x.shape, dtype=FP8, device=x.device)
        scale = torch.empty(sshape, dtype=torch.float32, device=x.device)
    else:  # written in place (a message buffer, an engine's storage): contiguous, of these shapes and dtypes
        q, scale = out
        if (tuple(q.shape), q.dtype, tuple(scale.shape), scale.dtype) != (tuple(x.shape), FP8, sshape, torch.float32) \
                or not (q.is_contiguous() and scale.is_contiguous()):
            raise ValueError(f"out must be contiguous {FP8} {tuple(x.shape)} and float32 {sshape}")
    if x.numel() == 0:
        return q, scale
    *lead, m, n = x.shape
    B = 1
    for s in lead:
        B *= s
    x3 = x.reshape(B, m, n)  # a view unless leading dims are not collapsible
    q3 = q.view(B, m, n)
    s3 = scale.view(B, sshape[-2], sshape[-1])
    mf = m // bm * bm  # rows in whole blocks
    if mf:
        _quantize_rows(x3[:, :mf].unflatten(1, (mf // bm, bm)), q3[:, :mf].unflatten(1, (mf // bm, bm)),
                       s3[:, :mf // bm], bn)
    if mf < m:
        _quantize_rows(x3[:, mf:].unsqueeze(1), q3[:, mf:].unsqueeze(1), s3[:, mf // bm:], bn)
    return q, scale


def quantize_region(x: torch.Tensor, offset: Sequence[int], full_shape: Sequence[int],
                    block: Sequence[int] = BLOCK,
                    out: tuple[torch.Tensor, torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Quantize `x`, the region at `offset` of a tensor of `full_shape`: (q, scale) where q is the full
    tensor's q there and scale its scales at `scale_offset(offset, block)` (shape `blocks_of(x.shape)`).

    The region must hold whole blocks along the last two dims (offset a multiple of the block, end a multiple
    of the block or the full extent); otherwise ValueError names the dim. Leading dims may be cut anywhere."""
    why = _misaligned(offset, tuple(x.shape), full_shape, block)
    if why is not None:
        raise ValueError(f"region {tuple(offset)} + {tuple(x.shape)} of {tuple(full_shape)} is not whole "
                         f"{tuple(block)} blocks: {why}")
    return quantize_blocks(x, block, out)


def _padded(x: torch.Tensor, offset: Sequence[int], block: Sequence[int]) -> tuple[torch.Tensor, int, int]:
    """Region `x` (at `offset`) in float32 inside zeros that fill out the blocks it touches to full-size blocks
    along the last two dims: (that tensor, the rows and columns of zeros before `x`). Zeros never raise a
    block's max |x|."""
    bm, bn = _check_block(block)
    *lead, m, n = x.shape
    r0, c0 = offset[-2] % bm, offset[-1] % bn
    buf = torch.zeros((*lead, _cdiv(r0 + m, bm) * bm, _cdiv(c0 + n, bn) * bn), dtype=torch.float32, device=x.device)
    buf[..., r0:r0 + m, c0:c0 + n] = x
    return buf, r0, c0


def _by_block(buf: torch.Tensor, block: Sequence[int]) -> torch.Tensor:
    """[..., H, W] (whole blocks) as [..., H / bm, bm, W / bn, bn], a view."""
    bm, bn = block
    return buf.unflatten(-1, (buf.shape[-1] // bn, bn)).unflatten(-3, (buf.shape[-2] // bm, bm))


def region_amax(x: torch.Tensor, offset: Sequence[int], block: Sequence[int] = BLOCK) -> torch.Tensor:
    """Max |x| of region `x` (at `offset`, any region) in each block it touches, over the part of the block it
    holds: float32, [..., blocks] (leading dims as x's; the blocks from `scale_offset(offset)`). A block's max
    |x| is the largest of its parts' (NaN if any is), so the holders of a block's parts can agree on the scale
    `quantize_blocks` gives it (`block_scales`) and each quantize its own part (`quantize_part`)."""
    return _amax(_by_block(_padded(x, offset, block)[0], block), (-3, -1))


def block_scales(amax: torch.Tensor) -> torch.Tensor:
    """The scales `quantize_blocks` gives blocks of max |x| `amax` (vLLM's arithmetic, on amax's device)."""
    return _scales(amax.to(torch.float32))[0]


def quantize_part(x: torch.Tensor, offset: Sequence[int], amax: torch.Tensor,
                  block: Sequence[int] = BLOCK) -> torch.Tensor:
    """The FP8 bytes of region `x` (at `offset`, any region) that `quantize_blocks` of the full tensor has there,
    given the max |x| of each whole block it touches (`amax`, shaped as `region_amax(x, offset)`): each element
    times its block's 1 / scale, converted as `quantize_blocks` converts, so bit for bit the full tensor's."""
    buf, r0, c0 = _padded(x, offset, block)
    _sf, inv = _scales(amax.to(device=x.device, dtype=torch.float32))
    _by_block(buf, block).mul_(inv[..., :, None, :, None])
    m, n = x.shape[-2:]
    return buf[..., r0:r0 + m, c0:c0 + n].to(FP8)


def tensor_amax(x: torch.Tensor, per_expert: bool = False) -> torch.Tensor:
    """max |x| in x's dtype, as vLLM's `weight_amax`: shape [1], or [E] per leading index with `per_expert`.
    All-reduce it (MAX) across the shards of one tensor and pass it to `quantize_tensor`."""
    if per_expert:
        lo, hi = x.flatten(1).aminmax(dim=-1)
    else:
        lo, hi = x.aminmax()
    return torch.maximum(lo.abs(), hi.abs()).reshape(-1)


def quantize_tensor(x: torch.Tensor, amax: torch.Tensor | float | None = None, *,
                    per_expert: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-tensor FP8 quantization as vLLM's online `fp8_per_tensor` does it: (q, scale), q float8_e4m3fn of
    x's shape, scale float32 [1] (or [E] with `per_expert`, one per leading index: vLLM's MoE weights).

    `amax` is the max |x| of the whole tensor (`tensor_amax`, all-reduced over the shards of a sharded
    tensor), so each shard quantizes locally to the full tensor's bits; None computes it from `x`. Then
    scale = float32(amax) / 448 (a true division) and q = fmax(-448, fmin(x * (1 / scale), 448)) cast to
    e4m3fn — the conversion of vLLM's `static_scaled_fp8_quant` CUDA kernel, whose C fmin/fmax also map NaN
    (0 * inf from an all-zero tensor, scale 0) to 448. That kernel has no CPU implementation in vLLM's CPU
    build, so this part is written from vLLM's source and not compared against vLLM's own output (the scale
    is: it is plain torch in vLLM)."""
    if amax is None:
        amax = tensor_amax(x, per_expert)
    amax = torch.as_tensor(amax, device=x.device).to(torch.float32).reshape(-1)
    scale = amax / torch.tensor(FP8_MAX, dtype=torch.float32, device=x.device)
    inv = 1.0 / scale
    hi = torch.tensor(FP8_MAX, dtype=torch.float32, device=x.device)
    if not per_expert and inv.numel() != 1:
        raise ValueError(f"per-tensor amax must be one value, got {inv.numel()}")
    if per_expert and inv.numel() != x.shape[0]:
        raise ValueError(f"per-expert amax must have {x.shape[0]} values, got {inv.numel()}")
    q = torch.empty(x.shape, dtype=FP8, device=x.device)
    slices = [(x[e], q[e], inv[e]) for e in range(x.shape[0])] if per_expert else [(x, q, inv[0])]
    for xs, qs, inv_s in slices:
        if xs.numel() == 0:
            continue
        n = xs.shape[-1] if xs.dim() else 1
        x2, q2 = xs.reshape(-1, n), qs.view(-1, n)
        step = max(1, _CHUNK // n)
        for r in range(0, x2.shape[0], step):
            v = x2[r:r + step].to(torch.float32, copy=True).mul_(inv_s)
            torch.fmin(v, hi, out=v)
            torch.fmax(v, hi.neg(), out=v)
            q2[r:r + step].copy_(v)
    return q, scale
