"""Layout and topology YAML: good layouts resolve to the right boxes; bad ones give one-line errors that name
the file, the key and (where there is one) the line: `file.yaml:N: key: message`."""
import re
import textwrap

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset

from conftest import ROOT, SMALL_MODEL
from reshard_cli.errors import ConfigError
from reshard_cli.formats import load_layout, load_pair
from reshard_cli.layouts.topology import load_topology


def write(tmp_path, name, body, model=SMALL_MODEL):
    """Write `model.yaml` and the layout `name` (first line of `body` is line 1)."""
    (tmp_path / "model.yaml").write_text(model)
    path = tmp_path / name
    path.write_text(textwrap.dedent(body).lstrip("\n"))
    return path


def expect_error(fn, path, *, key=None, line=None, contains=()):
    """`fn()` raises one ConfigError whose one-line message starts with `path:line: key: ` (line and key
    checked when given; without `line` a line number is allowed but not required)."""
    with pytest.raises(ConfigError) as info:
        fn()
    err, msg = info.value, str(info.value)
    assert "\n" not in msg, msg
    where = re.escape(str(path)) + (f":{line}" if line is not None else r"(:\d+)?")
    assert re.match(where + ": ", msg), msg
    if key is not None:
        assert re.match(f"{where}: {re.escape(key)}: ", msg), msg
        assert err.key == key
    assert err.file == str(path)
    if line is not None:
        assert err.line == line
    assert err.exit_code == 2
    for part in contains:
        assert part in msg, (part, msg)
    return msg


def bad_layout(tmp_path, body, **kw):
    path = write(tmp_path, "bad.yaml", body)
    return expect_error(lambda: load_layout(path), path, **kw)


def torch_box(shape, mesh_shape, coord, shard):
    placements = [Replicate() if s is None else Shard(s) for s in shard]
    local, offset = _compute_local_shape_and_global_offset(shape, mesh_shape, list(coord), placements)
    return tuple(offset), tuple(local)


def placement_of(layout, name):
    return layout.placement(layout.manifest.index(name))


# ------------------------------------------------------------------------------------------- errors


def test_yaml_syntax_error_names_line(tmp_path):
    bad_layout(tmp_path, """
        model: model.yaml
        mesh: {tp: 2
        placements: []
        """, line=3, contains=("YAML syntax error",))


def test_tab_indentation_is_a_syntax_error(tmp_path):
    bad_layout(tmp_path, "model: model.yaml\nmesh:\n\ttp: 2\n", line=3, contains=("YAML syntax error",))


def test_unknown_top_key_is_not_ignored(tmp_path):
    bad_layout(tmp_path, """
        model: model.yaml
        mesh: {tp: 2}
        placments:
          - {match: q_proj, shard: {tp: 0}}
        """, key="placments", line=3, contains=("unknown key", "did you mean 'placements'"))


@pytest.mark.parametrize("body, key, line", [
    ("model: model.yaml\nmesh: {tp: 2}\nplacements:\n  - {match: q_proj, shrd: {tp: 0}}\n",
     "placements[0].shrd", 4),
    ("model: model.yaml\nmesh: {pp: 2}\npipeline: {dim: pp, layer: [1, 1]}\n", "pipeline.layer", 3),
])
def test_unknown_nested_key(tmp_path, body, key, line):
    bad_layout(tmp_path, body, key=key, line=line, contains=("unknown key",))


def test_duplicate_key(tmp_path):
    bad_layout(tmp_path, "model: model.yaml\nmesh: {tp: 2}\nmesh: {tp: 4}\n", line=3,
               contains=("duplicate key 'mesh'",))


def test_missing_model_key(tmp_path):
    bad_layout(tmp_path, "mesh: {tp: 2}\n", key="model", line=1, contains=("missing required key",))


@pytest.mark.parametrize("body", ["model: model.yaml\n", "model: model.yaml\nmesh: {tp: 2}\nmeshes: {a: {tp: 2}}\n"])
def test_exactly_one_of_mesh_and_meshes(tmp_path, body):
    bad_layout(tmp_path, body, line=1, contains=("`mesh:`", "`meshes:`"))


