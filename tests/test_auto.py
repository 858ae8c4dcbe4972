"""Mode auto: the route each tensor class takes (forward, direct, broadcast) is the one the cost model predicts
cheaper; hand-made cases where each route must win, the choice without link figures, determinism across
processes, and rank views equal to the global plan restricted to the rank."""
import collections
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT, write_pair
from reshard_cli.plan import cost
from reshard_cli.plan.planner import Plan
from reshard_cli.plan.terms import ROUTES, Traffic
from reshard_cli.formats import load_pair
from reshard_cli.layouts.topology import Topology
from test_plan import check_coverage

MiB = 1 << 20


def _one_tensor(tmp_path, shape, src: str, dst: str):
    """One float32 tensor `w` of `shape`; src and dst layout bodies (mesh, ranks, placements)."""
    (tmp_path / "m.yaml").write_text("name: one\ndtype: float32\ntensors:\n"
                                     f"  - {{name: w, shape: {list(shape)}}}\n")
    (tmp_path / "src.yaml").write_text("model: m.yaml\n" + src)
    (tmp_path / "dst.yaml").write_text("model: m.yaml\n" + dst)
    return load_pair(tmp_path / "src.yaml", tmp_path / "dst.yaml")


def _by_route(plan: Plan) -> dict:
    """The cost model's figures for the plan's (one) tensor class on each route."""
    links, _ = cost.links_of(plan.topology)
    model = cost.model_for(plan, links)
    return {r: model.mode_cost(r, (r,) * len(plan.src.manifest.tensors)).seconds for r in ROUTES}


def _check_cheapest(plan: Plan, expected: str) -> dict:
    seconds = _by_route(plan)
    assert min(seconds, key=lambda r: (seconds[r], ROUTES.index(r))) == expected, seconds
    assert plan.class_routes.routes == (expected,)
    assert set(plan.routes) == {expected}
    pred = cost.predict(plan)
    assert pred.modes["auto"].seconds == seconds[expected]  # what plan predicts for auto is the chosen route's
    return seconds


SLOW = {"network_gbps": 1.0, "nvlink_gbps": 10.0, "latency_us": 1.0}


def test_broadcast_wins_for_one_source_many_domains(tmp_path):
    # rank 0 alone holds a 1 MiB tensor that 8 ranks in 4 domains replicate: the reshard path sends it into
    # every domain through rank 0's one NIC (4 MiB; direct: 8 MiB), a ring broadcast sends it once.
    src, dst = _one_tensor(tmp_path, (1024, 256), "mesh: {tp: 1}\n", "ranks: 2-9\nmesh: {dp: 8}\n")
    plan = cost.with_auto_routes(Plan(src, dst, Topology(name="t", ranks_per_domain=2, links=SLOW), mode="auto"))
    s = _check_cheapest(plan, "broadcast")
    assert s["forward"] == pytest.approx(4 * MiB / 1e9 + 8e-6 + MiB / 2 / 10e9 + 1e-6, rel=1e-9)
    assert s["broadcast"] == pytest.approx(MiB / 1e9 + 8 * 1e-6, rel=1e-9)  # one channel: the root is alone
    assert s["direct"] == pytest.approx(8 * MiB / 1e9 + 8e-6, rel=1e-9)


def test_direct_wins_for_a_tiny_tensor(tmp_path):
    # 16 floats, TP2 on ranks 0-1 -> replicated on ranks 2-3 (one domain): forwarding costs a second phase
    # (one more message) to save 32 bytes; direct sends both halves to both replicas in the same 2 messages.
    src, dst = _one_tensor(tmp_path, (16,), "mesh: {tp: 2}\nplacements:\n  - {match: w, shard: {tp: 0}}\n",
                           "mesh: {dp: 2}\n")
    links = {"network_gbps": 50.0, "nvlink_gbps": 450.0, "latency_us": 10.0}
    plan = cost.with_auto_routes(Plan(src, dst, Topology(name="t", ranks_per_domain=2, links=links), mode="auto"))
    s = _check_cheapest(plan, "direct")
    assert s["direct"] == pytest.approx(64 / 50e9 + 2 * 10e-6, rel=1e-9)
    assert s["forward"] == pytest.approx(32 / 50e9 + 2 * 10e-6 + 32 / 450e9 + 10e-6, rel=1e-9)
    pieces = list(plan.pieces())
    assert all(p.phase == 0 for p in pieces) and len(pieces) == 4  # each replica gets both halves itself


def test_forward_wins_for_a_large_tensor(tmp_path):
    # the same layouts with 1 MiB: each replica takes half over the network and forwards it over NVLink.
    src, dst = _one_tensor(tmp_path, (1024, 256), "mesh: {tp: 2}\nplacements:\n  - {match: w, shard: {tp: 0}}\n",
                           "mesh: {dp: 2}\n")
    plan = cost.with_auto_routes(Plan(src, dst, Topology(name="t", ranks_per_domain=2, links=SLOW), mode="auto"))
    s = _check_cheapest(plan, "forward")
    assert s["forward"] < s["direct"] and s["forward"] < s["broadcast"]
    assert {p.phase for p in plan.pieces()} == {0, 1}


