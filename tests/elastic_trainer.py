"""A one-process trainer that refits a fleet of running `vllm serve`s through the `reshard` trainer engine while
the fleet changes: run by tests/test_vllm_serve_fleet.py as `python elastic_trainer.py SPEC.json OUT.json`.

SPEC: {"config": the model's config.json, "a": and "b": checkpoint dirs, "urls": the first members (three, all
of whose workers share one NVLink domain, so replicas forward each other's bytes), "kill": which of them dies,
"join": a server added later (started on B), "port" and "master_port"}. The refit runs in staging groups of
one layer each. Steps:
  push B into the three; push A while the "kill" member is killed (SIGKILL) as the trainer starts sending
  group 1: it is dropped and the other two resume from group 1 among themselves (new group, new plan) in the
  same call; add the joining server (it catches up to A alone); push B into the three; push A while the joined
  server is stopped (SIGSTOP) at group 1: dropped after the stall limit, the others resume; continue it and
  add it again (it catches up to A); push B into all three.
OUT: each step's members, dropped ones (with why), what each member serves (greedy token ids), and the
engine's membership events (catch-up seconds, bytes re-sent)."""
import json
import os
import signal
import sys
import urllib.request
from pathlib import Path

import psutil
import torch.distributed as dist
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))  # the fault hook lives there
from vllm_elastic import fault_at_group  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8], [900, 1, 2, 3, 4, 5], [77] * 12]


def complete(url: str, model: str) -> list:
    body = json.dumps({"model": model, "prompt": PROMPTS, "max_tokens": 16, "temperature": 0.0,
                       "return_token_ids": True}).encode()
    req = urllib.request.Request(f"{url}/v1/completions", data=body, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        choices = json.loads(r.read())["choices"]
    return [c["token_ids"] for c in sorted(choices, key=lambda c: c["index"])]


def weights(path: str) -> dict:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def signal_server(url: str, sig) -> list:
    """Send `sig` to the server listening at `url` and every process it started (its engine core, its
    workers); the processes signalled."""
    port = int(url.rsplit(":", 1)[1])
    pid = next(c.pid for c in psutil.net_connections(kind="tcp") if c.laddr and c.laddr.port == port
               and c.status == psutil.CONN_LISTEN)
    proc = psutil.Process(pid)
    procs = [*proc.children(recursive=True), proc]
    for p in procs:
        try:
            p.send_signal(sig)
        except psutil.NoSuchProcess:
            pass
    return procs


def main() -> None:
    spec = json.load(open(sys.argv[1]))
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(spec["master_port"]))
    dist.init_process_group("gloo", rank=0, world_size=1)
    from reshard_cli.engines import vllm as vb
    from reshard_cli.engines.vllm.clients import http_client

    config, model = spec["config"], spec["a"]
    src = f"model: {config}\nmesh: {{fsdp: 1}}\nplacements:\n  - {{match: '.', shard: {{fsdp: 0}}}}\n"
    first = spec["urls"]
    dst = (f"model: {config}\nformat: vllm\nmesh: {{dp: {len(first)}, tp: 1}}\n")
    ckpt = {"a": weights(spec["a"]), "b": weights(spec["b"])}
    current = dict(ckpt["a"])
    info = vb.ReshardTrainerInitInfo(host="127.0.0.1", port=spec["port"], src=src, dst=dst, rank=0, timeout=20,
                                     stall=5, stage_mb=1e-3,  # every layer a group of its own
                                     topology="name: one-domain\ndomains: ['1-8']\n")  # every member's workers
    clients = [http_client(u, 60) for u in first]
    engine = vb.ReshardTrainerEngine.trainer_init(info, client=clients, source=vb.ReshardSource(lambda: current))
    steps = []

    def push(name: str, version: str) -> None:
        current.update(ckpt[name])
        report = engine.send_weights(version)
        members = report["members"]
        ran = engine.refit.parts[report["resumed_from_group"]:]
        steps.append({"pushed": name, "members": members, "dropped": report["dropped"],
                      "resumed_from_group": report["resumed_from_group"], "groups": len(engine.refit.groups),
                      "resumed_from_layer": report["resumed_from_layer"],
                      "resent_bytes": report.get("resent_bytes", 0), "wire_bytes": report["wire_bytes"],
                      "forwarded_bytes": report["forwarded_bytes"],
                      # the plan's own figures for the groups this update sent (a resumed one: from where it failed)
                      "plan_forwarded_bytes": sum(p.plan.stats()["forwarded_bytes"] for p in ran),
                      "plan_wire_bytes": sum(p.plan.stats()["wire_bytes"] for p in ran),
                      "replicas_identical": report["replicas_identical"],
                      "drop_and_resume_seconds": report.get("drop_and_resume_seconds"),
                      "seconds": report["seconds_with_membership"],
                      "weight_version": report["weight_version"],
                      "served": {u: complete(u, model) for u in members}})

    push("b", "step-1")
    fault_at_group(1, lambda: signal_server(spec["kill"], signal.SIGKILL))
    push("a", "step-2")
    join = spec["join"]

    def add(note: str) -> None:
        engine.add(http_client(join, 60))
        steps.append({"added": join, "note": note, "served": {join: complete(join, model)},
                      "event": engine.events[-1]})

    add("a new server, started on B")
    push("b", "step-3")
    stopped = []
    fault_at_group(1, lambda: stopped.extend(signal_server(join, signal.SIGSTOP)))
    push("a", "step-4")
    for p in stopped:
        p.send_signal(signal.SIGCONT)
    add("the stalled server, continued")
    push("b", "step-5")
    engine.shutdown()
    json.dump({"steps": steps, "events": engine.events}, open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