def test_mesh_product_differs_from_ranks_single_mesh(tmp_path):
    bad_layout(tmp_path, """
        model: model.yaml
        ranks: 0-2
        mesh: {tp: 2}
        """, key="mesh", line=3, contains=("mesh product 2 != number of ranks 3",))


def test_mesh_product_differs_from_ranks_named_mesh(tmp_path):
    bad_layout(tmp_path, """
        model: model.yaml
        ranks: '0-3'
        meshes:
          dense: {dp: 3, tp: 2}
          expert: {ep: 4}
        """, key="meshes.dense", line=4, contains=("mesh product 6 != number of ranks 4",))


def test_mesh_dim_size_must_be_positive_int(tmp_path):
    bad_layout(tmp_path, "model: model.yaml\nmesh: {tp: 0}\n", key="mesh.tp", line=2)


def test_rule_that_matches_no_tensor(tmp_path):
    bad_layout(tmp_path, """
        model: model.yaml
        mesh: {tp: 2}
        placements:
          - {match: q_proj, shard: {tp: 0}}
          - {match: 'nothing_is_called_this', shard: {tp: 0}}
        """, key="placements[1].match", line=5, contains=("matches no tensor", "'small'"))


def test_rule_shadowed_by_earlier_rule_matches_nothing(tmp_path):
    bad_layout(tmp_path, """
        model: model.yaml
        mesh: {tp: 2}
        placements:
          - {match: '.'}
          - {match: q_proj, shard: {tp: 0}}
        """, key="placements[1].match", line=5, contains=("matches no tensor",))


def test_shard_dim_out_of_range(tmp_path):
    bad_layout(tmp_path, """
        model: model.yaml
        mesh: {tp: 2}
        placements:
          - {match: q_proj, shard: {tp: 0}}
          - {match: 'norm', shard: {tp: 1}}
        """, key="placements[1].shard.tp", line=5,
        contains=("shard dim 1 out of range", "layers.0.norm.weight", "[6]"))


def test_shard_dim_must_be_nonnegative_int(tmp_path):
    bad_layout(tmp_path, "model: model.yaml\nmesh: {tp: 2}\nplacements:\n  - {match: q, shard: {tp: -1}}\n",
               key="placements[0].shard.tp", line=4)


def test_unknown_mesh(tmp_path):
    bad_layout(tmp_path, """
        model: model.yaml
        meshes:
          dense: {tp: 2}
          expert: {ep: 2}
        placements:
          - {match: q_proj, mesh: dens}
        """, key="placements[0].mesh", line=6, contains=("unknown mesh 'dens'", "dense, expert"))


def test_rule_must_name_a_mesh_when_there_are_several(tmp_path):
    bad_layout(tmp_path, """
        model: model.yaml
        meshes:
          dense: {tp: 2}
          expert: {ep: 2}
        placements:
          - {match: q_proj}
        """, key="placements[0]", line=6, contains=("several meshes",))


def test_unknown_mesh_dim_in_shard(tmp_path):
    bad_layout(tmp_path, """
        model: model.yaml
        mesh: {dp: 1, tp: 2}
        placements:
          - {match: q_proj, shard: {pt: 0}}
        """, key="placements[0].shard.pt", line=4, contains=("unknown mesh dim 'pt'", "dp, tp"))


def test_unknown_pipeline_dim(tmp_path):
    bad_layout(tmp_path, "model: model.yaml\nmesh: {tp: 2}\npipeline: pp\n", key="pipeline", line=3,
               contains=("unknown mesh dim 'pp'",))


def test_unknown_expert_dim(tmp_path):
    bad_layout(tmp_path, "model: model.yaml\nmesh: {tp: 2}\nexperts: [tp, ep]\n", key="experts", line=3,
               contains=("unknown mesh dim 'ep'",))


def test_expert_tensor_without_an_owner(tmp_path):
    # the experts fall through every rule to the first mesh, which has no `ep`
    bad_layout(tmp_path, """
        model: model.yaml
        meshes:
          dense: {tp: 2}
          expert: {ep: 2}
        experts: ep
        placements:
          - {match: q_proj, mesh: dense, shard: {tp: 0}}
        """, key="placements", line=6,
        contains=("layers.0.mlp.experts.0.up_proj.weight", "owner", "matches no rule", "'dense'", "'ep'"))


