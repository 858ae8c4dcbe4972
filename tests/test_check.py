"""`reshard check`: output directories written directly (no torchrun) from the synthetic values and the dst
layout's boxes, checked as they are and after each kind of damage."""
import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import PAIRS, ROOT, call_main, write_pair
from reshard_cli.io import sinks
from reshard_cli.base import checksums, rowsum
from reshard_cli.io.check import blocks, check_output
from reshard_cli.base.geometry import Box
from reshard_cli.formats import load_pair
from reshard_cli.io.sources import open_source
from reshard_cli.io.synthetic import synthetic_values

TRAIN, INFER = ROOT / "layouts/demo/train.yaml", ROOT / "layouts/demo/infer.yaml"


def make_output(src, dst, out, seed=0):
    """What `reshard run --out` writes, computed directly: each dst rank's boxes of the synthetic values."""
    src_l, dst_l = load_pair(src, dst)
    sinks.prepare_out_dir(out, overwrite=False)
    man = dst_l.manifest.tensors
    entries = []
    for i, r in enumerate(dst_l.ranks):
        tensors, listed = {}, {}
        for t, p in enumerate(dst_l.placements):
            if r in p.holder_set:
                spec, box = man[t], p.box_of(man[t].shape, r)
                x = synthetic_values(t, box, spec.shape, spec.dtype, seed)
                tensors[spec.name] = x
                listed[spec.name] = {"shape": list(spec.shape), "offsets": list(box.offsets),
                                     "local_shape": list(box.sizes), "dtype": spec.dtype,
                                     "checksum": checksums.fmt(checksums.checksum(x, box, spec.shape))}
        sinks.write_rank_file(out, i, tensors)
        entries.append({"index": i, "rank": r, "tensors": listed})
    sinks.write_manifest(out, sinks.build_manifest(src_l, dst_l, entries))
    return src_l, dst_l



@pytest.fixture(scope="module")
def good(tmp_path_factory):
    """pp2_ep2_to_dp2_tp2: PP + EP on the source, replicas on both sides, a bf16 and an empty tensor."""
    d = tmp_path_factory.mktemp("check")
    src, dst = write_pair(d, "pp2_ep2_to_dp2_tp2")
    make_output(src, dst, d / "out")
    return src, dst, d / "out"


@pytest.fixture
def copy(good, tmp_path):
    src, dst, out = good
    shutil.copytree(out, tmp_path / "out")
    return src, dst, tmp_path / "out"


def check(monkeypatch, capsys, src, dst, out, *more):
    return call_main(monkeypatch, capsys, "check", "--src", src, "--dst", dst, "--out", out, *more)


# ------------------------------------------------------------------------------------------------ passes


def test_blocks_tile_every_shard_in_row_major_order():
    for sizes in [(7,), (5, 3), (4, 3, 5), (2, 1, 3, 4), (3, 0), (), (1, 9)]:
        full = torch.arange(torch.Size(sizes).numel()).reshape(sizes)
        for limit in (1, 2, 5, 7, 12, 100):
            parts = []
            for offs, sz in blocks(sizes, limit):
                assert torch.Size(sz).numel() <= max(limit, 1)
                parts.append(full[tuple(slice(o, o + s) for o, s in zip(offs, sz))].reshape(-1))
            got = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64)
            assert torch.equal(got, full.reshape(-1)), (sizes, limit)


@pytest.mark.parametrize("pair", sorted(PAIRS))
def test_good_outputs_pass(tmp_path, pair):
    src, dst = write_pair(tmp_path, pair)
    _, dst_l = make_output(src, dst, tmp_path / "out")
    src_l, dst_l = load_pair(src, dst)
    want = sum(p.box_of(s.shape, r).numel * torch.empty(0, dtype=getattr(torch, s.dtype)).element_size()
               for r in dst_l.ranks for s, p in zip(dst_l.manifest.tensors, dst_l.placements) if r in p.holder_set)
    for block in (5, 1 << 18):  # tiny blocks: shards split along several dims
        res = check_output(src_l, dst_l, tmp_path / "out", block_elems=block)
        assert res.ok, [p.text() for p in res.problems]
        assert res.bytes == want and len(res.ranks) == dst_l.size
        assert all(r.checksum_ok and r.mismatches == 0 for r in res.ranks)


