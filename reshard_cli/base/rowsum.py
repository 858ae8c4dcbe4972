"""The position-aware checksum of `checksums` (its docstring has the definition), computed fast and without torch.

`checksums.checksum` is the reference, written in torch next to the transfers it proves. This module computes the
same value, bit for bit, on numpy arrays of the elements' raw bits (`bits_dtype`: a bf16 tensor is read as
int16, a float32 one as int32, ...), which is all that `reshard check` needs: it maps files and compares raw
words, so it starts without importing torch. Tests compare the two on every dtype.

The arithmetic is the reference's: per row, an exact float64 matrix-vector product of the signed 16-bit (or
8-bit) pieces with the 20-bit column weights (at most `_COLS` columns, every term below 2^52), then the rows
mixed mod 2^64 (numpy's uint64 arithmetic wraps). Only the grouping differs: steps of `_FAST_CHUNK` elements
converted into one reused float64 buffer that stays in cache, the column weights cached, the per-row sums
mixed once in `value`. The sums are exact, so the value is identical.
"""
from __future__ import annotations

import functools

import numpy as np

from reshard_cli.base.geometry import Box

_COLS = 1 << 16  # columns per exact float64 block
_FAST_CHUNK = 1 << 18  # elements per float64 step (2 MiB, so the converted bits stay in cache)

# element size -> the signed integer type whose values are the reference's pieces (1 and 2 bytes) or carry them
_SIGNED = {1: np.dtype(np.int8), 2: np.dtype(np.int16), 4: np.dtype(np.int32), 8: np.dtype(np.int64)}


def bits_dtype(itemsize: int) -> np.dtype:
    """The numpy integer type `RowChecksum` reads elements of `itemsize` bytes as."""
    try:
        return _SIGNED[itemsize]
    except KeyError:
        raise ValueError(f"unsupported element size {itemsize}") from None


def mix(v: np.ndarray) -> np.ndarray:
    """`checksums._mix` (splitmix-style multiply/xor-shift) of int64 values, as uint64; the bits are the same."""
    with np.errstate(over="ignore"):
        h = (v.astype(np.uint64) + np.uint64(0x632BE59BD9B4E019)) * np.uint64(0x9E3779B97F4A7C15)
        h ^= h >> np.uint64(31)
        h *= np.uint64(0xBF58476D1CE4E5B9)
        return h ^ (h >> np.uint64(29))


@functools.lru_cache(maxsize=64)
def col_weights(c0: int, c1: int, half: int) -> np.ndarray:
    """b(col) for global columns [c0, c1) and piece `half`, as float64 (cached and read-only: every block of a
    shard shares them)."""
    cols = np.arange(c0, c1, dtype=np.int64) * 4 + half
    w = ((mix(cols) & np.uint64(0xFFFFF)) | np.uint64(1)).astype(np.float64)
    w.flags.writeable = False
    return w


def row_ids(box: Box, shape: tuple) -> np.ndarray:
    """Global row numbers (every index but the last, flattened over the global shape) of the rows of `box`, in
    row-major order, int64: the rows the checksum weighs with a(row). A scalar or 1-D tensor has one row, 0."""
    if len(shape) <= 1:
        return np.zeros(1, dtype=np.int64)
    dims = shape[:-1]
    idx = np.zeros((), dtype=np.int64)
    stride = 1
    for d in range(len(dims) - 1, -1, -1):
        ax = np.arange(box.offsets[d], box.offsets[d] + box.sizes[d], dtype=np.int64) * stride
        idx = ax.reshape((-1,) + (1,) * idx.ndim) + idx
        stride *= dims[d]
    return idx.reshape(-1)


def checksum_buffer() -> np.ndarray:
    """A float64 scratch buffer for `RowChecksum` (reuse it across calls)."""
    return np.empty(_FAST_CHUNK, dtype=np.float64)


