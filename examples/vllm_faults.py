"""Faults against real vLLM engines, each followed by a retry in the same processes
(`python examples/vllm_refit.py --faults --json OUT`).

A 2-process FSDP2 trainer takes AdamW steps on a 4-layer Qwen3-MoE (dimensions that split into whole 128x128
blocks at TP2, so the same weights also serve block-FP8) and refits in groups of whole layers (a budget of 1.5
layers: at least four groups). Before each fault the trainer takes a step and saves it with transformers; the
fault is injected into the process it names (a vLLM worker, through vLLM's own `collective_rpc`; or trainer
rank 1), the update fails, and then the row records:

- `named`, `named_seconds`: the line the trainer raised, and how long after the update began;
- `committed_groups`: every worker's committed groups of that update, as each recorded it (equal on every
  worker, except where a commit itself failed: `torn` names the worker that holds part of one more group);
- `weight_version`: the engine's own label afterwards (`LLM.get_weight_version`), `paused`: whether its
  scheduler is paused (`on_partial: pause`);
- `forward_identical`: on every worker, each module of a group it did not commit computes (examples/
  vllm_probe.py: vLLM's own kernels on fixed inputs) exactly what it computed before the update began;
- `identical`: the engine's greedy tokens and logprobs equal a fresh vLLM engine's that loads exactly the
  committed groups from the new step and the rest from the previous one (vLLM's own loader); null where the
  workers differ (no checkpoint describes that engine);
- `retry_identical`: the same update again, in the same processes (a broken group: a new one on the same
  port), equals vLLM's load of the new step.

The engines: a BF16 TP2 `LLM` (the first faults), a block-FP8 TP2 `LLM` of the same weights (vLLM's FP8 method,
its kernels stand-ins where vLLM's CPU build has none: examples/vllm_stand_in_worker.py), and a fleet of two TP1
`LLM`s one of whose workers fails mid-transfer (the member is dropped and told what it holds; the other finishes
the step). Last, a rank of a user's own torchrun-style job stopped mid-refit over the default group
(examples/world_stall.py). At the end `leaked_threads` and `leaked_fds`: what the trainer's process and each BF16
worker hold more after the last retry than after the first refit.
"""
from __future__ import annotations

import os
import re
import sys
import time

FAULTS = [
    # (name, who: "worker <i>" or "trainer 1", what is expected: "agreed" (the group stays), "torn" (a commit
    # failed part-way on one worker) or "broken")
    ("processing fails in the third group", "worker 1", "agreed"),
    ("processing fails in the last group", "worker 1", "agreed"),
    ("corrupted bytes in the first group", "worker 0", "agreed"),
    ("commit fails part-way in the third group", "worker 1", "torn"),
    ("transfer set-up fails on a worker", "worker 0", "broken"),
    ("trainer rank raises mid-transfer", "trainer 1", "broken"),
]
FP8_FAULT = ("processing fails in the last group of a block-FP8 engine", "worker 1", "agreed")
FLEET_FAULT = ("a fleet member's worker raises mid-transfer", "replica 1 worker 0", "member")
# Qwen3-MoE whose every TP2 shard holds whole 128x128 blocks (q, k, v 256 rows; experts' intermediate 256)
CONFIG = dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=1000, hidden_size=256,
              intermediate_size=256, moe_intermediate_size=256, num_hidden_layers=4, num_attention_heads=4,
              num_key_value_heads=4, head_dim=64, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1,
              mlp_only_layers=[], norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6,
              rope_theta=10000.0, tie_word_embeddings=False)


# ------------------------------------------------------------------------------------------ injecting


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
    elif name.startswith("commit fails"):
        target.commit = _failing_commit(target.commit)
    elif name.startswith("transfer set-up"):
        def _install(part, shards, tensors):
            raise RuntimeError("simulated: the engine's buffers could not be allocated")
        refit._install = _install
    else:
        move = refit._move

        def moving(part):
            index = refit.parts.index(part)
            if "raises mid-transfer" in name and index == 1:
                raise RuntimeError("simulated: the device was lost mid-transfer")
            move(part)
            if name.startswith("corrupted") and index == 0:
                shard = max(part.engine.dst_shards.values(), key=lambda s: s.data.numel())
                shard.data.reshape(-1).view(torch.uint8)[3] ^= 0x40
        refit._move = moving