def test_demo_pair_cli_and_json(tmp_path, monkeypatch, capsys):
    out, js = tmp_path / "out", tmp_path / "check.json"
    make_output(TRAIN, INFER, out)
    r = check(monkeypatch, capsys, TRAIN, INFER, out, "--json", js)
    assert r.returncode == 0, (r.stdout, r.stderr)
    lines = r.stdout.splitlines()
    assert lines[0].startswith("reshard check: tiny-moe") and "all ok" in lines[-1] and "GB/s" in lines[-1]
    assert "rank-00001.safetensors" in r.stdout and "checksum" in r.stdout
    doc = json.loads(js.read_text())
    assert doc["ok"] and doc["problems"] == [] and doc["tensors"] == 226 and doc["bytes"] > 13_000_000
    assert [x["rank"] for x in doc["ranks"]] == [2, 3] and all(x["checksum_ok"] for x in doc["ranks"])


def test_other_source_kinds(good, tmp_path):
    """A safetensors checkpoint and a shard directory as the source, as `run` takes them."""
    src, dst, out = good
    src_l, dst_l = load_pair(src, dst)
    full = {s.name: synthetic_values(t, Box.full(s.shape), s.shape, s.dtype, 0) + 0
            for t, s in enumerate(src_l.manifest.tensors)}
    save_file(full, tmp_path / "ckpt.safetensors")
    assert check_output(src_l, dst_l, out, f"safetensors:{tmp_path / 'ckpt.safetensors'}").ok
    assert check_output(src_l, dst_l, out, f"shards:{out}").ok
    # the src layout's source: key is the default
    layout = tmp_path / "src-ckpt.yaml"
    layout.write_text(src.read_text() + f"source: {{kind: safetensors, path: {tmp_path / 'ckpt.safetensors'}}}\n")
    shutil.copy(src.parent / "model.yaml", tmp_path / "model.yaml")
    s2, d2 = load_pair(layout, dst)
    assert check_output(s2, d2, out).ok
    # another seed: every non-empty shard differs
    res = check_output(src_l, dst_l, out, "synthetic:3")
    assert not res.ok and {p.kind for p in res.problems} == {"values"}


# ------------------------------------------------------------------------------------------------ faults


def _rewrite(path, change):
    tensors = load_file(path)
    change(tensors)
    save_file(tensors, path)


def _flip_byte(path, name, element):
    raw = bytearray(path.read_bytes())
    n = int.from_bytes(raw[:8], "little")
    entry = json.loads(raw[8:8 + n])[name]
    item = {"F32": 4, "BF16": 2}[entry["dtype"]]
    raw[8 + n + entry["data_offsets"][0] + element * item] ^= 0x10
    path.write_bytes(bytes(raw))


def _manifest(out, change):
    doc = json.loads((out / "manifest.json").read_text())
    change(doc)
    (out / "manifest.json").write_text(json.dumps(doc))


Q = "layers.0.attn.q_proj.weight"


def test_one_flipped_byte(copy, monkeypatch, capsys, tmp_path):
    src, dst, out = copy
    # rank-00001 is dst rank 5 (dp 0, tp 1): rows 5:9 of q_proj [9, 6]; element 7 is local [1, 1]
    _flip_byte(out / "rank-00001.safetensors", Q, 7)
    r = check(monkeypatch, capsys, src, dst, out, "--json", tmp_path / "c.json")
    assert r.returncode == 1
    assert f"rank 5 (rank-00001.safetensors) tensor '{Q}': 1 element differs from the source, first at [6, 1] " \
           f"(shard index [1, 1])" in r.stdout
    assert "checksum of the file's shard is" in r.stdout
    assert "WRONG" in r.stdout and "FAILED: 2 problems" in r.stdout
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and "check failed: 2 problems on rank 5" in err[0]
    doc = json.loads((tmp_path / "c.json").read_text())
    values = [p for p in doc["problems"] if p["kind"] == "values"]
    assert values == [{"kind": "values", "message": values[0]["message"], "index": 1, "rank": 5, "tensor": Q,
                       "count": 1, "first_index": [6, 1], "local_index": [1, 1]}]
    assert not doc["ok"] and doc["ranks"][1]["mismatches"] == 2 and doc["ranks"][1]["checksum_ok"] is False
    assert doc["ranks"][0]["mismatches"] == 0 and doc["ranks"][0]["checksum_ok"] is True


