"""The shared-memory transport's own faults, injected mid-message: a peer killed, a peer stopped (SIGSTOP) with
and without a watchdog, a peer that posts another size; and its files. The transfer matrix over it is in
test_transport.py, `reshard run --transport shm` in test_run.py, the live API in test_api.py."""
import os
import signal
import subprocess
import time

import pytest
import torch
import torch.multiprocessing as mp

from dist_util import free_port

pytestmark = pytest.mark.multiprocess


def _entry(rank, port, fn, queue):
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE="2")
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        queue.put((rank, "ok", fn(rank)))
    except BaseException as e:  # noqa: BLE001
        queue.put((rank, "error", f"{type(e).__name__}: {e}"))


def _two(fn, wait_for=(1,), timeout=60.0) -> dict:
    """`fn(rank)` on two gloo processes; what the ranks in `wait_for` returned or raised (the others may die)."""
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port("127.0.0.1")
    procs = [ctx.Process(target=_entry, args=(r, port, fn, queue)) for r in range(2)]
    for p in procs:
        p.start()
    out = {}
    try:
        while set(wait_for) - set(out):
            rank, status, value = queue.get(timeout=timeout)
            out[rank] = (status, value)
    finally:
        for p in procs:
            p.join(timeout=2)
            if p.is_alive():
                os.kill(p.pid, signal.SIGCONT)
                p.kill()
    return out


def _killed(rank):
    from reshard_cli.transfer.comm import WORLD
    from reshard_cli.transfer.shm import ShmComm

    comm = ShmComm(WORLD)
    if rank == 0:
        os.kill(os.getpid(), signal.SIGKILL)  # before its message
    t0 = time.monotonic()
    try:
        comm.irecv(torch.empty(16), 0).wait()
    except Exception as e:  # noqa: BLE001
        return f"{time.monotonic() - t0:.1f}|{type(e).__name__}: {e}"
    return "no error"


def test_a_killed_peer_is_named_at_once():
    """A peer killed while this rank waits on its message: named as dead (its process is gone), not at a
    timeout."""
    status, value = _two(_killed)[1]
    assert status == "ok", value
    _seconds, line = value.split("|", 1)
    assert "rank 0 died (its process" in line, line


def _stopped(rank, guarded):
    from reshard_cli.transfer.comm import WORLD, refit_group
    from reshard_cli.transfer.shm import ShmComm
    from dist_util import agreed_port

    inner = refit_group("127.0.0.1", agreed_port(), rank, 2, timeout=60, stall=2) if guarded else WORLD
    comm = ShmComm(inner, timeout=2)
    if rank == 1:  # (not rank 0: it holds the refit group's store)
        subprocess.Popen(["sh", "-c", f"sleep 20; kill -CONT {os.getpid()}"], start_new_session=True)
        os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(30)  # continued after the others gave up: never sends
        return "continued"
    t0 = time.monotonic()
    try:
        comm.irecv(torch.empty(16), 1).wait()
    except Exception as e:  # noqa: BLE001
        return f"{time.monotonic() - t0:.1f}|{type(e).__name__}: {e}"
    return "no error"


@pytest.mark.parametrize("guarded", [False, True])
def test_a_stopped_peer_is_named(guarded):
    """A stopped peer (SIGSTOP: its process exists, its memory too): named by the group's watchdog at its stall
    limit, or without one at the transport's timeout, one line naming it."""
    status, value = _two(_StoppedFn(guarded), wait_for=(0,), timeout=60)[0]
    assert status == "ok", value
    _seconds, line = value.split("|", 1)
    if guarded:
        assert "GroupBroken" in line and "rank 1 stopped answering: no heartbeat" in line, line
    else:
        assert "rank 1 moved no message for 2 s" in line, line


class _StoppedFn:
    def __init__(self, guarded):
        self.guarded = guarded

    def __call__(self, rank):
        return _stopped(rank, self.guarded)


