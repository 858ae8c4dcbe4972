"""Launching: torchrun command lines, the rank map, `reshard run --dry-run`, and the two launcher scripts
(`bash -n`, the Slurm script against stand-in srun/scontrol/torchrun, and one real local.sh run on CPU)."""
import os
import re
import stat
import subprocess
import sys

import pytest

from conftest import ROOT
from reshard_cli.transfer import dryrun as launch
from reshard_cli.errors import ConfigError
from reshard_cli.formats import load_pair
from reshard_cli.layouts.topology import load_topology

TRAIN = "layouts/demo/train.yaml"
INFER = "layouts/demo/infer.yaml"
DS_SRC = "layouts/deepseek-v3/megatron-pp16-ep16.yaml"
DS_DST = "layouts/deepseek-v3/vllm-tp32-dp8.yaml"
DGX = "layouts/topologies/dgx-h100.yaml"
LOCAL = ROOT / "launchers" / "local.sh"
SLURM = ROOT / "launchers" / "slurm.sbatch"


def _env(**extra):
    env = dict(os.environ, CI="true", COLUMNS="200")
    env.pop("PYTHONPATH", None)
    env.pop("GPUS_PER_NODE", None)
    env.update(extra)
    return env


@pytest.fixture(scope="module")
def deepseek():
    return load_pair(ROOT / DS_SRC, ROOT / DS_DST)


def test_world_size(deepseek):
    assert launch.world_size(ROOT / TRAIN, ROOT / INFER) == 4
    assert launch.world_size(*deepseek) == 512


def test_single_node_command():
    cmd = launch.torchrun_command(TRAIN, INFER, extra_args=["--quiet"], world=4)
    assert cmd == ["torchrun", "--standalone", "--nproc-per-node", "4", "-m", "reshard_cli", "run",
                   "--src", TRAIN, "--dst", INFER, "--quiet"]
    assert launch.torchrun_command(ROOT / TRAIN, ROOT / INFER)[3] == "4"  # world size from the layouts


def test_multi_node_command(deepseek):
    cmd = launch.torchrun_command(DS_SRC, DS_DST, nnodes=64, nproc_per_node=8, rdzv_endpoint="node001:29500",
                                  extra_args=("--topology", DGX), world=512)
    assert cmd == ["torchrun", "--nnodes", "64", "--nproc-per-node", "8", "--rdzv-backend", "c10d",
                   "--rdzv-endpoint", "node001:29500", "--rdzv-id", "reshard", "-m", "reshard_cli", "run",
                   "--src", DS_SRC, "--dst", DS_DST, "--topology", DGX]
    # processes per node default to the world spread over the nodes
    assert launch.torchrun_command(DS_SRC, DS_DST, nnodes=64, rdzv_endpoint="h:1", world=512)[4] == "8"
    with pytest.raises(ConfigError, match="< the 512 ranks"):
        launch.torchrun_command(DS_SRC, DS_DST, nnodes=32, nproc_per_node=8, rdzv_endpoint="h:1", world=512)
    with pytest.raises(ConfigError, match="rendezvous endpoint"):
        launch.torchrun_command(DS_SRC, DS_DST, nnodes=64, nproc_per_node=8, world=512)


def test_rank_map_deepseek_on_dgx(deepseek):
    rows = launch.rank_map(*deepseek, load_topology(ROOT / DGX), 8)
    assert len(rows) == 512
    r0, r17, r255, r256, r511 = rows[0], rows[17], rows[255], rows[256], rows[511]
    assert (r0.rank, r0.node, r0.local, r0.group, r0.domain) == (0, 0, 0, "src", 0)
    assert r0.coords == "dense(pp=0,dp=0) expert(pp=0,ep=0)"
    assert (r17.node, r17.local, r17.group) == (2, 1, "src")
    assert r17.coords == "dense(pp=1,dp=1) expert(pp=1,ep=1)"  # 16 ranks per stage: rank 17 = stage 1, dp 1
    assert r255.coords == "dense(pp=15,dp=15) expert(pp=15,ep=15)" and r255.node == 31
    assert (r256.rank, r256.node, r256.local, r256.group, r256.domain) == (256, 32, 0, "dst", 32)
    assert r256.coords == "mesh(dp=0,tp=0)"
    assert (r511.node, r511.local, r511.group, r511.coords) == (63, 7, "dst", "mesh(dp=7,tp=31)")
    assert all(r.domain == r.node for r in rows)  # one NVLink domain per 8-GPU node
    assert {r.node for r in rows if r.group == "src"} == set(range(32))
    assert {r.node for r in rows if r.group == "dst"} == set(range(32, 64))


def test_rank_map_fills_the_last_node():
    rows = launch.rank_map(ROOT / TRAIN, ROOT / INFER, None, 3)
    assert [(r.rank, r.node, r.local, r.group) for r in rows] == [
        (0, 0, 0, "src"), (1, 0, 1, "src"), (2, 0, 2, "dst"), (3, 1, 0, "dst"), (4, 1, 1, "idle"),
        (5, 1, 2, "idle")]
    assert rows[0].coords == "dense(tp=0) expert(ep=0)" and rows[3].coords == "mesh(tp=1)"
    assert all(r.domain is None for r in rows)


def _run(*args, **env):
    return subprocess.run([sys.executable, "-m", "reshard_cli", *map(str, args)], cwd=ROOT, env=_env(**env),
                          capture_output=True, text=True, timeout=300)


