"""`format: vllm` without vLLM: the expansion's rules, vLLM's own split rules, and every bad input as one line.
(tests/test_vllm_format.py proves the storage against vLLM's loader.)"""
import pytest

from reshard_cli.errors import ConfigError
from reshard_cli.formats import vllm
from reshard_cli.base.geometry import chunk_range
from reshard_cli.layouts.layout import expert_owner
from reshard_cli.formats import load_layout


def layout(tmp_path, body, name="infer.yaml"):
    p = tmp_path / name
    p.write_text(body)
    return load_layout(p, first_rank=0)


def test_padded_chunks_follow_vllm_vocab_split():
    # vLLM: pad 1000 rows to 1024, 512 per TP2 rank; the second rank holds 488 real rows
    assert [chunk_range(1000, 2, i, pad=64) for i in range(2)] == [(0, 512), (512, 488)]
    # DTensor semantics stay the default
    assert [chunk_range(1000, 3, i) for i in range(3)] == [(0, 334), (334, 334), (668, 332)]
    assert [chunk_range(10, 4, i, pad=64) for i in range(4)] == [(0, 10), (10, 0), (10, 0), (10, 0)]


def test_vllm_pipeline_split_matches_get_pp_indices():
    # vLLM's rule: the remainder goes to the stages before the last, last-but-one first
    assert vllm.vllm_pp_layers(4, 2) == [2, 2]
    assert vllm.vllm_pp_layers(5, 2) == [3, 2]
    assert vllm.vllm_pp_layers(10, 4) == [2, 3, 3, 2]
    assert vllm.vllm_pp_layers(61, 4) == [15, 15, 16, 15]


