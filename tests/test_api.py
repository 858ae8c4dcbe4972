"""The live-process API: plain tensors with YAML layouts, DTensors without, buffers written in place."""
import subprocess
import sys

import pytest
import torch

from conftest import ROOT, SMALL_MODEL, write_pair
from dist_util import agreed_port, run_ranks


def _live(rank, world, src_path, dst_path, transport="auto"):
    from reshard_cli.transfer.live import Refit
    from reshard_cli.formats import load_pair

    src, dst = load_pair(src_path, dst_path)
    man = src.manifest.tensors
    role = "src" if rank in src.ranks else "dst" if rank in dst.ranks else "idle"
    refit = Refit(role=role, src=src_path, dst=dst_path, mode="hybrid", transport=transport)
    results = []
    buffers: dict = {}  # the destination buffers of the first refit, reused (in place) later
    sources: dict = {}  # step 1 updates the step-0 source tensors in place (the binding is kept); 2 passes new ones
    for step in range(3):
        full = {s.name: (torch.arange(s.numel, dtype=torch.float32).reshape(s.shape) * (step + 1)).to(
            getattr(torch, s.dtype)) for s in man}
        tensors = {}
        for t, s in enumerate(man):
            layout = src if role == "src" else dst
            if role != "idle" and rank in layout.placements[t].holder_set:
                box = layout.placements[t].box_of(s.shape, rank)
                if role == "src" and step == 1:
                    tensors[s.name] = sources[s.name].copy_(full[s.name][box.slices()])
                elif role == "src":
                    tensors[s.name] = sources[s.name] = full[s.name][box.slices()].clone()
                else:
                    tensors[s.name] = buffers[s.name] if step else torch.full(box.sizes, -7.0).to(full[s.name].dtype)
        if role == "dst" and step == 0:
            buffers.update(tensors)
        stats = refit(tensors, verify_checksums=True)
        ok = stats.checksums_ok
        if role == "dst":
            for t, s in enumerate(man):
                if s.name in tensors:
                    box = dst.placements[t].box_of(s.shape, rank)
                    ok = ok and torch.equal(tensors[s.name], full[s.name][box.slices()])
        results.append(ok)
    return results


@pytest.mark.parametrize("transport", ["auto", "shm"])
def test_yaml_layouts_plain_tensors(tmp_path, transport):
    src, dst = write_pair(tmp_path, "pp2_ep2_to_dp2_tp2")
    results = run_ranks(9, _live, str(src), str(dst), transport)  # rank 8 is idle
    assert all(all(r) for r in results.values()), results