def test_no_link_figures_means_forward_everywhere(tmp_path):
    src, dst = load_pair(*write_pair(tmp_path, "pp2_ep2_to_dp2_tp2"))
    for topo in (Topology(), Topology(name="bare", ranks_per_domain=2)):
        plan = cost.with_auto_routes(Plan(src, dst, topo, mode="auto"))
        assert set(plan.routes) == {"forward"}
        assert plan.paths == Plan(src, dst, topo, mode="reshard").paths
        assert sorted(plan.pieces()) == sorted(Plan(src, dst, topo, mode="reshard").pieces())
        assert plan.stats()["routes_by"].startswith("no link figures to weigh")


# Small pairs under link figures that make auto mix its routes (checked below), for the rank-view property.
MIXED = [("tp2_to_tp3", 2, {"network_gbps": 1e-4, "nvlink_gbps": 1e-4, "latency_us": 10}),
         ("pp2_ep2_to_dp2_tp2", 4, {"network_gbps": 1e-4, "nvlink_gbps": 1e-4, "latency_us": 10}),
         ("nested_dp_to_ep", 2, {"network_gbps": 50, "nvlink_gbps": 450, "latency_us": 10})]


def test_small_pairs_mix_routes(tmp_path):
    seen = set()
    for name, rpd, links in MIXED:
        src, dst = load_pair(*write_pair(tmp_path, name))
        plan = cost.with_auto_routes(Plan(src, dst, Topology(name="t", ranks_per_domain=rpd, links=links), mode="auto"))
        seen |= set(plan.routes)
        pred = cost.predict(plan)
        assert pred.modes["auto"].seconds <= min(pred.modes["reshard"].seconds, pred.modes["broadcast"].seconds)
    assert seen == set(ROUTES)


@pytest.mark.parametrize("name,rpd,links", MIXED, ids=[m[0] for m in MIXED])
def test_rank_view_is_the_global_plan_restricted(tmp_path, name, rpd, links):
    src, dst = load_pair(*write_pair(tmp_path, name))
    plan = cost.with_auto_routes(Plan(src, dst, Topology(name="t", ranks_per_domain=rpd, links=links), mode="auto"))
    check_coverage(plan)  # every destination element exactly once, on whichever route its tensor takes
    pieces = list(plan.pieces())
    bcasts = [b for b in plan.bcasts() if b.root >= 0]
    assert {p.tensor for p in pieces} | {b.tensor for b in bcasts} <= set(range(len(src.manifest.tensors)))
    for r in src.ranks + dst.ranks:
        # a fresh plan per rank, as each process of `reshard run` builds its own
        topo = Topology(name="t", ranks_per_domain=rpd, links=links)
        view = cost.with_auto_routes(Plan(src, dst, topo, mode="auto")).rank_view(r)
        assert sorted(view.pieces) == sorted(p for p in pieces if r in (p.src, p.dst)), r
        assert view.bcasts == [b for b in bcasts if r in dst.ranks or r == b.root or any(s == r for s, _ in b.gather)]
    stats = plan.stats()
    assert stats["path_stats"]["reshard"]["pieces"] == len(pieces)
    assert {k: v["tensors"] for k, v in stats["routes"].items()} == \
        {k: collections.Counter(plan.routes).get(k, 0) for k in ROUTES}


_SCRIPT = """
import json, sys
sys.path.insert(0, {tests!r})
from conftest import write_pair
from pathlib import Path
from reshard_cli import Plan
from reshard_cli.plan import cost
from reshard_cli.formats import load_pair
from reshard_cli.layouts.topology import Topology
src, dst = load_pair(*write_pair(Path({tmp!r}), {name!r}))
plan = cost.with_auto_routes(Plan(src, dst, Topology(name="t", ranks_per_domain={rpd}, links={links!r}),
                                  mode="auto"))
print(json.dumps([plan.class_routes.routes, [[p.tensor, p.src, p.dst, list(p.box.offsets), p.phase]
                                         for p in plan.rank_view({rank}).pieces]]))
"""


def test_every_process_computes_the_same_choice(tmp_path):
    """Two processes with different hash seeds (set and dict orders of str keys differ) agree exactly."""
    name, rpd, links = MIXED[0]
    out = []
    for seed in ("1", "2"):
        code = _SCRIPT.format(tests=str(ROOT / "tests"), tmp=str(tmp_path), name=name, rpd=rpd, links=links,
                              rank=2)
        env = dict(os.environ, PYTHONHASHSEED=seed)
        proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr
        out.append(json.loads(proc.stdout))
    assert out[0] == out[1]
    assert len(set(out[0][0])) > 1  # a mixed choice, so agreeing means something


