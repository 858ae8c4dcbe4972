"""Synthetic source values: the formula against an independent torch reference, and the property that makes them
worth comparing: no element's value repeats at a power-of-two distance, so data misrouted by 2^k elements (2^16
included, where the previous generator repeated) differs from what belongs there."""
import numpy as np
import pytest
import torch

from reshard_cli.base.checksums import global_index
from reshard_cli.base.geometry import Box
from reshard_cli.io.sources import synthetic_fill, synthetic_hash, synthetic_key, synthetic_table, synthetic_values

MANIFEST_DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn,
                   torch.float8_e5m2, torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]
_BITS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _signed(c: int) -> int:
    return c - (1 << 64) if c >= 1 << 63 else c


def reference_hash(t: int, idx: torch.Tensor, seed: int) -> torch.Tensor:
    """The 16-bit hash of every global flat index in `idx`, in torch int64 arithmetic (multiplications wrap mod
    2^64; a logical right shift is an arithmetic one masked): SplitMix64's word idx // 4 of the stream keyed by
    (t, seed), lane idx % 4."""
    key = _signed(synthetic_key(t, seed))
    z = (idx >> 2) * _signed(0x9E3779B97F4A7C15) + key
    z = (z ^ ((z >> 30) & ((1 << 34) - 1))) * _signed(0xBF58476D1CE4E5B9)
    z = (z ^ ((z >> 27) & ((1 << 37) - 1))) * _signed(0x94D049BB133111EB)
    z = z ^ ((z >> 31) & ((1 << 33) - 1))
    return (z >> ((idx & 3) * 16)) & 0xFFFF


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
    """synthetic_fill writes rows that start anywhere (each row its own lane, in one step or several, some lanes
    with no row) with or without a table; it needs a C-contiguous target and one start per row."""
    key = synthetic_key(2, 1)
    starts = np.array([0, 5, 6, 7, 9, 14, 1 << 36, (1 << 36) + 1], dtype=np.int64)
    idx = torch.from_numpy(starts)[:, None] + torch.arange(11)
    h = reference_hash(2, idx, 1).numpy()
    for rows in (starts, starts[:3], starts[[1, 5]]):  # lanes 0-3; 0, 1, 2; 1, 2 only
        n = rows.size
        assert np.array_equal(synthetic_fill(np.empty((n, 11), np.int32), rows, key),
                              h[[list(starts).index(s) for s in rows]])
    table = synthetic_table("bfloat16")
    got = synthetic_fill(np.empty((8, 11), np.int16), starts, key, table)
    assert np.array_equal(got, table[h]) and not table.flags.writeable
    with pytest.raises(ValueError):
        synthetic_fill(np.empty((11, 8), np.int16).T, starts, key, table)
    with pytest.raises(ValueError):
        synthetic_fill(np.empty((3, 11), np.int16), starts, key, table)
    assert synthetic_table("complex64") is None


@pytest.mark.parametrize("dtype", MANIFEST_DTYPES, ids=str)
def test_no_power_of_two_period(dtype):
    """Values 2^k elements apart (k = 0 .. 17, so 65536 too) differ almost everywhere, in every dtype (a bool in
    half the elements, as chance has it): data shifted by any power of two is never the data that belongs
    there. Also across tensors and seeds."""
    n, window = (1 << 18) + (1 << 17), 1 << 18
    x = _bits(synthetic_values(3, Box.full((n,)), (n,), dtype))
    least = 0.45 if dtype == torch.bool else 0.9
    for k in range(18):
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


def _splitmix_lane(key: int, i: int) -> int:
    """The definition, one element at a time on Python ints: lane i mod 4 (bits 16 (i mod 4) and up) of
    SplitMix64's word i // 4 of the stream whose key is `key`."""
    m = (1 << 64) - 1
    z = (key + (i >> 2) * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    z ^= z >> 31
    return (z >> (16 * (i & 3))) & 0xFFFF


@pytest.mark.parametrize("dtype", MANIFEST_DTYPES, ids=str)
def test_check_generator_is_the_per_element_definition(dtype, monkeypatch):
    """What `reshard check` compares a file with (`_SyntheticBlocks`: numpy words, lanes and the dtype's table, in
    steps) is the definition computed element by element (`_splitmix_lane`, then the value cast by torch):
    odd-sized shards at offsets that are multiples of nothing, rows that start at every lane of a word, steps of
    1, 7 and 61 elements that end mid-row and mid-word, flat indices past 2^33. `_compare` finds no difference in
    those values (and their checksum), and exactly one after one bit is flipped."""
    from reshard_cli.base import checksums, rowsum
    from reshard_cli.io import sources
    from reshard_cli.io.check import _compare, _Scratch, _SyntheticBlocks

    name = str(dtype).removeprefix("torch.")
    cases = [((1001,), Box((13,), (977,))), ((37, 91), Box((5, 3), (19, 71))), ((5, 9, 13), Box((1, 2, 3), (3, 5, 7))),
             ((3, (1 << 33) + 5), Box((1, (1 << 33) - 3), (2, 7))), ((1,), Box((0,), (1,))), ((), Box((), ()))]
    scratch = _Scratch()
    for t, seed in [(3, 0), (29, 11)]:
        key = synthetic_key(t, seed)
        for shape, box in cases:
            idx = global_index(box, shape).reshape(-1).tolist()
            h = torch.tensor([_splitmix_lane(key, i) for i in idx], dtype=torch.int64).reshape(box.sizes)
            values = reference_values(h, dtype)
            want = _bits(values).numpy()
            gen = _SyntheticBlocks.make(t, shape, name, seed)
            rows = rowsum.row_ids(box, shape)
            file = want.reshape(rows.size, box.sizes[-1] if box.sizes else 1)
            bad = want.copy()
            bad.reshape(-1)[bad.size // 2] ^= 1
            for step in (sources._FILL_STEP, 1, 7, 61):
                monkeypatch.setattr(sources, "_FILL_STEP", step)
                assert np.array_equal(gen.block(box, rows, np.empty_like(file), scratch), file), (t, shape, step)
                assert _compare(want, gen.block, box, shape, 50, scratch)[:3] == (
                    0, None, checksums.checksum(values, box, shape)), (t, shape, box, step)
                assert _compare(bad, gen.block, box, shape, 50, scratch)[0] == 1, (t, shape, box, step)