def test_expert_tensor_placed_on_a_mesh_without_expert_dims(tmp_path):
    bad_layout(tmp_path, """
        model: model.yaml
        meshes:
          dense: {tp: 2}
          expert: {ep: 2}
        experts: ep
        placements:
          - {match: experts, mesh: dense}
          - {match: '.', mesh: expert}
        """, key="placements[0]", line=7, contains=("owner", "mesh 'dense' has no 'ep'"))


def test_layer_tensor_without_a_pipeline_stage(tmp_path):
    bad_layout(tmp_path, """
        model: model.yaml
        meshes:
          dense: {tp: 2}
          staged: {pp: 2}
        pipeline: pp
        placements:
          - {match: q_proj, mesh: staged}
        """, key="placements", line=6,
        contains=("embed_tokens.weight", "matches no rule", "no pipeline dim 'pp'"))


def test_pipeline_dim_cannot_shard(tmp_path):
    bad_layout(tmp_path, """
        model: model.yaml
        mesh: {pp: 2, tp: 2}
        pipeline: pp
        placements:
          - {match: q_proj, shard: {pp: 0}}
        """, key="placements[0]", line=5, contains=("pipeline dim",))


def test_experts_must_split_evenly(tmp_path):
    bad_layout(tmp_path, "model: model.yaml\nmesh: {ep: 3}\nexperts: ep\n", key="experts", line=3,
               contains=("2 experts", "3 expert coordinates"))


@pytest.mark.parametrize("layers", ["[1, 2]", "[2]", "['a', 1]", "[true, 1]", "3"])
def test_pipeline_layers_must_fit_the_model(tmp_path, layers):
    bad_layout(tmp_path, f"model: model.yaml\nmesh: {{pp: 2}}\npipeline: {{dim: pp, layers: {layers}}}\n",
               key="pipeline.layers", line=3, contains=("2 layer counts",))


@pytest.mark.parametrize("ranks", ["'a-b'", "'3-1'", "[0, 0]", "{a: 1}", "-1", "true"])
def test_bad_ranks(tmp_path, ranks):
    bad_layout(tmp_path, f"model: model.yaml\nranks: {ranks}\nmesh: {{tp: 2}}\n", key="ranks", line=2)


def test_bad_regex(tmp_path):
    bad_layout(tmp_path, "model: model.yaml\nmesh: {tp: 2}\nplacements:\n  - {match: '(q', shard: {tp: 0}}\n",
               key="placements[0].match", line=4, contains=("bad regex",))


# Malformed values that used to escape as TypeError tracebacks.
@pytest.mark.parametrize("body, key, line", [
    ("model: model.yaml\nmeshes:\n  a: {tp: 2}\n  b: {ep: 2}\nplacements:\n  - {match: q, mesh: [a]}\n",
     "placements[0].mesh", 6),
    ("model: model.yaml\nmesh: {ep: 2}\nexperts: [[ep]]\n", "experts", 3),
    ("model: model.yaml\nmesh: {ep: 2}\nexperts: [ep, ep]\n", "experts", 3),
    ("model: model.yaml\nmesh: {tp: 2}\nplacements:\n  - {match: q, shard: {[tp]: 0}}\n", None, 4),
    ("model: model.yaml\nmesh: {tp: 2}\nplacements:\n  - q_proj\n", "placements[0]", None),
    ("model: model.yaml\nmesh: {tp: 2}\nplacements: {match: q}\n", "placements", 3),
    ("model: model.yaml\nmesh: {tp: 2}\nplacements:\n  - {match: q_proj, shard: [0]}\n", "placements[0].shard", 4),
    ("model: 3\nmesh: {tp: 2}\n", "model", 1),
    ("model: model.yaml\nmeshes: [1, 2]\n", "meshes", 2),
    ("model: model.yaml\nmesh: [tp, 2]\n", "mesh", 2),
])
def test_malformed_values_are_config_errors(tmp_path, body, key, line):
    bad_layout(tmp_path, body, key=key, line=line)


@pytest.mark.parametrize("body", ["", "- a\n- b\n", "just a string\n"])
def test_document_must_be_a_mapping(tmp_path, body):
    bad_layout(tmp_path, body, contains=("expected a mapping",))