@pytest.mark.parametrize("fault, expect", [
    ("missing_file", "rank 6 (rank-00002.safetensors): rank file rank-00002.safetensors is missing"),
    ("missing_tensor", f"rank 4 (rank-00000.safetensors) tensor '{Q}': missing from rank-00000.safetensors"),
    ("extra_tensor", "rank 4 (rank-00000.safetensors) tensor 'stray.weight': extra tensor in rank-00000"),
    ("wrong_shape", f"rank 4 (rank-00000.safetensors) tensor '{Q}': shape [4, 6] in rank-00000.safetensors, "
                    f"the dst layout's shard is [5, 6]"),
    ("wrong_dtype", f"rank 4 (rank-00000.safetensors) tensor '{Q}': dtype float64 in rank-00000.safetensors, "
                    f"the model says float32"),
    ("bf16_values", "rank 7 (rank-00003.safetensors) tensor 'layers.1.norm.weight': 6 elements differ from the "
                    "source, first at [0]"),
    ("manifest_incomplete", "rank 7 (rank-00003.safetensors): manifest is incomplete: it has no entry for this "
                            "rank of the dst layout"),
    ("manifest_offsets", f"rank 5 (rank-00001.safetensors) tensor '{Q}': manifest offsets [0, 0], the dst layout "
                         f"says [5, 0]"),
    ("manifest_checksum", f"rank 4 (rank-00000.safetensors) tensor '{Q}': checksum of the file's shard is"),
    ("manifest_rank", "rank 4 (rank-00000.safetensors): manifest says global rank 9, the dst layout has 4"),
    ("extra_rank_file", "output: extra rank file rank-00004.safetensors: the dst layout has 4 ranks"),
])
def test_faults_are_caught(copy, monkeypatch, capsys, fault, expect):
    src, dst, out = copy
    f0 = out / "rank-00000.safetensors"
    if fault == "missing_file":
        (out / "rank-00002.safetensors").unlink()
    elif fault == "missing_tensor":
        _rewrite(f0, lambda t: t.pop(Q))
    elif fault == "extra_tensor":
        _rewrite(f0, lambda t: t.update({"stray.weight": torch.zeros(3)}))
    elif fault == "wrong_shape":
        _rewrite(f0, lambda t: t.update({Q: t[Q][:4].clone()}))
    elif fault == "wrong_dtype":
        _rewrite(f0, lambda t: t.update({Q: t[Q].double()}))
    elif fault == "bf16_values":  # a replicated bf16 tensor, every element changed
        _rewrite(out / "rank-00003.safetensors",
                 lambda t: t.update({"layers.1.norm.weight": t["layers.1.norm.weight"] + 1}))
    elif fault == "manifest_incomplete":
        _manifest(out, lambda d: d["ranks"].pop(3))
    elif fault == "manifest_offsets":
        _manifest(out, lambda d: d["ranks"][1]["tensors"][Q].update(offsets=[0, 0]))
    elif fault == "manifest_checksum":
        _manifest(out, lambda d: d["ranks"][0]["tensors"][Q].update(checksum="0" * 16))
    elif fault == "manifest_rank":
        _manifest(out, lambda d: d["ranks"][0].update(rank=9))
    elif fault == "extra_rank_file":
        shutil.copy(f0, out / "rank-00004.safetensors")
    r = check(monkeypatch, capsys, src, dst, out)
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert expect in r.stdout, r.stdout
    assert len(r.stderr.strip().splitlines()) == 1 and r.stderr.startswith("reshard: error: check failed")
    assert "Traceback" not in r.stderr


