"""`formats.derived` without vLLM: the placement inferred from the boxes each TP rank loads, checked against
DTensor's own sharding (`distribute_tensor` on a fake mesh is what `shard_box` is tested against elsewhere;
here the candidates must reproduce exactly the boxes given, or fall back to replication), a staged box
written through its transform, the cache's one-line errors."""
import json

import pytest
import torch

from reshard_cli.base import files
from reshard_cli.base.geometry import Box, shard_box
from reshard_cli.errors import ConfigError
from reshard_cli.formats import derived


def _boxes(shape, tp, shard, pad=1) -> dict:
    out = {}
    for r in range(tp):
        b = shard_box(shape, (tp,), (r,), shard, pad)
        out[r] = (list(b.offsets), [o + s for o, s in zip(b.offsets, b.sizes)])
    return out


@pytest.mark.parametrize("shape,shard,pad", [((96, 64), (0,), 1), ((64, 96), (1,), 1), ((1000, 64), (0,), 64),
                                             ((7, 3), (0,), 1)])
def test_a_shard_is_recognised_as_the_shard_it_is(shape, shard, pad):
    """Rows or columns split as vLLM splits them (the vocab padded to 64, an uneven split): that shard."""
    rule = derived._rule_of(shape, _boxes(shape, 4, shard, pad), 4, kv=0)
    assert rule[:2] == ("shard", shard[0])
    assert shard_box(shape, (4,), (3,), (rule[1],), rule[2]) == shard_box(shape, (4,), (3,), shard, pad)


