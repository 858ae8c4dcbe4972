"""The cost model (`reshard_cli/cost.py`): hand-computed cases, monotonicity, lower bound <= prediction on every
bundled pair, and what `reshard plan --topology` prints and writes."""
import json
import os
import subprocess
import sys

import pytest

from conftest import ROOT
from reshard_cli.plan import cost
from reshard_cli.formats import load_pair
from reshard_cli.plan.planner import MODES, Plan
from reshard_cli.plan.terms import Traffic
from reshard_cli.layouts.topology import Topology, load_topology

MiB = 1 << 20
LINKS = {"network_gbps": 1.0, "nvlink_gbps": 10.0, "latency_us": 100.0}

BUNDLED = [
    ("layouts/demo/train.yaml", "layouts/demo/infer.yaml"),
    ("layouts/qwen3-30b-a3b/megatron-tp2-ep4-pp2.yaml", "layouts/qwen3-30b-a3b/vllm-tp4-dp4.yaml"),
    ("layouts/qwen3-235b-a22b/megatron-tp2-cp2-pp4-ep16.yaml", "layouts/qwen3-235b-a22b/vllm-tp8-dp8.yaml"),
    ("layouts/deepseek-v3/megatron-pp16-ep16.yaml", "layouts/deepseek-v3/vllm-tp32-dp8.yaml"),
    ("layouts/kimi-k2/megatron-pp16-ep16.yaml", "layouts/kimi-k2/vllm-tp16-dp8.yaml"),
    ("layouts/moe-2.4t/megatron-pp16-ep32.yaml", "layouts/moe-2.4t/vllm-tp16-dp16.yaml"),
    ("layouts/deepseek-v3/megatron-pp16-ep16.yaml", "layouts/deepseek-v3/vllm-tp16-dp16-fp8.yaml"),  # FP8 wire
]
TOPOLOGIES = ["layouts/topologies/dgx-h100.yaml", "layouts/topologies/gb200-nvl72.yaml"]
DEEPSEEK = BUNDLED[3]


def _pair(tmp_path, dst_mesh: str, dst_shard: str):
    """One float32 tensor of 1024 x 256 (1 MiB): src TP2 on ranks 0-1, dst on ranks 2-3."""
    (tmp_path / "m.yaml").write_text("name: one\ndtype: float32\ntensors:\n"
                                     "  - {name: layers.0.mlp.up_proj.weight, shape: [1024, 256]}\n")
    (tmp_path / "src.yaml").write_text("model: m.yaml\nmesh: {tp: 2}\nplacements:\n  - {match: '.', shard: {tp: 0}}\n")
    (tmp_path / "dst.yaml").write_text(f"model: m.yaml\nmesh: {dst_mesh}\nplacements:\n"
                                       f"  - {{match: '.'{dst_shard}}}\n")
    return load_pair(tmp_path / "src.yaml", tmp_path / "dst.yaml")


def _predict(src, dst, links=LINKS, rpd=2, mode="hybrid"):
    topo = Topology(name="t", ranks_per_domain=rpd, links=dict(links))
    return cost.predict(Plan(src, dst, topo, mode=mode))


