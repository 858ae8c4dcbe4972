"""The live-process API: plain tensors with YAML layouts, DTensors without, buffers written in place."""
import subprocess
import sys

import torch

from conftest import ROOT, write_pair
from dist_util import run_ranks


def _live(rank, world, src_path, dst_path):
    from reshard_cli.transfer.live import Refit
    from reshard_cli.formats import load_pair

    src, dst = load_pair(src_path, dst_path)
    man = src.manifest.tensors
    role = "src" if rank in src.ranks else "dst" if rank in dst.ranks else "idle"
    refit = Refit(role=role, src=src_path, dst=dst_path, mode="hybrid")
    results = []
    buffers: dict = {}  # the destination buffers of the first refit, reused (in place) later
    sources: dict = {}  # step 1 updates the step-0 source tensors in place (the binding is kept); 2 passes new ones
    for step in range(3):
        full = {s.name: (torch.arange(s.numel, dtype=torch.float32).reshape(s.shape) * (step + 1)).to(
            getattr(torch, s.dtype)) for s in man}
        tensors = {}
        for t, s in enumerate(man):
            layout = src if role == "src" else dst
            if role != "idle" and rank in layout.placements[t].holder_set:
                box = layout.placements[t].box_of(s.shape, rank)
                if role == "src" and step == 1:
                    tensors[s.name] = sources[s.name].copy_(full[s.name][box.slices()])
                elif role == "src":
                    tensors[s.name] = sources[s.name] = full[s.name][box.slices()].clone()
                else:
                    tensors[s.name] = buffers[s.name] if step else torch.full(box.sizes, -7.0).to(full[s.name].dtype)
        if role == "dst" and step == 0:
            buffers.update(tensors)
        stats = refit(tensors, verify_checksums=True)
        ok = stats.checksums_ok
        if role == "dst":
            for t, s in enumerate(man):
                if s.name in tensors:
                    box = dst.placements[t].box_of(s.shape, rank)
                    ok = ok and torch.equal(tensors[s.name], full[s.name][box.slices()])
        results.append(ok)
    return results


def test_yaml_layouts_plain_tensors(tmp_path):
    src, dst = write_pair(tmp_path, "pp2_ep2_to_dp2_tp2")
    results = run_ranks(9, _live, str(src), str(dst))  # rank 8 is idle
    assert all(all(r) for r in results.values()), results


def test_live_refit_example():
    r = subprocess.run([sys.executable, str(ROOT / "examples/live_refit.py")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "outputs equal after every refit" in r.stdout
    assert r.stdout.count("checksums ok") == 5


def _own_group(rank, world, src_path, dst_path, port):
    """The refit runs over its own group, numbered backwards from the default one: a message sent on the
    default group would reach the wrong process, so exact results prove only the refit group carried them."""
    from reshard_cli.formats import load_pair
    from reshard_cli.transfer.comm import refit_group
    from reshard_cli.transfer.live import Refit

    group = refit_group("127.0.0.1", port, world - 1 - rank, world)
    me = group.rank
    src, dst = load_pair(src_path, dst_path)
    man = src.manifest.tensors
    role = "src" if me in src.ranks else "dst" if me in dst.ranks else "idle"
    refit = Refit(role=role, src=src_path, dst=dst_path, mode="reshard", group=group)
    full = {s.name: (torch.arange(s.numel, dtype=torch.float32).reshape(s.shape) + 0.5).to(getattr(torch, s.dtype))
            for s in man}
    layout = src if role == "src" else dst
    tensors = {}
    if role != "idle":
        for t, box in layout.held(me):
            s = man[t]
            tensors[s.name] = full[s.name][box.slices()].clone() if role == "src" else \
                torch.full(box.sizes, -7.0).to(full[s.name].dtype)
    stats = refit(tensors, verify_checksums=True)
    exact = all(torch.equal(tensors[man[t].name], full[man[t].name][box.slices()])
                for t, box in dst.held(me)) if role == "dst" else True
    return stats.checksums_ok and exact


def test_refit_over_its_own_group(tmp_path):
    from dist_util import free_port

    src, dst = write_pair(tmp_path, "tp2_to_tp3")
    results = run_ranks(5, _own_group, str(src), str(dst), free_port())
    assert all(results.values()), results


def test_own_group_needs_reshard_mode():
    import pytest

    from reshard_cli.errors import ConfigError
    from reshard_cli.transfer.comm import GroupComm
    from reshard_cli.transfer.live import Refit

    with pytest.raises(ConfigError, match="mode reshard"):
        Refit(role="idle", mode="hybrid", group=GroupComm(None, 0, 1))
    assert Refit(role="idle", group=GroupComm(None, 0, 1)).mode == "reshard"  # auto, the default: reshard path only
