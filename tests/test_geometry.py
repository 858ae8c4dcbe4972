"""The geometry against torch's own DTensor shard computation (no process group needed)."""
import itertools
import random

import pytest
import torch
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from reshard_cli.base.geometry import Box, chunk_range, is_contiguous_region, shard_box


def torch_box(shape, mesh_shape, coord, placements):
    tp = [Replicate() if p is None else Shard(p) for p in placements]
    local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), tp)
    return tuple(offset), tuple(local)


def test_chunk_matches_torch_chunk():
    for n in range(0, 20):
        for k in range(1, 10):
            sizes = [c.numel() for c in torch.arange(n).chunk(k)] if n else []
            sizes += [0] * (k - len(sizes))
            assert [chunk_range(n, k, i)[1] for i in range(k)] == sizes


def test_documented_cases():
    assert [shard_box((9,), (8,), (i,), (0,)).sizes[0] for i in range(8)] == [2, 2, 2, 2, 1, 0, 0, 0]
    nested = [shard_box((5,), (2, 2), c, (0, 0)).sizes[0] for c in itertools.product(range(2), range(2))]
    assert nested == [2, 1, 1, 1]


@pytest.mark.parametrize("seed", range(40))
def test_random_meshes_match_dtensor(seed):
    rng = random.Random(seed)
    ndim = rng.randint(1, 3)
    shape = tuple(rng.choice([0, 1, 2, 3, 5, 7, 8, 9, 13, 16]) for _ in range(ndim))
    mesh_shape = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 4)))
    # nested: several mesh dims may shard the same tensor dim
    placements = tuple(rng.choice([None] + list(range(ndim))) for _ in mesh_shape)
    for coord in itertools.product(*(range(n) for n in mesh_shape)):
        ours = shard_box(shape, mesh_shape, coord, placements)
        assert (ours.offsets, ours.sizes) == torch_box(shape, mesh_shape, coord, placements), (shape, mesh_shape, coord, placements)


@pytest.mark.parametrize("seed", range(20))
def test_shards_partition_the_tensor(seed):
    """Every element belongs to exactly one shard per replica group (checked on a real tensor)."""
    rng = random.Random(100 + seed)
    shape = tuple(rng.randint(0, 9) for _ in range(2))
    mesh_shape = tuple(rng.randint(1, 3) for _ in range(3))
    placements = tuple(rng.choice([None, 0, 1]) for _ in mesh_shape)
    count = torch.zeros(shape, dtype=torch.int64)
    boxes = {shard_box(shape, mesh_shape, c, placements) for c in itertools.product(*(range(n) for n in mesh_shape))}
    for b in boxes:
        count[b.slices()] += 1
    assert bool((count == 1).all())


def test_intersect_split_contiguity():
    a, b = Box((0, 2), (4, 4)), Box((2, 0), (4, 4))
    assert a.intersect(b) == Box((2, 2), (2, 2))
    assert a.intersect(Box((4, 0), (1, 1))) is None
    parts = Box((1, 0), (10, 3)).split(4)
    assert [p.sizes for p in parts] == [(3, 3), (3, 3), (3, 3), (1, 3)]
    assert sum(p.numel for p in Box((0, 0), (2, 3)).split(5)) == 6  # falls back to the largest dim
    assert is_contiguous_region(Box((1, 0, 0), (2, 6, 5)), (4, 6, 5))
    assert is_contiguous_region(Box((1, 2, 0), (1, 3, 5)), (4, 6, 5))
    assert not is_contiguous_region(Box((0, 0, 0), (2, 3, 5)), (4, 6, 5))
    assert Box((2, 3), (2, 2)).local_slices(Box((2, 0), (4, 8))) == (slice(0, 2), slice(3, 5))
