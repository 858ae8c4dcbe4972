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
64-bit integers. That runs at memory speed instead of a dozen integer passes per element.
"""
from __future__ import annotations

import functools

import torch

from reshard_cli.plan.geometry import Box

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


# `RowChecksum`: elements per float64 step (2 MiB, so the converted bits stay in cache).
_FAST_CHUNK = 1 << 18


@functools.lru_cache(maxsize=64)
def _col_weights_range(c0: int, c1: int, half: int) -> torch.Tensor:
    """b(col) for columns [c0, c1) and piece `half`, as float64 (cached: every block of a shard shares them).
    Callers must not modify the tensor."""
    return _col_weights(torch.arange(c0, c1, dtype=torch.int64), half)


def _piece(bits: torch.Tensor, size: int, half: int) -> torch.Tensor:
    """Piece `half` of `_halves`, without the float64 conversion: `bits` itself (the int8/int16 view) for 1- and
    2-byte types, the shifted/masked integer for 4 and 8 bytes."""
    if size <= 2:
        return bits
    if size == 4:
        return bits >> 16 if half == 0 else bits & 0xFFFF
    return (bits >> (48 - 16 * half)) & 0xFFFF


_SIGNED_VIEW = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def checksum_buffer() -> torch.Tensor:
    """A float64 scratch buffer for `RowChecksum` / `checksum_block` (reuse it across calls)."""
    return torch.empty(_FAST_CHUNK, dtype=torch.float64)


def row_ids(box: Box, shape: tuple) -> torch.Tensor:
    """Global row numbers (every index but the last, flattened over the global shape) of the rows of `box`, in
    row-major order: the rows `checksum` weighs with a(row). A scalar or 1-D tensor has one row, number 0."""
    if len(shape) > 1:
        return global_index(Box(box.offsets[:-1], box.sizes[:-1]), tuple(shape[:-1])).reshape(-1)
    return torch.zeros(1, dtype=torch.int64)


class RowChecksum:
    """`checksum(x, box, shape)` of a region fed as chunks of its rows, bit for bit the same value.

    The region is seen as a matrix [rows, last dim] (a scalar as [1, 1]); `update(r0, rows)` takes rows
    [r0, r0 + n) as a 2-D tensor (strided rows are fine) and `value()` gives the checksum once every row was fed.
    The arithmetic is `checksum`'s: exact float64 matrix-vector products per row (at most `_COLS` columns, every
    term below 2^52), the 64-bit row mixing mod 2^64. Only the grouping differs: steps of `_FAST_CHUNK` elements
    converted into one reused float64 buffer (`buf`) that stays in cache, the column weights cached, the per-row
    sums mixed once in `value` instead of once per step and piece. The sum is exact, so the value is identical.
    Memory: 16 bytes per row plus `buf`.
    """

    def __init__(self, box: Box, shape: tuple, itemsize: int, buf: torch.Tensor | None = None,
                 rows: torch.Tensor | None = None):
        if itemsize not in _SIGNED_VIEW:
            raise ValueError(f"unsupported element size {itemsize}")
        if not shape:  # a scalar: one row, one column
            shape, box = (1,), Box((0,), (1,))
        self.size = itemsize
        self.ncols = box.sizes[-1]
        self.col0 = box.offsets[-1]
        self.rows = row_ids(box, shape) if rows is None else rows
        self.buf = buf if buf is not None and buf.dtype == torch.float64 and buf.numel() >= _FAST_CHUNK \
            else checksum_buffer()
        # one pass per row (1- and 2-byte types, at most _COLS columns): float64 row sums, converted at the end;
        # else each pass's row sums are added as int64
        self._single = itemsize <= 2 and self.ncols <= _COLS
        n = self.rows.numel()
        self._sums = torch.zeros(n, dtype=torch.float64 if self._single else torch.int64)

    def update(self, r0: int, rows: torch.Tensor) -> None:
        """Feed rows [r0, r0 + rows.shape[0]) of the region (a 2-D tensor of `ncols` columns)."""
        self._row_sums(rows, self._sums[r0:r0 + rows.shape[0]])

    def row_sums(self, rows: torch.Tensor) -> torch.Tensor:
        """The exact per-row sums Σ_col b(col)·bits of `rows` (2-D, `ncols` columns, this region's columns) as
        int64, without feeding them: for rows that repeat (`set_row_sums` takes them back)."""
        out = torch.zeros(rows.shape[0], dtype=self._sums.dtype)
        self._row_sums(rows, out)
        return out.to(torch.int64) if self._single else out

    def set_row_sums(self, r0: int, sums: torch.Tensor) -> None:
        """Feed rows [r0, r0 + len(sums)) by their exact sums (from `row_sums` of rows with the same values)."""
        self._sums[r0:r0 + sums.shape[0]] = sums

    def _row_sums(self, rows: torch.Tensor, out: torch.Tensor) -> None:
        size, ncols = self.size, self.ncols
        bits = rows.detach().view(_SIGNED_VIEW[size])
        cstep = min(ncols, _COLS)
        rstep = max(1, _FAST_CHUNK // cstep)
        outs = out.split(rstep)
        for c0 in range(0, ncols, cstep):
            c1 = min(c0 + cstep, ncols)
            cols = bits if c1 - c0 == ncols else bits[:, c0:c1]
            full = self.buf[:rstep * (c1 - c0)].view(rstep, c1 - c0)
            for half in range(max(1, size // 2)):
                w = _col_weights_range(self.col0 + c0, self.col0 + c1, half)
                for x, o in zip(cols.split(rstep), outs):
                    f = full if x.shape[0] == rstep else self.buf[:x.numel()].view(x.shape)
                    f.copy_(x if size <= 2 else _piece(x, size, half))  # integer -> float64, exact
                    if self._single:
                        torch.mv(f, w, out=o)  # exact: |terms| < 2^52
                    else:
                        o += torch.mv(f, w).to(torch.int64)

    def value(self) -> int:
        sums = self._sums.to(torch.int64) if self._single else self._sums
        return int((sums * _mix(self.rows)).sum()) & _MASK64  # int64 wraps: fine mod 2^64


def checksum_block(x: torch.Tensor, box: Box, shape: tuple, buf: torch.Tensor | None = None) -> int:
    """`checksum(x, box, shape)`, bit for bit, computed faster (see `RowChecksum`); `buf` from
    `checksum_buffer()` is reused when given. `x` is read in place when its rows are dense."""
    if x.numel() == 0:
        return 0
    x = _on_cpu(x, box)
    cs = RowChecksum(box, shape, x.element_size(), buf)
    cs.update(0, x.reshape(cs.rows.numel(), cs.ncols))
    return cs.value()


def combine(values) -> int:
    """Checksums of disjoint regions add up to the checksum of their union."""
    return sum(values) & _MASK64


def fmt(c: int) -> str:
    return f"{c:016x}"


def source_contributions(plan, rank: int, src_shards: dict) -> dict:
    """What this source rank contributes to each destination box's expected checksum.

    The first replica of each unique source box speaks for it; the key is (tensor, destination box offsets).
    """
    man = plan.src.manifest.tensors
    out: dict[tuple, int] = {}
    for t, sh in src_shards.items():
        shape = man[t].shape
        for a, replicas in plan.unique_boxes(shape, plan.src.placements[t]):
            if replicas[0] != rank:
                continue
            for b, _holders in plan.unique_boxes(shape, plan.dst.placements[t]):
                r = a.intersect(b)
                if r is not None:
                    key = (t, b.offsets)
                    out[key] = combine([out.get(key, 0), checksum(sh.read(r), r, shape)])
    return out


def merge_contributions(parts) -> dict:
    """Expected checksum per (tensor, destination box offsets), from every source rank's contributions."""
    out: dict[tuple, int] = {}
    for part in parts:
        for k, v in part.items():
            out[k] = combine([out.get(k, 0), v])
    return out


def mismatched_checksums(plan, rank: int, src_shards: dict, dst_shards: dict, extra=None,
                         comm=None) -> tuple[dict[int, int], list[int], list]:
    """Collective (every rank of `comm`, the default group when None): each destination shard's checksum against
    the sources' checksum of the same box. Returns (this rank's checksum per tensor, the tensors whose checksum
    differs, and what every rank passed as `extra`)."""
    from reshard_cli.transfer.comm import WORLD

    man = plan.src.manifest.tensors
    actual = {t: checksum(sh.data, sh.box, man[t].shape) for t, sh in dst_shards.items()}
    gathered = (comm or WORLD).all_gather_object((source_contributions(plan, rank, src_shards), extra))
    expected = merge_contributions(c for c, _x in gathered)
    bad = [t for t, sh in dst_shards.items() if sh.box.numel and expected.get((t, sh.box.offsets), 0) != actual[t]]
    return actual, bad, [x for _c, x in gathered]


def _int_bits(x: torch.Tensor) -> torch.Tensor:
    """The raw bits of `x` as one integer per element (bf16 -> int16, float32 -> int32, ...), flattened."""
    x = x.detach()
    if not x.is_contiguous():
        x = x.contiguous()
    return x.reshape(-1).view(_INT_VIEW[x.element_size()])


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


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
