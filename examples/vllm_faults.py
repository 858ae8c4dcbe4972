"""Faults against a real TP2 vLLM engine, each followed by a retry in the same processes on the same port
(`python examples/vllm_refit.py --faults --json OUT`).

A 2-process FSDP2 trainer refits a 4-layer Qwen3-MoE into a TP2 `LLM` in groups of whole layers (a budget of
1.5 layers: at least four groups). Before each fault the trainer takes a step and saves it with transformers;
the fault is injected into the process it names (a vLLM worker, through vLLM's own `collective_rpc`; or
trainer rank 1), the update fails, and then:

- `named`, `named_seconds`: the line the trainer raised, and how long after the update began;
- `committed_groups`: every worker's committed groups of that update, as each recorded it (all must be equal);
- `weight_version`: what the engine was told it holds;
- `identical`: the engine's greedy tokens and logprobs equal a fresh vLLM engine's that loads exactly the
  committed groups from the new step and the rest from the previous one (vLLM's own loader);
- `retry_identical`: the same update again, in the same processes (a broken group: a new one on the same
  port), equals vLLM's load of the new step;

and at the end `leaked_threads` and `leaked_fds`: what the trainer's process and each worker hold more after
the last retry than after the first refit.
"""
from __future__ import annotations

import os
import re
import sys
import time

FAULTS = [
    # (name, who: "worker <i>" or "trainer 1", what is expected: "agreed" (the group stays) or "broken")
    ("processing fails in the third group", "worker 1", "agreed"),
    ("processing fails in the last group", "worker 1", "agreed"),
    ("corrupted bytes in the first group", "worker 0", "agreed"),
    ("transfer set-up fails on a worker", "worker 0", "broken"),
    ("trainer rank raises mid-transfer", "trainer 1", "broken"),
]


def inject(refit, target, name: str) -> None:
    """Patch one process's refit (and a worker's engine target) for one update (`undo` removes it)."""
    import torch

    if name.startswith("processing fails"):
        prepare, calls = target.prepare, []

        def preparing(group):
            calls.append(group)
            if len(calls) == (len(refit.parts) if "last" in name else 3):
                raise MemoryError("simulated: no room to repack the kernels")
            return prepare(group)
        target.prepare = preparing
    elif name.startswith("transfer set-up"):
        def _install(part, shards, tensors):
            raise RuntimeError("simulated: the engine's buffers could not be allocated")
        refit._install = _install
    else:
        move = refit._move

        def moving(part):
            index = refit.parts.index(part)
            if name.startswith("trainer rank raises") and index == 1:
                raise RuntimeError("simulated: the trainer's device was lost mid-transfer")
            move(part)
            if name.startswith("corrupted") and index == 0:
                shard = max(part.engine.dst_shards.values(), key=lambda s: s.data.numel())
                shard.data.reshape(-1).view(torch.uint8)[3] ^= 0x40
        refit._move = moving


def undo(refit, target) -> None:
    for obj, attr in ((target, "prepare"), (refit, "_install"), (refit, "_move")):
        if obj is not None:
            vars(obj).pop(attr, None)


def _worker_inject(worker, who: str, name: str) -> str:
    """Run in every vLLM worker (vLLM's collective_rpc): inject `name` where the worker is `who`."""
    engine = worker.weight_transfer_engine
    if engine.role == f"vLLM {who}":
        inject(engine.refit, engine.target, name)
    return engine.role


def _worker_undo(worker) -> None:
    engine = worker.weight_transfer_engine
    undo(engine.refit, engine.target)


def _resources(worker=None) -> tuple:
    """(threads, open file descriptors, the threads' names) of the process this runs in."""
    import threading

    return threading.active_count(), len(os.listdir("/proc/self/fd")), sorted(t.name for t in threading.enumerate())


def mixed_checkpoint(prev: str, new: str, groups, committed: int, out: str) -> str:
    """A checkpoint holding the first `committed` groups from `new` and the rest from `prev` (what the engine
    must hold after the update), written with safetensors beside `new`'s config."""
    import shutil

    from safetensors.torch import load_file, save_file

    layers = {n for g in groups[:committed] for n in g.layers}
    outside = any(g.outside for g in groups[:committed])
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(new):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(new, f), out)
    a = {k: v for f in sorted(os.listdir(prev)) if f.endswith(".safetensors")
         for k, v in load_file(os.path.join(prev, f)).items()}
    b = {k: v for f in sorted(os.listdir(new)) if f.endswith(".safetensors")
         for k, v in load_file(os.path.join(new, f)).items()}
    mixed = {}
    for k in b:
        m = re.search(r"layers\.(\d+)\.", k)
        mixed[k] = b[k] if (int(m.group(1)) in layers if m else outside) else a[k]
    index = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(index):
        os.remove(index)
    save_file(mixed, os.path.join(out, "model.safetensors"))
    return out


def faults_rank1(model_dir: str, ports: dict, stage_mb: float) -> None:
    """Trainer rank 1: the same calls as rank 0 in the same order; injects the faults that name it."""
    import vllm_refit as vr

    trainer = vr.Trainer(1, model_dir, ports["trainer"])
    engine = vr.engines(trainer, None, model_dir, 2, ports, "reshard", stage_mb=stage_mb)
    engine.send_weights()
    trainer.save(None)  # rank 0 saves the first step's weights
    for k, (name, who, _kind) in enumerate(FAULTS):
        trainer.step(k)
        trainer.save(None)
        if who == "trainer 1":
            inject(engine.refit, None, name)
        try:
            engine.send_weights(weight_version=f"step-{k + 1}")
        except RuntimeError:
            pass
        undo(engine.refit, None)
        if engine.group is None:
            engine = vr.engines(trainer, None, model_dir, 2, ports, "reshard", stage_mb=stage_mb)
        engine.send_weights(weight_version=f"step-{k + 1}")
    import torch.distributed as dist

    dist.destroy_process_group()