def test_two_to_two_by_hand(tmp_path):
    # same TP2 boxes on both sides; domains {0,1} and {2,3}: each dst rank gets its 512 KiB over the network
    # from one source in one message.
    src, dst = _pair(tmp_path, "{tp: 2}", ", shard: {tp: 0}")
    pred = _predict(src, dst)
    half = 512 * 1024
    r = pred.modes["reshard"]
    assert r.network_s == pytest.approx(half / 1e9 + 100e-6, rel=1e-12)
    assert r.forward_s == 0 and r.nvlink0_s == 0
    assert r.seconds == pytest.approx(half / 1e9 + 100e-6, rel=1e-12)
    assert r.pipelined_seconds == pytest.approx(r.seconds, rel=1e-12)
    assert pred.modes["hybrid"].seconds == pytest.approx(r.seconds, rel=1e-12)  # up_proj takes the reshard path
    # broadcast: rank 0 gathers rank 1's half over NVLink (one message), then a ring {0, 2, 3}: the root is
    # alone in its domain, so one channel through its NIC (1 GB/s), 2 hops of latency.
    b = pred.modes["broadcast"]
    assert b.gather_s == pytest.approx(half / 10e9 + 100e-6, rel=1e-12)
    assert b.ring_s == pytest.approx(MiB / 1e9 + 2 * 100e-6, rel=1e-12)
    assert b.seconds == pytest.approx(half / 10e9 + 100e-6 + MiB / 1e9 + 200e-6, rel=1e-12)
    assert b.packs == 1 and b.ring_gbps == 1.0
    # lower bound: 1 MiB must enter domain 1 through 2 NICs (and leave domain 0 through 2)
    assert pred.bound.seconds == pytest.approx(MiB / 2e9, rel=1e-12)
    assert pred.bound.ingress_s == pytest.approx(MiB / 2e9, rel=1e-12)
    assert pred.bound.egress_s == pytest.approx(MiB / 2e9, rel=1e-12)
    assert pred.bound.seconds <= r.seconds


def test_forwards_by_hand(tmp_path):
    # dst replicates the tensor on ranks 2 and 3 (one domain): each source half is split between them
    # (256 KiB each over the network), then each forwards its 512 KiB to the other over NVLink.
    src, dst = _pair(tmp_path, "{dp: 2}", "")
    r = _predict(src, dst, mode="reshard").modes["reshard"]
    net = 512 * 1024 / 1e9 + 2 * 100e-6  # 2 messages: one from each source rank
    fwd = 512 * 1024 / 10e9 + 1 * 100e-6  # 1 message: both sub-pieces to the same peer in one bucket
    assert r.network_s == pytest.approx(net, rel=1e-12)
    assert r.forward_s == pytest.approx(fwd, rel=1e-12)
    assert r.seconds == pytest.approx(net + fwd, rel=1e-12)  # the time figure: phases add (an upper bound)
    assert r.pipelined_seconds == pytest.approx(max(net, fwd), rel=1e-12)
    pred = _predict(src, dst, mode="reshard")
    assert pred.bound.seconds == pytest.approx(MiB / 2e9, rel=1e-12)  # the whole tensor enters domain 1 once


def test_messages_follow_the_bucket(tmp_path):
    src, dst = _pair(tmp_path, "{tp: 2}", ", shard: {tp: 0}")
    topo = Topology(name="t", ranks_per_domain=2, links=dict(LINKS))
    plan = Plan(src, dst, topo, mode="reshard")
    small = cost.predict(plan, bucket_bytes=256 * 1024).modes["reshard"]  # 128 KiB messages: 4 per rank
    assert small.network_s == pytest.approx(512 * 1024 / 1e9 + 4 * 100e-6, rel=1e-12)


@pytest.fixture(scope="module")
def qwen30():
    return load_pair(*(ROOT / p for p in BUNDLED[1]))


def test_rank_bytes_agree_with_the_plan(qwen30):
    """The model's per-rank network bytes are the plan's own (`stats()["rank_bytes"]`), its in-domain bytes too."""
    src, dst = qwen30
    plan = Plan(src, dst, load_topology(ROOT / TOPOLOGIES[0]), mode="reshard")
    st = plan.stats()
    model = cost._Model(plan.classes, cost.links_of(plan.topology)[0], cost.DEFAULT_BUCKET_BYTES)
    per = model.reshard_loads(plan.routes)
    for r, v in st["rank_bytes"].items():
        assert (per[Traffic.NET][0][r], per[Traffic.NET][1][r]) == (v["send"], v["recv"]), r
    assert per[Traffic.NET][1].sum() == st["wire_bytes"] == st["min_wire_bytes"]
    assert per[Traffic.NVL0][1].sum() + per[Traffic.FWD][1].sum() == st["indomain_bytes"]


