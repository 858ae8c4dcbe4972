"""A one-process trainer that refits a fleet of running `vllm serve`s through the `reshard` trainer engine while
the fleet changes: run by tests/test_vllm_serve_fleet.py as `python elastic_trainer.py SPEC.json OUT.json`.

SPEC: {"config": path of the model's config.json, "a": and "b": checkpoint dirs, "urls": the first members,
"join": a server's URL added after the first update, "port": the refit group's port}. Steps:
  push B into the first members; add the joining server (it catches up to B alone); push A into all three
  (the group formed again); push B while the joined server's processes are stopped (SIGSTOP) as its update
  is called: it is dropped after the stall limit and the others get B among themselves in a new group;
  continue it and add it again (it catches up to B); push A into all three; push B while it is killed as
  its update is called (dropped again); push A into the survivors.
OUT: each step's members, dropped ones (with why), what each member serves (greedy token ids), and the
engine's membership events (catch-up seconds, bytes re-sent)."""
import json
import os
import signal
import sys
import urllib.request

import psutil
import torch.distributed as dist
from safetensors.torch import load_file

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
                                     stall=5)
    clients = [http_client(u, 60) for u in first]
    engine = vb.ReshardTrainerEngine.trainer_init(info, client=clients, source=vb.ReshardSource(lambda: current))
    steps = []

    def push(name: str, version: str) -> None:
        current.update(ckpt[name])
        report = engine.send_weights(version)
        members = report["members"]
        steps.append({"pushed": name, "members": members, "dropped": report["dropped"],
                      "resent_bytes": report.get("resent_bytes", 0), "wire_bytes": report["wire_bytes"],
                      "drop_and_resume_seconds": report.get("drop_and_resume_seconds"),
                      "seconds": report["seconds_with_membership"],
                      "weight_version": report["weight_version"],
                      "served": {u: complete(u, model) for u in members}})

    push("b", "step-1")
    join = spec["join"]

    def add(note: str) -> None:
        client = http_client(join, 60)
        engine.add(client)
        steps.append({"added": join, "note": note, "served": {join: complete(join, model)},
                      "event": engine.events[-1]})
        return client

    joining = add("a new server")
    push("a", "step-2")
    stopped = []

    def stalls(arg, update=joining.update_weights):  # stopped as its update is called: it never answers
        stopped.extend(signal_server(join, signal.SIGSTOP))
        return update(arg)
    joining.update_weights = stalls
    push("b", "step-3")
    for p in stopped:
        p.send_signal(signal.SIGCONT)
    joining = add("the stalled server, continued")
    push("a", "step-4")

    def dies(arg, update=joining.update_weights):  # dies as its update is called: the others are in the refit
        signal_server(join, signal.SIGKILL)
        return update(arg)
    joining.update_weights = dies
    push("b", "step-5")
    push("a", "step-6")
    engine.shutdown()
    json.dump({"steps": steps, "events": engine.events}, open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