def _failing_commit(commit):
    """The third group's commit fails after its first module was swapped in (a defect: the commit is a swap)."""
    from reshard_cli.engines.vllm import compat

    calls = []

    def committing(group):
        calls.append(group)
        if len(calls) != 3:
            return commit(group)
        swap, swapped = compat.swap_in, []

        def failing(module):
            swapped.append(module)
            if len(swapped) == 2:
                raise RuntimeError("simulated: the swap into the kernels' storage failed")
            swap(module)
        compat.swap_in = failing
        try:
            return commit(group)
        finally:
            compat.swap_in = swap
    return committing


def undo(refit, target) -> None:
    for obj, attr in ((target, "prepare"), (target, "commit"), (refit, "_install"), (refit, "_move")):
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


def _probe(worker) -> dict:
    """Run in every vLLM worker: what each module of its model computes (examples/vllm_probe.py, digested)."""
    import vllm_probe

    return vllm_probe.digest(worker.weight_transfer_engine.model, worker.vllm_config)


# ------------------------------------------------------------------------------------------ checkpoints


def mixed_checkpoint(prev: str, new: str, groups, committed: int, out: str) -> str:
    """A checkpoint holding the first `committed` groups from `new` and the rest from `prev` (what the engine
    must hold after the update), written with safetensors beside `new`'s config."""
    import shutil

    from safetensors.torch import save_file

    layers = {n for g in groups[:committed] for n in g.layers}
    outside = any(g.outside for g in groups[:committed])
    os.makedirs(out, exist_ok=True)
    for f in os.listdir(new):
        if not f.endswith(".safetensors"):
            shutil.copy(os.path.join(new, f), out)
    a, b = _tensors(prev), _tensors(new)
    mixed = {}
    for k in b:
        m = re.search(r"layers\.(\d+)\.", k)
        mixed[k] = b[k] if (int(m.group(1)) in layers if m else outside) else a[k]
    index = os.path.join(out, "model.safetensors.index.json")
    if os.path.exists(index):
        os.remove(index)
    save_file(mixed, os.path.join(out, "model.safetensors"))
    return out


def _tensors(path: str) -> dict:
    from safetensors.torch import load_file

    return {k: v for f in sorted(os.listdir(path)) if f.endswith(".safetensors")
            for k, v in load_file(os.path.join(path, f)).items()}


def fp8_checkpoint(bf16: str, out: str) -> str:
    """The block-FP8 checkpoint of a BF16 one, as vLLM's quantizer writes it (examples/vllm_fp8.py)."""
    from safetensors.torch import save_file

    import vllm_fp8

    fp8_config(bf16, out)
    save_file(vllm_fp8.fp8_checkpoint(_tensors(bf16)), os.path.join(out, "model.safetensors"))
    return out


