"""Sources (synthetic, safetensors, shards, DCP) and the shard sink: exact box reads, checks, atomic output."""
from __future__ import annotations

import json
import os
import random
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from conftest import PAIRS, SMALL_MODEL, write_pair
from reshard_cli.io import sinks
from reshard_cli.errors import ConfigError, RuntimeFailure
from reshard_cli.base.geometry import Box
from reshard_cli.formats import load_layout, load_pair
from reshard_cli.io.sources import DcpSource, SafetensorsSource, ShardsSource, SyntheticSource, open_source
from reshard_cli.io.synthetic import synthetic_hash, synthetic_values
from reshard_cli.base.checksums import checksum, fmt

# SMALL_MODEL plus an int64 tensor (sharded: its name matches the `embed` rules), a 0-d int64 and a bool.
EXT_MODEL = SMALL_MODEL.rstrip("\n") + """
  - {name: embed_ids, shape: [7, 3], dtype: int64}
  - {name: step, shape: [], dtype: int64}
  - {name: mask, shape: [5], dtype: bool}
"""


def ext_pair(tmp_path: Path, name: str) -> tuple[Path, Path]:
    (tmp_path / "ext.yaml").write_text(EXT_MODEL)
    paths = []
    for role, body in zip(("src", "dst"), PAIRS[name]):
        p = tmp_path / f"ext-{name}-{role}.yaml"
        p.write_text("model: ext.yaml\n" + textwrap.dedent(body))
        paths.append(p)
    return paths[0], paths[1]


def dt(name: str) -> torch.dtype:
    return getattr(torch, name)


def reference(manifest) -> dict[str, torch.Tensor]:
    return {s.name: synthetic_values(t, Box.full(s.shape), s.shape, dt(s.dtype))
            for t, s in enumerate(manifest.tensors)}


def odd_boxes(shape: tuple, rng: random.Random, n: int = 4) -> list[Box]:
    """Random sub-boxes (some empty), plus the full box."""
    out = [Box.full(shape)]
    for _ in range(n):
        offs, sizes = [], []
        for d in shape:
            o = rng.randint(0, d)
            offs.append(o)
            sizes.append(rng.randint(0, d - o))
        out.append(Box(tuple(offs), tuple(sizes)))
    return out


def assert_reads(source, layout, ref, seed=0):
    """Every rank's own boxes and some odd boxes read back exactly (values, dtype, shape)."""
    rng = random.Random(seed)
    for rank in layout.ranks:
        source.check(layout, rank)
        for t, p in enumerate(layout.placements):
            if rank not in p.holder_set:
                continue
            spec = layout.manifest.tensors[t]
            box = p.box_of(spec.shape, rank)
            got = source.read(t, box)
            want = ref[spec.name][box.slices()]
            assert got.dtype == want.dtype and tuple(got.shape) == box.sizes, (spec.name, box)
            assert torch.equal(got, want), (spec.name, box)
    for t, spec in enumerate(layout.manifest.tensors):
        for box in odd_boxes(spec.shape, rng):
            got = source.read(t, box)
            assert got.dtype == dt(spec.dtype) and torch.equal(got, ref[spec.name][box.slices()]), (spec.name, box)


# ------------------------------------------------------------------------------------------------ synthetic