class _Versions:
    """An LLMClient that records the weight versions the trainer engine sets."""

    def __init__(self, client):
        self.client, self.versions = client, []

    def __getattr__(self, name):
        return getattr(self.client, name)

    def finish_weight_update(self, weight_version=None):
        self.client.finish_weight_update(weight_version)
        if weight_version is not None:
            self.versions.append(weight_version)

    def update_weight_version(self, new_version):
        self.client.update_weight_version(new_version)
        self.versions.append(new_version)


def run_faults(root: str) -> dict:
    """The fault matrix against a TP2 engine (see the module docstring); its JSON."""
    import cloudpickle
    import torch.multiprocessing as mp

    import vllm_faults
    import vllm_refit as vr
    from reshard_cli.base.ports import free_port
    from reshard_cli.engines.vllm.clients import LLMClient

    cloudpickle.register_pickle_by_value(vllm_faults)  # the workers run these functions without this folder
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # vLLM's collective_rpc of a function: our own engine
    model_dir = vr.make_model("qwen3-moe", root, config=dict(vr.CONFIGS["qwen3-moe"], num_hidden_layers=4))
    stage_mb = vr.stage_budget_mb(model_dir, 2, 1.5)  # 1.5 layers: at least four groups for four layers
    port = free_port()
    ports = {"trainer": free_port(), "reshard": port, "bad": port}  # every init on the same port
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(2))
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    rank1 = mp.get_context("spawn").Process(target=faults_rank1, args=(model_dir, ports, stage_mb))
    rank1.start()
    llm = vr.make_engine(model_dir, 2, weight_transfer_config={"backend": "reshard"})
    client = _Versions(LLMClient(llm))
    trainer = vr.Trainer(0, model_dir, ports["trainer"])
    engine = vr.engines(trainer, client, model_dir, 2, ports, "reshard", stage_mb=stage_mb)
    engine.send_weights()
    groups = engine.refit.groups
    print(f"[faults] TP2 engine, {len(groups)} staging groups of at most {stage_mb:.2f} MiB", flush=True)
    before = [_resources(), *llm.collective_rpc(_resources)]
    references: dict = {}

    def reference(ckpt: str) -> list:
        if ckpt not in references:
            references[ckpt] = vr.reference(ckpt, 2)
        return references[ckpt]

    prev = os.path.join(root, "step-0")
    trainer.save(prev)
    rows = []
    for k, (name, who, kind) in enumerate(FAULTS):
        trainer.step(k)
        new = os.path.join(root, f"step-{k + 1}")
        trainer.save(new)
        if who.startswith("worker"):
            llm.collective_rpc(_worker_inject, args=(who, name))
        t0 = time.perf_counter()
        line, held = None, {}
        try:
            engine.send_weights(weight_version=f"step-{k + 1}")
        except RuntimeError as e:
            line, held = str(e), dict(getattr(e, "held", {}) or {})
        seconds = time.perf_counter() - t0
        version = client.versions[-1] if client.versions else None  # what the engine was told it holds now
        if who.startswith("worker"):
            llm.collective_rpc(_worker_undo)
        committed = sorted(set(held.values()))
        ours = vr.generate(llm)
        expected = prev if committed == [0] else new if committed == [len(groups)] else \
            mixed_checkpoint(prev, new, groups, committed[0], os.path.join(root, f"step-{k + 1}-held")) \
            if len(committed) == 1 else None
        identical = expected is not None and ours == reference(expected)
        broken = engine.group is None
        if broken:  # the group was given up: the same processes join a new one on the same port
            engine = vr.engines(trainer, client, model_dir, 2, ports, "reshard", stage_mb=stage_mb)
        engine.send_weights(weight_version=f"step-{k + 1}")
        retry_identical = vr.generate(llm) == reference(new)
        faulty = {"worker 0": "vLLM worker 0", "worker 1": "vLLM worker 1", "trainer 1": "trainer 1"}[who]
        row = {"fault": name, "who": who, "named": line, "named_seconds": round(seconds, 3),
               "committed_groups": held, "groups": len(groups),
               "weight_version": version,
               "identical": identical, "retry_identical": retry_identical, "group_broken": broken,
               "healthy_named": bool(line) and ("stopped answering" in line or f"({faulty})" not in line)}
        rows.append(row)
        print(f"[faults] {name}: {line and line[:160]} ({seconds:.2f} s); committed {held}; version "
              f"{row['weight_version']}; identical {identical}; retry identical {retry_identical}", flush=True)
        prev = new
    after = [_resources(), *llm.collective_rpc(_resources)]
    import torch.distributed as dist

    dist.destroy_process_group()
    rank1.join(timeout=120)
    return {"faults": rows, "groups": len(groups), "stage_budget_mb": stage_mb,
            "leaked_threads": sum(max(0, a[0] - b[0]) for a, b in zip(after, before)),
            "leaked_fds": sum(max(0, a[1] - b[1]) for a, b in zip(after, before)),
            "new_threads": [sorted(set(a[2]) - set(b[2])) for a, b in zip(after, before)],
            "resources_before": before, "resources_after": after}


def passed(result: dict) -> bool:
    return (all(len(set(r["committed_groups"].values())) == 1 and r["identical"] and r["retry_identical"]
                and r["named"] and not r["healthy_named"] for r in result["faults"])
            and result["leaked_threads"] == 0 and result["leaked_fds"] == 0)


if __name__ == "__main__":
    sys.exit("run it as: python examples/vllm_refit.py --faults [--json OUT]")