def fp8_config(bf16: str, out: str) -> None:
    """The block-FP8 model's config.json beside a BF16 model's (its `quantization_config` added)."""
    import json

    import vllm_fp8

    os.makedirs(out, exist_ok=True)
    config = json.load(open(os.path.join(bf16, "config.json")))
    tmp = os.path.join(out, f".config.json.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(vllm_fp8.fp8_config(config), f)
    os.replace(tmp, os.path.join(out, "config.json"))  # whole: trainer rank 1 may be reading it


# ------------------------------------------------------------------------------------------ trainer rank 1


def faults_rank1(model_dir: str, fp8_dir: str, ports: dict, stage_mb: float) -> None:
    """Trainer rank 1: the same trainer-engine calls as rank 0, in the same order; injects the faults that name
    it."""
    import vllm_refit as vr

    trainer = vr.Trainer(1, model_dir, ports["trainer"])

    def bf16():
        return vr.engines(trainer, None, model_dir, 2, ports, "reshard", stage_mb=stage_mb)
    engine = bf16()
    engine.send_weights()
    trainer.save(None)  # rank 0 saves the first step's weights
    for k, (name, who, _kind) in enumerate(FAULTS):
        engine = _rank1_fault(trainer, engine, bf16, k, name, who)
    engine.shutdown()
    trainer.save(None)  # the FP8 engine's first weights
    fp8 = lambda: vr.engines(trainer, None, model_dir, 2, ports, "reshard", stage_mb=stage_mb,  # noqa: E731
                             engine_dir=fp8_dir, quantization="fp8", port="fp8")
    engine = fp8()
    engine.send_weights()
    engine = _rank1_fault(trainer, engine, fp8, len(FAULTS), *FP8_FAULT[:2])
    engine.shutdown()
    engine = vr.engines(trainer, None, model_dir, 1, ports, "reshard", stage_mb=stage_mb, replicas=2, port="fleet")
    engine.send_weights()
    trainer.step(len(FAULTS) + 1)
    trainer.save(None)
    engine.send_weights(weight_version="fleet")  # member B fails, is dropped; A finishes
    engine.add(None)  # B again, caught up
    engine.send_weights(weight_version="fleet")
    engine.shutdown()
    import torch.distributed as dist

    dist.destroy_process_group()


def _rank1_fault(trainer, engine, again, k: int, name: str, who: str):
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
        engine = again()
    engine.send_weights(weight_version=f"step-{k + 1}")
    return engine


# ------------------------------------------------------------------------------------------ rank 0


class _Engine:
    """One engine under the faults (rank 0): its `LLM`, client, trainer engine and the references it is
    judged by."""

    def __init__(self, llm, client, make, stand_ins: bool = False):
        self.llm, self.client, self.make, self.stand_ins = llm, client, make, stand_ins
        self.engine = make()
        self.references: dict = {}

    def reference(self, ckpt: str) -> list:
        import vllm_refit as vr

        if ckpt not in self.references:
            self.references[ckpt] = vr.reference(ckpt, 2, stand_ins=self.stand_ins)
        return self.references[ckpt]

    def generate(self) -> list:
        """Greedy tokens (a paused engine is resumed for it: a paused LLM's generate waits)."""
        import vllm_refit as vr

        if self.client.is_paused():
            self.client.resume()
        return vr.generate(self.llm)


def _fault_row(e: _Engine, trainer, k: int, fault: tuple, prev: str, new: str, ckpt) -> dict:
    """One fault against `e` and its retry; `ckpt(path)` makes the checkpoint the engine loads from a BF16 one."""
    import vllm_probe

    name, who, kind = fault
    groups = e.engine.refit.groups
    before = e.llm.collective_rpc(_probe)
    if who.startswith("worker"):
        e.llm.collective_rpc(_worker_inject, args=(who, name))
    t0 = time.perf_counter()
    line, held, torn = None, {}, set()
    try:
        e.engine.send_weights(weight_version=f"step-{k + 1}")
    except RuntimeError as err:
        line, held, torn = str(err), dict(getattr(err, "held", {}) or {}), set(getattr(err, "torn", set()) or ())
    seconds = time.perf_counter() - t0
    if who.startswith("worker"):
        e.llm.collective_rpc(_worker_undo)
    version, paused = e.llm.get_weight_version(), e.client.is_paused()
    after = e.llm.collective_rpc(_probe)
    kept = []  # per worker: the modules of groups it did not commit, which must compute as before
    for i, (b, a) in enumerate(zip(before, after)):
        n = held.get(2 + i, 0) + (1 if 2 + i in torn else 0)
        rest = [g for g in groups[n:]]
        names = [f"model.layers.{x}" for g in rest for x in g.layers] + \
            ([n for n in b if not n.startswith("model.layers.")] if any(g.outside for g in rest) else [])
        kept.append(vllm_probe.changed(b, a, names))
    committed = sorted(set(held.values()))
    identical = None
    if not torn and len(committed) == 1:
        c = committed[0]
        source = prev if c == 0 else new if c == len(groups) else \
            mixed_checkpoint(prev, new, groups, c, os.path.join(os.path.dirname(new), f"step-{k + 1}-held"))
        identical = e.generate() == e.reference(ckpt(source))
    broken = e.engine.group is None
    if broken:  # the group was given up: the same processes join a new one on the same port
        e.engine = e.make()
    e.engine.send_weights(weight_version=f"step-{k + 1}")
    retry_identical = e.generate() == e.reference(ckpt(new))
    faulty = {"worker 0": "vLLM worker 0", "worker 1": "vLLM worker 1", "trainer 1": "trainer 1"}[who]
    row = {"fault": name, "who": who, "kind": kind, "named": line, "named_seconds": round(seconds, 3),
           "committed_groups": held, "torn": sorted(torn), "groups": len(groups), "weight_version": version,
           "paused": paused, "forward_identical": all(not c for c in kept), "forward_changed": kept,
           "identical": identical, "retry_identical": retry_identical, "group_broken": broken,
           "healthy_named": bool(line) and ("stopped answering" in line or f"({faulty})" not in line)}
    print(f"[faults] {name}: {line and line[:160]} ({seconds:.2f} s); committed {held}"
          f"{f', torn {sorted(torn)}' if torn else ''}; version {version}; paused {paused}; forward identical "
          f"{row['forward_identical']}{'' if row['forward_identical'] else f' ({kept})'}; identical {identical}; "
          f"retry identical {retry_identical}", flush=True)
    return row


def _bf16_phase(trainer, root: str, model_dir: str, ports: dict, stage_mb: float) -> tuple[list, tuple]:
    """The BF16 TP2 engine under FAULTS; (rows, (threads/fds before, after))."""
    import vllm_refit as vr
    from reshard_cli.engines.vllm.clients import LLMClient

    llm = vr.make_engine(model_dir, 2, weight_transfer_config={"backend": "reshard"})
    client = LLMClient(llm, "bf16")
    e = _Engine(llm, client, lambda: vr.engines(trainer, client, model_dir, 2, ports, "reshard", stage_mb=stage_mb))
    e.engine.send_weights()
    print(f"[faults] BF16 TP2 engine, {len(e.engine.refit.groups)} staging groups of at most {stage_mb:.2f} MiB",
          flush=True)
    before = [_resources(), *llm.collective_rpc(_resources)]
    prev = os.path.join(root, "step-0")
    trainer.save(prev)
    rows = []
    for k, fault in enumerate(FAULTS):
        trainer.step(k)
        new = os.path.join(root, f"step-{k + 1}")
        trainer.save(new)
        rows.append(_fault_row(e, trainer, k, fault, prev, new, lambda path: path))
        prev = new
    after = [_resources(), *llm.collective_rpc(_resources)]
    e.engine.shutdown()
    _stop(llm)
    return rows, (before, after)


def _fp8_phase(trainer, root: str, model_dir: str, fp8_dir: str, ports: dict, stage_mb: float) -> dict:
    """The block-FP8 TP2 engine of the same weights (quantized on the trainer's side), under FP8_FAULT."""
    import vllm_refit as vr
    from reshard_cli.engines.vllm.clients import LLMClient

    k = len(FAULTS)
    prev = os.path.join(root, f"step-{k}")
    trainer.save(prev)  # the weights the FP8 engine starts from, loaded by vLLM itself
    fp8_checkpoint(prev, fp8_dir)
    llm = vr.make_engine(fp8_dir, 2, weight_transfer_config={"backend": "reshard"},
                         worker_extension_cls=vr.STAND_INS)
    client = LLMClient(llm, "fp8")
    e = _Engine(llm, client, lambda: vr.engines(trainer, client, model_dir, 2, ports, "reshard", stage_mb=stage_mb,
                                                engine_dir=fp8_dir, quantization="fp8", port="fp8"),
                stand_ins=True)
    e.engine.send_weights()
    trainer.step(k)
    new = os.path.join(root, f"step-{k + 1}")
    trainer.save(new)
    row = _fault_row(e, trainer, k, FP8_FAULT, prev, new,
                     lambda path: fp8_checkpoint(path, path.rstrip("/") + "-fp8"))
    e.engine.shutdown()
    _stop(llm)
    return row


def _fleet_phase(trainer, root: str, model_dir: str, ports: dict, stage_mb: float) -> dict:
    """Two TP1 `LLM`s refit as a fleet; member B's worker raises mid-transfer: B is dropped and told what it
    holds (finished, labelled, paused), A finishes the step; then B joins again, caught up."""
    import vllm_refit as vr
    from reshard_cli.engines.vllm.clients import LLMClient

    llms = []
    for i in range(2):  # one core each
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(i % (os.cpu_count() or 1))
        llms.append(vr.make_engine(model_dir, 1, weight_transfer_config={"backend": "reshard"}))
    clients = [LLMClient(x, name) for x, name in zip(llms, "AB")]
    engine = vr.engines(trainer, clients, model_dir, 1, ports, "reshard", stage_mb=stage_mb, replicas=2,
                        port="fleet")
    engine.send_weights()
    prev = os.path.join(root, f"step-{len(FAULTS) + 1}")
    trainer.step(len(FAULTS) + 1)
    new = os.path.join(root, "fleet-new")
    trainer.save(new)
    groups = engine.refit.groups
    before_b = llms[1].collective_rpc(_probe)[0]
    llms[1].collective_rpc(_worker_inject, args=(FLEET_FAULT[1], FLEET_FAULT[0]))
    t0 = time.perf_counter()
    report = engine.send_weights(weight_version="fleet")
    seconds = time.perf_counter() - t0
    llms[1].collective_rpc(_worker_undo)
    dropped = report["dropped"]
    held_b = dropped[0]["held_groups"] if dropped else None
    version_b, paused_b = llms[1].get_weight_version(), clients[1].is_paused()
    after_b = llms[1].collective_rpc(_probe)[0]
    import vllm_probe

    rest = groups[held_b or 0:]
    names = [f"model.layers.{x}" for g in rest for x in g.layers] + \
        ([n for n in before_b if not n.startswith("model.layers.")] if any(g.outside for g in rest) else [])
    a_identical = vr.generate(llms[0]) == vr.reference(new, 1)
    clients[1].resume()
    b_expected = mixed_checkpoint(prev, new, groups, held_b or 0, os.path.join(root, "fleet-b-held"))
    b_identical = vr.generate(llms[1]) == vr.reference(b_expected, 1)
    engine.add(clients[1])  # B joins again, caught up to the step
    engine.send_weights(weight_version="fleet")
    retry = [vr.generate(x) == vr.reference(new, 1) for x in llms]
    survivor_version = llms[0].get_weight_version()
    engine.shutdown()
    for llm in llms:
        _stop(llm)
    row = {"fault": FLEET_FAULT[0], "who": FLEET_FAULT[1], "kind": FLEET_FAULT[2],
           "named": dropped[0]["why"] if dropped else None, "named_seconds": round(seconds, 3),
           "members_after": report["members"], "dropped": dropped, "committed_groups": {"B": held_b},
           "groups": len(groups), "weight_version": version_b, "paused": paused_b,
           "forward_identical": not vllm_probe.changed(before_b, after_b, names),
           "identical": b_identical, "survivor_identical": a_identical, "retry_identical": all(retry),
           "survivor_version": survivor_version}
    print(f"[faults] {FLEET_FAULT[0]}: dropped {[d['member'] for d in dropped]} holding {held_b} group(s), "
          f"labelled {version_b}, paused {paused_b}; A identical {a_identical}; B identical to what it holds "
          f"{b_identical}; after B rejoined, both identical {all(retry)}", flush=True)
    return row


def _stop(llm) -> None:
    """End an engine's processes before the next starts (the machine has few cores)."""
    import gc

    llm.llm_engine.engine_core.shutdown()  # vLLM's core client: its engine core and workers exit
    gc.collect()


def run_faults(root: str) -> dict:
    """The fault matrix (see the module docstring); its JSON."""
    import cloudpickle
    import torch.multiprocessing as mp

    import vllm_faults
    import vllm_probe
    import vllm_refit as vr
    import world_stall
    from reshard_cli.base.ports import free_port

    for module in (vllm_faults, vllm_probe):  # the workers run these functions without this folder
        cloudpickle.register_pickle_by_value(module)
    os.environ["VLLM_ALLOW_INSECURE_SERIALIZATION"] = "1"  # vLLM's collective_rpc of a function: our own engine
    here = os.path.dirname(os.path.abspath(__file__))  # the FP8 engine's workers import the stand-in extension
    os.environ["PYTHONPATH"] = os.pathsep.join(filter(None, [here, os.environ.get("PYTHONPATH")]))
    model_dir = vr.make_model("qwen3-moe", root, config=CONFIG)
    fp8_dir = os.path.join(root, "qwen3-moe-fp8")
    fp8_config(model_dir, fp8_dir)  # both trainer ranks read the FP8 engine's layout from it
    stage_mb = vr.stage_budget_mb(model_dir, 2, 1.5)  # 1.5 layers: at least four groups for four layers
    port = free_port()
    ports = {"trainer": free_port(), "reshard": port, "bad": port, "fp8": free_port(), "fleet": free_port()}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(2))
    os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    rank1 = mp.get_context("spawn").Process(target=faults_rank1, args=(model_dir, fp8_dir, ports, stage_mb))
    rank1.start()
    trainer = vr.Trainer(0, model_dir, ports["trainer"])
    rows, (before, after) = _bf16_phase(trainer, root, model_dir, ports, stage_mb)
    rows.append(_fp8_phase(trainer, root, model_dir, fp8_dir, ports, stage_mb))
    rows.append(_fleet_phase(trainer, root, model_dir, ports, stage_mb))
    import torch.distributed as dist

    dist.destroy_process_group()
    rank1.join(timeout=120)
    stall = world_stall.scenario()
    rows.append({"fault": "a rank of a torchrun job stopped mid-refit over the default group", "who": "rank 2",
                 "kind": "stalled", **stall})
    print(f"[faults] {rows[-1]['fault']}: named in {stall['named_seconds']:.2f} s (stall limit "
          f"{stall['stall_limit']} s): {stall['named']}", flush=True)
    return {"faults": rows, "groups": rows[0]["groups"], "stage_budget_mb": stage_mb,
            "leaked_threads": sum(max(0, a[0] - b[0]) for a, b in zip(after, before)),
            "leaked_fds": sum(max(0, a[1] - b[1]) for a, b in zip(after, before)),
            "new_threads": [sorted(set(a[2]) - set(b[2])) for a, b in zip(after, before)],
            "resources_before": before, "resources_after": after}


