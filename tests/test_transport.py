"""Transfers on gloo, checked element by element against the source tensors (destinations start as a sentinel)."""
import torch
import pytest

from conftest import write_pair
from dist_util import run_ranks


def reference(manifest):
    """Full tensors every process can rebuild: random values from a per-tensor seed."""
    out = []
    for t, spec in enumerate(manifest.tensors):
        g = torch.Generator().manual_seed(1000 + t)
        x = torch.randn(spec.shape, generator=g, dtype=torch.float32).to(getattr(torch, spec.dtype))
        out.append(x)
    return out


def local_shards(src, dst, rank: int, ref) -> tuple[dict, dict]:
    """This rank's source shards (slices of `ref`) and sentinel-filled destination buffers."""
    from reshard_cli.transfer.shards import LocalShard

    src_shards, dst_shards = {}, {}
    for t, spec in enumerate(src.manifest.tensors):
        if rank in src.placements[t].holder_set:
            box = src.placements[t].box_of(spec.shape, rank)
            src_shards[t] = LocalShard(box, ref[t][box.slices()].clone())
        if rank in dst.placements[t].holder_set:
            box = dst.placements[t].box_of(spec.shape, rank)
            buf = torch.empty(box.sizes, dtype=ref[t].dtype)
            if buf.numel():
                buf.reshape(-1).view(torch.uint8).fill_(0xA5)
            dst_shards[t] = LocalShard(box, buf)
    return src_shards, dst_shards


def _comm(transport: str):
    """gloo; shm (every pair over shared memory); or "mixed": only the pairs among ranks 0-2 over shared
    memory, the others over gloo, as for ranks on two hosts (one-sided with some peers, two-sided with others)."""
    from reshard_cli.transfer.comm import WORLD
    from reshard_cli.transfer.shm import ShmComm, with_transport

    if transport == "mixed":
        return ShmComm(WORLD, ranks={0, 1, 2})
    return with_transport(WORLD, transport, torch.device("cpu"))


def _refit(rank, world, src_path, dst_path, modes, topologies, bucket_bytes, direct_min_bytes=1 << 20,
           transport="gloo"):
    from reshard_cli.formats import load_pair
    from reshard_cli.plan.planner import Plan
    from reshard_cli.layouts.topology import Topology
    from reshard_cli.plan.schedule import TransferOptions
    from reshard_cli.transfer.engine import Engine

    src, dst = load_pair(src_path, dst_path)
    ref = reference(src.manifest)
    man = src.manifest.tensors
    failures = []
    comm = _comm(transport)
    for mode in modes:
        for rpd in topologies:
            topo = Topology(name="t", ranks_per_domain=rpd) if rpd else Topology()
            plan = Plan(src, dst, topo, mode=mode)
            src_shards, dst_shards = local_shards(src, dst, rank, ref)
            engine = Engine(plan, rank, src_shards, dst_shards,
                            options=TransferOptions(bucket_bytes=bucket_bytes, direct_min_bytes=direct_min_bytes),
                            comm=comm)
            engine.setup_groups()
            for _ in range(2):  # a second refit reuses the plan and buffers
                engine.run_reshard()
                engine.run_broadcast()
            for t, sh in dst_shards.items():
                if not torch.equal(sh.data.view(torch.uint8) if sh.data.dim() else sh.data,
                                   ref[t][sh.box.slices()].contiguous().view(torch.uint8) if sh.data.dim()
                                   else ref[t][sh.box.slices()]):
                    failures.append((mode, rpd, man[t].name, rank))
            # staging never exceeds the bucket budget on the reshard path
            if mode == "reshard" and engine.peak_staging_bytes > bucket_bytes:
                failures.append((mode, rpd, "staging", engine.peak_staging_bytes))
    return failures


@pytest.mark.parametrize("transport", ["gloo", "shm", "mixed"])
@pytest.mark.parametrize("pair,world", [("tp2_to_tp3", 5), ("pp2_ep2_to_dp2_tp2", 8), ("nested_dp_to_ep", 8)])
def test_every_mode_exact(tmp_path, pair, world, transport):
    src_path, dst_path = write_pair(tmp_path, pair)
    # tiny buckets force splitting and packing; topologies exercise the in-domain second phase
    results = run_ranks(world, _refit, str(src_path), str(dst_path), ("reshard", "broadcast", "hybrid"),
                        (None, 2), 256, 1 << 20, transport)
    assert all(not f for f in results.values()), results


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_direct_messages_and_pipelined_forwards_exact(tmp_path, transport):
    """Pieces large enough to travel alone (sent from / received into the tensors themselves, or staged at a
    strided end), mixed with packed buckets, with destination replicas sharing a domain: each forward goes as
    soon as the message that brings its data has landed, and everything lands exactly, twice."""
    src_path, dst_path = write_pair(tmp_path, "pp2_ep2_to_dp2_tp2")
    results = run_ranks(8, _refit, str(src_path), str(dst_path), ("reshard",), (2,), 1024, 16, transport)
    assert all(not f for f in results.values()), results


def _strided_sources(rank, world, src_path, dst_path, transport="gloo"):
    """Source shards passed as non-contiguous views (a transposed copy's transpose: the same values, other
    strides) where the plan sends a whole contiguous shard in one message larger than the staging."""
    from reshard_cli.formats import load_pair
    from reshard_cli.plan.planner import Plan
    from reshard_cli.plan.schedule import TransferOptions
    from reshard_cli.transfer.engine import Engine

    src, dst = load_pair(src_path, dst_path)
    ref = reference(src.manifest)
    src_shards, dst_shards = local_shards(src, dst, rank, ref)
    for sh in src_shards.values():
        if sh.data.dim() == 2:
            sh.data = sh.data.t().contiguous().t()
    engine = Engine(Plan(src, dst, mode="reshard"), rank, src_shards, dst_shards,
                    options=TransferOptions(bucket_bytes=64, direct_min_bytes=16), comm=_comm(transport))
    engine.run_reshard()
    return [src.manifest.tensors[t].name for t, sh in dst_shards.items()
            if not torch.equal(sh.data, ref[t][sh.box.slices()])]


@pytest.mark.parametrize("transport", ["gloo", "shm"])
def test_a_strided_source_of_a_message_larger_than_the_staging_is_packed(tmp_path, transport):
    """A message planned to go straight from the source tensor but strided there goes through a temporary
    buffer: the bytes are packed into it before the send (they were not: the receiver got garbage)."""
    src_path, dst_path = write_pair(tmp_path, "tp2_to_tp3")
    results = run_ranks(5, _strided_sources, str(src_path), str(dst_path), transport)
    assert all(not f for f in results.values()), results
