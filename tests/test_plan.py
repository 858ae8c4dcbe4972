"""Planner: exact coverage of every destination box, rank views, minimum wire bytes, balance, baseline."""
import pytest
import torch

from conftest import PAIRS, ROOT, write_pair
from reshard_cli.formats import load_pair
from reshard_cli.plan import cost
from reshard_cli.plan.planner import Plan
from reshard_cli.layouts.topology import Topology

TOPOLOGIES = [Topology(), Topology(name="pairs", ranks_per_domain=2), Topology(name="all", ranks_per_domain=64),
              # with link figures, so that mode auto weighs its routes (slow links: messages and bytes both count)
              Topology(name="pairs-links", ranks_per_domain=2,
                       links={"network_gbps": 1e-4, "nvlink_gbps": 1e-4, "latency_us": 10})]


def check_coverage(plan: Plan):
    """Every dst rank receives each element of its box exactly once, from a rank that has it."""
    man = plan.src.manifest
    for t, spec in enumerate(man.tensors):
        pieces = plan.tensor_pieces(t)
        sp, dp = plan.src.placements[t], plan.dst.placements[t]
        phase0 = {(p.dst, p.box) for p in pieces if p.phase == 0}
        for p in pieces:
            if p.phase == 0:
                assert p.src in sp.holder_set
                assert p.box.intersect(sp.box_of(spec.shape, p.src)) == p.box
            else:  # forwarded: the forwarder received exactly this box in phase 0
                assert (p.src, p.box) in phase0
                assert p.src in dp.holder_set
        for r in dp.holders:
            box = dp.box_of(spec.shape, r)
            count = torch.zeros(box.sizes, dtype=torch.int32)
            for p in pieces:
                if p.dst == r:
                    assert p.box.intersect(box) == p.box
                    count[p.box.local_slices(box)] += 1
            assert bool((count == 1).all()), (spec.name, r)


@pytest.mark.parametrize("pair", sorted(PAIRS))
@pytest.mark.parametrize("topo", TOPOLOGIES, ids=["none", "pairs", "one", "pairs-links"])
@pytest.mark.parametrize("mode", ["reshard", "auto"])
def test_pieces_cover_exactly(tmp_path, pair, topo, mode):
    src, dst = load_pair(*write_pair(tmp_path, pair))
    plan = cost.with_auto_routes(Plan(src, dst, topo, mode=mode))
    check_coverage(plan)
    stats = plan.stats()
    if mode == "reshard" or not topo.links:  # auto without link figures is reshard (forward everywhere)
        assert stats["wire_bytes"] == stats["min_wire_bytes"]
    # rank view == global plan restricted to the rank (a fresh plan per rank, as in `reshard run`)
    everything = list(plan.pieces())
    items = [s.itemsize for s in src.manifest.tensors]
    # the forwarded bytes the plan reports are its phase-1 pieces (what destination ranks send each other)
    assert stats["forwarded_bytes"] == sum(p.box.numel * items[p.tensor] for p in everything if p.phase == 1)
    assert stats["forwarded_bytes"] <= stats["indomain_bytes"]
    bcasts = [b for b in plan.bcasts() if b.root >= 0]
    for r in src.ranks + dst.ranks:
        view = cost.with_auto_routes(Plan(src, dst, topo, mode=mode)).rank_view(r)
        assert sorted(view.pieces) == sorted(p for p in everything if r in (p.src, p.dst))
        assert view.bcasts == [b for b in bcasts if r in dst.ranks or r == b.root or any(s == r for s, _ in b.gather)]


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_broadcast_plan_gathers_whole_tensor(tmp_path, pair):
    src, dst = load_pair(*write_pair(tmp_path, pair))
    plan = Plan(src, dst, mode="broadcast")
    for t, spec in enumerate(src.manifest.tensors):
        bc = plan.bcast(t)
        if spec.numel == 0:
            continue
        count = torch.zeros(spec.shape, dtype=torch.int32)
        count[bc.root_box.slices()] += 1
        for s, a in bc.gather:
            assert s in src.placements[t].holder_set
            count[a.slices()] += 1
        assert bool((count == 1).all())
        assert bc.receivers == dst.ranks
    rank_b = {r: plan.rank_view(r).bcasts for r in src.ranks + dst.ranks}
    for r in dst.ranks:
        assert len(rank_b[r]) == sum(1 for s in src.manifest.tensors if s.numel)