def test_more_bandwidth_less_time(qwen30):
    src, dst = qwen30
    topo = load_topology(ROOT / TOPOLOGIES[0])
    plan = Plan(src, dst, topo)
    base = cost.predict(plan)
    for change in ({"network_gbps": 100}, {"nvlink_gbps": 900}, {"latency_us": 1}):
        links = {**topo.links, **change}
        faster = cost.predict(plan, cost.with_measured_links(topo, **links))
        for m in MODES:
            assert faster.modes[m].seconds <= base.modes[m].seconds, (change, m)
            assert faster.modes[m].pipelined_seconds <= base.modes[m].pipelined_seconds, (change, m)
        if "network_gbps" in change:
            assert faster.bound.seconds == pytest.approx(base.bound.seconds / 2, rel=1e-9)
            assert faster.modes["reshard"].seconds < base.modes["reshard"].seconds
    slower = cost.predict(plan, cost.with_measured_links(topo, network_gbps=10, nvlink_gbps=100, latency_us=50))
    for m in MODES:
        assert slower.modes[m].seconds > base.modes[m].seconds


def test_measured_links_equal_a_yaml_topology(qwen30, tmp_path):
    src, dst = qwen30
    (tmp_path / "t.yaml").write_text("name: t\nranks_per_domain: 8\nlinks: {network_gbps: 3, nvlink_gbps: 7, "
                                     "latency_us: 20}\n")
    from_yaml = cost.predict(Plan(src, dst, load_topology(tmp_path / "t.yaml")))
    bare = Topology(name="t", ranks_per_domain=8)
    measured = cost.with_measured_links(bare, network_gbps=3, nvlink_gbps=7, latency_us=20)
    from_measured = cost.predict(Plan(src, dst, measured))
    assert from_yaml.to_json()["predicted_seconds"] == from_measured.to_json()["predicted_seconds"]
    assert cost.with_measured_links(bare, network_gbps=2).links == {"network_gbps": 2.0, "nvlink_gbps": 2.0,
                                                                     "latency_us": 0.0}


def test_no_links_no_prediction(qwen30):
    src, dst = qwen30
    bare = Topology(name="bare", ranks_per_domain=8)
    plan = Plan(src, dst, bare)
    assert cost.predict(plan) is None
    text, doc = cost.plan_prediction(plan)
    assert doc == {} and len(text.splitlines()) == 1 and "no links" in text
    assert cost.plan_prediction(Plan(src, dst)) == ("", {})  # no topology at all: nothing printed


_PREDICTED: dict = {}


def _predicted(pair, topology):
    """Every mode's prediction for a bundled pair (cached: the big pairs take seconds to plan)."""
    if (pair, topology) not in _PREDICTED:
        src, dst = load_pair(*(ROOT / p for p in pair))
        _PREDICTED[(pair, topology)] = cost.predict(Plan(src, dst, load_topology(ROOT / topology)))
    return _PREDICTED[(pair, topology)]


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=["dgx-h100", "gb200-nvl72"])
@pytest.mark.parametrize("pair", BUNDLED, ids=lambda p: p[1].split("/")[-2] + ("-fp8" if "fp8" in p[1] else ""))
def test_lower_bound_below_every_mode(pair, topology):
    pred = _predicted(pair, topology)
    for m, c in pred.modes.items():
        assert pred.bound.seconds <= c.pipelined_seconds * (1 + 1e-9) <= c.seconds * (1 + 1e-9), (m, c)
    # reshard mode moves exactly the minimum: its busiest network rank is at or above the ingress bound
    assert pred.modes["reshard"].network_s >= pred.bound.ingress_s * (1 - 1e-9)


@pytest.mark.parametrize("topology", TOPOLOGIES, ids=["dgx-h100", "gb200-nvl72"])
@pytest.mark.parametrize("pair", BUNDLED, ids=lambda p: p[1].split("/")[-2] + ("-fp8" if "fp8" in p[1] else ""))
def test_auto_never_slower_than_a_fixed_mode(pair, topology):
    """Mode auto's predicted seconds against the fixed modes' on every bundled pair and topology."""
    pred = _predicted(pair, topology)
    auto = pred.modes["auto"].seconds
    assert auto <= pred.modes["reshard"].seconds, (auto, pred.modes["reshard"].seconds)
    assert auto <= pred.modes["broadcast"].seconds, (auto, pred.modes["broadcast"].seconds)
    assert auto <= pred.modes["hybrid"].seconds, (auto, pred.modes["hybrid"].seconds)
    routes = pred.auto_routes
    assert sum(r["tensors"] for r in routes.values()) == len(load_pair(*(ROOT / p for p in pair))[0].manifest.tensors)