def test_missing_layout_file(tmp_path):
    path = tmp_path / "nope.yaml"
    expect_error(lambda: load_layout(path), path, contains=("file not found",))


def test_unreadable_layout_file(tmp_path):
    path = tmp_path / "dir.yaml"
    path.mkdir()  # reading a directory fails for every user, root included
    expect_error(lambda: load_layout(path), path, contains=("cannot read",))


def test_missing_model_file(tmp_path):
    path = write(tmp_path, "l.yaml", "model: missing-model.yaml\nmesh: {tp: 2}\n")
    expect_error(lambda: load_layout(path), path, key="model", contains=("'missing-model.yaml'", "no such file"))


def test_missing_dst_file_in_pair(tmp_path):
    src = write(tmp_path, "src.yaml", "model: model.yaml\nmesh: {tp: 2}\n")
    dst = tmp_path / "dst.yaml"
    expect_error(lambda: load_pair(src, dst), dst, contains=("file not found",))


def test_overlapping_src_and_dst_ranks(tmp_path):
    src = write(tmp_path, "src.yaml", "model: model.yaml\nranks: 0-1\nmesh: {tp: 2}\n")
    dst = write(tmp_path, "dst.yaml", "model: model.yaml\nranks: 1-2\nmesh: {tp: 2}\n")
    expect_error(lambda: load_pair(src, dst), dst, key="ranks", contains=("overlap", "rank 1", "src is 0-1"))


def test_src_and_dst_models_differ(tmp_path):
    other = (SMALL_MODEL
             .replace("{name: layers.0.attn.q_proj.weight, shape: [9, 6]}",
                      "{name: layers.0.attn.q_proj.weight, shape: [8, 6]}")
             .replace("{name: layers.0.norm.weight, shape: [6]}",
                      "{name: layers.0.norm.weight, shape: [6], dtype: bfloat16}")
             .replace("{name: norm.weight, shape: [6]}", "{name: final_norm.weight, shape: [6]}"))
    assert other.count("[8, 6]") == 1 and "final_norm" in other
    src = write(tmp_path, "src.yaml", "model: model.yaml\nmesh: {tp: 2}\n")
    (tmp_path / "other.yaml").write_text(other.replace("name: small", "name: other"))
    dst = write(tmp_path, "dst.yaml", "model: other.yaml\nmesh: {tp: 2}\n")
    expect_error(lambda: load_pair(src, dst), dst, key="model", contains=(
        "models differ",
        "layers.0.attn.q_proj.weight: shape [9, 6] in small vs [8, 6] in other",
        "layers.0.norm.weight: dtype float32 in small vs bfloat16 in other",
        "norm.weight: missing in other",
        "1 more",  # final_norm.weight, extra in dst
    ))


def test_dtype_override_makes_models_differ(tmp_path):
    src = write(tmp_path, "src.yaml", "model: model.yaml\nmesh: {tp: 2}\n")
    dst = write(tmp_path, "dst.yaml", "model: model.yaml\ndtype: bf16\nmesh: {tp: 2}\n")
    expect_error(lambda: load_pair(src, dst), dst, key="model", contains=("dtype float32", "bfloat16"))


# --------------------------------------------------------------------------------------- good paths


def test_single_mesh_form(tmp_path):
    lay = load_layout(write(tmp_path, "l.yaml", """
        model: model.yaml
        mesh: {dp: 2, tp: 3}
        placements:
          - {match: q_proj, shard: {tp: 0}}
        """))
    assert list(lay.meshes) == ["default"]
    mesh = lay.meshes["default"]
    assert (mesh.dims, mesh.shape, mesh.ranks) == (("dp", "tp"), (2, 3), tuple(range(6)))
    assert lay.name == "l" and lay.size == 6 and lay.pipeline is None and lay.experts == ()
    q = placement_of(lay, "layers.0.attn.q_proj.weight")
    assert q.shard == (None, 0) and q.fixed == (None, None) and q.holders == tuple(range(6))
    norm = placement_of(lay, "norm.weight")  # no rule: replicated on the first mesh
    assert norm.shard == (None, None) and norm.describe() == "default[replicate]"
    # row-major: the last dim varies fastest
    assert mesh.rank_at((1, 0)) == 3 and mesh.coord_of(5) == (1, 2)