def test_manifest_missing_is_bad_input(copy, monkeypatch, capsys):
    src, dst, out = copy
    (out / "manifest.json").unlink()
    r = check(monkeypatch, capsys, src, dst, out)
    assert r.returncode == 2 and r.stdout == ""
    err = r.stderr.strip().splitlines()
    assert len(err) == 1 and f"{out / 'manifest.json'}: manifest is missing" in err[0]


def test_manifest_for_other_layouts(copy, monkeypatch, capsys, tmp_path):
    """The output of one dst layout checked against another: names the rank and the tensor."""
    src, dst, out = copy
    other = tmp_path / "other.yaml"  # same ranks, q_proj sharded on dim 1 instead of 0; then other ranks
    other.write_text(dst.read_text().replace("'q_proj|up_proj|embed|lm_head', shard: {tp: 0}",
                                             "'q_proj|up_proj|embed|lm_head', shard: {tp: 1}"))
    shutil.copy(dst.parent / "model.yaml", tmp_path / "model.yaml")
    r = check(monkeypatch, capsys, src, other, out)
    assert r.returncode == 1
    assert f"rank 4 (rank-00000.safetensors) tensor '{Q}': manifest local_shape [5, 6], the dst layout says [9, 3]" \
           in r.stdout
    assert f"rank 4 (rank-00000.safetensors) tensor '{Q}': shape [5, 6] in rank-00000.safetensors" in r.stdout
    moved = tmp_path / "moved.yaml"
    moved.write_text("ranks: 8-11\n" + dst.read_text())
    r = check(monkeypatch, capsys, src, moved, out)
    assert r.returncode == 1
    assert "output: manifest's dst ranks 4-7 differ from the dst layout's 8-11" in r.stdout
    assert "rank 8 (rank-00000.safetensors): manifest says global rank 4, the dst layout has 8" in r.stdout


# ------------------------------------------------------------------------------------------------ fast paths


DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float64, torch.float8_e4m3fn, torch.float8_e5m2,
          torch.int8, torch.uint8, torch.int16, torch.int32, torch.int64, torch.bool]


def _random_region(g, dtype, ndim, wide=False):
    """A random global shape, a box inside it (offsets often non-zero) and random raw bits for the box."""
    shape = tuple(int(torch.randint(1, 12, (), generator=g)) for _ in range(ndim))
    if wide and ndim:  # more columns than one float64 step of the checksum (65536)
        shape = shape[:-1] + (70003,)
    offs = tuple(int(torch.randint(0, n, (), generator=g)) for n in shape)
    sizes = tuple(int(torch.randint(1, n - o + 1, (), generator=g)) for n, o in zip(shape, offs))
    n = torch.Size(sizes).numel()
    raw = torch.randint(0, 256, (n * dtype.itemsize,), dtype=torch.uint8, generator=g)
    x = (raw[:n] & 1).bool() if dtype == torch.bool else raw.view(dtype)
    return shape, Box(offs, sizes), x.reshape(sizes)


def _np(x):
    """A torch tensor's raw bits as the numpy view `rowsum` and check read (no copy: same memory, same strides)."""
    return x.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[x.element_size()]).numpy()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fast_checksum_is_bit_identical(dtype):
    """rowsum.RowChecksum (numpy, raw bits) / checksum_block give exactly checksums.checksum (torch): any dtype, 0-4
    dims, offsets, > 65536 columns, strided input, rows fed in chunks or as row sums."""
    g = torch.Generator().manual_seed(7)
    buf = rowsum.checksum_buffer()
    for trial in range(40):
        ndim = trial % 5
        shape, box, x = _random_region(g, dtype, ndim, wide=trial % 7 == 3)
        want = checksums.checksum(x, box, shape)
        assert checksums.checksum_block(x, box, shape) == want, (shape, box)
        assert checksums.checksum_block(x, box, shape, buf) == want
        if ndim >= 2:  # a strided view of the same values
            xt = x.transpose(0, -1).contiguous().transpose(0, -1)
            assert not xt.is_contiguous() or x.shape[0] == 1 or x.shape[-1] == 1
            assert checksums.checksum_block(xt, box, shape, buf) == want
        cs = rowsum.RowChecksum(box, shape, x.element_size(), buf)
        rows = _np(x).reshape(cs.rows.size, cs.ncols)
        half = rows.shape[0] // 2
        cs.update(0, rows[:half])
        cs.set_row_sums(half, cs.row_sums(rows[half:]))
        assert cs.value() == want