def test_hybrid_paths(tmp_path):
    src, dst = load_pair(*write_pair(tmp_path, "tp2_to_tp3"))
    plan = Plan(src, dst, mode="hybrid")
    by_name = {s.name: p for s, p in zip(src.manifest.tensors, plan.paths)}
    assert by_name["layers.0.mlp.experts.1.up_proj.weight"] == "reshard"
    assert by_name["layers.0.attn.q_proj.weight"] == "broadcast"
    stats = plan.stats()
    assert stats["paths"]["reshard"] + stats["paths"]["broadcast"] == stats["bytes"]
    custom = Plan(src, dst, mode="hybrid", reshard_match=r"q_proj")
    assert custom.paths[1] == "reshard" and custom.paths[4] == "broadcast"


def test_stats_match_pieces(tmp_path):
    """The class-aggregated statistics equal a direct sum over the pieces."""
    src, dst = load_pair(*write_pair(tmp_path, "pp2_ep2_to_dp2_tp2"))
    plan = Plan(src, dst, Topology(name="pairs", ranks_per_domain=2), mode="reshard")
    stats = plan.stats()
    dom = plan.topology.domain_of
    man = src.manifest.tensors
    wire = sum(p.box.numel * man[p.tensor].nbytes // man[p.tensor].numel for p in plan.pieces()
               if dom(p.src) != dom(p.dst))
    assert wire == stats["wire_bytes"]
    assert stats["pieces"] == sum(1 for _ in plan.pieces())


@pytest.mark.parametrize("dst_name", ["vllm-tp4-dp4"])
def test_bundled_30b_pair_balanced(dst_name):
    src, dst = load_pair(ROOT / "layouts/qwen3-30b-a3b/megatron-tp2-ep4-pp2.yaml",
                         ROOT / f"layouts/qwen3-30b-a3b/{dst_name}.yaml")
    for topo in (Topology(), Topology(name="dgx", ranks_per_domain=8)):
        s = Plan(src, dst, topo, mode="reshard").stats()
        assert s["wire_bytes"] == s["min_wire_bytes"]
        assert s["max_rank_send_bytes"] <= 1.05 * s["ideal_rank_send_bytes"]
        assert s["broadcast_wire_bytes"] >= s["wire_bytes"]
    r = dst.ranks[3]
    plan = Plan(src, dst, mode="hybrid")
    view = plan.rank_view(r)
    assert view.pieces and view.bcasts
    assert all(r in (p.src, p.dst) for p in view.pieces)


