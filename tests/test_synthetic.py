"""Synthetic source values: the formula against an independent torch reference, and the property that makes them
worth comparing: no element's value repeats at a power-of-two distance, so data misrouted by 2^k elements (2^16
included, where the previous generator repeated, and 2^20, the span of one rotation) differs from what belongs
there."""
import numpy as np
import pytest
import torch

from reshard_cli.base.checksums import global_index
from reshard_cli.base.geometry import Box
from reshard_cli.io.synthetic import (SPAN, synthetic_fill, synthetic_hash, synthetic_key, synthetic_period,
                                    synthetic_table, synthetic_values)

MANIFEST_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn,
                   torch.float8_e5m2, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
_GOLDEN, _MIX1, _MIX2 = 0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def _mix(z: torch.Tensor) -> torch.Tensor:
    """SplitMix64's output mix in torch int64 arithmetic (multiplications wrap mod 2^64; a logical right shift is
    an arithmetic one masked)."""
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _signed(_MIX1)
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _signed(_MIX2)
    return z ^ ((z >> 31) & ((1 << 33) - 1))


def reference_hash(t: int, idx: torch.Tensor, seed: int) -> torch.Tensor:
    """The 16-bit hash of every global flat index in `idx`, in torch: the rotation R of span idx // 2^20 is the
    top 20 bits of word idx // 2^20 of SplitMix64's stream keyed by (t, seed); the hash is lane p % 4 of word
    p // 4 of the stream of key 0, at position p = (idx mod 2^20 + R) mod 2^20."""
    assert SPAN == 1 << 20
    rotation = (_mix((idx >> 20) * _signed(_GOLDEN) + _signed(synthetic_key(t, seed))) >> 44) & ((1 << 20) - 1)
    p = ((idx & ((1 << 20) - 1)) + rotation) & ((1 << 20) - 1)
    return (_mix((p >> 2) * _signed(_GOLDEN)) >> ((p & 3) * 16)) & 0xFFFF