@pytest.mark.parametrize("ranks, expected", [
    ("'0-3'", (0, 1, 2, 3)),
    ("'4-7'", (4, 5, 6, 7)),
    ("'0-1,8-9'", (0, 1, 8, 9)),
    ("[3, 1, 2, 0]", (3, 1, 2, 0)),
    ("[0, '2-3', 9]", (0, 2, 3, 9)),
])
def test_ranks_forms(tmp_path, ranks, expected):
    lay = load_layout(write(tmp_path, "l.yaml", f"model: model.yaml\nranks: {ranks}\nmesh: {{dp: 2, tp: 2}}\n"))
    assert lay.ranks == expected
    mesh = lay.meshes["default"]
    assert [mesh.rank_at((i, j)) for i in range(2) for j in range(2)] == list(expected)
    assert all(mesh.coord_of(r) == (i // 2, i % 2) for i, r in enumerate(expected))


def test_default_ranks(tmp_path):
    path = write(tmp_path, "l.yaml", "model: model.yaml\nmesh: {tp: 3}\n")
    assert load_layout(path).ranks == (0, 1, 2)
    assert load_layout(path, first_rank=5).ranks == (5, 6, 7)


def test_dst_ranks_default_to_right_after_src(tmp_path):
    src = write(tmp_path, "src.yaml", "model: model.yaml\nranks: '4-7'\nmesh: {tp: 4}\n")
    dst = write(tmp_path, "dst.yaml", "model: model.yaml\nmesh: {dp: 3, tp: 2}\n")
    s, d = load_pair(src, dst)
    assert s.ranks == (4, 5, 6, 7) and d.ranks == tuple(range(8, 14))
    # src without ranks starts at 0; dst starts after the largest src rank
    s2, d2 = load_pair(dst, write(tmp_path, "dst2.yaml", "model: model.yaml\nmesh: {tp: 2}\n"))
    assert s2.ranks == tuple(range(6)) and d2.ranks == (6, 7)
    s3, d3 = load_pair(write(tmp_path, "src3.yaml", "model: model.yaml\nranks: [9, 0]\nmesh: {tp: 2}\n"), dst)
    assert d3.ranks == tuple(range(10, 16))


def test_default_pipeline_split_and_first_last_stage(tmp_path):
    lay = load_layout(write(tmp_path, "l.yaml", """
        model: model.yaml
        mesh: {pp: 2, tp: 2}
        pipeline: pp
        """))
    assert lay.pipeline == "pp" and lay.stage_of_layer == (0, 1)
    stage = {t.name: placement_of(lay, t.name).fixed[0] for t in lay.manifest.tensors}
    assert stage["embed_tokens.weight"] == 0
    assert stage["layers.0.attn.q_proj.weight"] == 0 and stage["layers.1.attn.q_proj.weight"] == 1
    assert stage["norm.weight"] == 1 and stage["lm_head.weight"] == 1
    assert placement_of(lay, "layers.1.norm.weight").holders == (2, 3)


def test_explicit_pipeline_layers(tmp_path):
    lay = load_layout(write(tmp_path, "l.yaml", """
        model: model.yaml
        ranks: '10-15'
        mesh: {pp: 3, tp: 2}
        pipeline: {dim: pp, layers: [0, 2, 0]}
        """))
    assert lay.stage_of_layer == (1, 1)
    assert placement_of(lay, "embed_tokens.weight").holders == (10, 11)           # first stage
    assert placement_of(lay, "layers.0.attn.q_proj.weight").holders == (12, 13)  # stage 1
    assert placement_of(lay, "layers.1.mlp.experts.1.up_proj.weight").holders == (12, 13)
    assert placement_of(lay, "lm_head.weight").holders == (14, 15)               # last stage


MANY_EXPERTS = "name: many\ndtype: bfloat16\ntensors:\n" + "".join(
    f"  - {{name: layers.{layer}.mlp.experts.{e}.{proj}.weight, shape: [4, 6]}}\n"
    for layer in range(2) for e in range(12) for proj in ("up_proj", "down_proj")
) + "  - {name: layers.0.attn.q_proj.weight, shape: [6, 6]}\n  - {name: layers.1.attn.q_proj.weight, shape: [6, 6]}\n"


def test_expert_owner_one_dim(tmp_path):
    lay = load_layout(write(tmp_path, "l.yaml", """
        model: model.yaml
        meshes:
          dense: {dp: 2, tp: 2}
          expert: {ep: 4}
        experts: ep
        placements:
          - {match: 'experts\\.', mesh: expert}
          - {match: '.', mesh: dense, shard: {tp: 0}}
        """, model=MANY_EXPERTS))
    assert lay.experts == ("ep",)
    for e in range(12):  # 12 experts over ep 4: expert e on coordinate e // 3
        p = placement_of(lay, f"layers.1.mlp.experts.{e}.up_proj.weight")
        assert p.fixed == (e // 3,) and p.holders == (e // 3,)
    # the same owner gives the same (interned) placement, across layers and projections
    assert placement_of(lay, "layers.0.mlp.experts.4.up_proj.weight") is \
        placement_of(lay, "layers.1.mlp.experts.5.down_proj.weight")
    assert placement_of(lay, "layers.0.attn.q_proj.weight").holders == (0, 1, 2, 3)


def test_expert_owner_several_dims_row_major(tmp_path):
    lay = load_layout(write(tmp_path, "l.yaml", """
        model: model.yaml
        ranks: '20-31'
        mesh: {pp: 2, dp: 2, tp: 3}
        pipeline: pp
        experts: [dp, tp]
        placements:
          - {match: 'experts\\.'}
          - {match: '.', shard: {tp: 0}}
        """, model=MANY_EXPERTS))
    for layer in range(2):
        for e in range(12):  # 12 experts over dp2 × tp3 = 6 coordinates: flat = e // 2, tp fastest
            flat = e // 2
            p = placement_of(lay, f"layers.{layer}.mlp.experts.{e}.up_proj.weight")
            assert p.fixed == (layer, flat // 3, flat % 3)
            assert p.holders == (20 + layer * 6 + flat,)
    q = placement_of(lay, "layers.1.attn.q_proj.weight")
    assert q.holders == tuple(range(26, 32)) and q.fixed == (1, None, None)


def test_expert_dims_can_be_sharded_by_other_dims(tmp_path):
    lay = load_layout(write(tmp_path, "l.yaml", """
        model: model.yaml
        mesh: {ep: 2, etp: 2}
        experts: ep
        placements:
          - {match: 'up_proj', shard: {etp: 0}}
          - {match: 'down_proj', shard: {etp: 1}}
        """))
    p = placement_of(lay, "layers.0.mlp.experts.1.up_proj.weight")
    assert p.fixed == (1, None) and p.holders == (2, 3)
    assert [b for b, _ in p.boxes((10, 6))] == [p.box_of((10, 6), 2), p.box_of((10, 6), 3)]
    assert p.box_of((10, 6), 3).offsets == (5, 0) and p.box_of((10, 6), 3).sizes == (5, 6)
    assert placement_of(lay, "layers.0.attn.q_proj.weight").holders == (0, 1, 2, 3)  # not an expert


def test_nested_shards(tmp_path):
    lay = load_layout(write(tmp_path, "l.yaml", """
        model: model.yaml
        mesh: {dp: 2, a: 2}
        placements:
          - {match: 'embed|lm_head', shard: {dp: 0, a: 0}}
          - {match: 'o_proj', shard: {a: 1, dp: 1}}
        """))
    emb = placement_of(lay, "embed_tokens.weight")
    assert emb.shard == (0, 0)
    # 13 rows: dp halves 7 | 6, then a halves each: 4 | 3 | 3 | 3
    assert [(lay.meshes["default"].coord_of(r), emb.box_of((13, 6), r).offsets[0], emb.box_of((13, 6), r).sizes[0])
            for r in range(4)] == [((0, 0), 0, 4), ((0, 1), 4, 3), ((1, 0), 7, 3), ((1, 1), 10, 3)]
    o = placement_of(lay, "layers.0.attn.o_proj.weight")
    # 9 cols: nested in mesh-dim order (dp first, then a): 5 | 4, then 3 | 2 and 2 | 2
    assert [o.box_of((6, 9), r).sizes[1] for r in range(4)] == [3, 2, 2, 2]
    for r in range(4):
        coord = lay.meshes["default"].coord_of(r)
        for shape, p in (((13, 6), emb), ((6, 9), o)):
            box = p.box_of(shape, r)
            assert (box.offsets, box.sizes) == torch_box(shape, (2, 2), coord, p.shard)


def test_placements_match_dtensor(tmp_path):
    lay = load_layout(write(tmp_path, "l.yaml", """
        model: model.yaml
        ranks: '3-14'
        meshes:
          dense: {pp: 2, dp: 2, tp: 3}
          expert: {pp: 2, ep: 2, etp: 3}
        pipeline: pp
        experts: ep
        placements:
          - {match: 'experts\\.\\d+\\.up_proj', mesh: expert, shard: {etp: 0}}
          - {match: 'experts\\.\\d+\\.down_proj', mesh: expert, shard: {etp: 1}}
          - {match: 'q_proj|embed|lm_head', mesh: dense, shard: {tp: 0}}
          - {match: 'o_proj', mesh: dense, shard: {tp: 1}}
          - {match: '.', mesh: dense}
        """))
    checked = 0
    for name in ("embed_tokens.weight", "layers.0.attn.q_proj.weight", "layers.1.attn.o_proj.weight",
                 "layers.1.mlp.experts.1.up_proj.weight", "layers.0.mlp.experts.0.down_proj.weight",
                 "layers.1.norm.weight", "lm_head.weight", "layers.1.empty.weight"):
        spec = lay.manifest.get(name)
        p = placement_of(lay, name)
        holders = set(p.holders)
        for coord, r in zip(p.coords, p.holders):
            assert p.mesh.rank_at(coord) == r and p.mesh.coord_of(r) == coord
            shard = p.shard
            box = p.box_of(spec.shape, r)
            assert (box.offsets, box.sizes) == torch_box(spec.shape, p.mesh.shape, coord, shard), (name, r)
            checked += 1
        # boxes(): unique boxes, each with every replica holding it
        grouped = p.boxes(spec.shape)
        assert sorted(r for _, rs in grouped for r in rs) == sorted(holders)
        assert all(p.box_of(spec.shape, r) == b for b, rs in grouped for r in rs)
    assert placement_of(lay, "layers.1.mlp.experts.1.up_proj.weight").holders == (12, 13, 14)
    assert placement_of(lay, "embed_tokens.weight").holders == tuple(range(3, 9))
    assert checked > 30


def test_equal_placements_are_shared(tmp_path):
    lay = load_layout(write(tmp_path, "l.yaml", """
        model: model.yaml
        mesh: {tp: 2}
        placements:
          - {match: 'q_proj', shard: {tp: 0}}
          - {match: 'embed|lm_head', shard: {tp: 0}}
        """))
    q0, q1 = placement_of(lay, "layers.0.attn.q_proj.weight"), placement_of(lay, "layers.1.attn.q_proj.weight")
    assert q0 is q1 and q0 is placement_of(lay, "embed_tokens.weight")  # same mesh/shard through another rule
    assert placement_of(lay, "norm.weight") is placement_of(lay, "layers.1.norm.weight")
    assert len(lay.placements) == len(lay.manifest.tensors)


BUNDLED = [
    ("qwen3-30b-a3b", "megatron-tp2-ep4-pp2", "vllm-tp4-dp4", 16, 16),
    ("qwen3-235b-a22b", "megatron-tp2-cp2-pp4-ep16", "vllm-tp8-dp8", 128, 64),
    ("deepseek-v3", "megatron-pp16-ep16", "vllm-tp32-dp8", 256, 256),
    ("kimi-k2", "megatron-pp16-ep16", "vllm-tp16-dp8", 256, 128),
]


@pytest.mark.parametrize("model, src_name, dst_name, n_src, n_dst", BUNDLED, ids=[b[0] for b in BUNDLED])
def test_bundled_pairs_load(model, src_name, dst_name, n_src, n_dst):
    folder = ROOT / "layouts" / model
    src, dst = load_pair(folder / f"{src_name}.yaml", folder / f"{dst_name}.yaml")
    assert (src.name, dst.name) == (src_name, dst_name)
    assert src.manifest.name == dst.manifest.name == model
    assert src.ranks == tuple(range(n_src)) and dst.ranks == tuple(range(n_src, n_src + n_dst))
    assert len(src.placements) == len(dst.placements) == len(src.manifest.tensors) > 1000
    # every expert tensor has exactly one owner coordinate per side's expert dims
    name = next(t.name for t in src.manifest.tensors if ".experts.3." in t.name)
    for lay in (src, dst):
        p = placement_of(lay, name)
        assert all(p.fixed[p.mesh.dims.index(d)] is not None for d in lay.experts)
    # a pipelined trainer: each layer's tensors live on one stage, the first layer on stage 0
    assert src.pipeline == "pp" and src.stage_of_layer[0] == 0 and src.stage_of_layer[-1] == \
        src.meshes["dense"].shape[0] - 1


# ------------------------------------------------------------------------------------------ topology


def topo_file(tmp_path, body):
    path = tmp_path / "topo.yaml"
    path.write_text(textwrap.dedent(body).lstrip("\n"))
    return path


def test_topology_ranks_per_domain(tmp_path):
    t = load_topology(topo_file(tmp_path, "name: nodes\nranks_per_domain: 4\n"))
    assert t.name == "nodes" and t.grouped and t.links == {}
    assert [t.domain_of(r) for r in range(9)] == [0, 0, 0, 0, 1, 1, 1, 1, 2]


def test_topology_explicit_domains_and_links(tmp_path):
    t = load_topology(topo_file(tmp_path, """
        domains: ['0-3', [4, 6], 8]
        links: {network_gbps: 25, nvlink_gbps: 450, latency_us: 5}
        """))
    assert t.name == "topo" and t.domains == ((0, 1, 2, 3), (4, 6), (8,))
    assert t.links == {"network_gbps": 25.0, "nvlink_gbps": 450.0, "latency_us": 5.0}
    assert t.domain_of(2) == t.domain_of(0) != t.domain_of(4) == t.domain_of(6)
    assert t.domain_of(5) != t.domain_of(7)  # unlisted ranks: each its own domain
    assert len({t.domain_of(r) for r in range(10)}) == 3 + 3  # 3 listed domains + ranks 5, 7, 9


def test_bundled_topology():
    t = load_topology(ROOT / "layouts" / "topologies" / "dgx-h100.yaml")
    assert t.name == "dgx-h100" and t.ranks_per_domain == 8 and t.links["network_gbps"] == 50.0
    assert t.domain_of(7) == t.domain_of(0) != t.domain_of(8)


@pytest.mark.parametrize("body, key, line, part", [
    ("ranks_per_domain: 4\ndomains: ['0-3']\n", None, 1, "exactly one of ranks_per_domain or domains"),
    ("name: x\n", None, 1, "exactly one of ranks_per_domain or domains"),
    ("ranks_per_domain: 4\nlinks:\n  network_gbps: fast\n", "links.network_gbps", 3, "non-negative number"),
    ("ranks_per_domain: 4\nlinks:\n  latency_us: -1\n", "links.latency_us", 3, "non-negative number"),
    ("ranks_per_domain: 4\nlinks:\n  netwrok_gbps: 1\n", "links.netwrok_gbps", 3, "did you mean 'network_gbps'"),
    ("ranks_per_domian: 4\n", "ranks_per_domian", 1, "did you mean 'ranks_per_domain'"),
    ("ranks_per_domain: 0\n", "ranks_per_domain", 1, "positive integer"),
    ("domains: []\n", "domains", 1, "non-empty list"),
    ("domains: ['0-3', 'x']\n", "domains[1]", 1, "bad rank range"),
    ("domains: ['0-3', '3-5']\n", None, 1, "domains: rank 3 is in two domains"),
    ("ranks_per_domain: 4\nlinks: [1]\n", "links", None, "expected a mapping"),
    ("ranks_per_domain: [4\n", None, 2, "YAML syntax error"),
])
def test_topology_errors(tmp_path, body, key, line, part):
    path = topo_file(tmp_path, body)
    expect_error(lambda: load_topology(path), path, key=key, line=line, contains=(part,))


def test_missing_topology_file(tmp_path):
    path = tmp_path / "none.yaml"
    expect_error(lambda: load_topology(path), path, contains=("file not found",))
