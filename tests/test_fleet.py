"""A destination fleet: its replicas read from the layout, what N separate refits would cost (domains cut at
replica boundaries), the engine block's list of URLs, the layout's replica N times, and what losing one replica
mid-refit costs. Single process, no engine."""
import pytest

from reshard_cli.errors import ConfigError
from reshard_cli.formats import load_layout, load_pair, with_replicas
from reshard_cli.layouts.topology import Topology
from reshard_cli.plan.cost import with_auto_routes
from reshard_cli.plan.fleet import Fleet, fleet_figures, fleet_of, loss_figures, separate_topology
from reshard_cli.plan.fp8 import wire_of
from reshard_cli.plan.groups import stage_groups
from reshard_cli.plan.planner import Plan

CONFIG = '{"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": 1000, "hidden_size": 128, ' \
         '"intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, ' \
         '"head_dim": 64, "tie_word_embeddings": false}'


def _pair(tmp_path, mesh: str, engine: str = ""):
    (tmp_path / "config.json").write_text(CONFIG)
    (tmp_path / "train.yaml").write_text("model: config.json\nmesh: {fsdp: 2}\nplacements:\n"
                                         "  - {match: '.', shard: {fsdp: 0}}\n")
    (tmp_path / "infer.yaml").write_text(f"model: config.json\nformat: vllm\nmesh: {mesh}\n{engine}")
    return load_pair(tmp_path / "train.yaml", tmp_path / "infer.yaml")


