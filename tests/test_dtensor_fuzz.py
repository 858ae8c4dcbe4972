"""Random DTensor layouts on both sides, refit through the live API in every mode, over gloo and over shared
memory, judged by torch: each destination DTensor's local shard must equal, bit for bit, what torch's own
`distribute_tensor` puts there (uneven and nested shards, replicas, 1-D and 2-D meshes, odd shapes)."""
import random

import pytest
import torch

from dist_util import run_ranks

pytestmark = pytest.mark.multiprocess

SHAPES = [(13, 7), (8, 6, 5), (11,), (4, 9), (3, 2, 7), (16, 16)]
MODES = ("reshard", "broadcast", "hybrid", "auto")


def _layouts(seed: int):
    """For `seed`: the two sides ((ranks, mesh shape) each: four ranks on a 1-D or 2x2 mesh, two on a 1-D one,
    which side is which drawn too) and, per tensor, each side's placement per mesh dim (None: replicated)."""
    rng = random.Random(seed)
    big = rng.choice([(4,), (2, 2)])
    if rng.random() < 0.5:
        sides = (((0, 1, 2, 3), big), ((4, 5), (2,)))
    else:
        sides = (((0, 1), (2,)), ((2, 3, 4, 5), big))
    per_tensor = []
    for shape in SHAPES:
        per_tensor.append(tuple([rng.choice([None] + list(range(len(shape)))) for _ in mesh]
                                for _ranks, mesh in sides))
    return sides, per_tensor


def _refit(rank, world, seed, transport):
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from reshard_cli.transfer.live import Refit

    sides, per_tensor = _layouts(seed)
    meshes = [DeviceMesh("cpu", torch.tensor(ranks).reshape(shape)) for ranks, shape in sides]  # every rank
    side = next((i for i, (ranks, _shape) in enumerate(sides) if rank in ranks), None)
    gen = torch.Generator().manual_seed(seed)
    full = {f"t{i}.weight": torch.randn(shape, generator=gen).to(torch.bfloat16) for i, shape in enumerate(SHAPES)}
    wrong = []
    for mode in MODES:
        tensors, truth = {}, {}
        if side is not None:
            for i, (name, x) in enumerate(full.items()):
                pl = [Replicate() if d is None else Shard(d) for d in per_tensor[i][side]]
                if side == 0:
                    tensors[name] = distribute_tensor(x, meshes[0], pl, src_data_rank=None)
                else:
                    truth[name] = distribute_tensor(x, meshes[1], pl, src_data_rank=None).to_local()
                    tensors[name] = distribute_tensor(torch.full_like(x, -7.0), meshes[1], pl, src_data_rank=None)
        refit = Refit(role=("src", "dst")[side] if side is not None else "idle", mode=mode, transport=transport)
        stats = refit(tensors, verify_checksums=True)
        refit.close()
        if not stats.checksums_ok:
            wrong.append((mode, "checksums"))
        for name, want in truth.items():
            got = tensors[name].to_local()
            if not torch.equal(got.view(torch.int16), want.view(torch.int16)):
                wrong.append((mode, name))
    return wrong


SEEDS, TRANSPORTS = (1, 2, 3), ("auto", "shm")


def _refit_all(rank, world):
    return {(seed, transport): _refit(rank, world, seed, transport) for seed in SEEDS for transport in TRANSPORTS}


@pytest.fixture(scope="module")
def fuzzed() -> dict:
    """Every seed over every transport, in one set of six processes (starting them was a third of each case)."""
    return run_ranks(6, _refit_all, timeout=900)


@pytest.mark.parametrize("transport", TRANSPORTS)
@pytest.mark.parametrize("seed", SEEDS)
def test_random_dtensor_layouts_land_where_torch_puts_them(fuzzed, seed, transport):
    wrong = {rank: r[(seed, transport)] for rank, r in fuzzed.items()}
    assert all(not w for w in wrong.values()), (seed, _layouts(seed), wrong)