@pytest.mark.parametrize("pair", ["tp2_to_tp3", "pp2_ep2_to_dp2_tp2", "nested_dp_to_ep"])
@pytest.mark.parametrize("bucket,direct", [(256, 64), (1 << 20, 1 << 30), (64, 0)])
def test_schedule_ends_agree(tmp_path, pair, bucket, direct):
    """Every message one rank's schedule sends is received by its peer's schedule under the same key, with
    the same length, and each rank's ops are in key order (the deadlock-freedom argument's premise)."""
    from reshard_cli.plan import schedule

    src_path, dst_path = write_pair(tmp_path, pair)
    src, dst = load_pair(src_path, dst_path)
    opts = schedule.TransferOptions(bucket_bytes=bucket, direct_min_bytes=direct)
    for rpd in (None, 2):
        plan = Plan(src, dst, Topology(name="t", ranks_per_domain=rpd) if rpd else Topology(), mode="reshard")
        sends, recvs = {}, {}
        for rank in src.ranks + dst.ranks:
            ops = schedule.rank_ops(plan, rank, opts)
            assert [o.key for o in ops] == sorted(o.key for o in ops)
            for o in ops:
                (sends if o.send else recvs)[(o.key, rank if o.send else o.peer, o.peer if o.send else rank)] = o.nbytes
        assert sends == recvs and sends
        assert all(n <= max(bucket // 2, schedule.ALIGN) or direct <= n for n in sends.values())


@pytest.mark.parametrize("bucket,direct", [(256, 64), (1 << 20, 1 << 30), (64, 0)])
def test_forwards_follow_the_message_that_brings_their_data(tmp_path, bucket, direct):
    """Phase 1 is pipelined per bucket: each forward a rank sends names (`after`) one of its own received
    phase-0 messages with a smaller key whose items cover the forward's, and the forwards carry exactly the
    plan's phase-1 pieces."""
    from reshard_cli.plan import schedule

    src_path, dst_path = write_pair(tmp_path, "pp2_ep2_to_dp2_tp2")
    src, dst = load_pair(src_path, dst_path)
    plan = Plan(src, dst, Topology(name="t", ranks_per_domain=2), mode="reshard")
    want = {(p.tensor, p.src, p.dst, p.box) for p in plan.pieces() if p.phase == 1}
    assert want
    opts = schedule.TransferOptions(bucket_bytes=bucket, direct_min_bytes=direct)
    got = set()
    for rank in dst.ranks:
        ops = schedule.rank_ops(plan, rank, opts)
        received = {o.key: o for o in ops if not o.send and o.key[4] == 0}
        for o in ops:
            if o.after is None:
                continue
            m = received[o.after]
            assert m.key < o.key and o.key[:4] == m.key[:4]
            carried = {(t, b) for t, b, _ in m.items}
            assert all((t, b) in carried for t, b, _ in o.items)
            for t, b, _ in o.items:
                got.add((t, rank, o.peer, b))
    # a piece larger than a bucket is forwarded part by part: compare the elements per (tensor, from, to)
    def volume(xs):
        out: dict = {}
        for t, s, d, b in xs:
            out[(t, s, d)] = out.get((t, s, d), 0) + b.numel
        return out

    assert volume(got) == volume(want)


def test_layouts_listing_tensors_in_other_orders_pair_by_name(tmp_path):
    """A checkpoint's header order and a config's order differ; the plan must still pair tensors by name."""
    (tmp_path / "a.yaml").write_text("tensors:\n  - {name: x, shape: [4, 6]}\n  - {name: y, shape: [8, 2]}\n")
    (tmp_path / "b.yaml").write_text("tensors:\n  - {name: y, shape: [8, 2]}\n  - {name: x, shape: [4, 6]}\n")
    (tmp_path / "src.yaml").write_text("model: a.yaml\nmesh: {tp: 2}\nplacements:\n  - {match: x, shard: {tp: 0}}\n")
    (tmp_path / "dst.yaml").write_text("model: b.yaml\nmesh: {tp: 2}\nplacements:\n  - {match: x, shard: {tp: 1}}\n")
    src, dst = load_pair(tmp_path / "src.yaml", tmp_path / "dst.yaml")
    assert [t.name for t in dst.manifest.tensors] == ["x", "y"]
    plan = Plan(src, dst, mode="reshard")
    x = [p for p in plan.pieces() if p.tensor == 0]
    assert {p.box.sizes for p in x} == {(2, 3)}  # rows of x (src) meet columns of x (dst), not y
    from reshard_cli.errors import ConfigError
    from reshard_cli.formats import load_layout
    with pytest.raises(ConfigError, match="different orders"):
        Plan(src, load_layout(tmp_path / "dst.yaml", first_rank=2))
