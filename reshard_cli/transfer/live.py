"""Live refit between running trainer and inference processes.

Every process of the job (trainer, inference, idle) creates one `Refit` after `init_process_group` and calls
it after each optimizer step:

    refit = Refit(role="src", dst="infer.yaml")        # a trainer process; its layout comes from its DTensors
    refit = Refit(role="dst", src="train.yaml", dst="infer.yaml")   # or both layouts from YAML
    stats = refit(named_tensors)                       # src: local shards or DTensors; dst: buffers, written in place

A layout left out is read from the DTensors the group's ranks pass on the first call (their device_mesh and
placements; every rank shares its specs once). The plan, buffers and groups are built on that first call and
reused by every later refit; each call writes into the destination buffers passed with it (usually the same
storage every time, so an engine's pointers stay valid).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from reshard_cli.errors import ConfigError
from reshard_cli.layouts.layout import Layout, Mesh, Placement
from reshard_cli import formats
from reshard_cli.formats import load_layout, load_pair
from reshard_cli.layouts.models import Manifest, TensorSpec
from reshard_cli.plan.planner import Plan
from reshard_cli.layouts.topology import NO_TOPOLOGY, Topology, load_topology
from reshard_cli.transfer import verify
from reshard_cli.transfer.agree import gather_failures, one_line
from reshard_cli.transfer.comm import WORLD, GroupComm
from reshard_cli.transfer.engine import Engine
from reshard_cli.transfer.pipeline import build_engine, ready_plan, transfer_options
from reshard_cli.transfer.shards import LocalShard


@dataclass
class RefitStats:
    seconds: float  # this rank's wall time of the refit
    bytes_sent: int  # by this rank, this refit
    checksums_ok: bool | None  # None when not verified
    bytes_received: int = 0  # by this rank, this refit


class Refit:
    def __init__(self, role: str, *, src: str | Path | Layout | None = None, dst: str | Path | Layout | None = None,
                 topology: str | Path | Topology | None = None, mode: str = "auto", bucket_mb: float = 64,
                 reshard_match: str | None = None, device: torch.device | str | None = None,
                 group: GroupComm | None = None):
        """`group`: a refit group of its own (`transfer.comm.refit_group`) instead of the default process group,
        for processes whose default group belongs to someone else (an inference engine's workers). Ranks in
        the layouts, and a DTensor mesh's ranks, are then the group's ranks; the broadcast route needs the
        default group, so there mode `auto` (the default) plans the reshard path only and other modes than
        `reshard` are refused."""
        if role not in ("src", "dst", "idle"):
            raise ConfigError(f"role must be 'src', 'dst' or 'idle', not {role!r}", key="role")
        if group is None and not dist.is_initialized():
            raise ConfigError("call torch.distributed.init_process_group before creating a Refit, or pass group=",
                              key="Refit")
        if group is not None and mode == "auto":
            mode = "reshard"
        if group is not None and mode != "reshard":
            raise ConfigError(f"a refit over its own group runs in mode reshard, not {mode!r}", key="mode")
        self.comm = group if group is not None else WORLD
        self.role = role
        self.rank = self.comm.rank
        if isinstance(src, (str, Path)) and isinstance(dst, (str, Path)):
            self._src, self._dst = load_pair(src, dst)  # dst ranks default to right after src
        else:
            self._src, self._dst = _as_layout(src), _as_layout(dst)
        self.topology = load_topology(topology) if isinstance(topology, (str, Path)) else (topology or NO_TOPOLOGY)
        self.mode, self.reshard_match = mode, reshard_match
        self.options = transfer_options(bucket_mb)
        self.device = torch.device(device) if device is not None else None
        self.plan: Plan | None = None
        self.engine: Engine | None = None
        self._bound: tuple | None = None  # what the engine's shards are views of (see `_rebind`)
        self._casts: list = []  # (converted copy, parameter) made at binding, refreshed at every refit

    def __call__(self, tensors: Mapping[str, torch.Tensor], *, verify_checksums: bool = False) -> RefitStats:
        if self.engine is None:
            self._setup(tensors)
        else:
            self._rebind(tensors)
        self.engine.bytes_sent = self.engine.bytes_received = 0  # this refit's, not a running total
        # No barriers: the messages themselves order the ranks. When this returns, this rank's part is done
        # (a destination's buffers hold the new weights; a source may change its tensors again).
        t0 = time.perf_counter()
        self.engine.run_reshard()
        self.engine.run_broadcast()
        if self.engine.device.type == "cuda":
            torch.cuda.synchronize(self.engine.device)
        stats = RefitStats(time.perf_counter() - t0, self.engine.bytes_sent, None, self.engine.bytes_received)
        if verify_checksums:
            stats.checksums_ok = self._verify()
        return stats

    # ------------------------------------------------------------------------------------------ set-up

    def _setup(self, tensors: Mapping[str, torch.Tensor]) -> None:
        specs = {name: _spec_of(name, x) for name, x in tensors.items()}
        gathered = self.comm.all_gather_object((self.role, specs))
        layouts = {}
        for role, given in (("src", self._src), ("dst", self._dst)):
            if given is not None:
                layouts[role] = given
                continue
            merged: dict[str, dict] = {}
            for r, (rr, sp) in enumerate(gathered):
                if rr == role:
                    for name, s in sp.items():
                        if s is None:
                            raise ConfigError(f"rank {r} passed a plain tensor for {name!r}, but no {role} layout "
                                              f"was given: pass DTensors or a layout", key=role)
                        merged.setdefault(name, s)
            if not merged:
                raise ConfigError(f"no {role} layout given and no rank passed DTensors as {role}", key=role)
            other = layouts.get("src") or self._dst  # list the tensors in a given layout's order
            layouts[role] = _layout_from_specs(role, merged, other.manifest if other else None)
        src, dst = layouts["src"], layouts["dst"]
        diff = src.manifest.diff(dst.manifest)
        if diff:
            raise ConfigError(f"src and dst models differ: {'; '.join(diff)}", key="dst")
        dst = dst.in_order_of(src.manifest)  # the plan pairs tensors by position
        overlap = set(src.ranks) & set(dst.ranks)
        if overlap:
            raise ConfigError(f"src and dst ranks overlap (rank {min(overlap)})", key="ranks")
        self.plan = ready_plan(src, dst, self.topology, mode=self.mode, reshard_match=self.reshard_match,
                               bucket_bytes=self.options.bucket_bytes)
        src_shards, dst_shards = self._agreed_shards(tensors)
        device = self.device or next((s.data.device for s in (*src_shards.values(), *dst_shards.values())),
                                     torch.device("cpu"))
        self.engine = build_engine(self.plan, self.rank, src_shards, dst_shards, self.options, device,
                                   comm=self.comm)
        self._bound = _storage_of(tensors)

    def _agreed_shards(self, tensors: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
        """What this rank passed is checked against the plan before anything moves; every rank learns of any
        rank's mistake (one line, the same everywhere) instead of waiting for a peer that gave up."""
        error, shards = None, ({}, {})
        try:
            shards = self._shards(tensors)
        except ConfigError as e:
            error = str(e)
        failed = gather_failures(self.comm.all_gather_object, error, exit_code=2)
        if failed:
            raise ConfigError(one_line(failed, me=self.rank, label="refit rank"))
        return shards

    def _shards(self, tensors: Mapping[str, torch.Tensor]) -> tuple[dict, dict]:
        """Check what this rank passed against the plan and wrap it (views, no copies)."""
        src_shards: dict[int, LocalShard] = {}
        dst_shards: dict[int, LocalShard] = {}
        for role, layout, out in (("src", self.plan.src, src_shards), ("dst", self.plan.dst, dst_shards)):
            if self.rank not in layout.ranks:
                continue
            man = layout.manifest
            held_names = (man.tensors[t].name for t, _ in layout.held(self.rank))
            bind = formats.get(layout.format).bind
            if bind is not None and any(n not in tensors for n in held_names):  # the framework's own names
                tensors = {**tensors, **bind(tensors, layout, self.rank, self._casts)}
            for t, box in layout.held(self.rank):
                spec = man.tensors[t]
                if spec.name not in tensors:
                    raise ConfigError(f"rank {self.rank} holds {spec.name!r} in the {role} layout but did not pass it",
                                      key=spec.name)
                local = _local(tensors[spec.name])
                if tuple(local.shape) != box.sizes or str(local.dtype).removeprefix("torch.") != spec.dtype:
                    raise ConfigError(f"rank {self.rank}: {spec.name} is {list(local.shape)} {local.dtype}, the "
                                      f"{role} layout expects {list(box.sizes)} {spec.dtype}", key=spec.name)
                if role == "dst" and not local.is_contiguous():
                    raise ConfigError(f"rank {self.rank}: destination buffer {spec.name} must be contiguous",
                                      key=spec.name)
                out[t] = LocalShard(box, local)
        return src_shards, dst_shards

    def _rebind(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Later refits: same plan, the tensors passed on this call. Destination buffers may be new storage
        (an engine that re-materializes its weights for each update); they are checked like the first ones.
        When every tensor is the same storage, shape and strides as last time (a trainer updating its
        parameters in place), the binding and the engine's views are kept; only converted copies are
        refreshed with the current values."""
        bound = _storage_of(tensors)
        if bound == self._bound:
            for copy, param in self._casts:
                copy.copy_(param)
            return
        self._casts = []
        self.engine.src_shards, self.engine.dst_shards = self._shards(tensors)
        self._bound = bound

    def _verify(self) -> bool:
        """Checksums: each destination shard against the sources' checksum of the same box (collective)."""
        eng = self.engine
        _actual, mismatched, _ = verify.mismatched_checksums(self.plan, self.rank, eng.src_shards, eng.dst_shards,
                                                             comm=self.comm)
        flag = torch.tensor([1 if mismatched else 0])
        self.comm.all_reduce_max(flag)
        return int(flag.item()) == 0


# ---------------------------------------------------------------------------------------------- helpers


def _as_layout(x) -> Layout | None:
    if x is None or isinstance(x, Layout):
        return x
    return load_layout(x)


def _storage_of(tensors: Mapping[str, torch.Tensor]) -> tuple:
    """Where every passed tensor's data lives: equal between two calls exactly when the same names are views
    of the same memory with the same shapes, strides and dtypes."""
    out = []
    for name, x in tensors.items():
        x = _local(x)
        out.append((name, x.data_ptr(), tuple(x.shape), x.stride(), x.dtype, x.device))
    return tuple(out)


def _local(x: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    x = x.to_local() if isinstance(x, DTensor) else x
    return x.detach()  # same storage; refit never records autograd history


def _spec_of(name: str, x: torch.Tensor) -> dict | None:
    """What a DTensor says about its layout (None for a plain tensor)."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    if not isinstance(x, DTensor):
        return None
    shard = []
    for p in x.placements:
        if isinstance(p, Shard) and type(p) is Shard:
            shard.append(p.dim)
        elif isinstance(p, Replicate):
            shard.append(None)
        else:  # Partial sums and _StridedShard index lists are not boxes
            raise ConfigError(f"{name}: placement {p} is not supported (Shard(d) and Replicate are)", key=name)
    mesh = x.device_mesh
    return {"shape": tuple(x.shape), "dtype": str(x.dtype).removeprefix("torch."),
            "mesh_shape": tuple(mesh.mesh.shape), "mesh_ranks": tuple(mesh.mesh.flatten().tolist()),
            "dims": tuple(mesh.mesh_dim_names or (f"d{i}" for i in range(mesh.ndim))), "shard": tuple(shard)}


def _layout_from_specs(role: str, specs: dict[str, dict], order: Manifest | None) -> Layout:
    names = [t.name for t in order.tensors if t.name in specs] if order else sorted(specs)
    names += sorted(set(specs) - set(names))
    manifest = Manifest(name=f"live-{role}", tensors=tuple(
        TensorSpec(n, tuple(specs[n]["shape"]), specs[n]["dtype"]) for n in names), source="live", config={})
    meshes: dict[tuple, Mesh] = {}
    placements = []
    for n in names:
        s = specs[n]
        key = (s["dims"], s["mesh_shape"], s["mesh_ranks"])
        if key not in meshes:
            meshes[key] = Mesh(f"mesh{len(meshes)}", s["dims"], s["mesh_shape"], s["mesh_ranks"])
        placements.append(Placement(meshes[key], s["shard"], (None,) * len(s["dims"])))
    interned: dict = {}
    placements = [interned.setdefault((p.mesh.name, p.shard), p) for p in placements]
    ranks = tuple(sorted({r for m in meshes.values() for r in m.ranks}))
    return Layout(file=f"<live {role}>", name=f"live-{role}", manifest=manifest, ranks=ranks,
                  meshes={m.name: m for m in meshes.values()}, pipeline=None, stage_of_layer=(), experts=(),
                  rules=(), placements=tuple(placements))