def passed(result: dict) -> bool:
    """Every engine fault: named (not a healthy rank), what each worker holds recorded and alike (or, for the
    torn commit, differing with a mixed label and the engine paused), every module it did not commit computing
    as before, identical to vLLM's load of what it holds, retried identically; the fleet's member told; the
    stopped rank named within its stall limit + 2 s; nothing leaked."""
    ok = result["leaked_threads"] == 0 and result["leaked_fds"] == 0
    for r in result["faults"]:
        if r["kind"] in ("agreed", "broken"):
            ok &= len(set(r["committed_groups"].values())) == 1 and r["identical"] is True
        if r["kind"] == "torn":
            ok &= bool(r["torn"]) and "+mixed-" in (r["weight_version"] or "") and r["paused"]
        if r["kind"] == "member":
            ok &= bool(r["dropped"]) and r["paused"] and "+partial-" in (r["weight_version"] or "") \
                and r["identical"] and r["survivor_identical"]
        if r["kind"] == "stalled":
            ok &= r["named_seconds"] <= r["stall_limit"] + 2 and "rank 2" in r["named"]
            continue
        ok &= bool(r["named"]) and r["forward_identical"] and r["retry_identical"] and not r.get("healthy_named")
    return ok


if __name__ == "__main__":
    sys.exit("run it as: python examples/vllm_refit.py --faults [--json OUT]")