def test_deepseek_auto_within_1_3x_of_the_bound():
    """(1.15x while the shared experts were planned TP-sharded; vLLM keeps them whole on every rank of this
    DP + EP layout: the busiest source rank then sends 7.62 GB even with each piece split evenly over the ranks
    that hold it, 152 ms, 1.11x the domain-level bound, which lets a domain's ranks share out their sends.)"""
    pred = _predicted(DEEPSEEK, TOPOLOGIES[0])
    assert pred.modes["auto"].seconds <= 1.3 * pred.bound.seconds
    assert pred.modes["auto"].seconds < pred.modes["hybrid"].seconds / 10  # the old default: 15x the bound


def test_deepseek_reshard_within_1_5x_of_the_bound():
    pred = _predicted(DEEPSEEK, TOPOLOGIES[0])
    assert pred.bound.seconds > 0
    assert pred.modes["reshard"].seconds <= 1.5 * pred.bound.seconds
    assert "ingress" in pred.bound.resource


def _reshard(*args):
    env = dict(os.environ, CI="true", COLUMNS="200")
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-m", "reshard_cli", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def test_plan_json_keys(tmp_path):
    # the demo pair (4 ranks) with two ranks per domain: trainer and inference in different domains
    topo = tmp_path / "pairs.yaml"
    topo.write_text("name: pairs\nranks_per_domain: 2\nlinks: {network_gbps: 50, nvlink_gbps: 450, latency_us: 10}\n")
    out = tmp_path / "plan.json"
    p = _reshard("plan", "--src", BUNDLED[0][0], "--dst", BUNDLED[0][1], "--topology", topo, "--json", out)
    assert p.returncode == 0, p.stderr
    assert "  predicted     pairs links:" in p.stdout
    assert "  lower bound   " in p.stdout and "this plan     auto:" in p.stdout  # auto: the default mode
    doc = json.loads(out.read_text())
    assert set(doc["predicted_seconds"]) == set(MODES)
    assert all(v > 0 for v in doc["predicted_seconds"].values())
    assert 0 < doc["lower_bound_seconds"] <= min(doc["predicted_seconds"].values())
    assert doc["prediction"]["links"] == {"network_gbps": 50.0, "nvlink_gbps": 450.0, "latency_us": 10.0}
    assert doc["params"] > 0  # the plan's own keys are still there


def test_plan_without_links_says_so_in_one_line(tmp_path):
    topo = tmp_path / "bare.yaml"
    topo.write_text("name: bare\nranks_per_domain: 2\n")
    out = tmp_path / "plan.json"
    p = _reshard("plan", "--src", BUNDLED[0][0], "--dst", BUNDLED[0][1], "--topology", topo, "--json", out)
    assert p.returncode == 0, p.stderr
    lines = [x for x in p.stdout.splitlines() if "predicted" in x or "lower bound" in x]
    assert lines == ["  predicted     none: topology bare has no links: figures (network_gbps, nvlink_gbps, "
                     "latency_us)"]
    doc = json.loads(out.read_text())
    assert "predicted_seconds" not in doc and "lower_bound_seconds" not in doc
    p = _reshard("plan", "--src", BUNDLED[0][0], "--dst", BUNDLED[0][1])
    assert p.returncode == 0 and "predicted" not in p.stdout


def test_bundled_topologies_have_links():
    for t in TOPOLOGIES:
        links, why = cost.links_of(load_topology(ROOT / t))
        assert links is not None, why
        assert links.network_gbps == 50 and links.latency_us == 10