def test_run_dry_run_prints_everything_and_starts_nothing():
    p = _run("run", "--src", DS_SRC, "--dst", DS_DST, "--topology", DGX, "--dry-run", "--quiet")
    assert p.returncode == 0, p.stderr
    out = p.stdout
    assert "world 512" in out
    assert (f"torchrun --standalone --nproc-per-node 512 -m reshard_cli run --src {DS_SRC} --dst {DS_DST} "
            f"--topology {DGX} --quiet") in out
    assert "torchrun --nnodes 64 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HEAD:29500" in out
    assert "--node-rank NODE_RANK" in out and "sbatch --nodes 64 launchers/slurm.sbatch" in out
    assert "--dry-run" not in out.split("world 512")[1]  # the printed commands run for real
    assert "src on node(s) 0-31, dst on node(s) 32-63" in out
    assert "every domain is inside one node" in out
    rows = re.findall(r"^ +(\d+) +(\d+) +(\d+)  (src|dst|idle) +(-?\d+|-)  (.*)$", out, re.M)
    assert len(rows) == 512  # every rank, for a user to check
    assert rows[0] == ("0", "0", "0", "src", "0", "dense(pp=0,dp=0) expert(pp=0,ep=0)")
    assert rows[256] == ("256", "32", "0", "dst", "32", "mesh(dp=0,tp=0)")
    assert "verified" not in out and p.stderr == ""


def test_dry_run_gpus_per_node_and_bad_input(tmp_path):
    p = _run("run", "--src", TRAIN, "--dst", INFER, "--dry-run", GPUS_PER_NODE="3")
    assert p.returncode == 0, p.stderr
    assert "3 GPUs per node (GPUS_PER_NODE) -> 2 node(s)" in p.stdout
    assert "(ranks 4-5 fill the last node and stay idle)" in p.stdout
    p = _run("run", "--src", TRAIN, "--dst", tmp_path / "missing.yaml", "--dry-run")
    assert p.returncode == 2 and p.stderr.count("\n") == 1 and "missing.yaml" in p.stderr


def test_scripts_parse():
    for script in (LOCAL, SLURM):
        assert os.access(script, os.X_OK), script
        p = subprocess.run(["bash", "-n", str(script)], capture_output=True, text=True)
        assert p.returncode == 0, p.stderr


def _fake_bin(tmp_path):
    """Stand-ins: srun runs its command once per node (SLURM_NODEID 0, 1), torchrun prints its argv."""
    b = tmp_path / "bin"
    b.mkdir()
    scripts = {
        "srun": '#!/usr/bin/env bash\nwhile [ $# -gt 0 ] && [ "${1#--}" != "$1" ]; do shift; done\n'
                'for i in 0 1; do SLURM_NODEID=$i "$@"; done\n',
        "scontrol": "#!/usr/bin/env bash\nprintf 'gpu-a001\\ngpu-a002\\n'\n",
        "torchrun": '#!/usr/bin/env bash\necho "torchrun $*"\n',
    }
    for name, text in scripts.items():
        (b / name).write_text(text)
        (b / name).chmod((b / name).stat().st_mode | stat.S_IEXEC)
    return b


@pytest.mark.parametrize("rdzv", ["c10d", "static"])
def test_slurm_script_commands(tmp_path, rdzv):
    b = _fake_bin(tmp_path)
    env = _env(PATH=f"{b}:{os.environ['PATH']}", SLURM_JOB_NODELIST="gpu-a[001-002]", SLURM_NNODES="2",
               SLURM_JOB_ID="77", GPUS_PER_NODE="2", RESHARD_RDZV=rdzv, TORCHRUN=str(b / "torchrun"),
               PYTHON=sys.executable, PYTHONPATH=str(ROOT))
    p = subprocess.run(["bash", str(SLURM), "--src", TRAIN, "--dst", INFER, "--quiet"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    lines = p.stdout.splitlines()
    run = f"-m reshard_cli run --src {TRAIN} --dst {INFER} --quiet"
    if rdzv == "c10d":
        assert lines == [f"torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d --rdzv-endpoint "
                         f"gpu-a001:29500 --rdzv-id 77 {run}"] * 2
    else:
        assert lines == [f"torchrun --node-rank {i} --nnodes 2 --nproc-per-node 2 --master-addr gpu-a001 "
                         f"--master-port 29500 {run}" for i in (0, 1)]
    assert "world 4 on 2 nodes x 2 GPUs" in p.stderr
    # too few nodes for the layouts: one line, exit 2, nothing started
    env["SLURM_NNODES"] = "1"
    p = subprocess.run(["bash", str(SLURM), "--src", TRAIN, "--dst", INFER], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stdout == "" and "2 nodes of 2 GPUs, got 1" in p.stderr


def test_local_script_bad_layout_is_one_line(tmp_path):
    p = subprocess.run(["bash", str(LOCAL), "--src", TRAIN, "--dst", str(tmp_path / "nope.yaml")], cwd=ROOT,
                       env=_env(PYTHON=sys.executable), capture_output=True, text=True, timeout=120)
    assert p.returncode == 2 and p.stderr.strip().count("\n") == 0 and "nope.yaml" in p.stderr
    assert "torchrun" not in p.stderr


def test_local_script_runs_the_demo(tmp_path):
    """The real thing: torchrun --standalone with 4 CPU processes over gloo; every destination rank verified."""
    p = subprocess.run(["bash", str(LOCAL), "--src", TRAIN, "--dst", INFER, "--quiet", "--no-link-test"],
                       cwd=ROOT, env=_env(PYTHON=sys.executable), capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, (p.stdout, p.stderr)
    assert "+ torchrun --standalone --nproc-per-node 4 -m reshard_cli run" in p.stderr
    assert "world 4" in p.stdout and "verified by exact values + checksums" in p.stdout
    assert re.search(r"rank +2 .* ok$", p.stdout, re.M) and re.search(r"rank +3 .* ok$", p.stdout, re.M)
