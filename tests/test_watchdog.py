"""The group watchdog (transfer/watchdog.py) in one process, over a real TCP store: heartbeats, reported faults,
guarded waits, and a refit group whose rank 0 never comes; then in small gloo jobs: a stopped rank of a user's
own job named within the stall limit, a closed Refit, and a transport set-up held up on one rank."""
import socket
import threading

import pytest
import torch.distributed as dist

from dist_util import free_port, run_ranks
from reshard_cli.base.ports import ephemeral_range
from reshard_cli.errors import RuntimeFailure
from reshard_cli.transfer import rendezvous
from reshard_cli.transfer.comm import refit_group
from reshard_cli.transfer.watchdog import Fault, GroupBroken, Guard, Watchdog


@pytest.fixture
def store():
    return dist.TCPStore("127.0.0.1", free_port(), 2, is_master=True, wait_for_workers=False)


def test_a_silent_peer_is_named_with_its_role(store):
    me, peer = Watchdog(store, 0, 2, stall=0.3), Watchdog(store, 1, 2, stall=0.3)
    me.roles = ["trainer 0", "vLLM worker 0"]
    assert me.check() is None  # first look: the count it sees now
    event = threading.Event()
    fault = None
    while fault is None:  # peer's heartbeat thread never started: its count never moves
        event.wait(0.1)
        fault = me.check()
    assert fault.ranks == (1,)
    assert fault.line.startswith("refit rank 1 (vLLM worker 0) stopped answering: no heartbeat for"), fault.line
    peer.close()


def test_a_beating_peer_is_not_named(store):
    me, peer = Watchdog(store, 0, 2, stall=0.5), Watchdog(store, 1, 2, stall=0.5, interval=0.05)
    peer.start()
    event = threading.Event()
    for _ in range(15):  # 1.5 s, three times the stall limit
        event.wait(0.1)
        assert me.check() is None
    peer.close()


def test_the_first_reported_fault_is_everyones(store):
    me, peer = Watchdog(store, 0, 2), Watchdog(store, 1, 2)
    peer.report(Fault("refit rank 1 (trainer 1): the transfer failed (RuntimeError: boom)", (1,)))
    peer.report(Fault("a later one", (0,)))
    assert me.check() == Fault("refit rank 1 (trainer 1): the transfer failed (RuntimeError: boom)", (1,))


def test_rank_0_keeps_the_store_until_every_live_peer_read_the_fault(monkeypatch):
    """Rank 0's process holds the store: a group given up after a fault lingers there until each other rank has
    read the fault (else a peer looking after the store was gone would name rank 0, not the rank that failed),
    not for ranks the fault names, nor for a rank whose heartbeat has stopped (dead)."""
    from reshard_cli.transfer import watchdog

    monkeypatch.setattr(watchdog, "DEATH_WINDOW", 60.0)  # what ends the linger below is the read, not a deadline
    store = dist.TCPStore("127.0.0.1", free_port(), 4, is_master=True, wait_for_workers=False)
    root, failed, reader, dead = (Watchdog(store, r, 4, interval=0.05) for r in range(4))
    for w in (root, failed, reader):
        w.start()
    line = "refit rank 1 (vLLM worker 0): setting up the transfer failed (RuntimeError: boom)"
    failed.report(Fault(line, (1,)))
    assert root.check() == Fault(line, (1,))
    linger = threading.Thread(target=root.linger, args=((1, 3),))  # the fault names 1; 3 is named too
    linger.start()
    linger.join(0.5)
    assert linger.is_alive()  # rank 2 has not read it yet
    assert reader.check() == Fault(line, (1,))
    linger.join(30)
    assert not linger.is_alive()
    monkeypatch.setattr(watchdog, "DEATH_WINDOW", 0.3)
    slow = Watchdog(store, 0, 4, interval=20.0)  # its own deadline: 40 s and more
    quiet = threading.Thread(target=slow.linger)  # rank 3 never beat or read: dropped once silent 0.3 s
    quiet.start()
    quiet.join(30)
    assert not quiet.is_alive()
    for w in (root, failed, reader, dead, slow):
        w.close()


class _Transport:
    """A stand-in for a process group: a wait on it blocks until the group is shut down, then raises as gloo
    does."""

    def __init__(self):
        self.ended = threading.Event()

    def wait(self):
        self.ended.wait()
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")

    def shutdown(self):
        self.ended.set()