def test_fast_checksum_block_sizes():
    """The checksum of a shard fed block by block (check's blocks) equals the checksum of the whole shard."""
    g = torch.Generator().manual_seed(3)
    shape, box = (10, 40, 7), Box((3, 11, 2), (6, 25, 5))
    x = torch.randn(box.sizes, generator=g).to(torch.bfloat16)
    want = checksums.checksum(x, box, shape)
    for limit in (1, 5, 6, 7, 35, 1000, 1 << 20):
        total = 0
        for offs, sizes in blocks(box.sizes, limit):
            sub = Box(tuple(o + a for o, a in zip(box.offsets, offs)), sizes)
            total += checksums.checksum_block(x[tuple(slice(a, a + s) for a, s in zip(offs, sizes))], sub, shape)
        assert total & ((1 << 64) - 1) == want, limit


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float16, torch.float8_e4m3fn,
                                   torch.float8_e5m2, torch.float64, torch.int8, torch.int32, torch.int64,
                                   torch.uint8, torch.bool], ids=str)
def test_fast_synthetic_values_are_the_generator_s(dtype):
    """Blocks `reshard check` generates (numpy, raw bits, into scratch) equal torch's synthetic_values bit for bit
    (seeds, tensor indices, 0-3 dims, flat indices past 2^32, rows starting at every lane of a hash word, rows
    across span boundaries, many narrow rows per span), and `_compare` finds one damaged element among them, where
    it is, and gives the file's checksum."""
    from reshard_cli.io.check import _compare, _Scratch, _SyntheticBlocks

    scratch = _Scratch()
    name = str(dtype).removeprefix("torch.")
    cases = [((5000,), Box((123,), (4000,))), ((1 << 40,), Box(((1 << 35) + 77,), (3000,))),
             ((300, 256), Box((17, 0), (200, 256))), ((256, 1000), Box((0, 500), (256, 500))),
             ((7, 9, 11), Box((1, 2, 3), (5, 6, 7))), ((3, 70000), Box((1, 3), (2, 69990))),
             ((1 << 20, 4096), Box(((1 << 20) - 8, 1024), (8, 1024))), ((64, 3001), Box((3, 7), (40, 2994))),
             ((50, 7), Box((3, 2), (40, 3))), ((), Box((), ())), ((1,), Box((0,), (1,))),
             ((5, 1 << 21), Box((1, (1 << 20) - 5), (3, (1 << 20) + 10)))]
    for t, seed in [(0, 0), (5, 3), (112, -7), (1000, 123456789)]:
        for shape, box in cases:
            gen = _SyntheticBlocks.make(t, shape, name, seed)
            assert gen is not None
            rows = rowsum.row_ids(box, shape)
            values = synthetic_values(t, box, shape, dtype, seed)
            want = _np(values).reshape(rows.size, box.sizes[-1] if box.sizes else 1)
            got = gen.block(box, rows, np.empty_like(want), scratch)
            assert got.dtype == want.dtype and np.array_equal(got, want), (t, seed, shape, box)
            if seed == 3:
                assert _compare(want.reshape(box.sizes), gen.block, box, shape, 1 << 12, scratch)[:3] == (
                    0, None, checksums.checksum(values, box, shape))
                bad = want.copy()
                k = bad.size * 2 // 3
                bad.reshape(-1)[k] ^= 1
                n, first, csum, _ = _compare(bad.reshape(box.sizes), gen.block, box, shape, 1 << 12, scratch)
                local = np.unravel_index(k, box.sizes) if box.sizes else ()
                assert (n, first) == (1, [o + int(v) for o, v in zip(box.offsets, local)]), (shape, box)
                assert csum == checksums.checksum(torch.from_numpy(bad.reshape(box.sizes)).view(dtype), box, shape)


