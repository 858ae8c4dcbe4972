"""The shared-memory transport: messages between ranks on one host through POSIX shared memory, one-sided;
everything else (collectives, the store, the watchdog, peers on other hosts) through the comm it wraps.

    comm = ShmComm(WORLD)           # collective over the group's ranks
    engine = Engine(plan, rank, src, dst, comm=comm)

How a message moves. Each rank owns files in /dev/shm: a control file, and the data segments it allocates.
The engine takes its staging (the reshard path's bucket ring, the broadcast path's packs) from `staging()`, so
a packed message already lies where its receiver reads it; a tensor sent from anywhere else is first copied
into a segment of its own. A send writes a descriptor (segment, offset, bytes) into the sender's control file,
in its slot ring for that receiver, then counts it (`sent`). The receiver, once the count shows it, maps the
sender's segment (once), copies the bytes straight into its tensor and counts it (`taken`, in its own control
file). A send is finished once its receiver has taken it: its bytes may be reused then. Nothing goes through
a socket or the kernel; a byte is copied twice (packed by the sender, taken by the receiver), as with gloo's
buckets, but without gloo's copies through the loopback device.

Progress. gloo finishes a message once both sides posted it, whatever the two ranks wait on next. Here the
receiver copies, so every wait of this comm also serves every posted receive whose descriptor has arrived
(per peer in posting order): a rank blocked anywhere in the transport keeps taking what is sent to it, and a
schedule that cannot deadlock over gloo cannot deadlock here.

Faults. A wait polls with short sleeps; every `POLL` seconds it asks the group's watchdog (a dead or stopped
peer named at the stall limit, every rank told, as over gloo) and whether the peer's process still exists (a
killed peer on this host is named at once). Without a watchdog a wait gives up after `timeout` seconds,
naming the peer.

Files are named /dev/shm/reshard-shm-<group>-p<pid>-r<rank>-<kind><n>. Each rank unlinks its own when the
comm closes (and at exit); a file whose process no longer exists is removed when the next comm forms on the
host. A descriptor's count is written after its bytes and its slot: x86-64 keeps stores in that order (other
machines are refused, ConfigError). Only host memory: CUDA tensors go through the wrapped comm (CUDA IPC is
where they would go here).
"""
from __future__ import annotations

import atexit
import mmap
import os
import platform
import re
import socket
import struct
import time
import uuid
from dataclasses import dataclass

import torch

from reshard_cli.errors import ConfigError

ROOT = "/dev/shm"
SLOTS = 64  # descriptors in flight per (sender, receiver) pair
POLL = 0.25  # seconds between two looks at the watchdog and the peers' processes while a wait is blocked
TIMEOUT = 300.0  # seconds a wait may go without progress when the group has no watchdog
_Q = struct.Struct("q")
_DESC = struct.Struct("qqqq")  # segment number, offset, bytes, kind (0: kept segment, 1: a send's own copy)
RELEASED = 32  # the last segments a rank gave back, told to its receivers (which unmap them)
_RELEASED_AT = 16  # in the control file: after the magic, the count of segments given back, then their ring
_HEAD = _RELEASED_AT + 8 + 8 * RELEASED  # then per peer: sent, taken, SLOTS descriptors
_PER_PEER = 16 + SLOTS * _DESC.size
_MAGIC = b"reshard-shm-1\0\0\0"
_NAME = re.compile(r"^reshard-shm-[0-9a-f]+-p(\d+)-r\d+-[a-z]\d+$")


def host_key() -> str:
    """Ranks with the same key share a host's shared memory (its name and boot)."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = ""
    return f"{socket.gethostname()}/{boot}"


def usable() -> str | None:
    """Why this machine cannot use the transport (None: it can)."""
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return f"the shared-memory transport relies on x86-64's store order; this machine is {platform.machine()}"
    if not os.path.isdir(ROOT) or not os.access(ROOT, os.W_OK):
        return f"the shared-memory transport needs a writable {ROOT}"
    return None


def sweep() -> int:
    """Remove the files of processes that no longer exist (a rank killed before it could). Returns how many."""
    gone = 0
    try:
        names = os.listdir(ROOT)
    except OSError:
        return 0
    for name in names:
        m = _NAME.match(name)
        if m and not _alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(ROOT, name))
                gone += 1
            except OSError:
                pass
    return gone


def _alive(pid: int) -> bool:
    """Whether process `pid` exists and has not ended (a zombie, not yet reaped by its parent, has)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] not in (b"Z", b"X")
    except FileNotFoundError:
        return False
    except (OSError, IndexError):
        pass
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class _Segment:
    """One file of /dev/shm mapped into this process, as bytes (`data`)."""

    def __init__(self, path: str, nbytes: int | None = None):
        self.path = path
        flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if nbytes is not None else 0)
        fd = os.open(path, flags, 0o600)
        try:
            if nbytes is not None:
                os.ftruncate(fd, max(nbytes, 1))
            size = os.fstat(fd).st_size
            self.map = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        self.data = torch.frombuffer(self.map, dtype=torch.uint8)
        self.ptr, self.size = self.data.data_ptr(), size
        self.n, self.users = int(path.rsplit("-", 1)[1][1:]), 0  # its number; sends not yet taken (a send's copy)

    def close(self) -> None:
        self.data = None
        try:
            self.map.close()
        except BufferError:  # a view of it is still alive somewhere: the mapping goes with it
            pass