def test_a_wait_on_the_callers_thread_is_ended_by_the_monitor(store):
    """No thread hop: the wait runs on the caller's thread; the monitor finds the fault while it is blocked and
    shuts the group's process groups down, which ends the wait with the fault's line."""
    me, peer = Watchdog(store, 0, 2), Watchdog(store, 1, 2)
    guard = Guard(me)
    transport = _Transport()
    guard.abortables.append(transport)
    threading.Timer(0.3, peer.report, args=(Fault("refit rank 1 (trainer 1): gone", (1,)),)).start()
    with pytest.raises(GroupBroken) as e:
        guard.run(transport.wait)
    assert str(e.value) == "refit rank 1 (trainer 1): gone" and e.value.ranks == (1,)
    assert transport.ended.is_set()
    with pytest.raises(GroupBroken):
        guard.run(lambda: None)
    guard.close()


def test_a_guarded_wait_ends_on_a_fault_and_the_group_stays_given_up(store):
    me, peer = Watchdog(store, 0, 2), Watchdog(store, 1, 2)
    guard = Guard(me)
    blocked = threading.Event()  # never set: a wait on a peer that will not answer (not one an abort ends)
    threading.Timer(0.3, peer.report, args=(Fault("refit rank 1 (trainer 1): gone", (1,)),)).start()
    with pytest.raises(GroupBroken) as e:
        guard.run_aside(blocked.wait)
    assert str(e.value) == "refit rank 1 (trainer 1): gone" and e.value.ranks == (1,)
    with pytest.raises(GroupBroken):  # at once, without waiting again
        guard.run(lambda: None)
    blocked.set()  # lets the helper thread end


def test_a_transport_error_is_explained_by_the_silent_peer(store):
    me, _peer = Watchdog(store, 0, 2, interval=0.05), Watchdog(store, 1, 2)
    guard = Guard(me)

    def closed():
        raise RuntimeError("[pair.cc:553] Connection closed by peer [127.0.0.1]:1234")
    with pytest.raises(GroupBroken) as e:
        guard.run(closed)
    assert "refit rank 1 stopped answering: no heartbeat" in str(e.value), str(e.value)


def test_a_refit_group_whose_store_never_answers_is_one_line():
    port = free_port()  # nobody listens there
    with pytest.raises(RuntimeFailure) as e:
        refit_group("127.0.0.1", port, 1, 2, timeout=2)
    assert str(e.value).startswith(f"refit group: rank 1 could not reach rank 0's store at 127.0.0.1:{port} "
                                   f"within 2 s"), str(e.value)
    assert "\n" not in str(e.value)


def test_a_port_where_something_else_listens_is_one_line_not_a_hang(monkeypatch):
    """A listener that accepts and never answers (another program's port) keeps TCPStore's own client waiting
    past any timeout; a rank joining a refit group there, and a worker telling it why it cannot join, give up
    within their timeout and a grace, with one line."""
    monkeypatch.setattr(rendezvous, "CONNECT_GRACE", 1.0)
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen()
    port, held = listener.getsockname()[1], []
    accepting = threading.Thread(target=lambda: [held.append(listener.accept()[0]) for _ in range(2)], daemon=True)
    accepting.start()
    try:
        with pytest.raises(RuntimeFailure) as e:
            refit_group("127.0.0.1", port, 1, 2, timeout=1)
        assert str(e.value).startswith(f"refit group: rank 1 could not reach rank 0's store at 127.0.0.1:{port} "
                                       f"within 1 s (something there accepted the connection and did not answer "
                                       f"as a store"), str(e.value)
        assert "\n" not in str(e.value)
        rendezvous.abort_group("127.0.0.1", port, "a reason", rank=1, timeout=1)  # returns: nobody to tell
    finally:
        accepting.join(timeout=10)
        for conn in held:  # the connecting threads left blocked return now
            conn.close()
        listener.close()
    for thread in threading.enumerate():
        if thread.name == "reshard-connect":
            thread.join(timeout=30)
            assert not thread.is_alive()


