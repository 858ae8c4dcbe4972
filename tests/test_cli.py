"""`reshard` as a user runs it: `python -m reshard_cli ...` in subprocesses (the same `main()` as the console
script `reshard = reshard_cli.cli:main`), checking stdout, stderr and exit codes. More error cases call that
`main()` in-process with a patched argv, which skips a Python start-up per case."""
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import ROOT, call_main
from reshard_cli.base.text import fmt_bytes

TRAIN = "layouts/demo/train.yaml"
INFER = "layouts/demo/infer.yaml"
DGX = "layouts/topologies/dgx-h100.yaml"
QWEN_SRC, QWEN_DST = "qwen3-30b-a3b/megatron-tp2-ep4-pp2", "qwen3-30b-a3b/vllm-tp4-dp4"
CONTRACT = ("params", "tensors", "bytes", "paths", "wire_bytes", "min_wire_bytes", "broadcast_wire_bytes",
            "indomain_bytes", "max_rank_send_bytes", "max_rank_recv_bytes", "plan_seconds", "pieces")


def reshard(*args, env: dict | None = None):
    env = dict(os.environ, CI="true", COLUMNS="120", **(env or {}))
    env.pop("PYTHONPATH", None)
    return subprocess.run([sys.executable, "-m", "reshard_cli", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def ok(proc):
    assert proc.returncode == 0, (proc.returncode, proc.stdout, proc.stderr)
    return proc



@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("cli")
    text = (ROOT / TRAIN).read_text()
    assert "\nplacements:\n" in text
    (d / "train-typo.yaml").write_text(text.replace("\nplacements:\n", "\nplacments:\n"))
    (d / "infer-bad.yaml").write_text((ROOT / INFER).read_text().replace("mesh: {tp: 2}", "mesh: {tp: 3}"))
    (d / "topo.yaml").write_text("ranks_per_domain: 8\nlinks: {network_gbps: fast}\n")
    # the demo's inference replica twice, written by hand; and a layout whose replica cannot be told
    (d / "infer-dp2.yaml").write_text((ROOT / INFER).read_text().replace("ranks: 2-3\n", "")
                                      .replace("mesh: {tp: 2}", "mesh: {dp: 2, tp: 2}"))
    (d / "infer-late-dp.yaml").write_text((ROOT / INFER).read_text().replace("ranks: 2-3\n", "")
                                          .replace("mesh: {tp: 2}", "mesh: {tp: 2, dp: 2}"))
    return d


@pytest.fixture(scope="module")
def runs(files):
    """The commands run as a user runs them, once each and concurrently (each is a Python start-up)."""
    d, base = files, ("plan", "--src", TRAIN, "--dst", INFER)
    cases = {
        "plan": (*base, "--mode", "hybrid", "--json", d / "plan.json", "--pieces", d / "pieces.jsonl.gz"),
        "default": (*base, "--topology", DGX, "--json", d / "default.json"),
        "reshard": (*base, "--mode", "reshard", "--json", d / "reshard.json"),
        "topology": (*base, "--topology", DGX, "--json", d / "topo.json"),
        "rank": (*base, "--rank", 2, "--json", d / "rank.json"),
        "typo": ("plan", "--src", d / "train-typo.yaml", "--dst", INFER),
        "typo_debug": ("--debug", "plan", "--src", d / "train-typo.yaml", "--dst", INFER),
        "missing_src": ("plan", "--src", d / "nope.yaml", "--dst", INFER),
        "mode_bogus": (*base, "--mode", "bogus"),
        "replicas": (*base, "--replicas", 3, "--json", d / "replicas.json"),
        "replicas_groups": ("plan", "--src", QWEN_SRC, "--dst", QWEN_DST, "--topology", DGX, "--replicas", 3,
                            "--json", d / "replicas-groups.json"),
        "help": ("--help",),
    }
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(reshard, *args) for name, args in cases.items()}
        return {name: f.result() for name, f in futures.items()}


def one_error_line(proc, rc=2):
    """Exactly one line on stderr, `reshard: error: ...`, the given exit code, no traceback."""
    assert proc.returncode == rc, (proc.returncode, proc.stdout, proc.stderr)
    lines = proc.stderr.strip("\n").splitlines()
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("reshard: error: "), proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    return lines[0]


def test_plan_prints_model_line_and_table(runs, files):
    proc = ok(runs["plan"])
    text = proc.stdout
    assert text.startswith("reshard plan: tiny-moe  demo-train-tp2-ep2 (2 ranks) -> demo-infer-tp2 (2 ranks)")
    assert "mode hybrid" in text
    model_line = next(line for line in text.splitlines() if line.strip().startswith("model "))
    assert "params in 113 tensors" in model_line
    assert "network wire" in text and "busiest rank" in text
    header = next(line for line in text.splitlines() if line.strip().startswith("#"))
    assert header.split()[1:] == ["path", "tensors", "bytes", "wire", "in-domain", "pieces"]
    assert any(line.split()[:1] == ["reshard"] for line in text.splitlines())
    assert any(line.split()[:1] == ["broadcast"] for line in text.splitlines())
    assert f"wrote {files / 'plan.json'}" in text
    assert proc.stderr == ""


def test_plan_json_contract(runs, files):
    ok(runs["plan"])
    doc = json.loads((files / "plan.json").read_text())
    assert set(CONTRACT) <= set(doc)
    assert set(doc["paths"]) >= {"reshard", "broadcast"}
    assert doc["tensors"] == 113 and doc["params"] > 0
    assert doc["paths"]["reshard"] + doc["paths"]["broadcast"] == doc["bytes"]
    assert doc["pieces"] > 0 and "broadcasts" not in doc  # --json is the summary: no piece list
    assert doc["wire_bytes"] >= doc["min_wire_bytes"] > 0
    assert doc["broadcast_wire_bytes"] > 0 and doc["plan_seconds"] >= 0
    assert doc["max_rank_send_bytes"] > 0 and doc["max_rank_recv_bytes"] > 0


def test_plan_pieces_stream(runs, files):
    """--pieces: a header line, then one piece or broadcast per line, as many as the summary counts."""
    import gzip

    ok(runs["plan"])
    doc = json.loads((files / "plan.json").read_text())
    with gzip.open(files / "pieces.jsonl.gz", "rt") as f:
        header = json.loads(f.readline())
        lines = [json.loads(line) for line in f]
    assert header["format"] == "reshard-pieces/1" and len(header["tensors"]) == doc["tensors"]
    assert header["broadcast_receivers"] == [2, 3]
    pieces = [x for x in lines if x[0] == "p"]
    bcasts = [x for x in lines if x[0] == "b"]
    assert pieces and bcasts and len(pieces) + len(bcasts) == len(lines)
    assert len(pieces) == doc["path_stats"]["reshard"]["pieces"]
    assert len(bcasts) == doc["path_stats"]["broadcast"]["tensors"]
    _k, tensor, src, dst, phase, offsets, sizes = pieces[0]
    assert src in (0, 1) and dst in (2, 3) and phase == 0 and len(offsets) == len(sizes)
    # the pieces of the reshard path cover the reshard-path bytes exactly (no topology: no forwards)
    elems = sum(int(torch.tensor(x[6]).prod()) if x[6] else 1 for x in pieces)
    assert elems * 2 == doc["paths"]["reshard"]  # bf16


def test_default_mode_is_auto(runs, files):
    """No --mode: auto, which says which route each class of tensors took (and, with a topology's links, what
    each mode would cost beside it)."""
    proc = ok(runs["default"])
    assert "mode auto" in proc.stdout
    routes = next(line for line in proc.stdout.splitlines() if line.startswith("  auto routes   "))
    assert "forward" in routes and "tensors in" in routes
    doc = json.loads((files / "default.json").read_text())
    assert doc["mode"] == "auto"
    assert set(doc["routes"]) == {"forward", "direct", "broadcast"}
    assert sum(v["tensors"] for v in doc["routes"].values()) == doc["tensors"]
    assert sum(v["bytes"] for v in doc["routes"].values()) == doc["bytes"]
    assert doc["predicted_seconds"]["auto"] <= min(doc["predicted_seconds"][m] for m in ("reshard", "broadcast"))


def test_reshard_mode_moves_the_minimum(runs, files):
    proc = ok(runs["reshard"])
    doc = json.loads((files / "reshard.json").read_text())
    assert doc["wire_bytes"] == doc["min_wire_bytes"] > 0
    assert doc["paths"]["broadcast"] == 0 and doc["paths"]["reshard"] == doc["bytes"]
    assert "mode reshard" in proc.stdout


def test_topology(runs, files):
    proc = ok(runs["topology"])
    assert "topology dgx-h100: 8 ranks per domain" in proc.stdout
    doc = json.loads((files / "topo.json").read_text())
    # all 4 ranks share one NVLink domain: nothing crosses the network
    assert doc["wire_bytes"] == doc["min_wire_bytes"] == 0 and doc["indomain_bytes"] > 0


def test_rank_view(runs, files):
    lines = ok(runs["rank"]).stdout.splitlines()
    assert lines[0].startswith("rank 2: ") and "pieces" in lines[0] and "broadcasts" in lines[0]
    assert lines[1].split()[1:] == ["tensor", "src", "dst", "box", "phase", "bytes"]
    doc = json.loads((files / "rank.json").read_text())
    assert doc["rank"] == 2 and doc["pieces"]
    assert all(2 in (p["src"], p["dst"]) for p in doc["pieces"])
    assert f"{len(doc['pieces'])} pieces" in lines[0]
    rows = [line.split() for line in lines[2:]]
    assert rows and all(r[2] == "2" for r in rows)  # rank 2 only receives
    assert rows[0][0] == doc["pieces"][0]["tensor"]


def _line(text: str, label: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(f"  {label:<14}"))


def test_replicas_refits_n_copies_of_the_replica(runs, files):
    """--replicas 3: the demo's TP2 inference layout three times, numbered after the trainer; losing one of them
    costs a whole refit of the other two (one staging group), as a plan into two replicas written by hand says."""
    from reshard_cli.plan.cost import with_auto_routes
    from reshard_cli.plan.planner import Plan

    proc = ok(runs["replicas"])
    text = proc.stdout
    assert text.startswith("reshard plan: tiny-moe  demo-train-tp2-ep2 (2 ranks) -> demo-infer-tp2 as 3 replicas "
                           "(6 ranks)")
    assert _line(text, "fleet").startswith("  fleet         3 replicas x 2 ranks: ")
    doc = json.loads((files / "replicas.json").read_text())
    loss = doc["fleet"]["loss"]
    two = with_auto_routes(Plan.build(TRAIN, files / "infer-dp2.yaml", mode="auto")).stats()["wire_bytes"]
    assert loss["replicas_after"] == 2 and loss["groups"] == 1
    assert loss["resent_bytes_first_group"] == loss["resent_bytes_last_group"] == loss["survivors_wire_bytes"] == two
    assert _line(text, "losing one") == (f"  losing one    replica mid-refit: the trainer re-sends {fmt_bytes(two)} to "
                                         f"the 2 survivors (one staging group: the whole refit again)")
    assert doc["dst_ranks"] == 6 and sorted(int(r) for r in doc["rank_bytes"]) == list(range(8))


def test_replicas_loss_by_staging_group(runs, files):
    """Into an engine's layout: a replica lost in group g costs the survivors' wire of groups g..end, from the
    first group (the most) down to the last (the least), over the staging line's groups."""
    text = ok(runs["replicas_groups"]).stdout
    doc = json.loads((files / "replicas-groups.json").read_text())
    loss, groups = doc["fleet"]["loss"], doc["staging"]["groups"]
    assert doc["fleet"]["replicas"] == 3 and loss["replicas_after"] == 2 and loss["groups"] == groups > 1
    resent = loss["resent_bytes_by_group"]
    assert len(resent) == groups and resent == sorted(resent, reverse=True)
    assert resent[0] == loss["resent_bytes_first_group"] == sum(loss["group_wire_bytes"])
    assert resent[-1] == loss["resent_bytes_last_group"] == loss["group_wire_bytes"][-1] > 0
    assert loss["resent_bytes_mean"] == pytest.approx(sum(resent) / groups)
    assert _line(text, "losing one") == (
        f"  losing one    replica mid-refit: the trainer re-sends {fmt_bytes(resent[0])} to the 2 survivors (lost "
        f"in group 1 of {groups}) .. {fmt_bytes(resent[-1])} (lost in the last), mean "
        f"{fmt_bytes(loss['resent_bytes_mean'])}; resumed at the failed group's first layer; committed layers are not sent again")


def test_no_loss_line_without_replicas(runs, monkeypatch, capsys, files):
    """Without --replicas nothing changes: a fleet layout gets its fleet line, and no loss figures."""
    proc = ok(call_main(monkeypatch, capsys, "plan", "--src", QWEN_SRC, "--dst", QWEN_DST, "--json",
                        files / "no-replicas.json"))
    assert "  fleet         4 replicas x 4 ranks" in proc.stdout and "losing one" not in proc.stdout
    assert "loss" not in json.loads((files / "no-replicas.json").read_text())["fleet"]
    assert "losing one" not in ok(runs["plan"]).stdout


@pytest.mark.parametrize("value", [0, -1])
def test_bad_replicas(monkeypatch, capsys, value):
    line = one_error_line(call_main(monkeypatch, capsys, "plan", "--src", TRAIN, "--dst", INFER, "--replicas", value))
    assert line.startswith("reshard: error: --replicas: ") and f"not {value}" in line


def test_replicas_of_a_layout_without_a_clear_replica(monkeypatch, capsys, files):
    bad = files / "infer-late-dp.yaml"
    line = one_error_line(call_main(monkeypatch, capsys, "plan", "--src", TRAIN, "--dst", bad, "--replicas", 2))
    assert line.startswith("reshard: error: --replicas: cannot make 2 replica(s) of demo-infer-tp2: ")
    assert f"{bad}" in line and "cannot tell the replica: `dp` is not the slowest (first) dim" in line


def test_rank_outside_both_groups(monkeypatch, capsys):
    line = one_error_line(call_main(monkeypatch, capsys, "plan", "--src", TRAIN, "--dst", INFER, "--rank", 9))
    assert "--rank" in line and "rank 9" in line


def test_bad_layout_is_one_line(runs, files):
    bad = files / "train-typo.yaml"
    line = bad.read_text().splitlines().index("placments:") + 1
    err = one_error_line(runs["typo"])
    assert err == f"reshard: error: {bad}:{line}: placments: unknown key (did you mean 'placements'?)"


def test_debug_shows_the_traceback(runs):
    proc = runs["typo_debug"]
    assert proc.returncode == 2
    assert "Traceback (most recent call last)" in proc.stderr
    assert "ConfigError" in proc.stderr and "placments" in proc.stderr


def test_bad_dst_layout_names_its_file(monkeypatch, capsys, files):
    line = one_error_line(call_main(monkeypatch, capsys, "plan", "--src", TRAIN, "--dst", files / "infer-bad.yaml"))
    assert f"{files / 'infer-bad.yaml'}:" in line and "mesh: mesh product 3 != number of ranks 2" in line


def test_missing_file(runs, files):
    missing = files / "nope.yaml"
    assert one_error_line(runs["missing_src"]) == f"reshard: error: {missing}: file not found"


def test_missing_topology_file(monkeypatch, capsys, files):
    missing = files / "nope.yaml"
    proc = call_main(monkeypatch, capsys, "plan", "--src", TRAIN, "--dst", INFER, "--topology", missing)
    assert one_error_line(proc) == f"reshard: error: {missing}: file not found"


def test_bad_topology(monkeypatch, capsys, files):
    line = one_error_line(call_main(monkeypatch, capsys, "plan", "--src", TRAIN, "--dst", INFER,
                                    "--topology", files / "topo.yaml"))
    assert f"{files / 'topo.yaml'}:2: links.network_gbps:" in line


def test_unknown_mode(runs):
    line = one_error_line(runs["mode_bogus"])
    assert "--mode" in line and "bogus" in line


def test_bad_reshard_match(monkeypatch, capsys):
    proc = call_main(monkeypatch, capsys, "plan", "--src", TRAIN, "--dst", INFER, "--reshard-match", "(oops")
    assert "--reshard-match" in one_error_line(proc)


def test_unwritable_json_is_bad_input(monkeypatch, capsys, files):
    out = files / "no-such-dir" / "plan.json"
    line = one_error_line(call_main(monkeypatch, capsys, "plan", "--src", TRAIN, "--dst", INFER, "--json", out))
    assert "--json" in line and str(files / "no-such-dir" / "plan.json") in line


def test_missing_option_is_a_usage_error(monkeypatch, capsys):
    proc = call_main(monkeypatch, capsys, "plan", "--src", TRAIN)
    assert proc.returncode == 2 and "--dst" in proc.stderr and "Traceback" not in proc.stderr


def test_help(runs):
    proc = ok(runs["help"])
    assert "Usage" in proc.stdout and "plan" in proc.stdout and "--debug" in proc.stdout


def test_plan_help(monkeypatch, capsys):
    proc = ok(call_main(monkeypatch, capsys, "plan", "--help"))
    for opt in ("--src", "--dst", "--topology", "--mode", "--json", "--rank"):
        assert opt in proc.stdout


def test_console_entry_point_is_main():
    """`python -m reshard_cli` runs the same function the `reshard` console script names."""
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["reshard"] == "reshard_cli.cli:main"
    assert "from reshard_cli.cli import main" in (ROOT / "reshard_cli" / "__main__.py").read_text()