def test_synthetic_values_deterministic_and_box_consistent():
    shape = (13, 6)
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool,
                  torch.float8_e4m3fn):
        full = synthetic_values(3, Box.full(shape), shape, dtype)
        assert full.dtype == dtype and tuple(full.shape) == shape
        again = synthetic_values(3, Box.full(shape), shape, dtype)
        bits = (lambda x: x.view(torch.uint8)) if dtype == torch.float8_e4m3fn else (lambda x: x)
        assert torch.equal(bits(full), bits(again))
        box = Box((2, 1), (5, 4))
        part = synthetic_values(3, box, shape, dtype)
        assert torch.equal(bits(part), bits(full[box.slices()].contiguous()))
    # the formula, spelled out for one element: the rotation r of its span (i // 2^20) is the top 20 bits of word
    # i // 2^20 of SplitMix64's (t, seed) stream; h is lane p % 4 of word p // 4 of key 0's, p = (i % 2^20 + r) % 2^20
    i, t, seed = 2 * 6 + 3, 3, 5
    mask = (1 << 64) - 1

    def mix(z):
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & mask
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & mask
        return z ^ (z >> 31)
    key = mix(mix(t + 1) ^ seed)
    r = mix((key + (i >> 20) * 0x9E3779B97F4A7C15) & mask) >> 44
    p = (i % (1 << 20) + r) % (1 << 20)
    h = (mix(((p // 4) * 0x9E3779B97F4A7C15) & mask) >> (16 * (p % 4))) & 0xFFFF
    assert synthetic_hash(t, i, seed) == h
    assert synthetic_values(t, Box((2, 3), (1, 1)), shape, torch.float32, seed).item() == h / 32768 - 1
    assert synthetic_values(t, Box((2, 3), (1, 1)), shape, torch.int64, seed).item() == h % 127
    assert synthetic_values(t, Box((2, 3), (1, 1)), shape, torch.bool, seed).item() == bool(h & 1)
    # seeds and tensor indices give different values; fp32 values are multiples of 2^-15 in [-1, 1)
    a = synthetic_values(0, Box.full(shape), shape, torch.float32)
    assert not torch.equal(a, synthetic_values(0, Box.full(shape), shape, torch.float32, seed=1))
    assert not torch.equal(a, synthetic_values(1, Box.full(shape), shape, torch.float32))
    assert torch.equal(a * 32768, (a * 32768).round()) and a.min() >= -1 and a.max() < 1
    # bf16 values round-trip through fp32 and back
    b = synthetic_values(4, Box.full(shape), shape, torch.bfloat16)
    assert torch.equal(b.float().bfloat16(), b)
    # 0-d and 0-element boxes
    assert synthetic_values(0, Box((), ()), (), torch.int64).shape == ()
    assert synthetic_values(0, Box((0, 0), (0, 4)), (0, 4), torch.bfloat16).shape == (0, 4)


def test_synthetic_source(tmp_path):
    src, _ = ext_pair(tmp_path, "tp2_to_tp3")
    layout = load_layout(src)
    s = open_source(None, layout)
    assert isinstance(s, SyntheticSource) and s.kind == "synthetic" and "seed 0" in s.description
    assert_reads(s, layout, reference(layout.manifest))
    s3 = open_source({"kind": "synthetic", "seed": 3}, layout)
    box = Box((1, 0), (4, 6))
    assert torch.equal(s3.read(0, box), s3.expected(0, box))
    assert torch.equal(s3.read(0, box), synthetic_values(0, box, (13, 6), torch.float32, 3))
    assert open_source("synthetic:3", layout).seed == 3


# ------------------------------------------------------------------------------------------------ safetensors


@pytest.mark.parametrize("pair", list(PAIRS))
def test_safetensors_single_file(tmp_path, pair):
    src, _ = ext_pair(tmp_path, pair)
    layout = load_layout(src)
    ref = reference(layout.manifest)
    save_file(ref, str(tmp_path / "model.safetensors"))
    s = open_source("safetensors:" + str(tmp_path / "model.safetensors"), layout)
    assert isinstance(s, SafetensorsSource) and s.kind == "safetensors" and "(1 file)" in s.description
    assert_reads(s, layout, ref)
    s.close()


@pytest.mark.parametrize("with_index", [True, False])
def test_safetensors_directory(tmp_path, with_index):
    src, _ = ext_pair(tmp_path, "pp2_ep2_to_dp2_tp2")
    layout = load_layout(src)
    ref = reference(layout.manifest)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    names = list(ref)
    parts = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for f, ns in parts.items():
        save_file({n: ref[n] for n in ns}, str(ckpt / f))
    if with_index:
        (ckpt / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {}, "weight_map": {n: f for f, ns in parts.items() for n in ns}}))
    # a mapping from the layout YAML: the path resolves against the YAML's directory
    s = open_source({"kind": "safetensors", "path": "ckpt"}, layout)
    assert "(2 files)" in s.description
    assert_reads(s, layout, ref)
    s.close()
    if with_index:  # the index file itself
        s = open_source("safetensors:ckpt/model.safetensors.index.json", layout, base_dir=tmp_path)
        assert_reads(s, layout, ref, seed=1)
        s.close()


def test_safetensors_read_is_lazy(tmp_path, monkeypatch):
    """Boxes are read with get_slice: only the requested region, never get_tensor."""
    src, _ = write_pair(tmp_path, "tp2_to_tp3")
    layout = load_layout(src)
    ref = reference(layout.manifest)
    save_file(ref, str(tmp_path / "m.safetensors"))
    s = open_source("safetensors:m.safetensors", layout, base_dir=tmp_path)
    s.read(0, Box((0, 0), (1, 1)))  # opens the handle
    handle = next(iter(s._handles._open.values()))
    calls = []

    class Spy:
        def __init__(self, h):
            self.h = h

        def get_slice(self, name):
            sl = self.h.get_slice(name)

            class S:
                def __getitem__(_, idx):
                    calls.append((name, idx))
                    return sl[idx]
            return S()

        def get_tensor(self, name):
            raise AssertionError("whole tensor read")

    s._handles._open = {k: Spy(handle) for k in s._handles._open}
    box = Box((3, 2), (4, 3))
    assert torch.equal(s.read(0, box), ref["embed_tokens.weight"][3:7, 2:5])
    assert calls == [("embed_tokens.weight", (slice(3, 7), slice(2, 5)))]


def _check_error(source, layout, *fragments):
    with pytest.raises(ConfigError) as e:
        for rank in layout.ranks:
            source.check(layout, rank)
    for f in fragments:
        assert f in str(e.value), (f, str(e.value))
    return str(e.value)


def test_safetensors_check_errors(tmp_path):
    src, _ = write_pair(tmp_path, "tp2_to_tp3")
    layout = load_layout(src)
    ref = reference(layout.manifest)
    ckpt = tmp_path / "ckpt"
    ckpt.mkdir()
    # missing tensor
    save_file({k: v for k, v in ref.items() if k != "norm.weight"}, str(ckpt / "model-00001.safetensors"))
    s = open_source("safetensors:" + str(ckpt), layout)
    _check_error(s, layout, str(ckpt), "'norm.weight' is missing")
    # wrong shape, in the second file
    save_file({"norm.weight": torch.zeros(7)}, str(ckpt / "model-00002.safetensors"))
    s = open_source("safetensors:" + str(ckpt), layout)
    msg = _check_error(s, layout, "model-00002.safetensors", "'norm.weight'", "shape [7]", "layout expects [6]")
    assert msg.startswith(str(ckpt / "model-00002.safetensors") + ": ")
    # wrong dtype
    save_file({"norm.weight": torch.zeros(6, dtype=torch.bfloat16)}, str(ckpt / "model-00002.safetensors"))
    s = open_source("safetensors:" + str(ckpt), layout)
    _check_error(s, layout, "model-00002.safetensors", "'norm.weight'", "dtype bfloat16", "expects float32")
    # the index names a tensor the shard file lacks
    save_file({"norm.weight": torch.zeros(6)}, str(ckpt / "model-00002.safetensors"))
    wm = {k: "model-00001.safetensors" for k in ref}
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    s = open_source("safetensors:" + str(ckpt), layout)
    _check_error(s, layout, "model-00001.safetensors", "'norm.weight' is missing")
    # all good again
    wm["norm.weight"] = "model-00002.safetensors"
    (ckpt / "model.safetensors.index.json").write_text(json.dumps({"weight_map": wm}))
    s = open_source("safetensors:" + str(ckpt), layout)
    for r in layout.ranks:
        s.check(layout, r)


# ------------------------------------------------------------------------------------------------ DCP


def dcp_save(state_dict: dict, path: Path) -> None:
    import torch.distributed.checkpoint as dcp
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


@pytest.mark.parametrize("pair", ["pp2_ep2_to_dp2_tp2", "nested_dp_to_ep"])
def test_dcp_plain_tensors(tmp_path, pair):
    src, _ = ext_pair(tmp_path, pair)
    layout = load_layout(src)
    ref = reference(layout.manifest)
    dcp_save({k: v.clone() for k, v in ref.items()}, tmp_path / "ckpt_dcp")
    s = open_source({"kind": "dcp", "path": "ckpt_dcp"}, layout)
    assert isinstance(s, DcpSource) and s.kind == "dcp" and "ckpt_dcp" in s.description
    assert_reads(s, layout, ref)
    # one dcp.load for many boxes, several of the same tensor
    reqs = [(0, Box((0, 0), (3, 6))), (0, Box((5, 2), (8, 4))), (1, Box((0, 0), (0, 6))), (0, Box((2, 1), (1, 1)))]
    outs = s.read_many(reqs)
    for (t, box), got in zip(reqs, outs):
        assert torch.equal(got, ref[layout.manifest.tensors[t].name][box.slices()])


def test_dcp_check_errors(tmp_path):
    src, _ = write_pair(tmp_path, "tp2_to_tp3")
    layout = load_layout(src)
    ref = reference(layout.manifest)
    bad = dict(ref)
    del bad["lm_head.weight"]
    dcp_save(bad, tmp_path / "d1")
    _check_error(open_source("dcp:" + str(tmp_path / "d1"), layout), layout, "d1", "'lm_head.weight' is missing")
    bad = dict(ref, **{"norm.weight": torch.zeros(5)})
    dcp_save(bad, tmp_path / "d2")
    _check_error(open_source("dcp:" + str(tmp_path / "d2"), layout), layout, ".metadata", "'norm.weight'",
                 "shape [5]", "[6]")
    bad = dict(ref, **{"norm.weight": torch.zeros(6, dtype=torch.float16)})
    dcp_save(bad, tmp_path / "d3")
    _check_error(open_source("dcp:" + str(tmp_path / "d3"), layout), layout, ".metadata", "'norm.weight'",
                 "dtype float16")
    (tmp_path / "notdcp").mkdir()
    with pytest.raises(ConfigError, match=r"notdcp/\.metadata"):
        open_source("dcp:" + str(tmp_path / "notdcp"), layout)


def test_dcp_metadata_is_not_unpickled_freely(tmp_path):
    import pickle
    src, _ = write_pair(tmp_path, "tp2_to_tp3")
    layout = load_layout(src)
    (tmp_path / "evil").mkdir()

    class Evil:
        def __reduce__(self):
            return (print, ("pwned",))

    (tmp_path / "evil" / ".metadata").write_bytes(pickle.dumps(Evil()))
    with pytest.raises(ConfigError, match="refusing to load builtins.print"):
        open_source("dcp:" + str(tmp_path / "evil"), layout)


def _dtensor_saver(rank: int, store: str, out: str, tensors: dict) -> None:
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor
    warnings.simplefilter("ignore")
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    try:
        mesh = init_device_mesh("cpu", (2,))
        sd = {}
        for name, (full, placement) in tensors.items():
            p = Replicate() if placement is None else Shard(placement)
            sd[name] = distribute_tensor(full, mesh, [p])
        dcp.save(sd, storage_writer=dcp.FileSystemWriter(out))
    finally:
        dist.destroy_process_group()


def _chunked_save(state_dict: dict, path: Path, parts: int = 3) -> None:
    """Save like a sharded (DTensor) checkpoint, in one process: every tensor of 1+ dims is stored as `parts`
    chunks along its first dim (torch.chunk style, uneven, possibly empty), each chunk a separate record."""
    import dataclasses

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    class ChunkedSavePlanner(DefaultSavePlanner):
        def create_local_plan(self):
            plan = super().create_local_plan()
            items = []
            for item in plan.items:
                x = self.state_dict[item.index.fqn]
                if item.type != WriteItemType.TENSOR or x.dim() == 0:
                    items.append(item)
                    continue
                for box in Box.full(tuple(x.shape)).split(parts):
                    box = Box(tuple(0 if s == 0 else o for o, s in zip(box.offsets, box.sizes)), box.sizes)
                    off = torch.Size(box.offsets)
                    items.append(WriteItem(index=MetadataIndex(item.index.fqn, off), type=WriteItemType.SHARD,
                                           tensor_data=TensorWriteData(
                                               chunk=ChunkStorageMetadata(offsets=off, sizes=torch.Size(box.sizes)),
                                               properties=TensorProperties.create_from_tensor(x), size=x.size())))
            self.plan = dataclasses.replace(plan, items=items)
            return self.plan

        def resolve_data(self, write_item):
            x = self.state_dict[write_item.index.fqn]
            if write_item.type != WriteItemType.SHARD:
                return x
            c = write_item.tensor_data.chunk
            return x[Box(tuple(c.offsets), tuple(c.sizes)).slices()].contiguous()

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save(state_dict, storage_writer=dcp.FileSystemWriter(str(path)), planner=ChunkedSavePlanner(),
                 no_dist=True)


def test_dcp_multi_chunk(tmp_path, monkeypatch):
    """Stored chunks like a sharded save's: boxes across chunk boundaries read exactly, and only the
    chunks that overlap a box are loaded."""
    src, _ = ext_pair(tmp_path, "tp2_to_tp3")
    layout = load_layout(src)
    ref = reference(layout.manifest)
    _chunked_save({k: v.clone() for k, v in ref.items()}, tmp_path / "chunked")
    s = open_source("dcp:" + str(tmp_path / "chunked"), layout)
    assert len(s.metadata.state_dict_metadata["embed_tokens.weight"].chunks) == 3  # rows 0:5, 5:10, 10:13
    assert_reads(s, layout, ref, seed=2)
    import torch.distributed.checkpoint.filesystem as fs
    loaded = []
    real = fs.torch.load

    def spy(*a, **k):
        x = real(*a, **k)
        loaded.append(tuple(x.shape))
        return x

    monkeypatch.setattr(fs.torch, "load", spy)
    assert torch.equal(s.read(0, Box((6, 1), (2, 3))), ref["embed_tokens.weight"][6:8, 1:4])
    assert loaded == [(5, 6)]  # the middle chunk only
    loaded.clear()
    assert torch.equal(s.read(0, Box((4, 0), (2, 6))), ref["embed_tokens.weight"][4:6])
    assert loaded == [(5, 6), (5, 6)]  # the two chunks the box straddles


@pytest.mark.skipif(not os.environ.get("RESHARD_SLOW_TESTS"), reason="spawns 2 processes (~15-30 s); "
                    "set RESHARD_SLOW_TESTS=1")
def test_dcp_dtensor_checkpoint(tmp_path):
    """A checkpoint saved by 2 gloo ranks from DTensors: boxes across stored chunks read exactly."""
    import torch.multiprocessing as mp
    src, _ = write_pair(tmp_path, "tp2_to_tp3")
    layout = load_layout(src)
    ref = reference(layout.manifest)
    placement = {"embed_tokens.weight": 0, "layers.0.attn.o_proj.weight": 1, "lm_head.weight": 0,
                 "layers.1.empty.weight": 0, "layers.1.norm.weight": 0}
    tensors = {n: (ref[n], placement.get(n)) for n in ref}
    out = tmp_path / "dt_dcp"
    mp.start_processes(_dtensor_saver, args=(str(tmp_path / "store"), str(out), tensors), nprocs=2,
                       start_method="spawn")
    s = open_source("dcp:" + str(out), layout)
    chunks = s.metadata.state_dict_metadata["embed_tokens.weight"].chunks
    assert len(chunks) == 2  # really sharded: the reads below cross chunk boundaries
    assert_reads(s, layout, ref)
    assert torch.equal(s.read(0, Box((5, 1), (4, 3))), ref["embed_tokens.weight"][5:9, 1:4])


# ------------------------------------------------------------------------------------------------ shards + sink


def write_shards(tmp_path: Path, src_layout, dst_layout, ref, out: Path) -> dict:
    sinks.prepare_out_dir(out, overwrite=False)
    reports = []
    for i, rank in enumerate(dst_layout.ranks):
        tensors, meta = {}, {}
        for t, p in enumerate(dst_layout.placements):
            if rank not in p.holder_set:
                continue
            spec = dst_layout.manifest.tensors[t]
            box = p.box_of(spec.shape, rank)
            x = ref[spec.name][box.slices()]  # a view: the sink makes it contiguous
            tensors[spec.name] = x
            meta[spec.name] = {"shape": list(spec.shape), "offsets": list(box.offsets),
                               "local_shape": list(box.sizes), "dtype": spec.dtype,
                               "checksum": fmt(checksum(x, box, spec.shape))}
        path = sinks.write_rank_file(out, i, tensors)
        assert path == out / sinks.rank_file_name(i)
        reports.append({"index": i, "rank": rank, "tensors": meta})
    manifest = sinks.build_manifest(src_layout, dst_layout, list(reversed(reports)))
    sinks.write_manifest(out, manifest)
    return manifest


@pytest.mark.parametrize("pair", list(PAIRS))
def test_shards_roundtrip(tmp_path, pair):
    src_path, dst_path = ext_pair(tmp_path, pair)
    src, dst = load_pair(src_path, dst_path)
    ref = reference(src.manifest)
    out = tmp_path / "out"
    m = write_shards(tmp_path, src, dst, ref, out)
    assert m["format"] == sinks.FORMAT and m["model"] == src.manifest.name
    assert [r["index"] for r in m["ranks"]] == list(range(dst.size))
    assert m["ranks"][1]["file"] == "rank-00001.safetensors" and m["ranks"][1]["rank"] == dst.ranks[1]
    assert m["src"]["yaml"] == src_path.read_text() and m["dst"]["ranks"] == list(dst.ranks)
    assert sinks.read_manifest(out) == json.loads(json.dumps(m))
    assert not list(out.glob("*.tmp")) and not list(out.glob(".*"))
    # read back as the source of the *src* layout: every src rank's boxes, and odd boxes
    s = open_source("shards:" + str(out), src)
    assert isinstance(s, ShardsSource) and s.kind == "shards" and f"({dst.size} rank files)" in s.description
    assert_reads(s, src, ref)
    s.close()


def test_shards_reads_replicas_once(tmp_path, monkeypatch):
    src_path, dst_path = write_pair(tmp_path, "pp2_ep2_to_dp2_tp2")  # dst: dp2 replicas
    src, dst = load_pair(src_path, dst_path)
    ref = reference(src.manifest)
    out = tmp_path / "out"
    write_shards(tmp_path, src, dst, ref, out)
    s = open_source("shards:" + str(out), src)
    import reshard_cli.io.sources as sources
    calls = []
    real = sources._read_slice

    def spy(handles, file, name, slices, sizes, dtype, what):
        calls.append((file.name, name, sizes))
        return real(handles, file, name, slices, sizes, dtype, what)

    monkeypatch.setattr(sources, "_read_slice", spy)
    t = src.manifest.index("embed_tokens.weight")
    assert torch.equal(s.read(t, Box.full((13, 6))), ref["embed_tokens.weight"])
    assert sum(math_prod(c[2]) for c in calls) == 13 * 6  # each element read once despite 2 replicas
    calls.clear()
    t = src.manifest.index("norm.weight")  # replicated on all 4 dst ranks
    assert torch.equal(s.read(t, Box((1,), (4,))), ref["norm.weight"][1:5])
    assert calls == [("rank-00000.safetensors", "norm.weight", (4,))]


def math_prod(xs):
    n = 1
    for x in xs:
        n *= x
    return n


def test_shards_errors(tmp_path):
    src_path, dst_path = write_pair(tmp_path, "tp2_to_tp3")
    src, dst = load_pair(src_path, dst_path)
    ref = reference(src.manifest)
    out = tmp_path / "out"
    m = write_shards(tmp_path, src, dst, ref, out)
    # missing rank file
    (out / "rank-00002.safetensors").rename(tmp_path / "moved.safetensors")
    s = open_source("shards:" + str(out), src)
    _check_error(s, src, "rank-00002.safetensors", "rank file is missing")
    with pytest.raises(ConfigError, match="rank-00002.safetensors"):
        s.read(0, Box.full((13, 6)))
    (tmp_path / "moved.safetensors").rename(out / "rank-00002.safetensors")
    # a rank missing from the manifest: check sees the gap, read names the tensor
    m2 = json.loads(json.dumps(m))
    del m2["ranks"][1]
    sinks.write_manifest(out, m2)
    s = open_source("shards:" + str(out), src)
    _check_error(s, src, "manifest.json", "'embed_tokens.weight'", "do not tile it")
    with pytest.raises(RuntimeFailure, match="embed_tokens.weight"):
        s.read(0, Box.full((13, 6)))
    # wrong shape / dtype / missing tensor in the manifest
    m3 = json.loads(json.dumps(m))
    for r in m3["ranks"]:
        r["tensors"]["norm.weight"]["dtype"] = "float16"
    sinks.write_manifest(out, m3)
    _check_error(open_source("shards:" + str(out), src), src, "manifest.json", "'norm.weight'", "dtype float16")
    m4 = json.loads(json.dumps(m))
    for r in m4["ranks"]:
        del r["tensors"]["lm_head.weight"]
    sinks.write_manifest(out, m4)
    _check_error(open_source("shards:" + str(out), src), src, "manifest.json", "'lm_head.weight' is missing")
    # missing manifest
    (out / "manifest.json").unlink()
    with pytest.raises(ConfigError, match="manifest.json"):
        open_source("shards:" + str(out), src)


def test_shards_partial_overlap(tmp_path):
    """Shards that overlap partly (not produced by the sink, but legal to read): each element taken once."""
    src, _ = write_pair(tmp_path, "tp2_to_tp3")
    layout = load_layout(src)
    ref = reference(layout.manifest)["norm.weight"]
    out = tmp_path / "out"
    sinks.prepare_out_dir(out, overwrite=False)
    reports = []
    for i, (o, n) in enumerate([(0, 4), (2, 3), (5, 1)]):
        sinks.write_rank_file(out, i, {"norm.weight": ref[o:o + n]})
        reports.append({"index": i, "rank": 10 + i, "tensors": {"norm.weight": {
            "shape": [6], "offsets": [o], "local_shape": [n], "dtype": "float32", "checksum": "0" * 16}}})
    sinks.write_manifest(out, sinks.build_manifest(layout, layout, reports))
    s = open_source("shards:" + str(out), layout)
    t = layout.manifest.index("norm.weight")
    for box in (Box((0,), (6,)), Box((1,), (4,)), Box((3,), (3,))):
        assert torch.equal(s.read(t, box), ref[box.slices()])


def test_dcp_with_process_group_initialized(tmp_path):
    """During a run every rank has a gloo group: DcpSource must still read locally (no collectives)."""
    import torch.distributed as dist
    src, _ = write_pair(tmp_path, "tp2_to_tp3")
    layout = load_layout(src)
    ref = reference(layout.manifest)
    dcp_save({k: v.clone() for k, v in ref.items()}, tmp_path / "d")
    s = open_source("dcp:" + str(tmp_path / "d"), layout)
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert torch.equal(s.read(1, Box((2, 1), (5, 4))), ref["layers.0.attn.q_proj.weight"][2:7, 1:5])
    finally:
        dist.destroy_process_group()


# ------------------------------------------------------------------------------------------------ sink details


def test_prepare_out_dir(tmp_path):
    out = tmp_path / "a" / "out"
    sinks.prepare_out_dir(out, overwrite=False)  # created
    assert out.is_dir()
    sinks.prepare_out_dir(out, overwrite=False)  # empty: fine
    sinks.write_rank_file(out, 0, {"x": torch.ones(2)})
    (out / "manifest.json").write_text("{}")
    (out / ".rank-00001.safetensors.123.tmp").write_text("partial")
    with pytest.raises(ConfigError, match=r"output directory is not empty \(use --overwrite\)") as e:
        sinks.prepare_out_dir(out, overwrite=False)
    assert str(out) in str(e.value)
    sinks.prepare_out_dir(out, overwrite=True)
    assert list(out.iterdir()) == []
    sinks.write_rank_file(out, 0, {"x": torch.ones(2)})
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ConfigError, match="notes.txt"):
        sinks.prepare_out_dir(out, overwrite=True)
    assert (out / "notes.txt").exists() and (out / "rank-00000.safetensors").exists()  # nothing removed
    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(ConfigError, match="not a directory"):
        sinks.prepare_out_dir(f, overwrite=True)


def test_write_rank_file(tmp_path):
    from safetensors import safe_open
    base = torch.arange(24, dtype=torch.float32).reshape(4, 6)
    tensors = {"t": base.t(), "v1": base[:2], "v2": base[2:], "e": torch.empty(0, 4, dtype=torch.bfloat16),
               "i": torch.arange(5, dtype=torch.int64), "s": torch.tensor(3, dtype=torch.int64),
               "b": torch.ones(6, dtype=torch.bfloat16)[::2]}
    p = sinks.write_rank_file(tmp_path, 7, tensors)
    assert p.name == "rank-00007.safetensors" == sinks.rank_file_name(7)
    assert [x.name for x in tmp_path.iterdir()] == [p.name]  # no *.tmp left behind
    with safe_open(str(p), framework="pt") as f:
        for k, v in tensors.items():
            assert torch.equal(f.get_tensor(k), v), k
    # a failing write leaves neither the final name nor a temp file
    with pytest.raises(Exception):
        sinks.write_rank_file(tmp_path, 8, {"x": torch.ones(2).to_sparse()})
    assert [x.name for x in tmp_path.iterdir()] == [p.name]


def test_read_manifest_errors(tmp_path):
    with pytest.raises(ConfigError, match=r"manifest.json: manifest is missing"):
        sinks.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text("{not json")
    with pytest.raises(ConfigError, match=r"manifest.json: corrupt manifest"):
        sinks.read_manifest(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format": "other/9", "ranks": []}))
    with pytest.raises(ConfigError, match=r"manifest.json: format: unknown format"):
        sinks.read_manifest(tmp_path)
    sinks.write_manifest(tmp_path, {"format": sinks.FORMAT, "ranks": []})
    assert sinks.read_manifest(tmp_path)["ranks"] == []
    assert [x.name for x in tmp_path.iterdir()] == ["manifest.json"]


# ------------------------------------------------------------------------------------------------ open_source


def test_open_source_specs(tmp_path):
    src, _ = write_pair(tmp_path, "tp2_to_tp3")
    layout = load_layout(src)
    assert open_source("synthetic", layout).kind == "synthetic"
    with pytest.raises(ConfigError, match=r"source\.kind: unknown source kind 'zip'") as e:
        open_source({"kind": "zip", "path": "x"}, layout)
    assert str(src) in str(e.value)
    with pytest.raises(ConfigError, match=r"source\.paht: unknown key"):
        open_source({"kind": "safetensors", "paht": "x"}, layout)
    with pytest.raises(ConfigError, match=r"source\.path: missing required key"):
        open_source({"kind": "dcp"}, layout)
    with pytest.raises(ConfigError, match=r"source\.seed"):
        open_source({"kind": "synthetic", "seed": "x"}, layout)
    with pytest.raises(ConfigError, match=r"source\.path: safetensors source not found"):
        open_source({"kind": "safetensors", "path": "nope/"}, layout)
    with pytest.raises(ConfigError, match=r"source: expected synthetic or KIND:PATH"):
        open_source("tar:foo", layout)
    with pytest.raises(ConfigError, match=r"source: expected synthetic or KIND:PATH"):
        open_source("safetensors", layout)