def test_picked_ports_are_never_ones_the_kernel_hands_out_by_itself():
    """A port picked for a store that is served later must not be one a gloo listener or an outgoing
    connection can take meanwhile: those come from the kernel's ephemeral range. Listeners the kernel places
    (as gloo's are) are never given a picked port, and no port is picked twice."""
    low, high = ephemeral_range()
    picked = [free_port("127.0.0.1") for _ in range(50)]
    assert len(set(picked)) == len(picked)
    assert not [p for p in picked if low <= p <= high], (low, high, picked)
    listeners = []
    try:
        for _ in range(50):
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            sock.listen()
            listeners.append(sock)
        assert not {s.getsockname()[1] for s in listeners} & set(picked)
    finally:
        for sock in listeners:
            sock.close()
    for port in picked[:5]:  # free now: a store can serve there
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_ranks_that_never_join_are_named_with_their_roles():
    with pytest.raises(RuntimeFailure) as e:
        refit_group("127.0.0.1", free_port(), 0, 3, timeout=1, names=lambda r: f"vLLM replica {r - 1} worker 0")
    assert str(e.value) == ("refit group: rank(s) 1 (vLLM replica 0 worker 0), 2 (vLLM replica 1 worker 0) did not "
                            "join within 1 s"), str(e.value)


def test_an_operation_that_just_finished_is_not_given_up(store):
    """The store's host (rank 0) may leave right after a successful last round: a wait whose operation has
    finished returns its result even when the watchdog's next look finds the store gone."""
    me = Watchdog(store, 0, 2)
    guard = Guard(me)
    finished = threading.Event()

    def last_round():
        finished.wait()
        return "agreed"
    real_check = me.check

    def store_gone(stall=None):  # the operation finishes while the watchdog looks, and the store is gone
        finished.set()
        import time

        time.sleep(0.05)
        return Fault("refit rank 0 stopped answering: the group's store, which that rank holds, is gone", (0,))
    me.check = store_gone
    assert guard.run_aside(last_round) == "agreed"
    me.check = real_check
    guard.close()


class _Event:
    """A stand-in for a CUDA event: complete after `polls` queries (never, with None)."""

    def __init__(self, polls=None):
        self.polls, self.queries = polls, 0

    def query(self):
        self.queries += 1
        return self.polls is not None and self.queries >= self.polls


class _Communicator:
    """A stand-in for an NCCL process group: records its abort."""

    aborted = False

    def abort(self):
        self.aborted = True


def test_a_cuda_wait_polls_its_event_and_a_fault_aborts_the_communicators(store):
    me, peer = Watchdog(store, 0, 2), Watchdog(store, 1, 2)
    guard = Guard(me)
    event = _Event(polls=5)
    guard.sync(event)  # completes after five polls, never blocking in the driver
    assert event.queries == 5
    nccl = type("ProcessGroupNCCL", (_Communicator,), {})()
    guard.abortables.append(nccl)
    threading.Timer(0.3, peer.report, args=(Fault("refit rank 1 (trainer 1): gone", (1,)),)).start()
    with pytest.raises(GroupBroken) as e:
        guard.sync(_Event(), what="the transfer")  # a kernel blocked on a dead peer: never completes
    assert str(e.value) == "refit rank 1 (trainer 1): gone" and nccl.aborted
    guard.close()


def test_a_kernel_error_seen_while_polling_names_this_rank(store):
    me, _peer = Watchdog(store, 0, 2, interval=0.05), Watchdog(store, 1, 2)
    me.start()

    class Failing:
        def query(self):
            raise RuntimeError("CUDA error: an illegal memory access was encountered")
    guard = Guard(me)
    with pytest.raises(GroupBroken) as e:
        guard.sync(Failing(), what="the transfer")
    assert "refit rank 1 stopped answering" in str(e.value) or \
        "refit rank 0: transport error (the transfer: CUDA error" in str(e.value), str(e.value)
    guard.close()


def test_a_rank_blocked_in_a_store_wait_keeps_beating(store):
    """A rendezvous (a process group's set-up) holds the store client it waits on: the heartbeat has a client
    of its own, so its peers never name a rank that is only waiting."""
    me, peer = Watchdog(store, 0, 2, stall=0.6), Watchdog(store, 1, 2, stall=0.6, interval=0.05)
    peer.start()
    blocked = threading.Thread(target=lambda: _quiet(store.wait, ["never-set"]), daemon=True)
    blocked.start()  # the shared client is now held by a wait that does not end
    import time

    end = time.monotonic() + 2.0
    while time.monotonic() < end:
        assert me.check() is None
        time.sleep(0.1)
    peer.close()


