"""`reshard bench`: one real run on the demo pair (gloo, 4 processes), plus the pure parts (suite, ratios,
tables, verification). No test asserts a time."""
import json
import os
import subprocess
import sys

import pytest
import torch

from conftest import ROOT
from dist_util import shm_files, shm_files_left

from reshard_cli.bench import BenchOptions, measure, report, suite as bench_suite
from reshard_cli.errors import ConfigError
from reshard_cli.base.geometry import Box

TRAIN, INFER = ROOT / "layouts/demo/train.yaml", ROOT / "layouts/demo/infer.yaml"
MODE_KEYS = ("seconds", "gbps", "wire_bytes", "peak_staging_bytes", "wrong", "cpu_seconds")


def reshard(*args, timeout=240):
    env = dict(os.environ, CI="true")
    return subprocess.run([sys.executable, "-m", "reshard_cli", *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_bench_demo_pair_end_to_end(tmp_path):
    js = tmp_path / "bench.json"
    r = reshard("bench", "--src", TRAIN, "--dst", INFER, "--sizes", "1", "--iters", "2", "--no-plan-scaling",
                "--json", js, "--quiet")
    assert r.returncode == 0, r.stderr
    assert "#wrong" in r.stdout and "link limit" in r.stdout and "size sweep" in r.stdout
    doc = json.loads(js.read_text())
    assert {"cases", "sweep", "plan_scaling"} <= set(doc)
    assert doc["plan_scaling"] == []
    (case,) = doc["cases"]
    for key in ("name", "bytes", "link_limit_gbps"):
        assert key in case
    assert case["bytes"] > 0 and case["link_limit_gbps"] > 0 and case["link_limit_cpu_seconds"] > 0
    assert case["cores"] >= 1 and "CPU ms" in r.stdout
    assert set(case["modes"]) == {"auto", "reshard", "hybrid", "broadcast", "live", "dcp"}
    for mode, v in case["modes"].items():
        for key in MODE_KEYS:
            assert key in v, (mode, key)
        assert v["wrong"] == 0, mode
        assert len(v["times"]) == 2 and v["seconds"] > 0 and v["cpu_seconds"] > 0
    dcp = case["modes"]["dcp"]
    assert dcp["bytes_written"] > 0 and dcp["wire_bytes"] >= dcp["bytes_written"]
    # reshard mode moves exactly the model once (no destination replicas, no topology)
    assert case["modes"]["reshard"]["wire_bytes"] >= case["bytes"]
    assert case["modes"]["broadcast"]["wire_bytes"] > case["modes"]["reshard"]["wire_bytes"]
    (point,) = doc["sweep"]  # --sizes 1 at --scale 1: the case itself, reused
    assert point["scale"] == 1 and point["bytes"] == case["bytes"]
    assert all(point["modes"][m]["wrong"] == 0 for m in bench_suite.MODES)


def test_bench_shared_memory_beside_the_backend(tmp_path):
    """`--transport shm`: every engine mode and the live API timed twice, over gloo and over shared memory,
    side by side on the same processes and buffers, each run verified exactly; the copy limit beside the link
    limit; no file left in /dev/shm."""
    before = shm_files()
    js = tmp_path / "bench.json"
    r = reshard("bench", "--src", TRAIN, "--dst", INFER, "--transport", "shm", "--iters", "2", "--no-plan-scaling",
                "--json", js, "--quiet")
    assert r.returncode == 0, r.stderr
    doc = json.loads(js.read_text())
    assert doc["transports"] == ["gloo", "shm"]
    (case,) = doc["cases"]
    assert list(case["modes"]) == ["auto", "auto@shm", "reshard", "reshard@shm", "hybrid", "hybrid@shm",
                                   "broadcast", "broadcast@shm", "live", "live@shm", "dcp"]
    for mode, v in case["modes"].items():
        assert v["wrong"] == 0 and len(v["times"]) == 2, mode
        if mode.endswith("@shm"):
            base = case["modes"][mode.removesuffix("@shm")]
            assert v["wire_bytes"] == base["wire_bytes"] and v["vs_backend"] > 0, mode
    assert case["copy_limit_gbps"] > 0 and "copy limit" in r.stdout and "reshard@shm" in r.stdout
    assert shm_files_left(before) == set()


def _fake_case(**seconds):
    modes = {m: {"seconds": s, "gbps": 1e9 / s / 1e9 if s else 0.0, "wire_bytes": 2_000_000_000,
                 "peak_staging_bytes": 64 << 20, "wrong": 0, "cpu_seconds": 2 * s} for m, s in seconds.items()}
    return {"name": "fake", "model": "m", "bytes": 1_000_000_000, "tensors": 3, "src": "a", "src_ranks": 2,
            "dst": "b", "dst_ranks": 2, "bucket_bytes": 64 << 20, "link_limit_seconds": 0.08,
            "link_limit_gbps": 12.5, "link_bytes": 1_000_000_000, "link_limit_cpu_seconds": 0.1, "cores": 2,
            "modes": modes}


def test_ratios_and_table_formatting():
    case = report.add_ratios(_fake_case(reshard=0.1, hybrid=0.2, broadcast=0.4, dcp=1.0))
    r = case["modes"]["reshard"]
    assert r["vs_broadcast"] == pytest.approx(4.0) and r["vs_dcp"] == pytest.approx(10.0)
    assert r["of_link"] == pytest.approx(0.8)  # 10 GB/s of 12.5 GB/s
    assert case["modes"]["broadcast"]["vs_broadcast"] == pytest.approx(1.0)
    assert case["modes"]["dcp"]["vs_broadcast"] == pytest.approx(0.4)
    text = report.case_table(case)
    lines = text.splitlines()
    assert lines[1].split()[:2] == ["#", "mode"] and "of link" in lines[1]
    reshard_row = next(line for line in lines if line.split()[0] == "reshard")
    assert reshard_row.split()[1:4] == ["100.0", "200.0", "10.00"]  # time ms, CPU ms, GB/s
    assert next(line for line in lines if "link limit" in line).split()[2:4] == ["80.0", "100.0"]
    assert "4.00x" in reshard_row and "10.00x" in reshard_row and "80 %" in reshard_row
    assert "link limit" in text and "12.50" in text
    # a missing time gives "-", never a crash
    case = report.add_ratios(_fake_case(reshard=0.1, hybrid=0.2, broadcast=0.0, dcp=1.0))
    assert case["modes"]["reshard"]["vs_broadcast"] is None
    assert "-" in next(line for line in report.case_table(case).splitlines() if line.split()[0] == "reshard")
    # a JSON written before the CPU column: "-" there too
    del case["modes"]["hybrid"]["cpu_seconds"], case["link_limit_cpu_seconds"]
    assert next(line for line in report.case_table(case).splitlines() if line.split()[0] == "hybrid").split()[2] == "-"


def test_sweep_and_report_text():
    case = report.add_ratios(_fake_case(reshard=0.1, hybrid=0.2, broadcast=0.4, dcp=1.0))
    points = []
    for scale, k in ((1, 1.0), (4, 3.0)):
        points.append({"case": "fake", "scale": scale, "bytes": int(1e9 * scale), "link_limit_seconds": 0.08 * k,
                       "link_limit_gbps": 12.5, "modes": {m: {"seconds": v["seconds"] * k, "gbps": v["gbps"],
                                                               "wire_bytes": 0, "wrong": 0}
                                                           for m, v in case["modes"].items()}})
    doc = {"suite": "s", "backend": "gloo", "device": "cpu", "world": 4, "iters": 5, "cases": [case],
           "sweep": points, "plan_scaling": [{"name": "p", "src_ranks": 8, "dst_ranks": 8, "tensors": 10,
                                              "classes": 2, "pieces": 100, "load_seconds": 0.5, "seconds": 0.001}]}
    text = report.report_text(doc)
    assert "size sweep" in text and "x4" in text and "time growth for 4.0x the bytes: reshard 3.0x" in text
    assert "plan scaling" in text and "10.000" in text  # us per piece
    assert "a run cannot take less than CPU ms / 2" in text


def test_expected_values_catch_wrong_elements():
    from reshard_cli.layouts.models import TensorSpec
    from reshard_cli.io.synthetic import synthetic_values
    from reshard_cli.transfer.shards import LocalShard, fill_sentinel

    man = (TensorSpec("w", (6, 4), "bfloat16"), TensorSpec("v", (5,), "float32"))
    boxes = {0: Box((2, 0), (2, 4)), 1: Box((0,), (5,))}
    data = {t: synthetic_values(t, b, man[t].shape, getattr(torch, man[t].dtype)) for t, b in boxes.items()}
    exp = measure.Expected(man, {t: LocalShard(b, data[t]) for t, b in boxes.items()}, torch.device("cpu"))
    assert exp.wrong(data) == 0
    data[0].view(torch.uint8).reshape(-1)[3] ^= 1  # one bit of one bf16 element
    data[1][[0, 4]] = data[1][[4, 0]].clone()  # two elements swapped
    assert exp.wrong(data) == 3
    sentinel = {t: x.clone() for t, x in data.items()}
    fill_sentinel(LocalShard(boxes[t], x) for t, x in sentinel.items())
    assert exp.wrong(sentinel) == 8 + 5


def test_cpu_suite_fits_six_processes(tmp_path):
    suite = bench_suite.load_suite("cpu", tmp_path)
    assert len(suite.cases) >= 2 and suite.sweep_case in [c.name for c in suite.cases] and suite.sizes
    assert bench_suite.world_needed(suite) <= 6
    from reshard_cli.layouts import bundled
    from reshard_cli.formats import load_pair

    scaled = [c for c in suite.cases if c.scale == 16]
    assert scaled and all("demo/train" in (c.src, c.dst) for c in scaled)  # bundled names, kept as written
    assert bundled.resolve("layout", "demo/train") == TRAIN
    replicas = []
    for c in suite.cases:
        _src, dst = load_pair(c.src, c.dst, scale=c.scale)
        replicas.append(max(len(rs) for p in dict.fromkeys(dst.placements) for _b, rs in p.boxes((64, 64))))
    assert max(replicas) >= 2  # one case has destination replicas


def test_suite_case_paths_and_bundled_names(tmp_path):
    """A relative path that exists next to the suite file wins; otherwise the string is a bundled name."""
    (tmp_path / "demo").mkdir()
    (tmp_path / "demo" / "train.yaml").write_text(TRAIN.read_text())
    (tmp_path / "suite.yaml").write_text("cases:\n  - {name: a, src: demo/train.yaml, dst: demo/infer}\n"
                                         "  - {name: b, src: demo/train, dst: demo/infer.yaml}\n")
    a, b = bench_suite.load_suite(str(tmp_path / "suite.yaml"), tmp_path).cases
    assert a.src == tmp_path / "demo" / "train.yaml" and a.dst == "demo/infer"
    assert b.src == "demo/train" and b.dst == "demo/infer.yaml"  # no such files next to the suite
    assert bench_suite.world_needed(bench_suite.Suite("s", [a, b])) == 4


def test_finish_reports_then_fails_on_wrong(capsys, tmp_path):
    from reshard_cli.errors import RuntimeFailure

    case = report.add_ratios(_fake_case(reshard=0.1, hybrid=0.2, broadcast=0.4, dcp=1.0))
    case["modes"]["hybrid"]["wrong"] = 7
    doc = {"suite": "s", "backend": "gloo", "device": "cpu", "world": 4, "iters": 5, "cases": [case], "sweep": [],
           "plan_scaling": []}
    js = tmp_path / "b.json"
    with pytest.raises(RuntimeFailure, match="verification failed: fake hybrid$"):
        report.finish(doc, BenchOptions(json=js))
    out = capsys.readouterr().out
    assert "link limit" in out and f"wrote {js}" in out  # reported and written first
    assert json.loads(js.read_text())["cases"][0]["modes"]["hybrid"]["wrong"] == 7


def test_bad_options_are_one_line_errors(tmp_path):
    with pytest.raises(ConfigError, match="--suite or --src"):
        bench_suite.resolve(BenchOptions(src=TRAIN, dst=INFER, suite="cpu"), tmp_path)
    with pytest.raises(ConfigError, match="--sizes"):
        bench_suite.resolve(BenchOptions(src=TRAIN, dst=INFER, sizes="1,two"), tmp_path)
    with pytest.raises(ConfigError, match="--suite: no-such-suite: .*no bundled suite"):
        bench_suite.resolve(BenchOptions(suite="no-such-suite"), tmp_path)
    with pytest.raises(ConfigError, match="--iters"):
        bench_suite.resolve(BenchOptions(src=TRAIN, dst=INFER, iters=0), tmp_path)
    bad = tmp_path / "suite.yaml"
    bad.write_text("cases:\n  - {src: a.yaml, dst: b.yaml, scael: 2}\n")
    with pytest.raises(ConfigError, match=r"suite.yaml:2: cases\[0\]\.scael: unknown key"):
        bench_suite.load_suite(str(bad), tmp_path)
    r = reshard("bench", "--src", TRAIN)  # no torchrun is started
    assert r.returncode == 2 and r.stderr.strip().count("\n") == 0 and "--dst" in r.stderr


def test_plot_without_matplotlib_is_one_line(monkeypatch):
    monkeypatch.setitem(sys.modules, "matplotlib", None)
    with pytest.raises(ConfigError, match="--plot: needs matplotlib"):
        report._pyplot()


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    case = report.add_ratios(_fake_case(reshard=0.1, hybrid=0.2, broadcast=0.4, dcp=1.0))
    point = {"case": "fake", "scale": 1, "bytes": case["bytes"], "link_limit_seconds": 0.08, "link_limit_gbps": 12.5,
             "modes": {m: {"seconds": v["seconds"], "gbps": v["gbps"]} for m, v in case["modes"].items()}}
    doc = {"suite": "s", "backend": "gloo", "world": 4, "iters": 5, "cases": [case], "sweep": [point, point]}
    report.write_plot(doc, tmp_path / "b.png")
    assert (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG"
