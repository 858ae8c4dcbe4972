"""An elastic fleet of vLLM engines under training (`python examples/vllm_refit.py --replicas 3 --elastic --json
OUT`): replicas die, stall and join between and during refits, and the fleet never loses a step.

A 2-process FSDP2 trainer takes optimizer steps and refits a 4-layer Qwen3-MoE into N TP1 `LLM`s (as N servers
are) in one refit: every replica's worker shares one NVLink domain (the replicas forward each other's bytes), in
staging groups of one layer. The steps:

- `clean`: a refit into every member.
- `killed`: replica 1's engine process is killed (SIGKILL) as the trainer starts sending group 1. The trainer
  engine drops it, the survivors form a new group with a new plan (forwarding among themselves) and resume from
  group 1 in the same call: group 0, which every survivor committed, is not sent again.
- `added`: a fresh `LLM` (loaded from the initial weights) joins; it catches up at once to the trainer's current
  weights, a refit of that member alone, and is refit with the fleet from the next step on.
- `stalled`: the added replica's engine is stopped (SIGSTOP) at group 1: named after the stall limit, dropped,
  the survivors resume; then it is continued (and stays out of the fleet).

Every step is checked against vLLM's own loader: the trainer saves the step with transformers, a fresh engine
loads it, and every member's greedy tokens and logprobs must equal it (`identical` per member). Each step
records `members`, `dropped` (with its reason and the groups it held), `resumed_from_group`, `resent_bytes`
(the survivors' groups from the failed one on), `drop_and_resume_seconds`, and for a join `catch_up_seconds`.
"""
from __future__ import annotations

import os
import signal
import time

import torch

from vllm_refit import Trainer, engines, generate, make_engine, make_model, reference, stage_budget_mb

LAYERS = 4
STALL_SECONDS = 5.0  # the refit group's stall limit: a stopped replica is named after this long


def schedule(replicas: int) -> list:
    """The steps, the same on both trainer ranks: (kind, replica index the fault hits)."""
    return [("clean", None), ("killed", min(1, replicas - 1)), ("added", None), ("clean", None),
            ("stalled", replicas - 1), ("clean", None)]


def fault_at_group(index: int, act) -> None:
    """Run `act` once, in this trainer process, as its refit starts sending group `index` of the next update
    (every member committed the groups before it)."""
    from reshard_cli.transfer.live import Refit

    move = Refit._move

    def moving(self, part):
        if self.parts.index(part) == index and Refit._move is moving:
            Refit._move = move  # once
            act()
        return move(self, part)
    Refit._move = moving


def _elastic_engines(trainer, client, model_dir: str, ports: dict, replicas: int, stage_mb: float):
    return engines(trainer, client, model_dir, 1, ports, "reshard", replicas=replicas, stage_mb=stage_mb,
                   stall=STALL_SECONDS)


def elastic_rank1(model_dir: str, ports: dict, replicas: int, stage_mb: float) -> None:
    """Trainer rank 1: the same calls as rank 0, in the same order, without the engines."""
    trainer = Trainer(1, model_dir, ports["trainer"])
    engine = _elastic_engines(trainer, None, model_dir, ports, replicas, stage_mb)
    for i, (kind, _) in enumerate(schedule(replicas)):
        if kind == "added":
            engine.add(None)
        trainer.step(i)
        engine.send_weights()
        trainer.save(None)
    engine.shutdown()
    torch.distributed.destroy_process_group()


def _new_processes(before: set) -> list:
    import psutil

    return [p for p in psutil.Process().children(recursive=True) if p.pid not in before]


def _signal(procs: list, sig) -> None:
    for p in procs:
        try:
            p.send_signal(sig)
        except Exception:  # noqa: BLE001 - already gone
            pass


