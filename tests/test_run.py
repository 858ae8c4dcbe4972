"""`reshard run` end to end, as a user runs it: it starts torchrun itself (gloo, CPU processes)."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from conftest import ROOT, write_pair
from dist_util import shm_files, shm_files_left

TRAIN, INFER = ROOT / "layouts/demo/train.yaml", ROOT / "layouts/demo/infer.yaml"


def reshard(*args, faults=None, timeout=240):
    """`reshard ARGS` as a user runs it; with `faults`, through tests/faults.py, which injects them in the
    workers through the run's hooks."""
    entry = ["-m", "reshard_cli"] if faults is None else [str(ROOT / "tests" / "faults.py"), faults]
    e = dict(os.environ, CI="true")
    return subprocess.run([sys.executable, *entry, *map(str, args)], cwd=ROOT, env=e,
                          capture_output=True, text=True, timeout=timeout)


def test_demo_run_out_json_and_feed_back(tmp_path):
    out, js = tmp_path / "out", tmp_path / "run.json"
    r = reshard("run", "--src", TRAIN, "--dst", INFER, "--out", out, "--json", js, "--iters", "2", "--quiet")
    assert r.returncode == 0, r.stderr
    assert "#wrong" in r.stdout and "link limit" in r.stdout
    doc = json.loads(js.read_text())
    for key in ("mode", "seconds", "bytes", "gbps", "wire_bytes", "wrong", "peak_staging_bytes",
                "link_limit_gbps", "checksums", "paths"):
        assert key in doc
    assert doc["wrong"] == 0 and set(doc["checksums"]) == {"2", "3"}
    # the default mode auto, with no topology to weigh routes by, sends everything on the reshard path
    assert doc["mode"] == "auto" and set(doc["paths"]) == {"reshard"}
    man = json.loads((out / "manifest.json").read_text())
    assert [r["file"] for r in man["ranks"]] == ["rank-00000.safetensors", "rank-00001.safetensors"]
    # the files hold exactly the slices the manifest describes
    shard = load_file(out / "rank-00001.safetensors")
    entry = man["ranks"][1]["tensors"]["model.layers.1.mlp.experts.3.down_proj.weight"]
    assert list(shard["model.layers.1.mlp.experts.3.down_proj.weight"].shape) == entry["local_shape"]
    # a non-empty output directory is refused, before any process starts
    r = reshard("run", "--src", TRAIN, "--dst", INFER, "--out", out, "--quiet")
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--overwrite" in r.stderr
    # the output feeds back in as a source (another layout: 2 replicas), reshard mode
    src = tmp_path / "back.yaml"
    src.write_text(TRAIN.read_text().replace("model: tiny-moe", f"model: tiny-moe\nsource: {{kind: shards, path: {out}}}"))
    dst = tmp_path / "dp.yaml"
    dst.write_text("model: tiny-moe\nmesh: {dp: 2}\n")
    r = reshard("run", "--src", src, "--dst", dst, "--mode", "reshard", "--quiet", "--no-link-test")
    assert r.returncode == 0, r.stderr
    assert "verified by checksums" in r.stdout and "WRONG" not in r.stdout


@pytest.mark.parametrize("faults", ["corrupt:2,missing:3", "misplaced:2,duplicated:3"])
def test_injected_faults_are_caught(tmp_path, faults):
    out = tmp_path / "out"
    r = reshard("run", "--src", TRAIN, "--dst", INFER, "--quiet", "--no-link-test", "--out", out,
                faults=faults)
    assert r.returncode == 1
    assert r.stdout.count("WRONG") == 2, r.stdout
    assert "verification failed" in r.stderr
    assert not (out / "manifest.json").exists()  # never a complete-looking output


def test_shared_memory_transport_run_is_exact_and_leaves_no_file(tmp_path):
    """`--transport shm`: the demo over shared memory, exact (values and checksums) and the same checksums as
    over gloo; its files in /dev/shm gone when the job ends."""
    before = shm_files()
    docs = {}
    for transport in ("gloo", "shm"):
        js = tmp_path / f"{transport}.json"
        r = reshard("run", "--src", TRAIN, "--dst", INFER, "--transport", transport, "--iters", "2", "--quiet",
                    "--json", js)
        assert r.returncode == 0, r.stderr
        docs[transport] = json.loads(js.read_text())
    assert docs["shm"]["transport"].startswith("shm") and docs["gloo"]["transport"] == "gloo"
    assert docs["shm"]["wrong"] == 0 and docs["shm"]["verified"] == "exact values + checksums"
    assert docs["shm"]["checksums"] == docs["gloo"]["checksums"]
    assert shm_files_left(before) == set()
    r = reshard("run", "--src", TRAIN, "--dst", INFER, "--transport", "shm", "--backend", "nccl", "--quiet")
    assert r.returncode == 2 and "--transport" in r.stderr and r.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_dead_rank_fails_every_rank(tmp_path, transport):
    out = tmp_path / "out"
    r = reshard("run", "--src", TRAIN, "--dst", INFER, "--quiet", "--no-link-test", "--timeout", "30",
                "--out", out, "--transport", transport, faults="die:1")
    assert r.returncode == 1
    assert "worker rank 1 died" in r.stderr
    assert "Traceback" not in r.stderr
    assert not (out / "manifest.json").exists()


