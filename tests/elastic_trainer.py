"""A one-process trainer that refits a fleet of running `vllm serve`s through the `reshard` trainer engine while
the fleet changes: run by tests/test_vllm_serve_fleet.py as `python elastic_trainer.py SPEC.json OUT.json`.

SPEC: {"config": path of the model's config.json, "a": and "b": checkpoint dirs, "urls": the first members,
"join": a server's URL added after the first update, "port": the refit group's port}. Steps:
  1. push B into the first members;
  2. add the joining server: it catches up to B alone;
  3. push A into all three (the group formed again with the new member);
  4. push B while the joined server's processes are killed as its update is called: it is dropped, the
     others get B among themselves in a new group;
  5. push A into the survivors.
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


def kill_server(url: str) -> None:
    """SIGKILL the server listening at `url` and every process it started (its engine core, its workers)."""
    port = int(url.rsplit(":", 1)[1])
    pid = next(c.pid for c in psutil.net_connections(kind="tcp") if c.laddr and c.laddr.port == port
               and c.status == psutil.CONN_LISTEN)
    proc = psutil.Process(pid)
    for p in [*proc.children(recursive=True), proc]:
        try:
            p.send_signal(signal.SIGKILL)
        except psutil.NoSuchProcess:
            pass


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
    info = vb.ReshardTrainerInitInfo(host="127.0.0.1", port=spec["port"], src=src, dst=dst, rank=0, timeout=60,
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
    joining = http_client(spec["join"], 60)
    engine.add(joining)
    steps.append({"added": spec["join"], "served": {spec["join"]: complete(spec["join"], model)},
                  "event": engine.events[-1]})
    push("a", "step-2")
    update = joining.update_weights

    def dies(arg):  # the joined server dies as its update is called: the others are already in the refit
        kill_server(spec["join"])
        return update(arg)
    joining.update_weights = dies
    push("b", "step-3")
    push("a", "step-4")
    engine.shutdown()
    json.dump({"steps": steps, "events": engine.events}, open(sys.argv[2], "w"), indent=1)


if __name__ == "__main__":
    main()