def reference_values(h: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """floats h / 32768 - 1 cast by torch, ints h % 127, bool h & 1."""
    if dtype == torch.bool:
        return (h & 1).bool()
    if dtype.is_floating_point:
        return (h.to(torch.float32) / 32768 - 1).to(dtype)
    return (h % 127).to(dtype)


def _bits(x: torch.Tensor) -> torch.Tensor:
    return x if x.is_complex() else x.view(_BITS[x.element_size()])


@pytest.mark.parametrize("dtype", MANIFEST_DTYPES + [torch.uint16, torch.complex64], ids=str)
def test_values_are_the_reference_formula(dtype):
    """synthetic_values (numpy: `synthetic_fill` and the dtype's table, or the hashes mapped by torch for a dtype
    no manifest has) equals the torch int64 reference bit for bit: 0-3 dims, offsets, rows that start at every
    lane of a word, flat indices past 2^32 and 2^40, seeds negative and past 2^64; `synthetic_hash` (Python ints)
    agrees element by element."""
    cases = [((1000,), Box((3,), (997,))), ((37, 91), Box((5, 3), (20, 70))), ((5, 7, 9), Box((1, 2, 3), (3, 4, 5))),
             ((), Box((), ())), ((1 << 40,), Box(((1 << 35) + 77,), (3000,))), ((3, 200000), Box((0, 5), (3, 199990))),
             ((9, 7), Box((0, 0), (9, 7))), ((1 << 33, 3), Box(((1 << 32) + 1, 1), (6, 2)))]
    for t, seed in [(0, 0), (7, 3), (112, -7), (4, (1 << 70) + 5)]:
        for shape, box in cases:
            idx = global_index(box, shape)
            h = reference_hash(t, idx, seed)
            got = synthetic_values(t, box, shape, dtype, seed)
            want = reference_values(h, dtype)
            assert got.dtype == dtype and got.shape == want.shape, (shape, box)
            assert torch.equal(_bits(got), _bits(want)), (t, seed, shape, box)
            flat_idx, flat_h = idx.reshape(-1).tolist(), h.reshape(-1).tolist()
            for j in sorted({0, 1, 2, 3, 5, len(flat_idx) - 1}):
                if j < len(flat_idx):
                    assert synthetic_hash(t, flat_idx[j], seed) == flat_h[j]


def test_fill_rows_anywhere():
    """synthetic_fill writes rows that start anywhere: overlapping, out of order, at equal and unequal steps (runs
    copied as one strided view), across a span boundary and over several spans, past 2^36, with the hashes or
    the dtype's values; it needs a C-contiguous target and one start per row."""
    key = synthetic_key(2, 1)
    starts = np.array([0, 5, 6, 7, 9, 14, 1 << 36, (1 << 36) + 1, SPAN - 4, 2 * SPAN - 11, 2 * SPAN - 10,
                       2 * SPAN - 9, 40, 30, 20, 3 * SPAN + 100, 3 * SPAN + 200, 3 * SPAN + 300], dtype=np.int64)
    for n in (11, 1, SPAN + 7, 2 * SPAN + 3):
        idx = torch.from_numpy(starts)[:, None] + torch.arange(n)
        h = reference_hash(2, idx, 1).numpy()
        for rows in (starts, starts[:3], starts[[1, 5]], starts[8:], starts[12:15]):
            got = synthetic_fill(np.empty((rows.size, n), np.int32), rows, key, synthetic_period(None))
            assert np.array_equal(got, h[[list(starts).index(s) for s in rows]]), (n, rows)
        table = synthetic_table("bfloat16")
        got = synthetic_fill(np.empty((starts.size, n), np.int16), starts, key, synthetic_period("bfloat16"))
        assert np.array_equal(got, table[h]), n
    consecutive = np.arange(5, dtype=np.int64) * 7 + SPAN - 17  # whole rows: one run over a span boundary
    got = synthetic_fill(np.empty((5, 7), np.int32), consecutive, key, synthetic_period(None))
    assert np.array_equal(got, reference_hash(2, torch.from_numpy(consecutive)[:, None] + torch.arange(7), 1).numpy())
    assert not table.flags.writeable and not synthetic_period("bfloat16").flags.writeable
    with pytest.raises(ValueError):
        synthetic_fill(np.empty((11, 18), np.int16).T, starts, key, synthetic_period("bfloat16"))
    with pytest.raises(ValueError):
        synthetic_fill(np.empty((3, 11), np.int16), starts, key, synthetic_period("bfloat16"))
    assert synthetic_table("complex64") is None
    with pytest.raises(ValueError):
        synthetic_period("complex64")


@pytest.mark.parametrize("dtype", MANIFEST_DTYPES, ids=str)
def test_no_power_of_two_period(dtype):
    """Values 2^k elements apart (k = 0 .. 22: 65536, the span of a rotation and several spans too) differ almost
    everywhere, in every dtype (a bool in half the elements, as chance has it): data shifted by any power of two
    is never the data that belongs there. Also across tensors and seeds."""
    n, window = 3 << 22, 1 << 23
    x = _bits(synthetic_values(3, Box.full((n,)), (n,), dtype))
    least = 0.45 if dtype == torch.bool else 0.9
    for k in range(23):
        differ = (x[:window] != x[1 << k:(1 << k) + window]).double().mean().item()
        assert differ > least, (k, differ)
    # a 2-D tensor shifted by whole rows (a misrouted row block), and other tensors or seeds at the same place
    y = x[:1 << 18].reshape(512, 512)
    assert (y[:256] != y[256:]).double().mean().item() > least
    for t, seed in ((4, 0), (3, 1)):
        other = _bits(synthetic_values(t, Box.full((n,)), (n,), dtype, seed))
        assert (other != x).double().mean().item() > least


def test_old_generator_repeated_every_65536_elements():
    """Why this changed: the previous formula kept 16 bits of i * 2654435761, which depend on i mod 2^16 only, so
    a shard misrouted by 65536 elements held exactly the expected values."""
    i = torch.arange(1 << 18, dtype=torch.int64)
    old = ((i * 2654435761) ^ (4 * 40503)) & 0xFFFF
    assert torch.equal(old[:1 << 17], old[1 << 16:(1 << 16) + (1 << 17)])
    new = reference_hash(3, i, 0)
    assert (new[:1 << 17] != new[1 << 16:(1 << 16) + (1 << 17)]).double().mean().item() > 0.99


def _definition(key: int, i: int) -> int:
    """The definition, one element at a time on Python ints: the rotation r of span i // 2^20 is the top 20 bits
    of SplitMix64's word i // 2^20 of the stream whose key is `key`; the hash is lane p mod 4 (bits 16 (p mod 4)
    and up) of SplitMix64's word p // 4 of the stream of key 0, at p = (i mod 2^20 + r) mod 2^20."""
    m = (1 << 64) - 1

    def splitmix_word(stream_key: int, q: int) -> int:
        z = (stream_key + q * 0x9E3779B97F4A7C15) & m
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
        return z ^ (z >> 31)
    r = splitmix_word(key, i >> 20) >> 44
    p = ((i & ((1 << 20) - 1)) + r) & ((1 << 20) - 1)
    return (splitmix_word(0, p >> 2) >> (16 * (p & 3))) & 0xFFFF


@pytest.mark.parametrize("dtype", MANIFEST_DTYPES, ids=str)
def test_check_generator_is_the_per_element_definition(dtype):
    """What `reshard check` compares a file with (`_SyntheticBlocks`: the dtype's period copied from each span's
    rotation, in runs of rows) is the definition computed element by element (`_definition`, then the value cast
    by torch): odd-sized shards at offsets that are multiples of nothing, rows that start at every lane of a word
    and cross a span boundary, flat indices past 2^33. `_compare` finds no difference in those values (and their
    checksum), and exactly one after one bit is flipped."""
    from reshard_cli.base import checksums, rowsum
    from reshard_cli.io.check import _compare, _Scratch, _SyntheticBlocks

    name = str(dtype).removeprefix("torch.")
    cases = [((1001,), Box((13,), (977,))), ((37, 91), Box((5, 3), (19, 71))), ((5, 9, 13), Box((1, 2, 3), (3, 5, 7))),
             ((3, (1 << 33) + 5), Box((1, (1 << 33) - 3), (2, 7))), ((1,), Box((0,), (1,))), ((), Box((), ())),
             ((3, (1 << 20) + 5), Box((0, (1 << 20) - 3), (3, 6))), ((9, 1 << 19), Box((1, (1 << 19) - 2), (8, 2)))]
    scratch = _Scratch()
    for t, seed in [(3, 0), (29, 11)]:
        key = synthetic_key(t, seed)
        for shape, box in cases:
            idx = global_index(box, shape).reshape(-1).tolist()
            h = torch.tensor([_definition(key, i) for i in idx], dtype=torch.int64).reshape(box.sizes)
            values = reference_values(h, dtype)
            want = _bits(values).numpy()
            gen = _SyntheticBlocks.make(t, shape, name, seed)
            rows = rowsum.row_ids(box, shape)
            file = want.reshape(rows.size, box.sizes[-1] if box.sizes else 1)
            bad = want.copy()
            bad.reshape(-1)[bad.size // 2] ^= 1
            assert np.array_equal(gen.block(box, rows, np.empty_like(file), scratch), file), (t, shape)
            assert _compare(want, gen.block, box, shape, 50, scratch)[:3] == (
                0, None, checksums.checksum(values, box, shape)), (t, shape, box)
            assert _compare(bad, gen.block, box, shape, 50, scratch)[0] == 1, (t, shape, box)
