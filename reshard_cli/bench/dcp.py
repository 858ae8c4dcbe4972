"""The torch.distributed.checkpoint baseline: save DTensors in the source layout, load DTensors in the
destination layout, through a fresh directory, on the same shards and buffers the engine modes use.

Bytes: what rank 0 finds written, and what the storage reader reads (each request reads its whole stored
chunk). Staging: the peak RSS growth during save + load (VmHWM reset through /proc/self/clear_refs before
every run), max over ranks; where /proc does not allow that, the bytes of the local state dict instead.
"""
from __future__ import annotations

import math
import shutil
import tempfile
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from reshard_cli.transfer import launcher
from reshard_cli.transfer.shards import fill_sentinel


def _free_dims(p) -> list[tuple[int, int | None]]:
    """(size, tensor dim or None) of each mesh dim a placement's DeviceMesh keeps: the dims not fixed to one
    coordinate (a dim fixed to several coordinates, like tied embeddings on two stages, replicates over them)."""
    return [(n if f is None else len(f), s) for n, s, f in zip(p.mesh.shape, p.shard, p.fixed)
            if f is None or isinstance(f, tuple)]


def _mesh_key(p) -> tuple:
    """A placement's DeviceMesh: its holders, shaped by the mesh dims that are not fixed (stage / expert)."""
    shape = tuple(n for n, _s in _free_dims(p)) or (1,)
    return p.holders, shape


def _dt_placements(p) -> list:
    from torch.distributed.tensor import Replicate, Shard

    out = [Shard(s) if s is not None else Replicate() for _n, s in _free_dims(p)]
    return out or [Replicate()]


def _device_meshes(layouts, device: torch.device) -> dict:
    """Every distinct (sub-)mesh of both layouts. Collective: every rank creates every mesh, same order."""
    from torch.distributed.device_mesh import DeviceMesh

    meshes: dict[tuple, Any] = {}
    for layout in layouts:
        for p in dict.fromkeys(layout.placements):  # placements are interned: first appearance order
            key = _mesh_key(p)
            if key not in meshes:
                holders, shape = key
                meshes[key] = DeviceMesh(device.type, torch.tensor(holders, dtype=torch.int).reshape(shape))
    return meshes


def _dtensors(layout, shards: dict, meshes: dict, man) -> dict:
    from torch.distributed.tensor import DTensor

    out = {}
    for t, sh in shards.items():
        p = layout.placements[t]
        shape = tuple(man[t].shape)
        stride = tuple(math.prod(shape[d + 1:]) for d in range(len(shape)))
        out[man[t].name] = DTensor.from_local(sh.data, meshes[_mesh_key(p)], _dt_placements(p), run_check=False,
                                              shape=torch.Size(shape), stride=stride)
    return out


def _counting_reader(path: str):
    """A FileSystemReader that adds up the stored bytes it reads (each request reads its whole stored chunk)."""
    from torch.distributed.checkpoint import FileSystemReader

    class CountingReader(FileSystemReader):
        nbytes: int | None = 0

        def read_data(self, plan, planner):
            try:
                self.nbytes += sum(self.storage_data[item.storage_index].length for item in plan.items)
            except Exception:  # noqa: BLE001 - another torch version's internals: no figure, still a load
                self.nbytes = None
            return super().read_data(plan, planner)

    return CountingReader(path)


def _rss_reset() -> int | None:
    """Give freed heap back to the OS, reset this process's peak RSS (VmHWM) and return the current RSS in bytes;
    None where /proc does not allow it."""
    try:
        import ctypes
        ctypes.CDLL(None).malloc_trim(0)  # else reused free heap pages would hide new allocations
    except (OSError, AttributeError):
        pass
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return _proc_status("VmRSS")
    except OSError:
        return None