def test_kv_heads_replicated_over_tp():
    """Two kv heads over tp 4: rank r holds head r // 2, each box on two ranks."""
    shape = (2 * 32, 128)
    boxes = {r: ([(r // 2) * 32, 0], [(r // 2 + 1) * 32, 128]) for r in range(4)}
    assert derived._rule_of(shape, boxes, 4, kv=2) == ("kv",)


def test_pieces_that_are_no_shard_replicate():
    """A Mamba in_proj: each rank loads row ranges spread over the tensor, so no shard gives them; the whole
    tensor goes to every rank (and is staged there). A rank loading nothing of it, likewise."""
    shape = (296, 128)
    boxes = {0: ([0, 0], [292, 128]), 1: ([64, 0], [296, 128])}
    assert derived._rule_of(shape, boxes, 2, kv=0) == ("replicate",)
    assert derived._rule_of(shape, {0: ([0, 0], [148, 128])}, 2, kv=0) == ("replicate",)


def test_experts_over_the_replicas():
    """A map over dp 2 x tp 2 (expert parallelism spans the replicas): a layer's stacked experts (gpt-oss),
    four to a rank in EP rank order (dp_rank * tp + tp_rank), are a shard over dp then tp, as DTensor nests
    Shard(0) on both mesh dims; a tensor every replica loads alike keeps its TP rule; one the replicas load
    apart in no shard's way goes whole to every rank."""
    shape = (16, 8, 4)
    experts = {r: ([4 * r, 0, 0], [4 * r + 4, 8, 4]) for r in range(4)}
    assert derived._rule_of(shape, experts, 2, kv=0, dp=2) == ("grid", 0)
    for r in range(4):
        b = shard_box(shape, (2, 2), (r // 2, r % 2), (0, 0))
        assert (list(b.offsets), [o + s for o, s in zip(b.offsets, b.sizes)]) == tuple(experts[r])
    rows = _boxes((96, 64), 2, (0,))
    assert derived._rule_of((96, 64), {r: rows[r % 2] for r in range(4)}, 2, kv=0, dp=2) == ("shard", 0, 1)
    odd = {0: ([0, 0], [8, 4]), 1: ([0, 0], [8, 4]), 2: ([8, 0], [16, 4]), 3: ([0, 0], [16, 4])}
    assert derived._rule_of((16, 4), odd, 2, kv=0, dp=2) == ("replicate",)


def test_derivation_processes(monkeypatch):
    """`RESHARD_DERIVE_JOBS` children trace a map's ranks at once, never more than there are ranks; a value that
    is not a number is one line naming the variable."""
    from reshard_cli.engines.vllm import maps

    monkeypatch.setenv("RESHARD_DERIVE_JOBS", "3")
    assert (maps.jobs(32), maps.jobs(2)) == (3, 2)
    monkeypatch.setenv("RESHARD_DERIVE_JOBS", "many")
    with pytest.raises(ConfigError, match="RESHARD_DERIVE_JOBS.*'many'"):
        maps.jobs(4)


def test_patterns_match_every_layer_and_no_other_name():
    p = derived._pattern("backbone.layers.12.mixer.conv1d.weight")
    import re

    assert re.match(p, "backbone.layers.0.mixer.conv1d.weight")
    assert not re.match(p, "backbone.layers.0.mixer.conv1d.bias")
    assert not any(c.isdigit() for c in p)  # keeps the layout's one-search-per-digitless-name matcher


def test_staged_box_written_through_its_transform():
    """A box staged whole, two regions of it written into two engine tensors, one as vLLM writes Mamba's A
    (-exp of the float32 value)."""
    held = Box((0,), (8,))
    buf = torch.arange(1, 9, dtype=torch.bfloat16) / 8
    a, b = torch.full((4,), float("nan")), torch.full((4,), float("nan"), dtype=torch.bfloat16)
    st = derived.Staged("x", buf, [(Box((0,), (4,)).local_slices(held), a, "-exp"),
                                   (Box((4,), (4,)).local_slices(held), b, "copy")])
    st.apply()
    assert torch.equal(a, -torch.exp(buf[:4].float()))
    assert torch.equal(b, buf[4:])


def test_transposed_box_written_as_the_region_walks_it():
    """gpt-oss's experts: vLLM stores the checkpoint's [E, H, 2I] box as [E, 2I, H] (a map's "permute 0,2,1"),
    and a transform may come before the permutation; an unknown transform is one line naming it."""
    box = torch.arange(2 * 3 * 4, dtype=torch.float32).reshape(2, 3, 4)
    assert torch.equal(derived.apply_transform("permute 0,2,1", box, (2, 4, 3)), box.permute(0, 2, 1))
    assert torch.equal(derived.apply_transform("neg; permute 0,2,1", box, (8, 3)), -box.permute(0, 2, 1).reshape(8, 3))
    with pytest.raises(ConfigError, match="'rotate 1'.*reshard derive"):
        derived.apply_transform("rotate 1", box, (2, 3, 4))


def test_unreadable_cache_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("RESHARD_CACHE", str(tmp_path))
    monkeypatch.setattr(derived, "engine_version", lambda: "9.9")
    path = files.cache_path(derived.CACHE_KIND, "k", "vllm", "9.9")
    path.parent.mkdir(parents=True)
    path.write_text("{not json")
    with pytest.raises(ConfigError, match="unreadable storage map .*delete it"):
        derived._load_cached("k")
    path.write_text(json.dumps({"schema": derived.SCHEMA + 1}))
    assert derived._load_cached("k") is None  # another schema: derived again


def test_derive_command(tmp_path):
    """`reshard derive`: a layout of another format is refused in one line; a hand-ruled family has nothing to
    derive; a family without hand rules is derived (where vLLM is installed) and cached, so a plan then reads
    the map; with an empty cache and no vLLM, the plan's one line names the command."""
    from test_cli import reshard

    r = reshard("derive", "--dst", "demo/infer")
    assert r.returncode == 2 and "learns vLLM's storage; this layout has format: hf" in r.stderr, r.stderr
    r = reshard("derive", "--dst", "kimi-k2/vllm-tp16-dp8")
    assert r.returncode == 0 and "nothing to derive" in r.stdout, r.stderr
    pytest.importorskip("transformers")
    config = {"model_type": "nemotron_h", "architectures": ["NemotronHForCausalLM"], "vocab_size": 1000,
              "hidden_size": 64, "layers_block_type": ["mamba", "attention"], "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 128, "ssm_state_size": 16,
              "mamba_num_heads": 4, "mamba_head_dim": 16, "n_groups": 1, "conv_kernel": 4,
              "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    (tmp_path / "infer.yaml").write_text("model: config.json\nformat: vllm\nmesh: {tp: 2}\n")
    env = {"RESHARD_CACHE": str(tmp_path / "cache")}
    if derived.engine_version() is None:
        r = reshard("plan", "--src", tmp_path / "infer.yaml", "--dst", tmp_path / "infer.yaml", env=env)
        assert r.returncode == 2 and "reshard derive --dst" in r.stderr, r.stderr
        return
    r = reshard("derive", "--dst", tmp_path / "infer.yaml", "--json", tmp_path / "d.json", env=env)
    assert r.returncode == 0, r.stderr
    doc = json.loads((tmp_path / "d.json").read_text())
    assert doc["tp"] == 2 and all(x["staged_tensors"] > 0 for x in doc["ranks"])
    assert len(list((tmp_path / "cache" / "vllm-storage").glob("*.json"))) == 1