def test_library_plan_auto(tmp_path):
    """`reshard_cli.Plan(mode="auto")` from library code, with a bundled topology name."""
    import reshard_cli

    plan = cost.with_auto_routes(reshard_cli.Plan.build(ROOT / "layouts/demo/train.yaml",
                                                        ROOT / "layouts/demo/infer.yaml", topology="dgx-h100",
                                                        mode="auto"))
    assert plan.mode == "auto" and len(plan.routes) == len(plan.src.manifest.tensors)
    assert set(plan.paths) <= {"reshard", "broadcast"}
    stats = plan.stats()
    assert stats["mode"] == "auto" and sum(v["bytes"] for v in stats["routes"].values()) == stats["bytes"]
    with pytest.raises(Exception, match="unknown mode"):
        reshard_cli.Plan(plan.src, plan.dst, mode="fastest")


@pytest.mark.parametrize("name,rpd,links", MIXED, ids=[m[0] for m in MIXED])
@pytest.mark.parametrize("mode", ["auto", "reshard"])
def test_model_loads_are_the_pieces(tmp_path, name, rpd, links, mode):
    """The cost model's per-rank bytes (from the classes' columns, walked without building pieces) equal the
    sums over the plan's pieces, kind by kind, for forward and direct routes alike; so do `stats()`'s."""
    import numpy as np

    src, dst = load_pair(*write_pair(tmp_path, name))
    plan = cost.with_auto_routes(Plan(src, dst, Topology(name="t", ranks_per_domain=rpd, links=links), mode=mode))
    model = cost.model_for(plan, cost.links_of(plan.topology)[0])
    model.saved_loads.clear()  # sum the rows afresh
    per = model.reshard_loads(plan.routes)
    item = plan.classes.itemsizes()
    dom = plan.classes.domains
    want = {k: (np.zeros(model.world), np.zeros(model.world)) for k in (Traffic.NET, Traffic.NVL0, Traffic.FWD)}
    for p in plan.pieces():
        kind = Traffic.FWD if p.phase else (Traffic.NET if dom[p.src] != dom[p.dst] else Traffic.NVL0)
        want[kind][0][p.src] += p.box.numel * item[p.tensor]
        want[kind][1][p.dst] += p.box.numel * item[p.tensor]
    for k, (sent, recv) in want.items():
        assert per is not None
        assert np.array_equal(per[k][0], sent) and np.array_equal(per[k][1], recv), k
    st = plan.stats()
    net_send = {r: v["send"] for r, v in st["rank_bytes"].items()}
    bcast_send = {}
    for b in plan.bcasts():  # stats() counts both paths' network bytes; take the broadcast path's out
        if b.root >= 0:
            for s, a in b.gather:
                if dom[s] != dom[b.root]:
                    bcast_send[s] = bcast_send.get(s, 0) + a.numel * item[b.tensor]
            bcast_send[b.root] = bcast_send.get(b.root, 0) + src.manifest.tensors[b.tensor].nbytes
    for r, v in net_send.items():
        assert v - bcast_send.get(r, 0) == want[Traffic.NET][0][r], r


def _refit_auto(rank, world, src_path, dst_path, rpd, links, bucket_bytes):
    """One rank of a gloo refit in mode auto (its own plan, as every process builds one), checked exactly."""
    import torch

    from reshard_cli.plan.schedule import TransferOptions
    from reshard_cli.transfer.engine import Engine
    from test_transport import local_shards, reference

    src, dst = load_pair(src_path, dst_path)
    ref = reference(src.manifest)
    plan = cost.with_auto_routes(Plan(src, dst, Topology(name="t", ranks_per_domain=rpd, links=links), mode="auto"))
    src_shards, dst_shards = local_shards(src, dst, rank, ref)
    engine = Engine(plan, rank, src_shards, dst_shards, options=TransferOptions(bucket_bytes=bucket_bytes))
    engine.setup_groups()
    engine.run_reshard()
    engine.run_broadcast()
    wrong = [src.manifest.tensors[t].name for t, sh in dst_shards.items()
             if not torch.equal(sh.data, ref[t][sh.box.slices()])]
    return wrong, sorted(collections.Counter(plan.routes).items())


@pytest.mark.parametrize("name,rpd,links", MIXED[:2], ids=[m[0] for m in MIXED[:2]])
def test_auto_refit_is_exact(tmp_path, name, rpd, links):
    """The transport runs auto's mixed routes (forward, direct, broadcast) exactly, every rank planning alone."""
    from dist_util import run_ranks

    src_path, dst_path = write_pair(tmp_path, name)
    src, dst = load_pair(src_path, dst_path)
    world = max(dst.ranks) + 1
    results = run_ranks(world, _refit_auto, str(src_path), str(dst_path), rpd, links, 256)
    assert all(not wrong for wrong, _routes in results.values()), results
    assert len({tuple(routes) for _w, routes in results.values()}) == 1  # every rank chose alike
    assert len(next(iter(results.values()))[1]) > 1  # and the routes are mixed