class RowChecksum:
    """The checksum of a region fed as chunks of its rows, bit for bit `checksums.checksum`'s value.

    The region is seen as a matrix [rows, last dim] (a scalar as [1, 1]); `update(r0, rows)` takes rows
    [r0, r0 + n) as a 2-D array of the elements' bits (`bits_dtype(itemsize)`; strided rows are fine) and
    `value()` gives the checksum once every row was fed. Memory: 16 bytes per row plus `buf`.
    """

    def __init__(self, box: Box, shape: tuple, itemsize: int, buf: np.ndarray | None = None,
                 rows: np.ndarray | None = None):
        self.dtype = bits_dtype(itemsize)
        if not shape:  # a scalar: one row, one column
            shape, box = (1,), Box((0,), (1,))
        self.size = itemsize
        self.ncols = box.sizes[-1]
        self.col0 = box.offsets[-1]
        self.rows = row_ids(box, shape) if rows is None else rows
        self.buf = buf if buf is not None and buf.dtype == np.float64 and buf.size >= _FAST_CHUNK \
            else checksum_buffer()
        # one pass per row (1- and 2-byte types, at most _COLS columns): float64 row sums, converted at the end;
        # else each pass's row sums are added as int64
        self._single = itemsize <= 2 and self.ncols <= _COLS
        self._sums = np.zeros(self.rows.size, dtype=np.float64 if self._single else np.int64)

    def update(self, r0: int, rows: np.ndarray) -> None:
        """Feed rows [r0, r0 + rows.shape[0]) of the region (a 2-D array of `ncols` columns)."""
        self._row_sums(rows, self._sums[r0:r0 + rows.shape[0]])

    def row_sums(self, rows: np.ndarray) -> np.ndarray:
        """The exact per-row sums Σ_col b(col)·bits of `rows` (2-D, `ncols` columns, this region's columns) as
        int64, without feeding them: for rows that repeat (`set_row_sums` takes them back)."""
        out = np.zeros(rows.shape[0], dtype=self._sums.dtype)
        self._row_sums(rows, out)
        return out.astype(np.int64) if self._single else out

    def set_row_sums(self, r0: int, sums: np.ndarray) -> None:
        """Feed rows [r0, r0 + len(sums)) by their exact sums (from `row_sums` of rows with the same values)."""
        self._sums[r0:r0 + sums.shape[0]] = sums

    def _row_sums(self, rows: np.ndarray, out: np.ndarray) -> None:
        size, ncols = self.size, self.ncols
        bits = rows.view(self.dtype) if rows.dtype != self.dtype else rows
        cstep = min(ncols, _COLS)
        rstep = max(1, _FAST_CHUNK // cstep)
        nrows = bits.shape[0]
        for c0 in range(0, ncols, cstep):
            c1 = min(c0 + cstep, ncols)
            cols = bits if c1 - c0 == ncols else bits[:, c0:c1]
            for half in range(max(1, size // 2)):
                w = col_weights(self.col0 + c0, self.col0 + c1, half)
                for r0 in range(0, nrows, rstep):
                    x = cols[r0:r0 + rstep]
                    f = self.buf[:x.size].reshape(x.shape)
                    np.copyto(f, x if size <= 2 else _piece(x, size, half), casting="unsafe")  # exact
                    o = out[r0:r0 + rstep]
                    if self._single:
                        np.dot(f, w, out=o)  # exact: |terms| < 2^52
                    else:
                        o += np.dot(f, w).astype(np.int64)

    def value(self) -> int:
        sums = self._sums.astype(np.int64) if self._single else self._sums
        with np.errstate(over="ignore"):
            return int((sums.view(np.uint64) * mix(self.rows)).sum(dtype=np.uint64))


def fmt(c: int) -> str:
    """A checksum as the 16 hex digits the manifests and reports show."""
    return f"{c:016x}"


def _piece(bits: np.ndarray, size: int, half: int) -> np.ndarray:
    """The reference's signed 16-bit piece `half` of 4- and 8-byte elements, as integers."""
    if size == 4:
        return bits >> 16 if half == 0 else bits & 0xFFFF
    return (bits >> (48 - 16 * half)) & 0xFFFF


__all__ = ["RowChecksum", "bits_dtype", "checksum_buffer", "col_weights", "fmt", "mix", "row_ids"]