def run_elastic(root: str, replicas: int = 3) -> dict:
    import psutil
    import torch.multiprocessing as mp

    from reshard_cli.base.ports import free_port
    from reshard_cli.engines.vllm.clients import LLMClient

    if replicas < 2:
        raise SystemExit("--elastic needs --replicas 2 or more")
    from vllm_refit import CONFIGS

    model_dir = make_model("qwen3-moe", root, config=dict(CONFIGS["qwen3-moe"], num_hidden_layers=LAYERS))
    stage_mb = stage_budget_mb(model_dir, 1, 1.0)  # one layer per group
    ports = {"trainer": free_port(), "reshard": free_port()}
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    rank1 = mp.get_context("spawn").Process(target=elastic_rank1, args=(model_dir, ports, replicas, stage_mb))
    rank1.start()

    def start(name: str):
        before = {p.pid for p in psutil.Process().children(recursive=True)}
        llm = make_engine(model_dir, 1, weight_transfer_config={"backend": "reshard"})
        return {"name": name, "llm": llm, "client": LLMClient(llm, name), "procs": _new_processes(before)}

    t0 = time.perf_counter()
    fleet = [start(f"replica {i}") for i in range(replicas)]
    print(f"[elastic] {replicas} engines up in {time.perf_counter() - t0:.0f} s", flush=True)
    trainer = Trainer(0, model_dir, ports["trainer"])
    engine = _elastic_engines(trainer, [m["client"] for m in fleet], model_dir, ports, replicas, stage_mb)
    members = list(fleet)  # in the engine's order
    stopped: list = []
    steps = []
    for i, (kind, hit) in enumerate(schedule(replicas)):
        row: dict = {"step": i + 1, "kind": kind, "catch_up_seconds": None}  # set when a replica joins
        if kind == "added":  # between steps: it catches up to the weights the fleet serves now
            joining = start(f"replica {replicas + len([s for s in steps if s['kind'] == 'added'])}")
            engine.add(joining["client"])
            event = engine.events[-1]
            row.update(joined=joining["name"], catch_up_seconds=event["catch_up_seconds"],
                       catch_up_bytes=event["resent_bytes"], catch_up_version=event["weight_version"],
                       identical_after_catch_up=generate(joining["llm"]) == steps[-1]["reference"])
            members.append(joining)
        row["loss"] = trainer.step(i)
        victim = members[hit] if hit is not None else None
        if kind == "killed":
            fault_at_group(1, lambda v=victim: _signal(v["procs"], signal.SIGKILL))
        elif kind == "stalled":
            fault_at_group(1, lambda v=victim: (stopped.extend(v["procs"]), _signal(v["procs"], signal.SIGSTOP)))
        report = engine.send_weights(weight_version=f"step-{i + 1}")
        _signal(stopped, signal.SIGCONT)
        stopped.clear()
        names = {m["name"]: m for m in members}
        members = [names[n] for n in report["members"]]
        ckpt = os.path.join(root, f"elastic-step{i + 1}")
        trainer.save(ckpt)
        theirs = reference(ckpt, 1)  # vLLM's own loader, in a fresh engine
        row.update(members=[m["name"] for m in members],
                   dropped=report["dropped"],
                   identical={m["name"]: generate(m["llm"]) == theirs for m in members},
                   resumed_from_group=report["resumed_from_group"], groups=len(engine.refit.groups),
                   wire_bytes=report["wire_bytes"], forwarded_bytes=report["forwarded_bytes"],
                   resent_bytes=report.get("resent_bytes", 0),
                   drop_and_resume_seconds=report.get("drop_and_resume_seconds"),
                   seconds=report["seconds_with_membership"], weight_version=report["weight_version"])
        row["reference"] = theirs
        steps.append(row)
        dropped = "; ".join(f"{d['member']} dropped ({d['why'][:90]}...), held {d['held_groups']} group(s)"
                            for d in row["dropped"]) or "none dropped"
        print(f"[elastic] step {i + 1} {kind}: members {row['members']}, {dropped}; "
              f"{row['wire_bytes'] / 1e6:.2f} MB sent"
              + (f", resumed from group {row['resumed_from_group']} of {row['groups']}: re-sent "
                 f"{row['resent_bytes'] / 1e6:.2f} MB in {row['drop_and_resume_seconds']:.2f} s"
                 if row["dropped"] else "")
              + (f"; {row['joined']} caught up in {row['catch_up_seconds']:.2f} s "
                 f"({row['catch_up_bytes'] / 1e6:.2f} MB), identical {row['identical_after_catch_up']}"
                 if kind == "added" else "")
              + f"; identical to vLLM's loader: {row['identical']}", flush=True)
    engine.shutdown()
    torch.distributed.destroy_process_group()
    rank1.join(timeout=120)
    for s in steps:
        del s["reference"]
    return {"replicas": replicas, "layers": LAYERS, "stage_mb": stage_mb, "steps": steps}


def passed(result: dict) -> bool:
    """Every member identical at every step, the fault's victim named in its step, the joined one identical from
    its catch-up on."""
    steps = result["steps"]
    ok = all(all(s["identical"].values()) for s in steps)
    for s in steps:
        if s["kind"] in ("killed", "stalled"):
            ok &= len(s["dropped"]) == 1 and s["resent_bytes"] > 0 and s["resumed_from_group"] >= 1
        if s["kind"] == "added":
            ok &= s["identical_after_catch_up"] and s["joined"] in s["members"]
    return ok