@dataclass
class _Recv:
    tensor: torch.Tensor | None  # where the bytes go, or
    peer: int
    consume: object = None  # what reads them where they are (`itake`)
    nbytes: int = 0
    done: bool = False


@dataclass
class _Send:
    peer: int
    seq: int  # the receiver has taken it once its `taken` count passes this
    temp: _Segment | None = None  # the send's own copy, freed once taken
    done: bool = False


class ShmWork:
    """A message of the shared-memory transport: `wait()` serves every posted receive until this one is done."""

    __slots__ = ("comm", "op")

    def __init__(self, comm: "ShmComm", op):
        self.comm, self.op = comm, op

    def wait(self) -> None:
        self.comm._wait(self.op)

    def is_completed(self) -> bool:
        self.comm._progress()
        return self.op.done


class ShmComm:
    """`inner` (a `transfer.comm` comm) with its messages between ranks of this host carried by shared memory.
    Collective to make (every rank of the group, same order). Everything but `isend`, `irecv`, `broadcast`,
    `new_group`, `staging` and `connect` is `inner`'s."""

    def __init__(self, inner, *, timeout: float | None = None, ranks=None):
        """`ranks`: carry only the pairs among these (and on one host) over shared memory; None: every pair on
        one host."""
        self.inner = inner
        self.rank, self.size = inner.rank, inner.size
        self.timeout = timeout or getattr(inner, "timeout", None) or TIMEOUT
        token = uuid.uuid4().hex[:12]
        me = (host_key(), os.getpid(), token, usable())
        infos = inner.all_gather_object(me, what="setting up shared memory")
        refused = [(r, info[3]) for r, info in enumerate(infos) if info[3]]
        if refused:  # every rank says the same line, none waits on a transport that will not form
            raise ConfigError(f"rank {refused[0][0]}: {refused[0][1]}", key="--transport")
        host = me[0]
        self.local = frozenset(r for r, info in enumerate(infos) if info[0] == host
                               and (ranks is None or (r in ranks and self.rank in ranks)))
        self.pids = {r: infos[r][1] for r in self.local}
        self.group = infos[0][2]  # rank 0's token names the group's files
        if self.rank == 0:
            sweep()
        inner.barrier()  # nobody creates a file before the sweep
        self._files: list[str] = []
        self._seq = 0
        self.ctl = self._create("c", _HEAD + self.size * _PER_PEER)
        self.ctl.map[:len(_MAGIC)] = _MAGIC
        self._segments: dict[int, _Segment] = {}  # number -> this rank's kept segments
        self._peer_ctl: dict[int, _Segment] = {}
        self._peer_seg: dict[tuple, _Segment] = {}  # (peer, number) -> a peer's kept segment, mapped
        self._released_seen = [0] * self.size  # how many of each peer's given-back segments this rank unmapped
        self._sent = [0] * self.size  # descriptors written to each peer
        self._taken = [0] * self.size  # descriptors taken from each peer
        self._recvs: dict[int, list[_Recv]] = {}  # peer -> posted receives, oldest first
        self._sends: dict[int, list[_Send]] = {}  # peer -> unfinished sends, oldest first
        self._groups: dict[int, tuple] = {}  # id(inner group) -> its member ranks
        self.bytes_copied = 0
        atexit.register(self.close)
        inner.barrier()  # every control file exists before anyone maps one

    # ------------------------------------------------------------------------------------------ inner's

    def __getattr__(self, name):  # the store, the watchdog, collectives, notes: the wrapped comm's
        if name == "inner":
            raise AttributeError(name)
        return getattr(self.inner, name)

    @property
    def guard(self):
        return self.inner.guard

    def one_sided_with(self, peer: int) -> bool:
        """Whether messages with `peer` are one-sided (its receiver takes them from the sender's `staging`, see
        `transfer.engine`): a peer on this host; the others go through the wrapped comm."""
        return peer in self.local

    @property
    def device(self):
        return self.inner.device

    # ------------------------------------------------------------------------------------------- files

    def _path(self, kind: str, n: int = 0, rank: int | None = None, pid: int | None = None) -> str:
        rank = self.rank if rank is None else rank
        pid = os.getpid() if pid is None else pid
        return os.path.join(ROOT, f"reshard-shm-{self.group}-p{pid}-r{rank}-{kind}{n}")

    def _create(self, kind: str, nbytes: int, n: int = 0) -> _Segment:
        path = self._path(kind, n)
        seg = _Segment(path, nbytes)
        self._files.append(path)
        return seg

    def _drop(self, seg: _Segment) -> None:
        seg.close()
        try:
            os.unlink(seg.path)
            self._files.remove(seg.path)
        except (OSError, ValueError):
            pass

    def staging(self, nbytes: int, device: torch.device) -> torch.Tensor:
        """`nbytes` of staging a message may be sent from without a copy: a segment of its own, kept."""
        if torch.device(device).type != "cpu":
            return torch.empty(nbytes, dtype=torch.uint8, device=device)
        self._seq += 1
        seg = self._segments[self._seq] = self._create("d", nbytes, self._seq)
        return seg.data[:nbytes]

    def release(self, buf: torch.Tensor) -> None:
        """Give back a segment `staging` returned (its receivers have taken every message of it): unlinked, and
        told to the receivers, which unmap it (a refit in staging groups gives one back per group)."""
        for n, seg in list(self._segments.items()):
            if seg.ptr == buf.data_ptr():
                del self._segments[n]
                self._drop(seg)
                count = _Q.unpack_from(self.ctl.map, _RELEASED_AT)[0]
                _Q.pack_into(self.ctl.map, _RELEASED_AT + 8 + 8 * (count % RELEASED), n)
                _Q.pack_into(self.ctl.map, _RELEASED_AT, count + 1)  # after the number: readers see it then
                return

    def _unmap_released(self, peer: int) -> None:
        """Drop this rank's mappings of the segments `peer` gave back (all of its kept ones, when more were given
        back than its control file remembers: they are mapped again when next used)."""
        theirs = self._their_ctl(peer)
        count = _Q.unpack_from(theirs, _RELEASED_AT)[0]
        seen = self._released_seen[peer]
        if count == seen:
            return
        if count - seen > RELEASED:
            gone = {n for (p, n) in self._peer_seg if p == peer}
        else:
            gone = {_Q.unpack_from(theirs, _RELEASED_AT + 8 + 8 * (i % RELEASED))[0] for i in range(seen, count)}
        for n in gone:
            seg = self._peer_seg.pop((peer, n), None)
            if seg is not None:
                seg.close()
        self._released_seen[peer] = count

    def close(self) -> None:
        """Unlink this rank's files and drop every mapping (peers keep theirs until they close)."""
        for seg in [*self._segments.values(), *self._peer_seg.values(), *self._peer_ctl.values()]:
            seg.close()
        self._segments, self._peer_seg, self._peer_ctl = {}, {}, {}
        for path in list(getattr(self, "_files", [])):
            try:
                os.unlink(path)
            except OSError:
                pass
        self._files = []
        try:
            atexit.unregister(self.close)
        except Exception:  # noqa: BLE001 - at exit already
            pass

    # ------------------------------------------------------------------------------------- control file

    def _slot_of(self, peer: int) -> int:
        return _HEAD + peer * _PER_PEER

    def _their_ctl(self, peer: int) -> mmap.mmap:
        seg = self._peer_ctl.get(peer)
        if seg is None:
            seg = self._peer_ctl[peer] = _Segment(self._path("c", 0, peer, self.pids[peer]))
        return seg.map

    def _their_taken(self, peer: int) -> int:
        """How many of this rank's descriptors `peer` has taken (read from its control file)."""
        return _Q.unpack_from(self._their_ctl(peer), self._slot_of(self.rank) + 8)[0]

    # -------------------------------------------------------------------------------------------- sends

    def _locate(self, t: torch.Tensor) -> tuple[int, int] | None:
        """(segment number, offset) when `t`'s bytes lie in one of this rank's kept segments."""
        p = t.data_ptr()
        for n, seg in self._segments.items():
            if seg.ptr <= p and p + t.numel() * t.element_size() <= seg.ptr + seg.size:
                return n, p - seg.ptr
        return None

    def isend(self, t: torch.Tensor, peer: int):
        if peer not in self.local or t.device.type != "cpu":
            return self.inner.isend(t, peer)
        return ShmWork(self, self._post_send(t, peer))

    def _post_send(self, t: torch.Tensor, peer: int, temp: _Segment | None = None) -> _Send:
        nbytes = t.numel() * t.element_size()
        where = self._locate(t) if t.is_contiguous() and temp is None else None
        if where is None:
            if temp is None:  # from anywhere else: a copy of its own (shared by a broadcast's members)
                self._seq += 1
                temp = self._create("t", nbytes, self._seq)
                temp.data[:nbytes].view(t.dtype).view(t.shape).copy_(t)
            temp.users += 1
            where = (temp.n, 0)
        while self._sent[peer] - self._their_taken(peer) >= SLOTS:  # its slot ring is full
            self._block(peer, lambda: self._sent[peer] - self._their_taken(peer) < SLOTS)
        base = self._slot_of(peer)
        slot = base + 16 + (self._sent[peer] % SLOTS) * _DESC.size
        _DESC.pack_into(self.ctl.map, slot, where[0], where[1], nbytes, 1 if temp is not None else 0)
        self._sent[peer] += 1
        _Q.pack_into(self.ctl.map, base, self._sent[peer])  # after the slot: the receiver reads it then
        op = _Send(peer, self._sent[peer], temp)
        self._sends.setdefault(peer, []).append(op)
        return op

    def _check_sends(self, peer: int) -> None:
        ops = self._sends.get(peer)
        if not ops:
            return
        taken = self._their_taken(peer)
        while ops and ops[0].seq <= taken:
            op = ops.pop(0)
            op.done = True
            if op.temp is not None:
                op.temp.users -= 1
                if not op.temp.users:
                    self._drop(op.temp)

    # ----------------------------------------------------------------------------------------- receives

    def irecv(self, t: torch.Tensor, peer: int):
        if peer not in self.local or t.device.type != "cpu":
            return self.inner.irecv(t, peer)
        if not t.is_contiguous():
            raise ValueError("the shared-memory transport receives into contiguous tensors only")
        op = _Recv(t, peer, nbytes=t.numel() * t.element_size())
        self._recvs.setdefault(peer, []).append(op)
        return ShmWork(self, op)

    def itake(self, nbytes: int, peer: int, consume):
        """A receive of `nbytes` from `peer` (on this host) read where the sender left it: `consume(buf)` is
        called with a uint8 view of the sender's bytes once they are there (during any wait of this comm), and
        the message is taken when it returns; so a receiver unpacks a bucket without copying it first."""
        op = _Recv(None, peer, consume, nbytes)
        self._recvs.setdefault(peer, []).append(op)
        return ShmWork(self, op)

    def _take(self, peer: int) -> bool:
        """Serve `peer`'s oldest posted receive if its descriptor has arrived; whether one was served."""
        ops = self._recvs.get(peer)
        if not ops:
            return False
        theirs = self._their_ctl(peer)
        base = self._slot_of(self.rank)
        if _Q.unpack_from(theirs, base)[0] <= self._taken[peer]:
            return False
        n, off, nbytes, kind = _DESC.unpack_from(theirs, base + 16 + (self._taken[peer] % SLOTS) * _DESC.size)
        op = ops.pop(0)
        if nbytes != op.nbytes:
            self.inner.fail(f"rank {self.rank}: a message from rank {peer} of {nbytes} bytes arrived where "
                            f"{op.nbytes} were posted (the two ranks follow different plans)", (self.rank, peer))
        if kind:  # a send's own copy: mapped for this message only
            seg = _Segment(self._path("t", n, peer, self.pids[peer]))
            try:
                self._land(op, seg.data[off:off + nbytes])
            finally:
                seg.close()
        else:
            self._unmap_released(peer)
            seg = self._peer_seg.get((peer, n))
            if seg is None:
                seg = self._peer_seg[(peer, n)] = _Segment(self._path("d", n, peer, self.pids[peer]))
            self._land(op, seg.data[off:off + nbytes])
        self.bytes_copied += nbytes
        self._taken[peer] += 1
        _Q.pack_into(self.ctl.map, self._slot_of(peer) + 8, self._taken[peer])
        op.done = True
        return True

    @staticmethod
    def _land(op: _Recv, buf: torch.Tensor) -> None:
        if op.consume is not None:
            op.consume(buf)
        else:
            op.tensor.view(-1).view(torch.uint8).copy_(buf)

    # -------------------------------------------------------------------------------------------- waits

    def _progress(self) -> bool:
        """Serve every posted receive whose descriptor is there, and finish the sends taken; any progress."""
        moved = False
        for peer in list(self._recvs):
            while self._take(peer):
                moved = True
        for peer in list(self._sends):
            before = len(self._sends[peer])
            self._check_sends(peer)
            moved |= len(self._sends[peer]) != before
        return moved

    def _wait(self, op) -> None:
        if op.done:
            return
        self._block(op.peer, lambda: op.done)

    def _block(self, peer: int, ready) -> None:
        """Serve the transport until `ready()`; a dead or stopped peer named (see the module's docstring)."""
        nap, last_look, last_move = 2e-6, time.monotonic(), time.monotonic()
        while True:
            if self._progress():
                nap, last_move = 2e-6, time.monotonic()
            if ready():
                return
            time.sleep(nap)
            nap = min(nap * 2, 5e-4)
            now = time.monotonic()
            if now - last_look >= POLL:
                last_look = now
                self._look(peer, now - last_move)

    def _look(self, peer: int, idle: float) -> None:
        """Raise (telling the group) if the group broke, `peer`'s process ended, or nothing moved too long."""
        guard = self.inner.guard
        if guard is not None:
            if guard.broken is not None:
                raise guard.broken
            fault = guard.watchdog.check()
            if fault is not None:
                guard.fail(fault)
        if not _alive(self.pids[peer]):
            self.inner.fail(f"{self._who(peer)} died (its process {self.pids[peer]} is gone) while rank "
                            f"{self.rank} waited on a message with it", (peer,))
        if guard is None and idle > self.timeout:
            self.inner.fail(f"{self._who(peer)} moved no message for {idle:.0f} s while rank {self.rank} waited "
                            f"on one with it (the transport's timeout)", (peer,))

    def _who(self, rank: int) -> str:
        guard = self.inner.guard
        return guard.watchdog.who(rank) if guard is not None else f"rank {rank}"

    # ----------------------------------------------------------------------------------- groups, links

    def new_group(self, ranks: list[int]):
        group = self.inner.new_group(ranks)
        members = tuple(sorted(set(ranks)))
        if group is not None:
            self._groups[id(group)] = (members, group)
        return group

    def broadcast(self, t: torch.Tensor, root: int, group) -> None:
        """From the root to every member of `group`: over shared memory when they all are on this host (the
        root's bytes copied once at most, every member taking them from there), else the wrapped comm's."""
        members = self._groups.get(id(group), ((),))[0]
        if not members or t.device.type != "cpu" or not set(members) <= self.local:
            return self.inner.broadcast(t, root, group)
        if self.rank != root:
            self.irecv(t, root).wait()
            return
        ops, temp = [], None
        for m in members:
            if m != root:
                op = self._post_send(t, m, temp)
                temp = op.temp
                ops.append(op)
        for op in ops:
            self._wait(op)

    def connect(self, peers=(), *, groups=(), tag: str | None = None) -> None:
        """The wrapped comm's set-up, for the peers it carries (this host's need none)."""
        self.inner.connect(set(peers) - self.local, groups=groups, tag=tag)