def test_expert_owners():
    assert [expert_owner(e, 8, 4, "linear") for e in range(8)] == [0, 0, 1, 1, 2, 2, 3, 3]
    assert [expert_owner(e, 10, 4, "balanced") for e in range(10)] == [0, 0, 0, 1, 1, 1, 2, 2, 3, 3]
    assert [expert_owner(e, 8, 4, "round_robin") for e in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_qwen3_moe_tp8_replicates_kv_heads_and_pads_vocab(tmp_path):
    lay = layout(tmp_path, "model: qwen3-30b-a3b\nformat: vllm\nmesh: {dp: 2, tp: 8}\n")
    man = lay.manifest
    k = man.index("model.layers.0.self_attn.k_proj.weight")
    hd = man.config["head_dim"]
    # 4 kv heads over 8 TP ranks: ranks 0,1 hold head 0; ranks 2,3 head 1; ... (vLLM: head r // 2)
    assert [lay.placements[k].box_of(man.tensors[k].shape, r).offsets[0] for r in range(8)] == \
        [h * hd for h in (0, 0, 1, 1, 2, 2, 3, 3)]
    st = {et.name: et for et in vllm.storage(lay, 3)}
    qkv = st["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv.shape == (32 * hd // 8 + 2 * hd, 2048)  # this rank's q heads + one k and one v head
    w13 = st["model.layers.0.mlp.experts.routed_experts.w13_weight"]
    assert w13.shape == (128, 2 * 768 // 8, 2048)  # all experts, TP-sharded (no expert parallelism)
    assert st["model.embed_tokens.weight"].shape == (151936 // 8, 2048)
    summary = vllm.summary(lay)
    assert summary["direct_bytes"] == summary["checkpoint_bytes"] > 0


def test_expert_parallel_round_robin_needs_grouped_routing(tmp_path):
    # Qwen3-MoE has no expert groups: vLLM falls back to linear placement, and so does the layout
    lay = layout(tmp_path, "model: qwen3-30b-a3b\nformat: vllm\nmesh: {tp: 4}\n"
                           "engine: {expert_parallel: true, expert_placement: round_robin}\n")
    st = {et.name: et for et in vllm.storage(lay, 1)}
    w2 = st["model.layers.0.mlp.experts.routed_experts.w2_weight"]
    assert w2.shape[0] == 32 and [int(lay.manifest.tensors[v.tensor].name.split(".")[5]) for v in w2.views[:2]] \
        == [32, 33]
    assert lay.expert_order == "balanced"
    # DeepSeek-V3 routes by groups (n_group 8): round robin holds
    ds = layout(tmp_path, "model: deepseek-v3\nformat: vllm\nmesh: {tp: 8}\n"
                          "engine: {expert_parallel: true, expert_placement: round_robin}\n", "ds.yaml")
    assert ds.expert_order == "round_robin"


@pytest.mark.parametrize("body,key,text", [
    ("model: qwen3-30b-a3b\nformat: vllm\nmesh: {tp: 4}\nplacements: []\n", "placements", "derived"),
    ("model: qwen3-30b-a3b\nformat: vllm\nmesh: {tp: 4, dp: 2}\n", "mesh", "dp, pp, tp in that order"),
    ("model: qwen3-30b-a3b\nformat: vllm\nmesh: {ep: 4}\n", "mesh", "dp, pp, tp"),
    ("model: qwen3-30b-a3b\nformat: vllm\nmesh: {tp: 3}\n", "mesh.tp", "does not divide the model's 32 attention"),
    ("model: qwen3-30b-a3b\nformat: vllm\nmesh: {tp: 2}\nengine: {expert_paralel: true}\n", "engine.expert_paralel",
     "unknown key"),
    ("model: qwen3-30b-a3b\nformat: vllm\nmesh: {tp: 2}\nengine: {expert_placement: random}\n",
     "engine.expert_placement", "linear or round_robin"),
    ("model: qwen3-30b-a3b\nformat: sglang\nmesh: {tp: 2}\n", "format", "unknown format"),
    ("model: qwen3-30b-a3b\nformat: vllm\nmesh: {pp: 2}\nengine: {expert_parallel: true}\n",
     "engine.expert_parallel", "neither"),
    ("model: qwen3-30b-a3b\nmesh: {tp: 2}\nengine: {expert_parallel: true}\n", "engine", "format: hf"),
    ("model: qwen3-30b-a3b\nformat: vllm\nmesh: {tp: 2}\nengine: {kind: sglang}\n", "engine.kind", "vllm engine"),
    ("model: qwen3-30b-a3b\nformat: vllm\nmesh: {tp: 2}\nengine: {url: 'localhost:8000'}\n", "engine.url",
     "http(s) URL"),
    ("model: qwen3-30b-a3b\nformat: vllm\nmesh: {tp: 2}\nengine: {all2all_backend: deepep}\n",
     "engine.all2all_backend", "unknown all2all backend 'deepep' (vLLM's: allgather_reducescatter, deepep_high"),
    ("model: qwen3-30b-a3b\nformat: vllm\nmesh: {tp: 2}\nengine: {all2all_backend: [moonep]}\n",
     "engine.all2all_backend", "unknown all2all backend ['moonep']"),
])
def test_bad_vllm_layouts_are_one_line(tmp_path, body, key, text):
    with pytest.raises(ConfigError) as info:
        layout(tmp_path, body)
    msg = str(info.value)
    assert f": {key}: " in msg and text in msg and "\n" not in msg, msg


def test_the_all2all_backend_decides_where_shared_experts_are_whole(tmp_path):
    """DeepSeek-V3's shared experts with experts over dp 2 x tp 4: whole on every rank where vLLM runs MoE
    sequence-parallel (its default backend, at any number of stages), TP-sharded under moonep; and a live
    engine whose backend disagrees with the layout's is named before anything moves."""
    from types import SimpleNamespace

    from reshard_cli.engines.vllm.worker import check_deployment

    name = "model.layers.3.mlp.shared_experts.up_proj.weight"
    placed = {}
    for key, mesh, engine in [("default", "{dp: 2, tp: 4}", ""), ("pp", "{dp: 2, pp: 2, tp: 4}", ""),
                              ("moonep", "{dp: 2, tp: 4}", ", all2all_backend: moonep")]:
        lay = layout(tmp_path, f"model: deepseek-v3\nformat: vllm\nmesh: {mesh}\n"
                               f"engine: {{expert_parallel: true{engine}}}\n", f"{key}.yaml")
        placed[key] = lay.placements[lay.manifest.index(name)].describe()
    assert placed == {"default": "default[replicate]", "pp": "default[pp=0]", "moonep": "default[tp:S(0)]"}
    pc = SimpleNamespace(tensor_parallel_size=4, pipeline_parallel_size=1, enable_expert_parallel=True,
                         all2all_backend="moonep")
    check_deployment(lay, pc, worker=0)
    with pytest.raises(ConfigError, match=r"^dst: the engine runs MoE all2all backend 'deepep_low_latency' "
                                          r"\(sequence-parallel\), the layout 'moonep' \(not sequence-parallel\): "
                                          r"set `engine.all2all_backend: deepep_low_latency` in it$"):
        check_deployment(lay, SimpleNamespace(**{**vars(pc), "all2all_backend": "deepep_low_latency"}), worker=0)


def test_vllm_format_needs_a_config(tmp_path):
    (tmp_path / "m.yaml").write_text("tensors:\n  - {name: model.embed_tokens.weight, shape: [8, 4]}\n")
    with pytest.raises(ConfigError, match="needs the model's HF config"):
        layout(tmp_path, "model: m.yaml\nformat: vllm\nmesh: {tp: 2}\n")


def test_bind_names_the_first_mismatch(tmp_path):
    import torch

    lay = layout(tmp_path, "model: qwen3-0.6b\nformat: vllm\nmesh: {tp: 2}\n")
    params = {et.name: torch.zeros(et.shape, dtype=torch.bfloat16) for et in vllm.storage(lay, 0)}
    views = vllm.bind(params, lay, 0)
    assert set(views) == {lay.manifest.tensors[t].name for t, _box in lay.held(0)}  # every held tensor, a view
    qkv = params["model.layers.0.self_attn.qkv_proj.weight"]
    k = views["model.layers.0.self_attn.k_proj.weight"]
    assert k.data_ptr() > qkv.data_ptr() and k.untyped_storage().data_ptr() == qkv.untyped_storage().data_ptr()
    params["model.layers.0.self_attn.qkv_proj.weight"] = torch.empty(0, dtype=torch.bfloat16)  # CPU repack
    with pytest.raises(ConfigError, match="qkv_proj.weight is \\[0\\].*kernel format"):
        vllm.bind(params, lay, 0)
    del params["model.layers.0.self_attn.qkv_proj.weight"]
    with pytest.raises(ConfigError, match="no parameter 'model.layers.0.self_attn.qkv_proj.weight'"):
        vllm.bind(params, lay, 0)


def test_a_running_engine_is_not_started_by_reshard_run(tmp_path):
    """`engine: {url}`: the layout keeps the URL, and a run starts the source ranks only."""
    from reshard_cli.formats import load_pair
    from reshard_cli.transfer.dryrun import world_size

    (tmp_path / "train.yaml").write_text("model: qwen3-0.6b\nmesh: {fsdp: 4}\n"
                                         "placements:\n  - {match: '.', shard: {fsdp: 0}}\n")
    (tmp_path / "infer.yaml").write_text("model: qwen3-0.6b\nformat: vllm\nmesh: {tp: 2}\n"
                                         "engine: {kind: vllm, url: 'http://10.0.0.5:8000/'}\n")
    src, dst = load_pair(tmp_path / "train.yaml", tmp_path / "infer.yaml")
    assert dst.engine_url == "http://10.0.0.5:8000" and dst.ranks == (4, 5)
    assert world_size(src, dst) == 4
    (tmp_path / "infer.yaml").write_text("model: qwen3-0.6b\nformat: vllm\nmesh: {tp: 2}\n")
    assert world_size(tmp_path / "train.yaml", tmp_path / "infer.yaml") == 6


def test_a_new_format_is_its_module_and_one_registry_line(tmp_path, monkeypatch):
    """The registry is the only place that knows the formats: a format registered there (here a toy one that
    shards every matrix over tp and owns a `toy:` key) is loaded, expanded, summarised and bound like the
    built-in ones, and its key is refused on another format's layout."""
    import torch

    from reshard_cli import formats
    from reshard_cli.formats.base import Format

    def expand(doc, manifest, file):
        out = {k: v for k, v in doc.items() if k != "toy"}
        out["placements"] = [{"match": r"proj\.weight$", "shard": {"tp": doc["toy"]["dim"]}}]
        return out

    def bind(params, layout, rank, casts=None):
        return {name.removeprefix("toy."): p for name, p in params.items()}

    toy = Format(name="toy", description="a test format", keys={"toy": "holds the toy's split"}, expand=expand,
                 bind=bind, summary=lambda layout: {"format": "toy", "rank": layout.ranks[0]})
    monkeypatch.setitem(formats.FORMATS, "toy", toy)
    monkeypatch.setitem(formats._OWNED, "toy", toy)
    lay = layout(tmp_path, "model: qwen3-0.6b\nformat: toy\nmesh: {tp: 2}\ntoy: {dim: 1}\n")
    q = lay.manifest.index("model.layers.0.self_attn.q_proj.weight")
    assert lay.format == "toy" and lay.placements[q].shard == (1,)
    assert formats.summary(lay) == {"format": "toy", "rank": 0}
    assert formats.get("toy").bind({"toy.a": torch.ones(1)}, lay, 0).keys() == {"a"}
    with pytest.raises(ConfigError, match=r"`toy:` holds the toy's split; it needs `format: toy`"):
        layout(tmp_path, "model: qwen3-0.6b\nmesh: {tp: 2}\ntoy: {dim: 0}\n", name="hf.yaml")
    with pytest.raises(ConfigError, match=r"unknown format 'toys' \(formats: hf, vllm, megatron, toy\)"):
        layout(tmp_path, "model: qwen3-0.6b\nformat: toys\nmesh: {tp: 2}\n", name="bad.yaml")
    with pytest.raises(ConfigError, match="cannot derive a layout from a running model"):
        formats.live_layout("toy", None, "qwen3-0.6b")


def test_stage_mb_is_checked_and_resolved_in_one_place(tmp_path):
    """Every way a user gives what an engine worker stages at once (a layout's `engine: {stage_mb}`,
    `reshard run --stage-mb`, `Refit(stage_mb=)`, the engine's init info) goes through one check, refused in one
    line naming where it came from, and resolves by one rule: given, else the layout's, else the default."""
    from pathlib import Path

    from reshard_cli.formats.base import checked_stage_mb
    from reshard_cli.plan.groups import DEFAULT_STAGE_MB, stage_budget_mb, stage_bytes
    from reshard_cli.transfer.run import RunOptions

    assert checked_stage_mb(None) is None and checked_stage_mb(0) == 0.0 and checked_stage_mb(3) == 3.0
    for bad in (-1, -0.5, float("nan"), True, "64"):
        with pytest.raises(ConfigError, match=r"stage_mb: must be >= 0 MiB \(0: the whole model at once\)"):
            checked_stage_mb(bad)
    with pytest.raises(ConfigError, match=r"infer\.yaml.*engine\.stage_mb: must be >= 0 MiB"):
        layout(tmp_path, "model: qwen3-0.6b\nformat: vllm\nmesh: {tp: 2}\nengine: {stage_mb: -1}\n")
    with pytest.raises(ConfigError, match=r"--stage-mb: must be >= 0 MiB"):
        RunOptions(src=Path("a.yaml"), dst=Path("b.yaml"), stage_mb=-2).validated()
    plain = layout(tmp_path, "model: qwen3-0.6b\nformat: vllm\nmesh: {tp: 2}\n")
    given = layout(tmp_path, "model: qwen3-0.6b\nformat: vllm\nmesh: {tp: 2}\nengine: {stage_mb: 0}\n", "e.yaml")
    assert stage_budget_mb(plain) == DEFAULT_STAGE_MB and stage_budget_mb(given) == 0.0
    assert stage_budget_mb(given, 5) == 5.0 and stage_bytes(1.5) == 3 << 19
    with pytest.raises(ConfigError, match="stage_mb: must be >= 0 MiB"):
        stage_budget_mb(given, -3)