def _sizes(rank):
    from reshard_cli.transfer.comm import WORLD
    from reshard_cli.transfer.shm import ShmComm

    comm = ShmComm(WORLD)
    try:
        if rank == 0:
            comm.isend(torch.arange(8.0), 1).wait()
        else:
            comm.irecv(torch.empty(4), 0).wait()
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    finally:
        if rank == 1:
            comm.close()
    return "no error"


def test_a_message_of_another_size_is_one_line():
    """Two ranks that follow different plans: the receiver names both, it does not copy past its tensor."""
    status, value = _two(_sizes, wait_for=(1,))[1]
    assert status == "ok" and "32 bytes arrived where 16 were posted" in value, value


def _files(rank):
    from reshard_cli.transfer.comm import WORLD
    from reshard_cli.transfer.shm import ROOT, ShmComm

    comm = ShmComm(WORLD)
    buf = comm.staging(1 << 16, torch.device("cpu"))
    mine = sorted(n for n in os.listdir(ROOT) if f"-p{os.getpid()}-" in n)
    if rank == 0:
        buf.view(torch.float32)[:8] = torch.arange(8.0)
        comm.isend(buf[:32].view(torch.float32), 1).wait()  # from its staging: no copy of its own
        comm.isend(torch.arange(4.0), 1).wait()  # from elsewhere: a copy, gone once taken
    else:
        a, b = torch.empty(8), torch.empty(4)
        comm.irecv(a, 0).wait()
        comm.irecv(b, 0).wait()
        assert torch.equal(a, torch.arange(8.0)) and torch.equal(b, torch.arange(4.0))
    WORLD.barrier()
    after = sorted(n for n in os.listdir(ROOT) if f"-p{os.getpid()}-" in n)
    comm.close()
    left = [n for n in os.listdir(ROOT) if f"-p{os.getpid()}-" in n]
    return mine, after, left


def test_files_are_the_control_file_and_staging_and_are_unlinked_at_close():
    out = _two(_files, wait_for=(0, 1))
    for rank in (0, 1):
        status, value = out[rank]
        assert status == "ok", value
        mine, after, left = value
        assert [n.rsplit("-", 1)[1] for n in mine] == ["c0", "d1"]
        assert after == mine  # a send's own copy is unlinked once its receiver took it
        assert left == []


def _released(rank):
    from reshard_cli.transfer.comm import WORLD
    from reshard_cli.transfer.shm import ShmComm

    comm = ShmComm(WORLD)
    mapped = []
    for step in range(3):  # a refit in staging groups: each group's staging given back, a new one taken
        if rank == 0:
            buf = comm.staging(4096, torch.device("cpu"))
            buf.view(torch.float32)[:4] = step
            comm.isend(buf[:16].view(torch.float32), 1).wait()
            comm.release(buf)
        else:
            x = torch.empty(4)
            comm.irecv(x, 0).wait()
            assert torch.equal(x, torch.full((4,), float(step)))
            mapped.append(sorted(n for _p, n in comm._peer_seg))
        WORLD.barrier()
    comm.close()
    return mapped


def test_segments_given_back_are_unmapped_by_their_receivers():
    """A receiver keeps a sender's staging mapped between messages, and drops it once the sender gave it back
    (else every staging group of every refit would stay in memory until the receiver closed)."""
    assert _two(_released)[1] == ("ok", [[1], [2], [3]])


def test_files_of_dead_processes_are_swept(tmp_path):
    from reshard_cli.transfer.shm import ROOT, sweep

    p = subprocess.Popen(["true"])
    p.wait()
    stale = os.path.join(ROOT, f"reshard-shm-0123456789ab-p{p.pid}-r0-c0")
    live = os.path.join(ROOT, f"reshard-shm-0123456789ab-p{os.getpid()}-r0-c0")
    for path in (stale, live):
        open(path, "wb").close()
    try:
        sweep()
        assert not os.path.exists(stale) and os.path.exists(live)
    finally:
        for path in (stale, live):
            if os.path.exists(path):
                os.unlink(path)