def test_live_refit_example():
    r = subprocess.run([sys.executable, str(ROOT / "examples/live_refit.py")], cwd=ROOT, capture_output=True,
                       text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "outputs equal after every refit" in r.stdout
    assert r.stdout.count("checksums ok") == 5


def _own_group(rank, world, src_path, dst_path):
    """The refit runs over its own group, numbered backwards from the default one: a message sent on the
    default group would reach the wrong process, so exact results prove only the refit group carried them."""
    from reshard_cli.formats import load_pair
    from reshard_cli.transfer.comm import refit_group
    from reshard_cli.transfer.live import Refit

    group = refit_group("127.0.0.1", agreed_port(), world - 1 - rank, world)
    me = group.rank
    src, dst = load_pair(src_path, dst_path)
    man = src.manifest.tensors
    role = "src" if me in src.ranks else "dst" if me in dst.ranks else "idle"
    refit = Refit(role=role, src=src_path, dst=dst_path, mode="reshard", group=group)
    full = {s.name: (torch.arange(s.numel, dtype=torch.float32).reshape(s.shape) + 0.5).to(getattr(torch, s.dtype))
            for s in man}
    layout = src if role == "src" else dst
    tensors = {}
    if role != "idle":
        for t, box in layout.held(me):
            s = man[t]
            tensors[s.name] = full[s.name][box.slices()].clone() if role == "src" else \
                torch.full(box.sizes, -7.0).to(full[s.name].dtype)
    stats = refit(tensors, verify_checksums=True)
    exact = all(torch.equal(tensors[man[t].name], full[man[t].name][box.slices()])
                for t, box in dst.held(me)) if role == "dst" else True
    return stats.checksums_ok and exact


def test_refit_over_its_own_group(tmp_path):
    src, dst = write_pair(tmp_path, "tp2_to_tp3")
    results = run_ranks(5, _own_group, str(src), str(dst))
    assert all(results.values()), results


FLEET = ("""model: model.yaml
mesh: {tp: 2}
placements:
  - {match: 'q_proj|up_proj|embed|lm_head', shard: {tp: 0}}
  - {match: 'o_proj|down_proj', shard: {tp: 1}}
""", """model: model.yaml
mesh: {dp: 2, tp: 2}
placements:
  - {match: 'q_proj|up_proj|embed|lm_head', shard: {tp: 0}}
  - {match: 'o_proj|down_proj', shard: {tp: 1}}
""")  # a 2-rank trainer; two TP2 replicas
APART = "name: fleet\ndomains: ['2-5']\n"  # the replicas share one NVLink domain, the trainer has its own
TOGETHER = "name: colocated\ndomains: ['0,2-5']\n"  # trainer rank 0 shares it: its shards need no network


def _fleet(rank, world, src_path, dst_path, topo_path, transport="auto"):
    """Every mode over a refit group of its own (numbered backwards from the default group, so only the refit
    group can carry the bytes) into two replicas of one domain: each destination shard exact, element by
    element, from sentinel-filled buffers; every rank's bytes sent and received."""
    from reshard_cli.formats import load_pair
    from reshard_cli.transfer.comm import refit_group
    from reshard_cli.transfer.live import Refit

    group = refit_group("127.0.0.1", agreed_port(), world - 1 - rank, world)
    me = group.rank
    src, dst = load_pair(src_path, dst_path)
    man = src.manifest.tensors
    role = "src" if me in src.ranks else "dst"
    full = {s.name: (torch.arange(s.numel, dtype=torch.float32).reshape(s.shape) + 0.5).to(getattr(torch, s.dtype))
            for s in man}
    layout = src if role == "src" else dst
    out = {}
    for mode in ("reshard", "broadcast", "hybrid", "auto"):
        refit = Refit(role=role, src=src_path, dst=dst_path, topology=topo_path, mode=mode, group=group,
                      reshard_match="up_proj|down_proj", transport=transport)
        tensors = {man[t].name: (full[man[t].name][box.slices()].clone() if role == "src" else
                                 torch.full(box.sizes, -7.0).to(full[man[t].name].dtype))
                   for t, box in layout.held(me)}
        stats = refit(tensors, verify_checksums=True)
        exact = all(torch.equal(tensors[man[t].name], full[man[t].name][box.slices()])
                    for t, box in dst.held(me)) if role == "dst" else True
        out[mode] = (me, stats.checksums_ok and exact, stats.bytes_sent, stats.bytes_received,
                     refit.plan.mode, refit.plan.stats())
    return out


@pytest.mark.parametrize("topology,transport", [(APART, "auto"), (TOGETHER, "auto"), (APART, "shm")],
                         ids=["apart", "colocated", "apart-shm"])
def test_every_mode_over_its_own_group_with_forwarding(tmp_path, topology, transport):
    """Over a refit group of its own, the plan's forwarding and every route run: the trainer sends each byte
    once into the replicas' domain (the minimum), the replicas forward exactly the plan's forwarded bytes to each
    other, and broadcast and hybrid (sub-groups on the group's store) land the same values. With a trainer rank
    inside the domain, its shards reach both replicas from there and only the other rank's are forwarded."""
    (tmp_path / "model.yaml").write_text(SMALL_MODEL)
    paths = []
    for name, text in zip(("src.yaml", "dst.yaml", "topo.yaml"), (*FLEET, topology)):
        (tmp_path / name).write_text(text)
        paths.append(str(tmp_path / name))
    results = run_ranks(6, _fleet, *paths, transport)
    for mode in ("reshard", "broadcast", "hybrid", "auto"):
        rows = sorted(r[mode] for r in results.values())
        assert all(ok for _, ok, *_ in rows), (mode, rows)
        stats = rows[0][5]
        sent = {me: s for me, _, s, *_ in rows}
        forwarded = sum(sent[r] for r in range(2, 6))  # what the replicas sent each other
        assert forwarded == stats["forwarded_bytes"], (mode, sent, stats)
        if mode == "reshard":
            assert stats["wire_bytes"] == stats["min_wire_bytes"] > 0, stats
            assert sent[0] + sent[1] == stats["wire_bytes"] + stats["indomain_bytes"] - forwarded, (sent, stats)
            assert sum(r[3] for r in rows) == stats["wire_bytes"] + stats["indomain_bytes"]
            if topology == APART:  # each byte once into the domain, the rest forwarded inside it
                assert stats["wire_bytes"] == stats["bytes"] and forwarded == stats["indomain_bytes"] > 0, stats
            else:  # rank 0's half comes from inside the domain: only rank 1's half crosses, and is split
                assert 0 < stats["wire_bytes"] < stats["bytes"] and 0 < forwarded < stats["indomain_bytes"], stats
        if mode == "broadcast":
            assert rows[0][4] == "broadcast" and sent[0] + sent[1] > 0


def _resumed(rank, world, src_path, dst_path, topo_path):
    """A refit in agreed groups of one layer each (the tensors outside the layers, layer 0, layer 1), then the
    next step resumed at layer 0 (what a fleet's survivors run after a member was dropped in that group):
    destinations start from a sentinel; after the resumed refit the group before it still holds the first
    step, exactly, and the rest the second. Resumed past the last layer, only the last group runs."""
    from reshard_cli.formats import load_pair
    from reshard_cli.transfer.comm import refit_group
    from reshard_cli.transfer.live import Refit

    group = refit_group("127.0.0.1", agreed_port(), rank, world)
    src, dst = load_pair(src_path, dst_path)
    man = src.manifest.tensors
    role = "src" if rank in src.ranks else "dst"
    refit = Refit(role=role, src=src_path, dst=dst_path, topology=topo_path, mode="reshard", group=group,
                  stage_mb=1e-4)  # 104 bytes: every layer a group of its own
    layout = src if role == "src" else dst

    def step(k):
        return {s.name: (torch.arange(s.numel, dtype=torch.float32).reshape(s.shape) * k + 0.5).to(
            getattr(torch, s.dtype)) for s in man}
    one, two = step(1), step(2)
    held = {man[t].name: box for t, box in layout.held(rank)}
    buffers = {n: torch.full(box.sizes, -7.0).to(one[n].dtype) for n, box in held.items()}
    sources = {n: one[n][box.slices()].clone() for n, box in held.items()}
    first = refit(sources if role == "src" else buffers, verify_checksums=True)
    for n, box in held.items():
        sources[n].copy_(two[n][box.slices()])
    resumed = refit(sources if role == "src" else buffers, verify_checksums=True, resume_layer=0)
    skipped = {man[t].name for t in refit.groups[0].tensors}
    exact = role == "src" or all(torch.equal(buffers[n], (one if n in skipped else two)[n][box.slices()])
                                 for n, box in held.items())
    last = refit(sources if role == "src" else buffers, resume_layer=99)
    wire = [p.plan.stats()["wire_bytes"] for p in refit.parts]
    return {"rank": rank, "exact": exact, "ok": (first.checksums_ok, resumed.checksums_ok),
            "sent": (first.bytes_sent, resumed.bytes_sent, last.bytes_sent), "wire": wire,
            "groups": [g.layers for g in refit.groups], "first": (first.first_group, resumed.first_group,
                                                               last.first_group), "skipped": sorted(skipped)}


def test_a_resumed_refit_sends_only_the_groups_from_there_on(tmp_path):
    """`resume_layer`: the groups before it are not sent again (what the trainer engine resumes from after a
    fleet member was dropped). Two replicas in one domain, forwarding on: the trainer sends exactly the later
    groups' wire, every destination holds the skipped group from the step before (element by element) and
    the rest from this step."""
    (tmp_path / "model.yaml").write_text(SMALL_MODEL)
    paths = []
    for name, text in zip(("src.yaml", "dst.yaml", "topo.yaml"), (*FLEET, APART)):
        (tmp_path / name).write_text(text)
        paths.append(str(tmp_path / name))
    rows = sorted(run_ranks(6, _resumed, *paths).values(), key=lambda r: r["rank"])
    assert rows[0]["groups"] == [(), (0,), (1,)] and "embed_tokens.weight" in rows[0]["skipped"], rows[0]
    assert all(r["exact"] and r["ok"] == (True, True) and r["first"] == (0, 1, 2) for r in rows), rows
    wire = rows[0]["wire"]
    trainer = [sum(r["sent"][i] for r in rows[:2]) for i in (0, 1, 2)]
    assert trainer == [sum(wire), sum(wire[1:]), wire[2]] and wire[0] > 0, (trainer, wire)


def test_own_group_plans_with_a_topology():
    from reshard_cli.transfer.comm import GroupComm
    from reshard_cli.transfer.live import Refit

    assert Refit(role="idle", group=GroupComm(None, 0, 1)).mode == "auto"  # every route runs over a refit group




def _setup_fails_on_one_rank(rank, world, src_path, dst_path):
    from reshard_cli.errors import ReshardError
    from reshard_cli.transfer.live import Refit

    try:  # rank 1's topology file cannot be read: its Refit fails, and its program goes on to a collective
        refit = Refit(role="src" if rank < 2 else "dst", src=src_path, dst=dst_path,
                      topology="missing-topology.yaml" if rank == 1 else None)
        refit({})
        return "no error"
    except ReshardError as e:
        return str(e)


def test_a_rank_whose_setup_failed_is_named_at_the_first_collective(tmp_path):
    """Over the default group (no watchdog): a rank whose Refit(...) raised tells its peers in their first
    collective, so every rank ends with a line naming it instead of pairing collectives at random."""
    src, dst = write_pair(tmp_path, "tp2_to_tp3")
    results = run_ranks(5, _setup_fails_on_one_rank, str(src), str(dst), timeout=60)
    assert "missing-topology.yaml" in results[1], results[1]
    for rank in (0, 2, 3, 4):
        assert results[rank].startswith("refit rank 1: its set-up failed:"), results[rank]
        assert "missing-topology.yaml" in results[rank], results[rank]


def _fails_mid_transfer(rank, world, src_path, dst_path):
    import time

    from reshard_cli.errors import ReshardError
    from reshard_cli.formats import load_pair
    from reshard_cli.transfer.live import Refit

    src, dst = load_pair(src_path, dst_path)
    layout = src if rank in src.ranks else dst
    tensors = {s.name: torch.zeros(layout.placements[t].box_of(s.shape, rank).sizes, dtype=getattr(torch, s.dtype))
               for t, s in enumerate(layout.manifest.tensors) if rank in layout.placements[t].holder_set}
    refit = Refit(role="src" if rank in src.ranks else "dst", src=src_path, dst=dst_path)
    if rank == 1:  # this source rank fails before its first byte: its peers wait on bytes that never come
        def failing(part):
            raise RuntimeError("simulated: the shards could not be read")
        refit._move = failing
    t0 = time.monotonic()
    try:
        refit(tensors, verify_checksums=True)  # every rank ends in the verification's collective
        return "no error", 0.0
    except ReshardError as e:
        return str(e), time.monotonic() - t0
    finally:
        refit.close()


def test_a_failure_mid_transfer_over_the_default_group_is_told_to_every_rank(tmp_path):
    """A Refit over the default group of the user's own job (no launcher of ours, no watchdog set): one rank
    fails in the middle of the transfer. Its peers, blocked on its bytes, are told by the watchdog the Refit
    keeps over the job's store and end with its line, instead of at gloo's timeout (30 minutes here)."""
    src, dst = write_pair(tmp_path, "tp2_to_tp3")
    results = run_ranks(5, _fails_mid_transfer, str(src), str(dst), timeout=90)
    print({r: (round(s, 2), line) for r, (line, s) in results.items()})
    for rank in range(5):
        line, _seconds = results[rank]
        assert line.startswith("refit rank 1: the transfer failed (RuntimeError: simulated"), (rank, line)
