"""Synthetic values: what a synthetic source holds, computable by any rank for any element, and what
`reshard check` compares an output against.

Element i (global flat index) of tensor t under a seed is the value of a 16-bit hash h: one fixed random period
of SPAN hashes read from a position that depends on i's span (i // SPAN) through 20 bits of the tensor's own
SplitMix64 stream (`synthetic_hash` spells it out). The dtype's value of each hash is one table
(`synthetic_table`), so a span's values are slices of one precomputed period (`synthetic_period`) and
generating them is a copy (`synthetic_fill`, numpy only: `reshard check` runs without torch).
"""
from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING

from reshard_cli.base.geometry import Box

if TYPE_CHECKING:
    import numpy as np
    import torch


_M64 = (1 << 64) - 1
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # SplitMix64's constants


def _fmix64(z: int) -> int:
    """SplitMix64's output mix of a 64-bit integer (a bijection), on Python ints."""
    z = ((z ^ (z >> 30)) * _MIX1) & _M64
    z = ((z ^ (z >> 27)) * _MIX2) & _M64
    return z ^ (z >> 31)


@functools.lru_cache(maxsize=32)
def synthetic_table(dtype: str) -> "np.ndarray | None":
    """The value of every 16-bit hash h as raw bits (`rowsum.bits_dtype`: int16 for bfloat16, ...), read-only,
    for a manifest dtype (a torch dtype name); None for another. floats: h / 32768 - 1 (exact in float32: 16
    significant bits at most) rounded to nearest even into the dtype, as torch's cast does; ints h % 127; bool
    h & 1. numpy computes the types it has (bfloat16 from float32 by its bits), torch the float8 types."""
    import numpy as np

    from reshard_cli.base import rowsum
    h = np.arange(1 << 16, dtype=np.int64)
    ints = {"int8": np.int8, "uint8": np.uint8, "int16": np.int16, "int32": np.int32, "int64": np.int64}
    if dtype == "bool":
        values = (h & 1).astype(np.int8)
    elif dtype in ints:
        values = (h % 127).astype(ints[dtype])
    elif dtype in ("float32", "float64", "float16", "bfloat16", "float8_e4m3fn", "float8_e5m2"):
        f32 = h.astype(np.float32) / np.float32(32768) - np.float32(1)
        if dtype == "float32":
            values = f32
        elif dtype == "float64":
            values = f32.astype(np.float64)
        elif dtype == "float16":
            values = f32.astype(np.float16)
        elif dtype == "bfloat16":  # round to nearest even (no NaN or infinity among these values)
            b = f32.view(np.uint32)
            values = ((b + np.uint32(0x7FFF) + ((b >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)) \
                .astype(np.uint16)
        else:
            import torch

            from reshard_cli.base.checksums import numpy_bits
            values = numpy_bits(torch.from_numpy(f32).to(getattr(torch, dtype)))
    else:
        return None
    values = np.ascontiguousarray(values).view(rowsum.bits_dtype(values.itemsize))
    values.flags.writeable = False
    return values


def synthetic_key(t: int, seed: int = 0) -> int:
    """The 64-bit key of tensor `t` under `seed` (any Python ints): every (t, seed) its own stream."""
    return _fmix64(_fmix64((t + 1) & _M64) ^ (seed & _M64))


# The values of a synthetic tensor are one fixed random sequence of SPAN hashes (the period), read from a
# different place in every span of SPAN elements: element i of tensor t is the period's hash at position
# (i mod SPAN + R) mod SPAN, R = the rotation of span i // SPAN (20 bits of the tensor's own SplitMix64 stream).
# Data moved by d elements lands where the expected values are the period read from another position: unlike
# it everywhere unless both spans' rotations happen to differ by exactly -d mod SPAN (chance 2^-20 per pair
# of spans, whatever d is: 2^16 and every other power of two included), and the same holds between tensors
# and seeds. Generating a span's values is a copy out of the period (memory speed), not a hash per element.
SPAN_BITS = 20
SPAN = 1 << SPAN_BITS


def synthetic_rotation(key: int, span: int) -> int:
    """The rotation of span `span` (global flat indices span * SPAN ..) of the stream of `key`: the top
    SPAN_BITS bits of its SplitMix64 word `span`."""
    return _fmix64((key + span * _GOLDEN) & _M64) >> (64 - SPAN_BITS)


def _period_hash(p: int) -> int:
    """The period's 16-bit hash at position `p` (0 <= p < SPAN): lane p mod 4 (bits 16 (p mod 4) and up) of
    SplitMix64's word p // 4 of the stream of key 0."""
    return (_fmix64((p >> 2) * _GOLDEN & _M64) >> (16 * (p & 3))) & 0xFFFF


def synthetic_hash(t: int, i: int, seed: int = 0) -> int:
    """The 16-bit hash h of global flat index `i` of tensor `t` (the definition `synthetic_values` and
    `synthetic_fill` compute, spelled out on Python ints)."""
    rotation = synthetic_rotation(synthetic_key(t, seed), i >> SPAN_BITS)
    return _period_hash(((i & (SPAN - 1)) + rotation) & (SPAN - 1))


def _mix_array(words: "np.ndarray") -> "np.ndarray":
    """SplitMix64's output mix of uint64 `words`, in place (wrapping arithmetic)."""
    import numpy as np

    words ^= words >> np.uint64(30)
    words *= np.uint64(_MIX1)
    words ^= words >> np.uint64(27)
    words *= np.uint64(_MIX2)
    words ^= words >> np.uint64(31)
    return words


@functools.lru_cache(maxsize=8)
def synthetic_period(dtype: "str | None") -> "np.ndarray":
    """The period as the values of torch dtype name `dtype` (raw bits, `synthetic_table`), or as the hashes
    themselves (uint16) for None: positions 0 .. 2 * SPAN - 1, position p holding the hash at p mod SPAN, so a
    span's values from any rotation are one slice. Read-only; built once per dtype (~20 ms)."""
    import numpy as np

    words = _mix_array(np.arange(SPAN // 4, dtype=np.uint64) * np.uint64(_GOLDEN))
    h = (words if sys.byteorder == "little" else words.byteswap()).view("<u2").astype(np.uint16)
    h = np.concatenate([h, h])
    table = synthetic_table(dtype) if dtype is not None else None
    if dtype is not None and table is None:
        raise ValueError(f"no synthetic values of dtype {dtype}")
    period = h if table is None else table[h]
    period.flags.writeable = False
    return period


def synthetic_fill(out: "np.ndarray", starts: "np.ndarray", key: int, period: "np.ndarray") -> "np.ndarray":
    """Write synthetic values into `out` ([rows, n], C-contiguous) and return it: row k holds global flat indices
    starts[k] .. starts[k] + n - 1 of the tensor of `key` (`synthetic_key`), read from `period`
    (`synthetic_period`: values as raw bits of out's dtype, or hashes cast into out). numpy only (any thread).

    Rows inside one span are slices of the period at positions (start mod SPAN) + rotation; runs of such rows
    with equal steps between their starts are copied as one strided view, so the work is a copy of every value
    and a few numpy calls per span and per run, whatever the rows' width; a row that crosses spans is copied in
    pieces."""
    import numpy as np
    from numpy.lib.stride_tricks import as_strided

    rows, n = out.shape
    if not out.size:
        return out
    if not out.flags.c_contiguous:
        raise ValueError("synthetic_fill writes into a C-contiguous array")
    starts = np.asarray(starts, dtype=np.int64).reshape(-1)
    if starts.size != rows:
        raise ValueError(f"{starts.size} row starts for {rows} rows")
    result = out
    if rows > 1 and bool((starts[1:] - starts[:-1] == n).all()):  # consecutive rows: one run
        out, starts, rows = out.reshape(1, rows * n), starts[:1], 1
        n = out.shape[1]
    offset = starts & (SPAN - 1)
    span = starts >> SPAN_BITS
    crossing = offset + n > SPAN
    rotation = (_mix_array(span.astype(np.uint64) * np.uint64(_GOLDEN) + np.uint64(key & _M64))
                >> np.uint64(64 - SPAN_BITS)).astype(np.int64)
    position = offset + rotation  # of each row's first value in the period (rows inside one span)
    step = np.diff(starts)
    # a run of rows: one span, none crossing, equal steps between starts (so between positions)
    cut = np.ones(rows, dtype=bool)
    if rows > 1:
        cut[1:] = (span[1:] != span[:-1]) | crossing[1:] | crossing[:-1] | (step < 0)
        cut[2:] |= step[1:] != step[:-1]
    bounds = np.flatnonzero(cut).tolist() + [rows]
    size = period.itemsize
    for a, e in zip(bounds[:-1], bounds[1:]):
        if crossing[a]:
            _fill_across(out[a], int(starts[a]), key, period)
            continue
        stride = int(step[a]) if e - a > 1 else 0
        view = as_strided(period[int(position[a]):], shape=(e - a, n), strides=(stride * size, size),
                          writeable=False)
        np.copyto(out[a:e], view, casting="unsafe")
    return result


def _fill_across(row: "np.ndarray", start: int, key: int, period: "np.ndarray") -> None:
    """`synthetic_fill` of one row over two or more spans (global flat indices start ..): piece by piece."""
    import numpy as np

    g, j, n = start, 0, row.size
    while j < n:
        o = g & (SPAN - 1)
        m = min(n - j, SPAN - o)
        p = o + synthetic_rotation(key, g >> SPAN_BITS)
        np.copyto(row[j:j + m], period[p:p + m], casting="unsafe")
        g, j = g + m, j + m


def synthetic_values(t: int, box: Box, shape: tuple, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    """Deterministic values of global region `box` of tensor `t` (any rank can compute any expected value).

    h = the 16-bit hash of global flat index i: the period's hash at position (i mod 2^20 + R) mod 2^20, where
    the period's hash at p is lane p mod 4 of SplitMix64's word p // 4 of key 0, and R, the rotation of span
    i // 2^20, is the top 20 bits of word i // 2^20 of the SplitMix64 stream keyed by (t, seed)
    (`synthetic_hash` spells it out on Python ints, `synthetic_fill` computes it in numpy). Nothing repeats at a
    power-of-two period (or any other): data moved by any offset differs from the right values about as often
    as random values would, but for a 2^-20 chance per pair of spans. floats: h / 32768 - 1 cast to `dtype`
    (exact in fp32; rounded to nearest even for narrower types, so still a pure function of (t, i, seed));
    ints: h % 127; bool: h & 1. Computed on the CPU, through the dtype's period of values (`synthetic_period`).
    """
    import numpy as np
    import torch

    from reshard_cli.base import rowsum
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype)
    shape = tuple(shape)
    if any(s == 0 for s in box.sizes):
        return torch.empty(box.sizes, dtype=dtype)
    ncols, col0 = (box.sizes[-1], box.offsets[-1]) if box.sizes else (1, 0)
    starts = rowsum.row_ids(box, shape) * (shape[-1] if shape else 1) + col0
    name = str(dtype).removeprefix("torch.")
    key = synthetic_key(t, seed)
    if synthetic_table(name) is not None:
        period = synthetic_period(name)
        bits = synthetic_fill(np.empty((starts.size, ncols), dtype=period.dtype), starts, key, period)
        return torch.from_numpy(bits).view(dtype).reshape(box.sizes)
    h = torch.from_numpy(synthetic_fill(np.empty((starts.size, ncols), dtype=np.int32), starts, key,
                                        synthetic_period(None))).reshape(box.sizes)
    if dtype == torch.bool:
        return (h & 1).bool()
    if dtype.is_floating_point:
        return (h.to(torch.float32) / 32768 - 1).to(dtype)
    return (h % 127).to(dtype)


__all__ = ["SPAN", "synthetic_fill", "synthetic_hash", "synthetic_key", "synthetic_period", "synthetic_rotation",
           "synthetic_table", "synthetic_values"]
