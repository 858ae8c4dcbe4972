"""`reshard topo` (NVML discovery as a command, bandwidth measurement) and `reshard run --topology auto`.

The CLI tests take the real no-driver path of this machine; the rendering and YAML of a DGX H100 go through
the library functions with the fake NVML of test_nvml.py."""
import json
import os
import subprocess
import sys

import pytest
import yaml

from conftest import ROOT
from reshard_cli.hw.nvml import discover, domains_from_keys, rank_domain_key, render, to_topology
from reshard_cli.layouts.topology import load_topology
from test_check import call_main
from test_nvml import FakeNvml

TRAIN, INFER = ROOT / "layouts/demo/train.yaml", ROOT / "layouts/demo/infer.yaml"


@pytest.fixture(scope="module")
def no_driver():
    d = discover()
    if d.nvml_error is None:
        pytest.skip("this machine has a working NVIDIA driver")
    return d


def test_topo_without_driver(no_driver, monkeypatch, capsys, tmp_path):
    host = no_driver.host
    r = call_main(monkeypatch, capsys, "topo", "--json", tmp_path / "t.json", "--yaml", tmp_path / "t.yaml")
    assert r.returncode == 0, r.stderr
    lines = r.stdout.splitlines()
    assert lines[0].startswith("NVML not available")
    assert lines[1] == (f"host {host.hostname}: {host.cpus} CPU{'s' if host.cpus != 1 else ''}, "
                        f"{host.memory_bytes / 2**30:.1f} GiB memory, {host.numa_nodes} NUMA node"
                        f"{'s' if host.numa_nodes != 1 else ''}")
    assert f"domains: 1 (CPU) key host:{host.hostname}:cpu" in r.stdout
    doc = json.loads((tmp_path / "t.json").read_text())
    assert doc["gpus"] == [] and doc["host"]["hostname"] == host.hostname
    assert doc["domain_keys"] == [f"host:{host.hostname}:cpu"] and "bandwidth" not in doc
    topo = load_topology(tmp_path / "t.yaml")
    assert topo.name == f"discovered:{host.hostname}" and topo.ranks_per_domain == 1

    # this host's 4 CPU processes as one domain, fed to `reshard plan`
    r = call_main(monkeypatch, capsys, "topo", "--yaml", tmp_path / "t4.yaml", "--ranks-per-node", "4")
    assert r.returncode == 0 and "4 ranks per domain" in r.stdout
    assert load_topology(tmp_path / "t4.yaml").ranks_per_domain == 4
    r = call_main(monkeypatch, capsys, "plan", "--src", TRAIN, "--dst", INFER, "--topology", tmp_path / "t4.yaml")
    assert r.returncode == 0, r.stderr
    assert f"topology discovered:{host.hostname}: 4 ranks per domain" in r.stdout
    assert "network wire  0 B" in r.stdout  # every rank in one domain: nothing crosses the network


def test_topo_bandwidth_on_cpu(no_driver, monkeypatch, capsys, tmp_path):
    r = call_main(monkeypatch, capsys, "topo", "--bandwidth", "--bandwidth-mb", "16", "--json", tmp_path / "b.json")
    assert r.returncode == 0, r.stderr
    table = r.stdout[r.stdout.index("bandwidth"):]
    assert "GB/s" in table and "memcpy" in table and "process->process gloo" in table and "16.78 MB" in table
    rows = json.loads((tmp_path / "b.json").read_text())["bandwidth"]
    assert [x["test"] for x in rows] == ["memcpy", "process->process gloo"]
    assert all(x["bytes"] == 16 << 20 and x["seconds"] > 0 and x["gbps"] > 0 for x in rows)


def test_fake_dgx_h100_render_and_yaml(tmp_path):
    fake = FakeNvml.load("dgx-h100.yaml")
    d = discover(fake, host=fake.host())
    from reshard_cli.hw.nvml import topo_text
    text = topo_text(d)
    assert text == render(d) and "driver 550.54.15" in text.splitlines()[0]
    assert "NV18" in text and "host:dgx01:nvswitch" in text
    (tmp_path / "dgx.yaml").write_text(yaml.safe_dump(to_topology(d).to_yaml_dict(), sort_keys=False))
    topo = load_topology(tmp_path / "dgx.yaml")
    assert topo.name == "discovered:dgx01" and topo.ranks_per_domain == 8
    assert [topo.domain_of(r) for r in (0, 7, 8, 15)] == [0, 0, 1, 1]
    # two such hosts under torchrun: the job's domains from the keys every rank reports
    keys = [rank_domain_key(d, r % 8).replace("dgx01", f"dgx0{1 + r // 8}") for r in range(16)]
    job = domains_from_keys(keys)
    (tmp_path / "job.yaml").write_text(yaml.safe_dump(job.to_yaml_dict(), sort_keys=False))
    assert load_topology(tmp_path / "job.yaml").domains == (tuple(range(8)), tuple(range(8, 16)))


def _env():
    e = dict(os.environ, CI="true", OMP_NUM_THREADS="1")
    e.pop("PYTHONPATH", None)
    return e


@pytest.fixture(scope="module")
def launched(no_driver, tmp_path_factory):
    """The two multi-process commands, started together (each is seconds of Python start-up and rendezvous)."""
    d = tmp_path_factory.mktemp("topo")
    cmds = {
        "auto": ["-m", "reshard_cli", "run", "--src", TRAIN, "--dst", INFER, "--topology", "auto",
                 "--out", d / "out", "--json", d / "run.json", "--quiet", "--no-link-test"],
        "torchrun": ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                     "-m", "reshard_cli", "topo", "--yaml", d / "job.yaml"],
    }
    procs = {k: subprocess.Popen([sys.executable, *map(str, c)], cwd=ROOT, env=_env(), stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True) for k, c in cmds.items()}
    done = {}
    for k, p in procs.items():
        try:
            out, err = p.communicate(timeout=300)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        done[k] = subprocess.CompletedProcess(p.args, p.returncode, out, err)
    return d, done


def test_run_topology_auto_then_check(launched, monkeypatch, capsys):
    """CPU: every rank reports this host's CPU key, so all four ranks form one domain; the output checks."""
    d, done = launched
    r = done["auto"]
    assert r.returncode == 0, r.stderr
    assert "verified by exact values + checksums" in r.stdout and r.stdout.count("  ok") == 2
    doc = json.loads((d / "run.json").read_text())
    assert doc["wrong"] == 0 and doc["wire_bytes"] == 0  # one domain: nothing crosses the network
    assert sum(p["indomain_bytes"] for p in doc["paths"].values()) > 0
    r = call_main(monkeypatch, capsys, "check", "--src", TRAIN, "--dst", INFER, "--out", d / "out")
    assert r.returncode == 0, (r.stdout, r.stderr)
    assert "all ok" in r.stdout and "226 tensors" in r.stdout


def test_topo_under_torchrun(no_driver, launched):
    d, done = launched
    r = done["torchrun"]
    assert r.returncode == 0, r.stderr
    host = no_driver.host.hostname
    assert r.stdout.startswith("reshard topo: 2 ranks on 1 host, 1 domain")
    assert f"== {host}: ranks 0-1" in r.stdout and f"ranks 0-1        host:{host}:cpu" in r.stdout
    assert load_topology(d / "job.yaml").domains == ((0, 1),)