def _quiet(fn, *args):
    try:
        fn(*args)
    except Exception:  # noqa: BLE001
        pass


def test_a_closed_group_frees_its_port_and_threads():
    """close() ends a refit group for good: the same host:port takes the next group at once, and no
    helper or heartbeat thread is left."""
    port = free_port()
    before = threading.active_count()
    for _ in range(3):
        group = refit_group("127.0.0.1", port, 0, 1, timeout=5)
        group.barrier()
        group.close()
    assert threading.active_count() == before


def test_a_collective_paired_with_another_step_names_the_rank():
    from reshard_cli.transfer.comm import _tagged, _untag

    mine, theirs = _tagged("group 2 prepared", "ok"), _tagged("update numbers", {"worker": 3})
    with pytest.raises(GroupBroken) as e:
        _untag([mine, theirs], "group 2 prepared", 0)
    assert str(e.value).startswith("refit rank 1 is in 'update numbers' while rank 0 is in 'group 2 prepared'")
    with pytest.raises(GroupBroken) as e:
        _untag([mine, ("error", 1, "")], "group 2 prepared", 0)
    assert "refit rank 1 is in a collective that is not reshard's" in str(e.value)


def test_broken_groups_on_one_port_leave_no_descriptor_or_thread():
    """A group given up after a fault, closed, and made again on the same port, eight times: no thread and no
    file descriptor is left over (the error's frames refer back to the group; closing collects them)."""
    import os

    from reshard_cli.transfer.watchdog import GroupBroken as Broken

    port = free_port()
    counts = []
    for _ in range(8):
        group = refit_group("127.0.0.1", port, 0, 1, timeout=5)
        group.barrier()
        group.new_group([0])
        with pytest.raises(Broken):
            group.fail("refit rank 0: simulated", (0,))
        group.close()
        counts.append((threading.active_count(), len(os.listdir("/proc/self/fd"))))
    assert len(set(counts[1:])) == 1, counts


def test_a_closed_guard_refuses_later_waits_without_watching_dead_heartbeats(store):
    """After close() the heartbeats have stopped: a later wait raises one line at once instead of starting a
    monitor (or a helper) that would soon name a peer as stopped."""
    me, _peer = Watchdog(store, 0, 2), Watchdog(store, 1, 2)
    guard = Guard(me)
    assert guard.run(lambda: "ran") == "ran"
    guard.close()
    before = set(threading.enumerate())
    for call in (lambda: guard.run(lambda: None), lambda: guard.run_aside(lambda: None),
                 lambda: guard.sync(_Event(polls=1))):
        with pytest.raises(RuntimeFailure) as e:
            call()
        assert str(e.value) == ("refit rank 0: its group's watchdog was closed (the group is over): nothing waits "
                                "on it again"), str(e.value)
    assert set(threading.enumerate()) <= before  # no monitor or helper thread started again
    assert guard._monitor_thread is None and guard._helper_thread is None


def test_an_overdue_aside_call_is_given_up_with_the_overdue_line(store):
    me, _peer = Watchdog(store, 0, 2), Watchdog(store, 1, 2)
    guard = Guard(me)
    blocked = threading.Event()
    with pytest.raises(GroupBroken) as e:
        guard.run_aside(blocked.wait, overdue=lambda: Fault("refit rank 1: setting up its transport did not "
                                                            "finish within 3 s", (1,)))
    assert e.value.ranks == (1,) and str(e.value).startswith("refit rank 1: setting up its transport")
    blocked.set()
    guard.close()


def test_refit_stall_is_validated_once():
    from reshard_cli.errors import ConfigError
    from reshard_cli.transfer.live import Refit

    group = refit_group("127.0.0.1", free_port(), 0, 1, timeout=10)
    try:
        for bad in (0, -1, float("inf"), float("nan"), "3", True):
            with pytest.raises(ConfigError) as e:
                Refit(role="idle", group=group, stall=bad)
            assert str(e.value).startswith("stall: stall must be a positive number of seconds"), str(e.value)
        assert Refit(role="idle", group=group, stall=2.5).stall == 2.5
    finally:
        group.close()