@pytest.mark.parametrize("stalled,transport", [(1, "auto"), (0, "auto"), (1, "shm")])
def test_stalled_rank_is_named(tmp_path, stalled, transport):
    """A worker stopped (SIGSTOP) before its first byte: the job's watchdog names it in one line (half of
    --timeout without a heartbeat) and the job ends, rather than a peer timing out and naming itself. Rank 0
    stalled too: another rank says it. (--timeout 10: a rank silent 5 s is named; it continues at 15 s and
    takes torchrun's stop then.)"""
    out = tmp_path / "out"
    r = reshard("run", "--src", TRAIN, "--dst", INFER, "--quiet", "--no-link-test", "--timeout", "10",
                "--out", out, "--transport", transport, faults=f"stall:{stalled}:15")
    assert r.returncode == 1, r.stdout + r.stderr
    lines = [x for x in r.stderr.splitlines() if x.strip()]
    assert len(lines) == 1 and "Traceback" not in r.stderr, r.stderr
    assert f"rank {stalled} stopped answering: no heartbeat for" in lines[0], lines
    assert not (out / "manifest.json").exists()


def test_checkpoint_source_and_bad_checkpoint(tmp_path):
    """A safetensors checkpoint in, on a small model; a wrong checkpoint stops before any transfer."""
    src, dst = write_pair(tmp_path, "tp2_to_tp3")
    from reshard_cli.formats import load_layout
    from reshard_cli.io.synthetic import synthetic_values
    from reshard_cli.base.geometry import Box

    man = load_layout(src).manifest
    full = {s.name: synthetic_values(t, Box.full(s.shape), s.shape, getattr(torch, s.dtype), 7) + 0
            for t, s in enumerate(man.tensors)}
    save_file(full, tmp_path / "ckpt.safetensors")
    r = reshard("run", "--src", src, "--dst", dst, "--source", f"safetensors:{tmp_path / 'ckpt.safetensors'}",
                "--quiet", "--no-link-test")
    assert r.returncode == 0, r.stderr
    assert r.stdout.count(" ok") == 3
    del full["layers.1.attn.q_proj.weight"]
    full["norm.weight"] = torch.zeros(7)
    save_file(full, tmp_path / "bad.safetensors")
    r = reshard("run", "--src", src, "--dst", dst, "--source", f"safetensors:{tmp_path / 'bad.safetensors'}",
                "--quiet", "--no-link-test")
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "bad.safetensors" in lines[0]
    assert "q_proj" in lines[0] or "norm.weight" in lines[0]


def test_world_too_small_under_torchrun(tmp_path):
    src, dst = write_pair(tmp_path, "tp2_to_tp3")
    e = dict(os.environ, CI="true", OMP_NUM_THREADS="1")
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        "-m", "reshard_cli", "run", "--src", str(src), "--dst", str(dst), "--quiet"],
                       cwd=ROOT, env=e, capture_output=True, text=True, timeout=240)
    assert r.returncode != 0
    assert "world size 2 is smaller than the 5 ranks" in r.stderr


@pytest.mark.parametrize("rank", [0, 1])
def test_a_failed_validation_is_said_once_by_rank_0_and_by_another_only_where_rank_0_passed(monkeypatch, rank):
    """`launcher.prepare`: rank 0 raises the line at once; another rank first leaves rank 0 the time to say
    the same (it exiting first could let torchrun stop rank 0 before its line is out), then raises its own
    line itself (not a silent exit): there rank 0 passed the check, and nobody else would say it."""
    from reshard_cli.errors import ConfigError
    from reshard_cli.transfer import launcher

    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    waited = []
    monkeypatch.setattr(launcher.time, "sleep", waited.append)

    def validate():
        raise ConfigError("no such file", file="dst.yaml", key="model")

    with pytest.raises(ConfigError, match="no such file") as e:
        launcher.prepare(validate)
    assert not e.value.quiet and e.value.exit_code == 2
    assert waited == ([launcher.REPORT_GRACE] if rank else [])