def test_replicas_are_the_dp_coordinates(tmp_path):
    _src, dst = _pair(tmp_path, "{dp: 4, tp: 2}")
    fleet = fleet_of(dst)
    assert fleet == Fleet(4, 2)
    assert [fleet.replica_of(i) for i in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert fleet.ranks_of(dst, 1) == dst.ranks[2:4]
    assert fleet_of(_pair(tmp_path, "{tp: 2}")[1]) == Fleet(1, 2)


def test_separate_refits_cost_n_times_and_the_fleet_once(tmp_path):
    """Four TP2 replicas in one domain: one refit sends each byte once into it; four separate refits (domains cut
    at replica boundaries) send it four times; the broadcast baseline more still."""
    src, dst = _pair(tmp_path, "{dp: 4, tp: 2}")
    topo = Topology(name="one", domains=(tuple(dst.ranks),))
    cut = separate_topology(topo, dst, fleet_of(dst))
    assert cut.domains == tuple(tuple(dst.ranks[i:i + 2]) for i in range(0, 8, 2))
    figures = fleet_figures(Plan(src, dst, topo, mode="reshard"), fleet_of(dst))
    nbytes = src.manifest.nbytes
    assert figures["wire_bytes"] == figures["min_wire_bytes"] == nbytes
    assert figures["separate_refits_wire_bytes"] == 4 * nbytes
    assert figures["broadcast_wire_bytes"] > figures["wire_bytes"]
    assert figures["indomain_bytes"] > 0 and figures["replicas"] == 4 and figures["workers_per_replica"] == 2


def test_engine_urls(tmp_path):
    _src, dst = _pair(tmp_path, "{dp: 2, tp: 1}", "engine: {url: ['http://a:8000/', 'http://b:8000']}\n")
    assert dst.engine_urls == ("http://a:8000", "http://b:8000")
    assert dst.engine_url == "http://a:8000, http://b:8000"
    _src, one = _pair(tmp_path, "{tp: 1}", "engine: {url: 'http://a:8000'}\n")
    assert one.engine_urls == ("http://a:8000",)
    with pytest.raises(ConfigError, match="engine.url.*listed twice"):
        _pair(tmp_path, "{dp: 2, tp: 1}", "engine: {url: ['http://a:8000', 'http://a:8000/']}\n")
    with pytest.raises(ConfigError, match="engine.url.*or a list of them"):
        _pair(tmp_path, "{dp: 2, tp: 1}", "engine: {url: ['http://a:8000', 7]}\n")


def test_clients_must_cover_the_layouts_replicas(tmp_path):
    pytest.importorskip("vllm", reason="the trainer engine needs vLLM")
    from reshard_cli.engines.fleet.replicas import replica_bases

    class Client:
        def __init__(self, replicas=None):
            self.replicas = replicas

    _src, dst = _pair(tmp_path, "{dp: 4, tp: 1}")
    assert replica_bases([Client(2), Client(), Client(1)], dst) == [0, 2, 3]
    assert replica_bases([Client()], dst) == [0]  # one client without a count drives the whole layout
    with pytest.raises(ConfigError, match=r"the layout has 4 replica\(s\) \(dp 4\), the 2 engine client\(s\) drive "
                                          r"3 \(2 \+ 1\)"):
        replica_bases([Client(2), Client(1)], dst)


# ---------------------------------------------------------------------------------- N replicas; losing one

LAYERS4 = CONFIG.replace('"num_hidden_layers": 2', '"num_hidden_layers": 4')
# two source replicas (dp) of an FSDP2 trainer: a broadcast's root alternates between them
TRAIN_DP = "model: config.json\nmesh: {dp: 2, fsdp: 2}\nplacements:\n  - {match: '.', shard: {fsdp: 0}}\n"


FP8_LAYERS4 = LAYERS4[:-1] + ', "quantization_config": {"quant_method": "fp8", "fmt": "e4m3", ' \
    '"activation_scheme": "dynamic", "weight_block_size": [128, 128]}}'


def _fleet_files(tmp_path, replicas: int, stage_mb: float = 0.3, fp8: bool = False):
    """A 4-layer model from a dp2 x fsdp2 trainer into `replicas` TP2 replicas, written out by hand: small
    staging groups (a layer or two each). `fp8`: into block-FP8 TP1 replicas (FSDP's 128-row halves of the
    256-row projections hold whole blocks, its 64-row halves of k/v_proj cut them)."""
    (tmp_path / "config.json").write_text(FP8_LAYERS4 if fp8 else LAYERS4)
    (tmp_path / "train.yaml").write_text(TRAIN_DP)
    infer = tmp_path / f"infer-dp{replicas}.yaml"
    engine = f"{{stage_mb: {stage_mb}, quantization: fp8}}" if fp8 else f"{{stage_mb: {stage_mb}}}"
    infer.write_text(f"model: config.json\nformat: vllm\nmesh: {{dp: {replicas}, tp: {1 if fp8 else 2}}}\n"
                     f"engine: {engine}\n")
    return tmp_path / "train.yaml", infer


def _boxes(layout) -> list:
    return [[(b, tuple(rs)) for b, rs in p.boxes(t.shape)] for t, p in zip(layout.manifest.tensors, layout.placements)]


def test_with_replicas_is_the_layout_written_with_that_dp(tmp_path):
    """The dst layout's replica N times (`formats.with_replicas`) is the layout one would write with `dp: N`:
    the same placements on the same ranks, numbered after the source's; a layout without dp is one replica."""
    train, infer4 = _fleet_files(tmp_path, 4)
    _train, infer2 = _fleet_files(tmp_path, 2)
    src, dst4 = load_pair(train, infer4)
    grown = with_replicas(dst4, 2, after=src)
    written = load_pair(train, infer2)[1]
    assert grown.ranks == written.ranks == tuple(range(4, 8))
    assert _boxes(grown) == _boxes(written)
    assert fleet_of(grown) == Fleet(2, 2) and grown.name == "infer-dp4 as 2 replicas"
    assert with_replicas(dst4, 4, after=src).name == "infer-dp4"  # as many as it has: its own name
    _src, one = _pair(tmp_path, "{tp: 2}")  # no dp: the whole layout is the replica
    three = with_replicas(one, 3)
    assert fleet_of(three) == Fleet(3, 2) and three.ranks == tuple(range(one.ranks[0], one.ranks[0] + 6))


def test_with_replicas_refuses_a_layout_whose_replica_is_unclear(tmp_path):
    (tmp_path / "config.json").write_text(CONFIG)
    cases = {"late-dp.yaml": "mesh: {tp: 2, dp: 2}\nplacements:\n  - {match: 'proj', shard: {tp: 0}}\n",
             "some-dp.yaml": "meshes:\n  a: {dp: 2, tp: 2}\n  b: {ep: 4}\nplacements:\n"
                             "  - {match: 'proj', mesh: a, shard: {tp: 0}}\n"}
    for name, body in cases.items():
        (tmp_path / name).write_text("model: config.json\n" + body)
        layout = load_layout(tmp_path / name)
        with pytest.raises(ConfigError, match=f"{name}.*cannot tell the replica"):
            with_replicas(layout, 3)
    _src, dst = _pair(tmp_path, "{dp: 2, tp: 2}")
    with pytest.raises(ConfigError, match="at least one replica"):
        with_replicas(dst, 0)


def _wire(plan) -> int:
    """The plan's network bytes as they travel (into a block-FP8 engine, FP8 where the senders quantize)."""
    return plan.stats(wire=wire_of(plan))["wire_bytes"]


def _truth(src, survivors, groups, topology, mode) -> list[int]:
    """Ground truth: each of the survivors' staging groups planned on its own into them (the planner on the two
    layouts' subsets, as a refit in groups builds its parts); lost in the fleet's group g, the survivors are
    sent their groups from the first one holding a tensor the fleet's groups 0..g-1 did not commit."""
    mine = stage_groups(survivors)
    wires = [_wire(with_auto_routes(Plan(src.subset(g.tensors), survivors.subset(g.tensors), topology, mode=mode)))
             for g in mine]
    out = []
    for g in range(len(groups)):
        committed = {t for done in groups[:g] for t in done.tensors}
        first = next((i for i, m in enumerate(mine) if not set(m.tensors) <= committed), len(mine) - 1)
        out.append(sum(wires[first:]))
    return out


LINKS = {"network_gbps": 25.0, "nvlink_gbps": 400.0, "latency_us": 30.0}


@pytest.mark.parametrize("mode,links", [("reshard", {}), ("hybrid", {}), ("auto", {}), ("auto", LINKS),
                                        ("broadcast", {})])
def test_losing_a_replica_resends_what_the_survivors_plans_send(tmp_path, mode, links):
    """`loss_figures` against the planner itself: losing one of 3 replicas in staging group g costs the wire of
    groups g..end, each planned on its own into a 2-replica layout written by hand."""
    train, infer3 = _fleet_files(tmp_path, 3)
    _train, infer2 = _fleet_files(tmp_path, 2)
    src, dst3 = load_pair(train, infer3)
    survivors = load_pair(train, infer2)[1]
    # trainer replica 0 shares a domain with the first replica's ranks; replica 1 is alone
    topo = Topology(name="mixed", domains=((0, 1, 4, 5), (2, 3), (6, 7), (8, 9)), links=links)
    groups = stage_groups(dst3)
    assert len(groups) >= 3
    loss = loss_figures(with_auto_routes(Plan(src, dst3, topo, mode=mode)), with_replicas(dst3, 2, after=src),
                        groups, stage_groups(survivors))
    truth = _truth(src, survivors, groups, topo, mode)
    assert loss["resent_bytes_by_group"] == truth
    assert loss["resent_bytes_first_group"] == truth[0] and loss["resent_bytes_last_group"] == truth[-1]
    assert loss["resent_bytes_mean"] == pytest.approx(sum(truth) / len(truth))
    assert loss["groups"] == len(groups) and loss["replicas_after"] == 2
    whole = _wire(with_auto_routes(Plan(src, survivors, topo, mode=mode)))
    assert loss["survivors_wire_bytes"] == whole
    assert truth[0] > truth[-1] > 0
    if links:  # the cost model chooses each group's routes from that group's traffic: here not as for the whole
        assert stage_groups(survivors) == groups  # the same groups here: each one's own wire is truth's step
        own = [truth[g] - (truth[g + 1] if g + 1 < len(truth) else 0) for g in range(len(truth))]
        assert with_auto_routes(Plan(src, survivors, topo, mode=mode)).group_wire_bytes(
            [g.tensors for g in groups]) != own
    if mode == "broadcast":  # a broadcast's root follows its place in its group's plan, not in the whole
        assert truth[0] != whole  # model's: in groups, the survivors are sent another amount than in one piece


@pytest.mark.parametrize("mode,links", [("reshard", {}), ("hybrid", {}), ("auto", LINKS)])
def test_an_fp8_fleet_weighs_the_bytes_that_travel(tmp_path, mode, links):
    """Into block-FP8 replicas the fleet's and the survivors' figures are the FP8 wire's (`plan.fp8.on_wire`),
    each against the planner itself; only the gather->broadcast baseline stays in BF16."""
    from reshard_cli.plan.fp8 import on_wire

    train, infer3 = _fleet_files(tmp_path, 3, fp8=True)
    _train, infer2 = _fleet_files(tmp_path, 2, fp8=True)
    src, dst3 = load_pair(train, infer3)
    survivors = load_pair(train, infer2)[1]
    topo = Topology(name="mixed", domains=((0, 1, 4), (2, 3), (5,), (6,)), links=links)
    plan = with_auto_routes(Plan(src, dst3, topo, mode=mode))
    assert wire_of(plan) is not None
    stats = on_wire(plan)
    figures = fleet_figures(plan, fleet_of(dst3))
    assert figures["wire_bytes"] == stats["wire_bytes"] < stats["bf16_wire_bytes"]
    assert figures["min_wire_bytes"] == stats["min_wire_bytes"] < stats["bf16_min_wire_bytes"]
    assert figures["broadcast_wire_bytes"] == plan.stats()["broadcast_wire_bytes"]
    alone = with_auto_routes(Plan(src, dst3, separate_topology(topo, dst3, fleet_of(dst3)), mode=mode))
    assert figures["separate_refits_wire_bytes"] == _wire(alone)
    groups = stage_groups(dst3)
    loss = loss_figures(plan, with_replicas(dst3, 2, after=src), groups, stage_groups(survivors))
    assert loss["resent_bytes_by_group"] == _truth(src, survivors, groups, topo, mode)
    whole = with_auto_routes(Plan(src, survivors, topo, mode=mode))
    assert loss["survivors_wire_bytes"] == _wire(whole) < whole.stats()["wire_bytes"]


def test_group_wire_bytes_of_every_tensor_is_the_plans_wire(tmp_path):
    train, infer3 = _fleet_files(tmp_path, 3)
    src, dst = load_pair(train, infer3)
    topo = Topology(name="mixed", domains=((0, 1, 4, 5), (2, 3), (6, 7), (8, 9)))
    for mode in ("reshard", "hybrid", "broadcast"):
        plan = Plan(src, dst, topo, mode=mode)
        assert plan.group_wire_bytes([range(len(src.manifest.tensors))]) == [plan.stats()["wire_bytes"]]


def test_a_resumed_refit_starts_at_the_first_layer_not_committed_in_its_own_groups():
    """The survivors of a fleet may group the layers otherwise (experts spread over fewer replicas): the resume
    point travels as a layer, and each side starts at its own first group holding it, sending a committed
    layer again rather than skipping one that is not."""
    from reshard_cli.plan.groups import Group, resume_group, resume_layer

    def g(layers, outside=False):
        return Group(tensors=(), layers=tuple(layers), outside=outside, nbytes=0)
    fine = [g([], True), g([0]), g([1]), g([2]), g([3])]
    coarse = [g([0, 1], True), g([2, 3])]
    assert resume_layer([]) is None and resume_group(fine, None) == 0
    assert resume_layer(fine[:1]) == 0 and resume_group(fine, 0) == 1  # only the outside tensors committed
    assert resume_layer(coarse[:1]) == 2 and resume_group(fine, 2) == 3  # coarse -> fine: layers 0-1 kept
    assert resume_layer(fine[:3]) == 2 and resume_group(coarse, 2) == 1
    assert resume_layer(fine[:2]) == 1 and resume_group(coarse, 1) == 0  # layer 0 is sent again, 1 is not skipped
    assert resume_layer(fine) == 4 and resume_group(fine, 4) == 4  # all committed: the last group runs again