TRANSPORTS = ("auto", "gloo", "nccl", "shm")


def checked_transport(choice: str, key: str = "--transport") -> str:
    """`choice` when it names a transport, else one line naming `key`."""
    if choice not in TRANSPORTS:
        raise ConfigError(f"unknown transport {choice!r} ({', '.join(TRANSPORTS)})", key=key)
    return choice


def with_transport(comm, choice: str, device: torch.device):
    """The comm that carries a refit's messages over `choice`: `shm` wraps `comm` (collective: every rank of
    its group), its peers on this host through shared memory; `gloo` and `nccl` are the group's own backend,
    `auto` too (shared memory is chosen by name). Refused in one line where the choice cannot be had."""
    checked_transport(choice)
    if choice == "shm":
        if torch.device(device).type != "cpu":
            raise ConfigError("the shared-memory transport carries host memory; this job's tensors are on "
                              f"{torch.device(device).type} (CUDA IPC is not built yet): use nccl", key="--transport")
        return ShmComm(comm)
    return comm


def transport_name(choice: str) -> str:
    """What carried a job's messages, for its report: `shm` (peers on other hosts: the backend), or the
    process group's backend."""
    import torch.distributed as dist

    backend = str(dist.get_backend()) if dist.is_initialized() else "gloo"
    return f"shm (+{backend} between hosts)" if choice == "shm" else backend
