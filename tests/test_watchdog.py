"""The group watchdog (transfer/watchdog.py) in one process, over a real TCP store: heartbeats, reported faults,
guarded waits, and a refit group whose rank 0 never comes."""
import threading

import pytest
import torch.distributed as dist

from dist_util import free_port
from reshard_cli.errors import RuntimeFailure
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


def test_a_guarded_wait_ends_on_a_fault_and_the_group_stays_given_up(store):
    me, peer = Watchdog(store, 0, 2), Watchdog(store, 1, 2)
    guard = Guard(me)
    blocked = threading.Event()  # never set: a wait on a peer that will not answer
    threading.Timer(0.3, peer.report, args=(Fault("refit rank 1 (trainer 1): gone", (1,)),)).start()
    with pytest.raises(GroupBroken) as e:
        guard.run(blocked.wait)
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


def test_ranks_that_never_join_are_named_with_their_roles():
    with pytest.raises(RuntimeFailure) as e:
        refit_group("127.0.0.1", free_port(), 0, 3, timeout=1, names=lambda r: f"vLLM replica {r - 1} worker 0")
    assert str(e.value) == ("refit group: rank(s) 1 (vLLM replica 0 worker 0), 2 (vLLM replica 1 worker 0) did not "
                            "join within 1 s"), str(e.value)