# ------------------------------------------------------------------------------ processes (gloo, small)

SRC_1 = "model: model.yaml\nmesh: {tp: 1}\nplacements:\n  - {match: 'q_proj', shard: {tp: 0}}\n"
DST_2 = ("model: model.yaml\nmesh: {tp: 2}\nplacements:\n  - {match: 'q_proj|up_proj|embed|lm_head', shard: {tp: 0}}\n"
         "  - {match: 'o_proj|down_proj', shard: {tp: 1}}\n")  # rank 0 sends to ranks 1 and 2


def _one_to_two(tmp_path):
    from conftest import SMALL_MODEL

    (tmp_path / "model.yaml").write_text(SMALL_MODEL)
    (tmp_path / "src.yaml").write_text(SRC_1)
    (tmp_path / "dst.yaml").write_text(DST_2)
    return str(tmp_path / "src.yaml"), str(tmp_path / "dst.yaml")


def _tensors(rank, src_path, dst_path):
    import torch

    from reshard_cli.formats import load_pair

    src, dst = load_pair(src_path, dst_path)
    layout = src if rank in src.ranks else dst
    man = layout.manifest.tensors
    role = "src" if rank in src.ranks else "dst"
    return role, {man[t].name: torch.ones(box.sizes, dtype=getattr(torch, man[t].dtype))
                  for t, box in layout.held(rank)}