def test_same_bits_any_alignment():
    """The int64-word comparison is exact for blocks at any address (a file's tensor starts wherever the header
    says), strided sources, and differences in the head, body or tail bytes."""
    from reshard_cli.io.check import _Scratch, _same_bits

    scratch = _Scratch()
    same_bits = lambda a, b, scratch: _same_bits(_np(a), _np(b), scratch)  # noqa: E731 - the torch views' bits
    g = torch.Generator().manual_seed(5)
    for dtype in (torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float64):
        item = dtype.itemsize
        for shift in range(0, 16, item):
            for rows, cols in ((3, 5), (4, 8), (1, 1), (7, 12)):
                n = rows * cols * item
                raw = torch.randint(0, 256, (n + 16,), dtype=torch.uint8, generator=g)
                got = raw[shift:shift + n].view(dtype).view(rows, cols)
                wide = torch.zeros(rows, cols + 8, dtype=dtype)  # strided sources, word-aligned rows or not
                wide[:, 3:3 + cols] = got
                wide[:, 8 // item:8 // item + cols] = got
                for want in (got.clone(), wide[:, 3:3 + cols], wide[:, 8 // item:8 // item + cols]):
                    same = checksums.differing(got, want) is None
                    assert same_bits(got, want, scratch) == same
                    for pos in {0, n // item // 2, n // item - 1}:
                        bad = want.clone()
                        bad.view(-1).view(torch.uint8)[pos * item] ^= 1
                        assert not same_bits(got, bad, scratch)


def test_mapped_file_views(tmp_path):
    """A rank file's tensors as views of the mapped file equal what safetensors reads (every dtype, empty and
    scalar tensors), as torch tensors and as numpy raw bits at any alignment; a header our parser refuses is a
    ConfigError (check reports the file as one it cannot open)."""
    from reshard_cli.errors import ConfigError
    from reshard_cli.io.mapped import MappedSafetensors

    g = torch.Generator().manual_seed(1)
    tensors = {f"t{i}": _random_region(g, dt, i % 4)[2].clone() for i, dt in enumerate(DTYPES)}
    tensors["empty"] = torch.zeros(0, 4)
    tensors["odd"] = torch.arange(7, dtype=torch.int16).to(torch.bfloat16)  # the next bf16 tensor: not 8-aligned
    save_file(tensors, tmp_path / "f.safetensors")
    with MappedSafetensors(tmp_path / "f.safetensors") as m:
        back = load_file(tmp_path / "f.safetensors")
        for name, x in back.items():
            v = m.tensor(name)
            assert v is not None and v.dtype == x.dtype and v.shape == x.shape and checksums.differing(v, x) is None
            a = m.array(name)
            assert m.dtype(name) == str(x.dtype).removeprefix("torch.") and np.array_equal(a, _np(x))
        assert m.tensor("nope") is None
    (tmp_path / "bad.safetensors").write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}      ")
    with pytest.raises(ConfigError):
        MappedSafetensors(tmp_path / "bad.safetensors")


@pytest.fixture(scope="module")
def ckpt(good, tmp_path_factory):
    src, dst, out = good
    src_l, _ = load_pair(src, dst)
    path = tmp_path_factory.mktemp("ckpt") / "ckpt.safetensors"
    save_file({s.name: synthetic_values(t, Box.full(s.shape), s.shape, s.dtype, 0) + 0
               for t, s in enumerate(src_l.manifest.tensors)}, path)
    return path


O = "layers.0.attn.o_proj.weight"  # [6, 9], Shard(1) on tp: rank-00001 holds columns 5:9 (a strided source view)


@pytest.mark.parametrize("source", ["synthetic", "safetensors", "shards"])
@pytest.mark.parametrize("tensor, element, first, local", [(Q, 7, [6, 1], [1, 1]), (O, 9, [2, 6], [2, 1]),
                                                           (O, 0, [0, 5], [0, 0])])
def test_flipped_byte_every_source(copy, ckpt, tmp_path, source, tensor, element, first, local):
    """The same damage is found the same way whatever the source (generated, a mapped checkpoint, a copy of the
    output read with Source.read), and the reported checksum is the file's."""
    src, dst, out = copy
    pristine = tmp_path / "pristine"
    shutil.copytree(out, pristine)
    _flip_byte(out / "rank-00001.safetensors", tensor, element)
    spec = {"synthetic": "synthetic", "safetensors": f"safetensors:{ckpt}", "shards": f"shards:{pristine}"}[source]
    src_l, dst_l = load_pair(src, dst)
    with open_source(spec, src_l) as s:  # the checkpoint is read in place, the shard directory with read()
        assert (s.array(src_l.manifest.index(tensor)) is not None) == (source == "safetensors")
    res = check_output(src_l, dst_l, out, spec)
    values = [p for p in res.problems if p.kind == "values"]
    assert [(p.rank, p.tensor, p.count, p.first_index, p.local_index) for p in values] == \
        [(5, tensor, 1, first, local)]
    shard = load_file(out / "rank-00001.safetensors")[tensor]
    t = dst_l.manifest.index(tensor)
    box = dst_l.placements[t].box_of(dst_l.manifest.tensors[t].shape, 5)
    csum = checksums.fmt(checksums.checksum(shard, box, dst_l.manifest.tensors[t].shape))
    checks = [p for p in res.problems if p.kind == "checksum"]
    assert len(checks) == 1 and f"checksum of the file's shard is {csum}" in checks[0].message
    assert len(res.problems) == 2


def test_flipped_byte_in_a_large_shard(tmp_path):
    """The demo's embedding shard [1024, 256] (bf16), in one block or several: one damaged element is found where
    it is, and the checksum reported is the file's."""
    out = tmp_path / "out"
    src_l, dst_l = make_output(TRAIN, INFER, out)
    name = "model.embed_tokens.weight"
    _flip_byte(out / "rank-00000.safetensors", name, 1000 * 256 + 3)
    shard = load_file(out / "rank-00000.safetensors")[name]
    t = dst_l.manifest.index(name)
    spec = dst_l.manifest.tensors[t]
    csum = checksums.fmt(checksums.checksum(shard, dst_l.placements[t].box_of(spec.shape, dst_l.ranks[0]), spec.shape))
    for block in (1 << 16, 1 << 22):
        res = check_output(src_l, dst_l, out, block_elems=block)
        assert [(p.kind, p.tensor) for p in res.problems] == [("values", name), ("checksum", name)]
        assert (res.problems[0].count, res.problems[0].first_index) == (1, [1000, 3])
        assert f"checksum of the file's shard is {csum}" in res.problems[1].message


def _old_synthetic_bits(t, box, shape, seed=0):
    """bf16 bits of the previous generator's values (h = ((i * 2654435761) ^ ((t + 1) * 40503) ^ (seed * 97)) &
    0xFFFF): periodic in the flat index i with period 2^16."""
    i = checksums.global_index(box, shape)
    h = ((i * 2654435761) ^ ((t + 1) * 40503) ^ (seed * 97)) & 0xFFFF
    return (h.to(torch.float32) / 32768 - 1).to(torch.bfloat16).view(torch.int16)


@pytest.mark.parametrize("shift", [65536, -65536, 131072, 1])
def test_shard_misrouted_by_a_power_of_two_is_caught(tmp_path, monkeypatch, capsys, shift):
    """A shard holding the source's elements `shift` flat positions away (an off-by-2^16 read or send: the
    demo's embedding shard, rows 0:1024 of [2048, 256] bf16, is 262144 elements of consecutive flat indices),
    written with a manifest checksum that matches it, so only the values can tell: `reshard check` fails on it.
    The previous generator repeated every 2^16 elements and could not see a shift by 65536 or 131072."""
    out = tmp_path / "out"
    src_l, dst_l = make_output(TRAIN, INFER, out)
    name = "model.embed_tokens.weight"
    t = dst_l.manifest.index(name)
    spec = dst_l.manifest.tensors[t]
    box = dst_l.placements[t].box_of(spec.shape, dst_l.ranks[0])
    assert (box.offsets, box.sizes, spec.shape, spec.dtype) == ((0, 0), (1024, 256), (2048, 256), "bfloat16")
    n = 1024 * 256
    start = max(shift, 0)  # flat index where the misrouted data starts (shards of flat [0, n) or [-shift, ...))
    full = synthetic_values(t, Box.full(spec.shape), spec.shape, spec.dtype).reshape(-1)
    if shift < 0:  # rank 1's shard, rows 1024:2048, holding flat [n + shift, 2n + shift)
        box, start, f = dst_l.placements[t].box_of(spec.shape, dst_l.ranks[1]), n + shift, 1
    else:
        f = 0
    wrong = full[start:start + n].reshape(box.sizes).clone()
    right = full[box.offsets[0] * 256:box.offsets[0] * 256 + n].reshape(box.sizes)
    differ = int((wrong.view(torch.int16) != right.view(torch.int16)).sum())
    assert differ > n // 2  # most elements differ: nothing repeats at a power-of-two period
    if shift % 65536 == 0:  # the old values were the same there: the misroute was invisible on synthetic data
        moved = Box((box.offsets[0] + shift // 256, 0), box.sizes)
        assert torch.equal(_old_synthetic_bits(t, moved, spec.shape), _old_synthetic_bits(t, box, spec.shape))
    fname = f"rank-{f:05d}.safetensors"
    _rewrite(out / fname, lambda d: d.update({name: wrong}))
    _manifest(out, lambda d: d["ranks"][f]["tensors"][name].update(
        checksum=checksums.fmt(checksums.checksum(wrong, box, spec.shape))))
    res = check_output(src_l, dst_l, out)
    assert [(p.kind, p.tensor, p.rank, p.count) for p in res.problems] == [("values", name, dst_l.ranks[f], differ)]
    r = check(monkeypatch, capsys, TRAIN, INFER, out)
    assert r.returncode == 1 and f"{differ} elements differ from the source" in r.stdout, r.stdout


def test_threads_report_what_one_thread_reports(tmp_path, monkeypatch):
    """Shards compared on worker threads give the same problems, in the same order, with the same checksums and
    byte counts, as one thread: damage in several tensors of both rank files, repeating and wide rows."""
    from reshard_cli.io import check as check_mod

    out = tmp_path / "out"
    src_l, dst_l = make_output(TRAIN, INFER, out)
    for f, name, element in [("rank-00000.safetensors", "model.embed_tokens.weight", 1000 * 256 + 3),
                             ("rank-00000.safetensors", "model.norm.weight", 5),
                             ("rank-00001.safetensors", "model.layers.1.mlp.experts.3.down_proj.weight", 77),
                             ("rank-00001.safetensors", "model.embed_tokens.weight", 2)]:
        _flip_byte(out / f, name, element)
    results = []
    for threads in (1, 4):
        monkeypatch.setattr(check_mod._Workers, "MAX", threads)
        res = check_output(src_l, dst_l, out)
        results.append(([p.text() for p in res.problems], [(r.bytes, r.tensors, r.checksum_ok) for r in res.ranks]))
    assert results[0] == results[1]
    assert len([p for p in results[0][0] if "differ" in p]) == 4


@pytest.mark.parametrize("source", ["synthetic", "safetensors"])
def test_check_does_not_import_torch(ckpt, good, source):
    """`reshard check` with a synthetic or safetensors source runs on numpy alone (its start-up is not torch's)."""
    import subprocess
    import sys

    src, dst, out = good
    spec = "synthetic" if source == "synthetic" else f"safetensors:{ckpt}"
    code = ("import sys\nfrom reshard_cli.cli import main\nsys.argv = ['reshard', 'check', '--src', sys.argv[1], "
            "'--dst', sys.argv[2], '--out', sys.argv[3], '--source', sys.argv[4]]\n"
            "try:\n    main()\nexcept SystemExit as e:\n    assert not e.code, e.code\n"
            "assert 'torch' not in sys.modules, 'torch was imported'\nprint('no torch')\n")
    r = subprocess.run([sys.executable, "-c", code, str(src), str(dst), str(out), spec], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0 and "all ok" in r.stdout and "no torch" in r.stdout, (r.stdout, r.stderr)
