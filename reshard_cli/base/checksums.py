"""Position-aware checksums: prove that every element sits at the right global index with the right bits.

Think of a tensor as rows (every index but the last, flattened over the *global* shape) and columns (the
last index). Then

    checksum(region) = Σ_(row, col)  a(row) · b(col) · bits(x[row, col])   (mod 2^64)

with a(row) a 64-bit mix of the global row number, b(col) a 20-bit mix of the global column, and bits(x) the
value's raw bit pattern (signed 16-bit halves). The sum is additive over disjoint regions, so sources compute
it for the parts they hold and destinations for what they received, and the two must agree without any full
tensor existing anywhere. A misplaced element changes its weight, a missing one (a sentinel left in place)
or a corrupted one changes bits, a duplicated one changes both.

The inner sum over a row is a float64 matrix-vector product, exact because every term stays below 2^52
(16-bit halves times 20-bit weights, at most 2^16 columns per block); only the per-row results are mixed in
64-bit integers. That runs at memory speed instead of a dozen integer passes per element. `rowsum` computes the same value
faster, on numpy arrays of raw bits, without torch (`reshard check`; `checksum_block` here).
"""
from __future__ import annotations

import torch

from reshard_cli.base.geometry import Box
from reshard_cli.base import rowsum

_MASK64 = (1 << 64) - 1
_CHUNK = 1 << 22  # elements per step: bounds the float64 temporaries (32 MiB)
_COLS = 1 << 16  # columns per exact float64 block


def _halves(x: torch.Tensor) -> list[torch.Tensor]:
    """The element bits as signed 16-bit (or 8-bit) pieces, each as float64, same shape as x."""
    size = x.element_size()
    if size == 1:
        return [x.view(torch.int8).to(torch.float64)]
    if size == 2:
        return [x.view(torch.int16).to(torch.float64)]
    if size == 4:
        v = x.view(torch.int32)
        return [(v >> 16).to(torch.float64), (v & 0xFFFF).to(torch.float64)]
    if size == 8:
        v = x.view(torch.int64)
        return [((v >> s) & 0xFFFF).to(torch.float64) for s in (48, 32, 16, 0)]
    raise ValueError(f"unsupported dtype {x.dtype}")


def _mix(v: torch.Tensor) -> torch.Tensor:
    """A 64-bit integer mix (splitmix-style multiply/xor-shift, wrapping int64 arithmetic)."""
    h = (v + 0x632BE59BD9B4E019) * -7046029254386353131
    h = h ^ ((h >> 31) & 0x1FFFFFFFF)
    h = h * -4658895280553007687
    return h ^ ((h >> 29) & 0x7FFFFFFFF)


def _col_weights(cols: torch.Tensor, half: int) -> torch.Tensor:
    return ((_mix(cols * 4 + half) & 0xFFFFF) | 1).to(torch.float64)


def global_index(box: Box, shape: tuple, rows: slice | None = None) -> torch.Tensor:
    """Global flat indices of the elements of `box` (optionally rows [a, b) of its first dim), row-major."""
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]
    idx = torch.zeros((), dtype=torch.int64)
    for d, (o, s) in enumerate(zip(box.offsets, box.sizes)):
        lo, hi = (o, o + s)
        if d == 0 and rows is not None:
            lo, hi = o + rows.start, o + rows.stop
        ax = torch.arange(lo, hi, dtype=torch.int64) * strides[d]
        idx = idx.unsqueeze(-1) + ax if d else ax
    return idx


def _on_cpu(x: torch.Tensor, box: Box) -> torch.Tensor:
    """`x` (which must have the box's shape) detached, on the CPU."""
    if tuple(x.shape) != tuple(box.sizes):
        raise ValueError(f"tensor shape {tuple(x.shape)} != box {box.sizes}")
    x = x.detach()
    return x.cpu() if x.device.type != "cpu" else x


def checksum(x: torch.Tensor, box: Box, shape: tuple) -> int:
    """Checksum of `x`, which holds global region `box` of a tensor of `shape` (mod 2^64, as a Python int)."""
    if x.numel() == 0:
        return 0
    x = _on_cpu(x, box)
    if not shape:  # a scalar: one row, one column
        shape, box, x = (1,), Box((0,), (1,)), x.reshape(1)
    ncols = box.sizes[-1]
    rows_box = Box(box.offsets[:-1], box.sizes[:-1])
    row_ids = global_index(rows_box, tuple(shape[:-1])).reshape(-1) if len(shape) > 1 else torch.zeros(
        1, dtype=torch.int64)
    a = _mix(row_ids)  # int64 weights per row
    x2 = x.reshape(-1, ncols)
    col0 = box.offsets[-1]
    total = 0
    step = max(1, _CHUNK // ncols)
    for c0 in range(0, ncols, _COLS):
        c1 = min(c0 + _COLS, ncols)
        cols = torch.arange(col0 + c0, col0 + c1, dtype=torch.int64)
        for r0 in range(0, x2.shape[0], step):
            block = x2[r0:r0 + step, c0:c1].contiguous()
            for half, bits in enumerate(_halves(block)):
                rowsum = (bits @ _col_weights(cols, half)).to(torch.int64)  # exact: |terms| < 2^52
                total += int((rowsum * a[r0:r0 + step]).sum())  # int64 wraps: fine mod 2^64
    return total & _MASK64


def checksum_block(x: torch.Tensor, box: Box, shape: tuple, buf=None) -> int:
    """`checksum(x, box, shape)`, bit for bit, computed faster on the raw bits by `rowsum.RowChecksum` (`buf`
    from `rowsum.checksum_buffer()` is reused when given). `x` is read in place when its rows are dense."""
    if x.numel() == 0:
        return 0
    x = _on_cpu(x, box)
    cs = rowsum.RowChecksum(box, shape, x.element_size(), buf)
    cs.update(0, numpy_bits(x).reshape(cs.rows.size, cs.ncols))
    return cs.value()


def numpy_bits(x: torch.Tensor):
    """`x`'s raw bits as the numpy array `rowsum` and `reshard check` read (a signed integer of the element's
    size: int16 for bf16, ...), on the CPU; a view of `x` when it is on the CPU."""
    return x.detach().cpu().view(_INT_VIEW[x.element_size()]).numpy()


fmt = rowsum.fmt  # a checksum as the 16 hex digits manifests and reports show


def combine(values) -> int:
    """Checksums of disjoint regions add up to the checksum of their union."""
    return sum(values) & _MASK64


def _int_bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of `x` as one integer per element (bf16 -> int16, float32 -> int32, ...), flattened."""
    x = x.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    return x.reshape(-1).view(_INT_VIEW[x.element_size()])


_INT_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def differing(got: torch.Tensor, want: torch.Tensor) -> torch.Tensor | None:
    """Exact comparison, bit for bit (NaN-safe, -0.0 differs from 0.0): None when equal, else a flat boolean
    tensor marking each differing element."""
    a, b = _int_bits(got), _int_bits(want.to(got.device))
    if torch.equal(a, b):
        return None
    return a != b


def count_differing(got: torch.Tensor, want: torch.Tensor) -> int:
    diff = differing(got, want)
    return 0 if diff is None else int(diff.sum())