def _proc_status(key: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(key + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


class DcpRun:
    """DCP as users run it offline: `dcp.save` of the source DTensors into a fresh directory, then `dcp.load`
    into DTensors of the destination layout (wrapping the same destination buffers, sentinel-filled).

    `prepare` / `run` / `check` are one measurement's steps (`check` returns the wrong elements on this rank,
    counted by `expected.wrong`); build it, `figures()` and `close()` collectively."""

    def __init__(self, src_l, dst_l, rank: int, src_shards: dict, dst_shards: dict, expected,
                 device: torch.device, dcp_dir: Path | None):
        self.rank, self.device, self.expected = rank, device, expected
        self.dst_shards = dst_shards
        man = src_l.manifest.tensors
        meshes = _device_meshes((src_l, dst_l), device)  # collective
        self.src_sd = _dtensors(src_l, src_shards, meshes, man)
        self.dst_sd = _dtensors(dst_l, dst_shards, meshes, man)
        self.names = {t: man[t].name for t in dst_shards}
        self.sd_bytes = sum(sh.data.numel() * sh.data.element_size()
                            for sh in list(src_shards.values()) + list(dst_shards.values()))
        base = [tempfile.mkdtemp(prefix="reshard-bench-dcp-", dir=str(dcp_dir) if dcp_dir else None)
                if rank == 0 else None]
        dist.broadcast_object_list(base, src=0)
        self.root = Path(base[0])
        self.dcp_dir = str(dcp_dir or tempfile.gettempdir())
        self.i = 0
        self.read: int | None = 0
        self.written = 0
        self.rss = 0
        self.rss_ok = True
        self.rss0: int | None = None
        self.reader = None

    def _ckpt(self) -> Path:
        return self.root / f"run{self.i}"

    def prepare(self) -> None:
        fill_sentinel(self.dst_shards.values())  # sentinel, not zeros: an element DCP never writes cannot pass
        self.rss0 = _rss_reset()

    def run(self) -> None:
        import torch.distributed.checkpoint as dcp

        self.reader = _counting_reader(str(self._ckpt()))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            dcp.save(self.src_sd, checkpoint_id=str(self._ckpt()))
            dcp.load(self.dst_sd, storage_reader=self.reader)

    def check(self) -> int:
        hwm = _proc_status("VmHWM")
        if self.rss0 is None or hwm is None:
            self.rss_ok = False
        else:
            self.rss = max(self.rss, hwm - self.rss0)
        self.read = self.reader.nbytes if self.reader is not None else None
        if self.rank == 0:
            self.written = sum(f.stat().st_size for f in self._ckpt().rglob("*") if f.is_file())
        wrong = self.expected.wrong({t: self.dst_sd[name].to_local() for t, name in self.names.items()})
        launcher.sync(self.device)  # every rank is done with the checkpoint before it goes
        if self.rank == 0:
            shutil.rmtree(self._ckpt(), ignore_errors=True)
        self.i += 1
        return wrong

    def close(self) -> None:
        launcher.sync(self.device)
        if self.rank == 0:
            shutil.rmtree(self.root, ignore_errors=True)

    def figures(self) -> dict:
        """Collective: the DCP-only figures (bytes written and read, staging)."""
        MIN, SUM, MAX = dist.ReduceOp.MIN, dist.ReduceOp.SUM, dist.ReduceOp.MAX
        read_ok = launcher.allreduce_int(0 if self.read is None else 1, MIN)
        read = launcher.allreduce_int(self.read or 0, SUM)
        written = launcher.allreduce_int(self.written, SUM)
        if launcher.allreduce_int(1 if self.rss_ok else 0, MIN):
            staging, kind = launcher.allreduce_int(self.rss, MAX), \
                "peak RSS growth during save+load (VmHWM), max over ranks"
        else:
            staging, kind = launcher.allreduce_int(self.sd_bytes, MAX), "bytes of the local state dict, max over ranks"
        return {"peak_staging_bytes": staging, "staging_kind": kind, "bytes_written": written,
                "bytes_read": read if read_ok else None, "wire_bytes": written + (read if read_ok else 0),
                "checkpoint_dir": self.dcp_dir}
