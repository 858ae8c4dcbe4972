"""A destination fleet: its replicas read from the layout, what N separate refits would cost (domains cut at
replica boundaries), and the engine block's list of URLs. Single process, no engine."""
import pytest

from reshard_cli.errors import ConfigError
from reshard_cli.formats import load_pair
from reshard_cli.layouts.topology import Topology
from reshard_cli.plan.fleet import Fleet, fleet_figures, fleet_of, separate_topology
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
    from reshard_cli.engines.vllm.trainer import replica_bases

    class Client:
        def __init__(self, replicas=None):
            self.replicas = replicas

    _src, dst = _pair(tmp_path, "{dp: 4, tp: 1}")
    assert replica_bases([Client(2), Client(), Client(1)], dst) == [0, 2, 3]
    assert replica_bases([Client()], dst) == [0]  # one client without a count drives the whole layout
    with pytest.raises(ConfigError, match=r"the layout has 4 replica\(s\) \(dp 4\), the 2 engine client\(s\) drive "
                                          r"3 \(2 \+ 1\)"):
        replica_bases([Client(2), Client(1)], dst)