def test_a_stopped_rank_of_a_user_job_is_named_by_every_other_rank():
    """A Refit over the default group of a user's own job (gloo, its timeout gloo's default of 30 minutes):
    one rank stopped (SIGSTOP) mid-refit. Every other rank, blocked on it in a message or in a collective of
    the default group, ends with one line naming it (examples/world_stall.py: its figures are the report's)."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples"))
    from world_stall import scenario

    result = scenario(stall=3.0)
    print(result)  # named_seconds against the stall limit: reported, not asserted
    assert sorted(result["lines"]) == [0, 1, 3], result
    for rank, line in result["lines"].items():
        assert line.startswith("refit rank 2 (dst) stopped answering: no heartbeat for"), (rank, line)
        assert "\n" not in line


def _closed(rank, world, src_path, dst_path):
    from reshard_cli.errors import ReshardError
    from reshard_cli.transfer.live import Refit

    role, tensors = _tensors(rank, src_path, dst_path)
    refit = Refit(role=role, src=src_path, dst=dst_path, stall=2)
    ok = refit(tensors, verify_checksums=True).checksums_ok
    refit.close()
    try:
        refit(tensors, verify_checksums=True)
        line = "no error"
    except ReshardError as e:
        line = str(e)
    threads = [t.name for t in threading.enumerate() if t.name.startswith("reshard-")]
    return ok, line, threads


def test_a_closed_refit_refuses_later_calls_with_one_line(tmp_path):
    """close() ends a Refit over the default group: its watchdog stops, and a later call raises one line at
    once (never a monitor over the stopped heartbeats, which would name a healthy peer)."""
    src, dst = _one_to_two(tmp_path)
    results = run_ranks(3, _closed, src, dst, timeout=120)
    for rank, (ok, line, threads) in results.items():
        assert ok is True, (rank, ok)
        assert line == (f"refit rank {rank}: this Refit was closed (Refit.close): make a new Refit to refit "
                        f"again"), (rank, line)
        assert threads == [], (rank, threads)


def _set_up_fails(rank, world, src_path, dst_path, port, how):
    import time

    from reshard_cli.errors import ReshardError
    from reshard_cli.transfer import comm as comm_mod
    from reshard_cli.transfer.live import Refit

    group = refit_group("127.0.0.1", port, rank, world, timeout=30)
    if how == "slow":
        group.link_limit = 3.0  # a set-up step without progress this long is named (default: half the timeout)
    if rank == 1:  # this rank's own part of setting up its transport never finishes, or fails
        real = comm_mod._link

        def injected(comm, links, step, device):
            if how == "slow":
                time.sleep(120)
            else:
                raise RuntimeError("simulated: the communicator could not be created")
            return real(comm, links, step, device)
        comm_mod._link = injected
    role, tensors = _tensors(rank, src_path, dst_path)
    refit = Refit(role=role, src=src_path, dst=dst_path, mode="reshard", group=group)
    t0 = time.monotonic()
    try:
        refit(tensors)
        line = "no error"
    except ReshardError as e:
        line = str(e)
    seconds = time.monotonic() - t0
    group.close()
    return line, seconds


@pytest.mark.parametrize("how", ["slow", "failing"])
def test_a_set_up_step_held_up_on_one_rank_is_named_by_every_rank(tmp_path, how):
    """The transport's set-up (each pair's first message, made up front under the watchdog when the engine is
    built) held up on rank 1: its step never finishes, or fails. Every rank ends with one line naming rank 1:
    the slow step once it has made no progress for the link limit (rank 2 waits on rank 0, which waits on
    rank 1: the store's record of where each rank is leads to it), the failing one as that rank's error."""
    from dist_util import free_port

    src, dst = _one_to_two(tmp_path)
    results = run_ranks(3, _set_up_fails, src, dst, free_port(), how, timeout=120)
    print({r: (round(s, 2), line) for r, (line, s) in results.items()})
    for rank, (line, _seconds) in results.items():
        assert "\n" not in line
        if how == "slow":
            assert line == "refit rank 1: setting up its transport with refit rank 0 did not finish within 3 s", \
                (rank, line)
        else:
            assert line.startswith("refit rank 1: transport error (setting up its transport with refit rank 0: "
                                   "RuntimeError: simulated: the communicator could not be created"), (rank, line)


def _refits_in_a_row(rank, world, src_path, dst_path):
    import torch.distributed as dist

    from reshard_cli.transfer import rendezvous
    from reshard_cli.transfer.live import Refit

    made = []
    real = dist.TCPStore

    def counting(*args, **kwargs):  # every client connection a watchdog opens to the job's store
        made.append(args[:2])
        return real(*args, **kwargs)

    dist.TCPStore = counting
    try:
        role, tensors = _tensors(rank, src_path, dst_path)
        oks, idle = [], []
        for _ in range(3):
            refit = Refit(role=role, src=src_path, dst=dst_path, stall=2)
            oks.append(refit(tensors, verify_checksums=True).checksums_ok)
            refit.close()
            idle.append(sorted(id(c) for clients in rendezvous._JOB_CLIENTS.values() for c in clients))
    finally:
        dist.TCPStore = real
    return oks, len(made), idle


def test_later_refits_over_the_default_group_reuse_their_store_connections(tmp_path):
    """Each Refit over the default group watches it over two client connections to the job's store; a closed
    Refit's are taken by the next one, not opened again (a new connection can wait 5 s in torch's handshake
    when several ranks connect at once)."""
    src, dst = _one_to_two(tmp_path)
    results = run_ranks(3, _refits_in_a_row, src, dst, timeout=120)
    for rank, (oks, made, idle) in results.items():
        assert oks == [True] * 3, (rank, oks)
        assert made == 2, (rank, made)  # the first Refit's two, then none
        assert len(idle[0]) == 2 and idle[0] == idle[1] == idle[2], (rank, idle)


_LEAVES_IN_TORCH = """
import sys, threading, time
from datetime import timedelta
import torch.distributed as dist
from reshard_cli.transfer import watchdog
server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
client = dist.TCPStore("127.0.0.1", server.port, is_master=False, timeout=timedelta(seconds=2))
def blocked():
    try:
        client.wait(["never"])
    except Exception:
        pass
thread = threading.Thread(target=blocked, daemon=True)
thread.start()
if sys.argv[1] == "held":
    watchdog.in_torch(thread)
time.sleep(0.5)
"""


def test_a_thread_left_inside_a_torch_call_is_waited_for_at_exit():
    """A daemon thread whose store call returns after the interpreter began to tear down aborts the process in
    C++ ("terminate called without an active exception", what two CI runs saw at a fleet's and a Megatron
    rank's exit); the same thread handed to `watchdog.in_torch` is waited for, and the process exits 0."""
    import subprocess
    import sys

    def run(mode):
        return subprocess.run([sys.executable, "-c", _LEAVES_IN_TORCH, mode], capture_output=True, text=True,
                              timeout=120)
    left = run("left")
    assert left.returncode != 0 and "terminate called without an active exception" in left.stderr
    held = run("held")
    assert held.returncode == 0, held.stderr[-2000:]
