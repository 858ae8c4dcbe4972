"""NVML discovery against a fake NVML loaded from YAML fixtures, and against the real pynvml (no driver here)."""
from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

import pynvml
import pytest
import yaml

from reshard_cli.errors import ConfigError
from reshard_cli.hw.nvml import (Discovery, HostInfo, discover, domains_from_keys, format_cpu_list,
                              normalize_bus_id, rank_domain_key, render, to_json, to_topology)

FIXTURES = Path(__file__).parent / "fixtures" / "nvml"


# ------------------------------------------------------------------------------------------ the fake


class _Handle:
    def __init__(self, index: int):
        self.index = index

    def __repr__(self) -> str:
        return f"<gpu {self.index}>"


class _Pci:
    def __init__(self, bus_id: str):
        self.busId = bus_id


class _Mem:
    def __init__(self, total: int):
        self.total = total
        self.free = total
        self.used = 0


def _parse_cpus(text: str) -> list[int]:
    out: list[int] = []
    for part in str(text).split(","):
        lo, _, hi = part.partition("-")
        out.extend(range(int(lo), int(hi or lo) + 1))
    return out


class FakeNvml:
    """Implements the pynvml calls `discover` makes, answering from a YAML description.

    Fixture keys: host, driver, defaults (merged into every gpu), gpus (bus_id, name, memory_gib, cc,
    pcie [gen, width], numa, affinity, nvlinks {switch: n, peers: {gpu: n}, down: n, version},
    fabric {state, cluster_uuid, clique_id}, p2p_nvlink: status or {peer: status}),
    topology {same_numa, other_numa, pairs {"i,j": LEVEL}}, missing_functions, remote_bus_id_form,
    init_error (an NVMLError_* class name), fail_all (an NVMLError_* class name raised by every device call).
    Whatever a fixture leaves out raises pynvml.NVMLError_NotSupported.
    """

    def __init__(self, doc: dict):
        self.doc = doc
        defaults = doc.get("defaults", {}) or {}
        self.gpus = [{**copy.deepcopy(defaults), **g} for g in doc.get("gpus", [])]
        self.missing = set(doc.get("missing_functions", []) or [])
        self.calls: list[str] = []
        self.initialised = 0
        self.shutdowns = 0
        self._links = [self._make_links(i, g) for i, g in enumerate(self.gpus)]

    @classmethod
    def load(cls, name: str) -> "FakeNvml":
        return cls(yaml.safe_load((FIXTURES / name).read_text()))

    def host(self) -> HostInfo:
        h = self.doc["host"]
        return HostInfo(hostname=h["hostname"], cpus=h["cpus"], memory_bytes=int(h["memory_gib"] * 2**30),
                        numa_nodes=h["numa_nodes"])

    # constants, error classes and ctypes structs come from the real module
    def __getattr__(self, name: str) -> Any:
        if name.startswith(("NVML_", "NVMLError", "c_nvml")):
            return getattr(pynvml, name)
        raise AttributeError(name)

    # -- helpers
    def _enter(self, fn: str) -> None:
        self.calls.append(fn)
        if fn in self.missing:
            raise pynvml.NVMLError_FunctionNotFound()
        if self.doc.get("fail_all") and fn.startswith("nvmlDevice") and fn != "nvmlDeviceGetCount":
            if fn != "nvmlDeviceGetHandleByIndex":
                raise getattr(pynvml, self.doc["fail_all"])()

    def _gpu(self, handle: _Handle, key: str) -> Any:
        g = self.gpus[handle.index]
        if key not in g or g[key] is None:
            raise pynvml.NVMLError_NotSupported()
        return g[key]

    def _make_links(self, i: int, g: dict) -> list[dict] | None:
        spec = g.get("nvlinks")
        if not spec:
            return None
        links: list[dict] = []
        for k in range(spec.get("switch", 0)):
            links.append({"up": True, "type": pynvml.NVML_NVLINK_DEVICE_TYPE_SWITCH,
                          "bus": f"00000000:{0x40 + k % 4:02X}:00.0"})   # four NVSwitches
        for peer, count in (spec.get("peers") or {}).items():
            bus = self.gpus[int(peer)]["bus_id"]
            if self.doc.get("remote_bus_id_form") == "legacy":
                bus = bus[-12:].lower()
            for _ in range(count):
                links.append({"up": True, "type": spec.get("peer_type", pynvml.NVML_NVLINK_DEVICE_TYPE_GPU),
                              "bus": bus})
        links.extend({"up": False} for _ in range(spec.get("down", 0)))
        for lk in links:
            lk["version"] = spec.get("version")
        return links

    def _link(self, handle: _Handle, link: int) -> dict:
        links = self._links[handle.index]
        if links is None or link >= len(links):
            raise pynvml.NVMLError_NotSupported()
        return links[link]

    # -- system
    def nvmlInit(self) -> None:
        self.calls.append("nvmlInit")
        if self.doc.get("init_error"):
            raise getattr(pynvml, self.doc["init_error"])()
        self.initialised += 1

    def nvmlShutdown(self) -> None:
        self.calls.append("nvmlShutdown")
        assert self.initialised > self.shutdowns, "nvmlShutdown without nvmlInit"
        self.shutdowns += 1

    def nvmlSystemGetDriverVersion(self) -> str:
        self._enter("nvmlSystemGetDriverVersion")
        if "driver" not in self.doc:
            raise pynvml.NVMLError_NotSupported()
        return self.doc["driver"]

    def nvmlDeviceGetCount(self) -> int:
        self._enter("nvmlDeviceGetCount")
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> _Handle:
        self._enter("nvmlDeviceGetHandleByIndex")
        if not 0 <= index < len(self.gpus):
            raise pynvml.NVMLError_InvalidArgument()
        return _Handle(index)

    # -- per device
    def nvmlDeviceGetName(self, h: _Handle) -> str:
        self._enter("nvmlDeviceGetName")
        return self._gpu(h, "name")

    def nvmlDeviceGetUUID(self, h: _Handle) -> str:
        self._enter("nvmlDeviceGetUUID")
        return self.gpus[h.index].get("uuid") or f"GPU-{h.index:08x}-0000-4000-8000-{abs(hash(self.gpus[h.index]['bus_id'])) % 10**12:012d}"

    def nvmlDeviceGetPciInfo(self, h: _Handle) -> _Pci:
        self._enter("nvmlDeviceGetPciInfo")
        return _Pci(self._gpu(h, "bus_id"))

    def nvmlDeviceGetMemoryInfo(self, h: _Handle) -> _Mem:
        self._enter("nvmlDeviceGetMemoryInfo")
        return _Mem(int(self._gpu(h, "memory_gib") * 2**30))

    def nvmlDeviceGetCudaComputeCapability(self, h: _Handle) -> tuple[int, int]:
        self._enter("nvmlDeviceGetCudaComputeCapability")
        major, minor = self._gpu(h, "cc")
        return major, minor

    def nvmlDeviceGetCpuAffinity(self, h: _Handle, cpu_set_size: int) -> list[int]:
        self._enter("nvmlDeviceGetCpuAffinity")
        words = [0] * cpu_set_size
        for cpu in _parse_cpus(self._gpu(h, "affinity")):
            if cpu // 64 < cpu_set_size:
                words[cpu // 64] |= 1 << (cpu % 64)
        return words

    def nvmlDeviceGetNumaNodeId(self, h: _Handle) -> int:
        self._enter("nvmlDeviceGetNumaNodeId")
        return self._gpu(h, "numa")

    def nvmlDeviceGetCurrPcieLinkGeneration(self, h: _Handle) -> int:
        self._enter("nvmlDeviceGetCurrPcieLinkGeneration")
        return self._gpu(h, "pcie")[0]

    def nvmlDeviceGetCurrPcieLinkWidth(self, h: _Handle) -> int:
        self._enter("nvmlDeviceGetCurrPcieLinkWidth")
        return self._gpu(h, "pcie")[1]

    def nvmlDeviceGetNvLinkState(self, h: _Handle, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkState")
        return pynvml.NVML_FEATURE_ENABLED if self._link(h, link)["up"] else pynvml.NVML_FEATURE_DISABLED

    def nvmlDeviceGetNvLinkVersion(self, h: _Handle, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkVersion")
        version = self._link(h, link).get("version")
        if version is None:
            raise pynvml.NVMLError_NotSupported()
        return version

    def nvmlDeviceGetNvLinkRemotePciInfo(self, h: _Handle, link: int) -> _Pci:
        self._enter("nvmlDeviceGetNvLinkRemotePciInfo")
        lk = self._link(h, link)
        if not lk["up"]:
            raise pynvml.NVMLError_NotSupported()
        return _Pci(lk["bus"])

    def nvmlDeviceGetNvLinkRemoteDeviceType(self, h: _Handle, link: int) -> int:
        self._enter("nvmlDeviceGetNvLinkRemoteDeviceType")
        lk = self._link(h, link)
        if not lk["up"]:
            raise pynvml.NVMLError_NotSupported()
        return lk["type"]

    def nvmlDeviceGetP2PStatus(self, h1: _Handle, h2: _Handle, index: int) -> int:
        self._enter("nvmlDeviceGetP2PStatus")
        assert index == pynvml.NVML_P2P_CAPS_INDEX_NVLINK
        spec = self._gpu(h1, "p2p_nvlink")
        if isinstance(spec, dict):
            return spec.get(h2.index, pynvml.NVML_P2P_STATUS_NOT_SUPPORTED)
        return spec

    def nvmlDeviceGetTopologyCommonAncestor(self, h1: _Handle, h2: _Handle) -> int:
        self._enter("nvmlDeviceGetTopologyCommonAncestor")
        topo = self.doc.get("topology")
        if topo is None:
            raise pynvml.NVMLError_NotSupported()
        a, b = sorted((h1.index, h2.index))
        pairs = {tuple(int(x) for x in k.split(",")): v for k, v in (topo.get("pairs") or {}).items()}
        if (a, b) in pairs:
            level = pairs[(a, b)]
        elif self.gpus[a].get("numa") == self.gpus[b].get("numa"):
            level = topo.get("same_numa", "NODE")
        else:
            level = topo.get("other_numa", "SYSTEM")
        return getattr(pynvml, f"NVML_TOPOLOGY_{level}")

    def _fill_fabric(self, fn: str, h: _Handle, ref: Any) -> int:
        self._enter(fn)
        f = self._gpu(h, "fabric")
        info = getattr(ref, "_obj", ref)          # ctypes.byref(struct) -> struct
        info.state = f["state"]
        info.status = pynvml.NVML_SUCCESS
        if "cluster_uuid" in f:
            import uuid
            info.clusterUuid[:] = list(uuid.UUID(f["cluster_uuid"]).bytes)
        info.cliqueId = f.get("clique_id", 0)
        return pynvml.NVML_SUCCESS

    def nvmlDeviceGetGpuFabricInfoV(self, h: _Handle, ref: Any) -> int:
        return self._fill_fabric("nvmlDeviceGetGpuFabricInfoV", h, ref)

    def nvmlDeviceGetGpuFabricInfo(self, h: _Handle, ref: Any) -> int:
        return self._fill_fabric("nvmlDeviceGetGpuFabricInfo", h, ref)


def run(name: str, **changes: Any) -> tuple[Discovery, FakeNvml]:
    fake = FakeNvml.load(name)
    if changes:
        doc = copy.deepcopy(fake.doc)
        doc.update(changes)
        fake = FakeNvml(doc)
    d = discover(fake, host=fake.host())
    assert fake.initialised == fake.shutdowns, "nvmlShutdown must follow a successful nvmlInit"
    return d, fake


def off_diagonal(d: Discovery) -> set[str]:
    n = len(d.matrix)
    return {d.matrix[r][c] for r in range(n) for c in range(n) if r != c}


# ------------------------------------------------------------------------------------------ fixtures


def test_dgx_h100_one_nvswitch_domain():
    d, fake = run("dgx-h100.yaml")
    assert d.nvml_error is None and d.driver == "550.54.15"
    assert len(d.gpus) == 8
    g0, g7 = d.gpus[0], d.gpus[7]
    assert g0.name == "NVIDIA H100 80GB HBM3"
    assert g0.memory_bytes == 80 * 2**30
    assert g0.compute_capability == (9, 0)
    assert (g0.pcie_gen, g0.pcie_width) == (5, 16)
    assert g0.bus_id == "0000:18:00.0" and g7.bus_id == "0000:db:00.0"
    assert (g0.numa_node, g7.numa_node) == (0, 1)
    assert g0.cpu_affinity == "0-55,112-167" and g7.cpu_affinity == "56-111,168-223"
    assert g0.links_up == 18 and len(g0.links) == 18
    assert {lk.remote_type for lk in g0.links} == {"switch"} and g0.links[0].version == 6
    assert g0.fabric is None                                  # fabric state NOT_SUPPORTED
    assert d.domains == [list(range(8))]
    assert d.domain_keys == ["host:dgx01:nvswitch"]
    assert [d.matrix[i][i] for i in range(8)] == ["X"] * 8
    assert off_diagonal(d) == {"NV18"}
    assert "nvmlDeviceGetTopologyCommonAncestor" not in fake.calls    # all pairs are NVLink
    assert "nvmlDeviceGetP2PStatus" not in fake.calls                 # link data was enough
    assert rank_domain_key(d, 5) == "host:dgx01:nvswitch"

    topo = to_topology(d)
    assert topo.name == "discovered:dgx01" and topo.ranks_per_domain == 8 and topo.domains == ()
    assert topo.links == {}
    assert to_topology(d, ranks_per_node=4).ranks_per_domain == 4
    with pytest.raises(ConfigError):
        to_topology(d, ranks_per_node=9)


def test_gb200_nvl72_fabric_key():
    d, _ = run("gb200-nvl72-tray.yaml")
    key = "fabric:6f1c2a3e-9b0d-4e57-8a21-3c4d5e6f7a80:32766"
    assert [g.fabric for g in d.gpus] == [("6f1c2a3e-9b0d-4e57-8a21-3c4d5e6f7a80", 32766)] * 4
    assert d.domains == [[0, 1, 2, 3]]
    assert d.domain_keys == [key]
    assert off_diagonal(d) == {"NV18"}
    assert all(g.pcie_gen is None and g.pcie_width is None for g in d.gpus)   # NotSupported -> None
    assert d.gpus[2].bus_id == "0018:01:00.0" and d.gpus[3].cpu_affinity == "72-143"
    assert d.gpus[0].links[0].version == 7
    assert rank_domain_key(d, 3) == key
    topo = to_topology(d)
    assert topo.ranks_per_domain == 4 and topo.name == "discovered:nvl72-tray03"


def test_gb200_incomplete_fabric_falls_back_to_nvswitch():
    fake = FakeNvml.load("gb200-nvl72-tray.yaml")
    for g in fake.gpus:
        g["fabric"] = {"state": pynvml.NVML_GPU_FABRIC_STATE_IN_PROGRESS}
    d = discover(fake, host=fake.host())
    assert all(g.fabric is None for g in d.gpus)
    assert d.domain_keys == ["host:nvl72-tray03:nvswitch"]


def test_l40s_pcie_only():
    d, fake = run("l40s-pcie.yaml")
    assert [g.name for g in d.gpus] == ["NVIDIA L40S"] * 4
    assert all(g.links == [] and g.fabric is None for g in d.gpus)
    assert d.domains == [[0], [1], [2], [3]]
    assert d.domain_keys == [f"host:l40s-node:gpu{i}" for i in range(4)]
    m = d.matrix
    assert m[0][1] == m[1][0] == "PIX"
    assert m[2][3] == "PHB"
    assert m[0][2] == m[1][3] == m[3][0] == "SYS"
    assert "NV" not in "".join(off_diagonal(d))
    assert fake.calls.count("nvmlDeviceGetP2PStatus") == 6       # fallback asked, answered "not supported"
    topo = to_topology(d)
    assert topo.domains == ((0,), (1,), (2,), (3,)) and topo.ranks_per_domain is None
    assert to_topology(d, ranks_per_node=2).domains == ((0,), (1,))
    assert rank_domain_key(d, 2) == "host:l40s-node:gpu2"
    with pytest.raises(ConfigError):
        rank_domain_key(d, 4)


def test_v100_direct_nvlink_pair():
    d, fake = run("old-gpu.yaml")
    g0 = d.gpus[0]
    assert g0.name == "Tesla V100-SXM2-32GB" and g0.compute_capability == (7, 0)
    assert g0.numa_node is None                                    # NotSupported
    assert g0.fabric is None                                       # FunctionNotFound
    assert "nvmlDeviceGetGpuFabricInfoV" in fake.calls
    assert len(g0.links) == 6 and g0.links_up == 2
    assert [lk.state for lk in g0.links] == ["up", "up"] + ["down"] * 4
    assert g0.links[0].remote_type == "gpu" and g0.links[0].remote_bus_id == "0000:1b:00.0"
    assert g0.links[5].remote_bus_id is None and g0.links[5].version == 2
    assert d.domains == [[0, 1]]
    assert d.domain_keys == ["host:v100-box:nvlink:0"]
    assert d.matrix == [["X", "NV2"], ["NV2", "X"]]
    assert to_topology(d).ranks_per_domain == 2


def test_v100_remote_type_unknown_is_inferred_from_bus_id():
    fake = FakeNvml.load("old-gpu.yaml")
    fake.missing.add("nvmlDeviceGetNvLinkRemoteDeviceType")
    d = discover(fake, host=fake.host())
    assert d.gpus[0].links[0].remote_type == "gpu"
    assert d.domains == [[0, 1]] and d.matrix[0][1] == "NV2"


def test_p2p_fallback_when_link_queries_unsupported():
    fake = FakeNvml.load("l40s-pcie.yaml")
    fake.gpus[0]["p2p_nvlink"] = {1: pynvml.NVML_P2P_STATUS_OK}
    d = discover(fake, host=fake.host())
    assert d.domains == [[0, 1], [2], [3]]
    assert d.domain_keys == ["host:l40s-node:nvlink:0", "host:l40s-node:gpu2", "host:l40s-node:gpu3"]
    assert d.matrix[0][1] == "NV?"
    assert to_topology(d).domains == ((0, 1), (2,), (3,))


def test_every_device_call_failing_never_crashes():
    d, fake = run("dgx-h100.yaml", fail_all="NVMLError_NoPermission")
    assert fake.shutdowns == 1
    assert len(d.gpus) == 8
    g = d.gpus[0]
    assert g.name == "unknown" and g.uuid == "" and g.bus_id == "" and g.memory_bytes == 0
    assert g.compute_capability is None and g.cpu_affinity is None and g.numa_node is None
    assert g.pcie_gen is None and g.links == [] and g.fabric is None
    assert d.domains == [[i] for i in range(8)]
    assert off_diagonal(d) == {"N/A"}
    render(d)
    json.dumps(to_json(d))


def test_init_failure_with_fake():
    d, fake = run("dgx-h100.yaml", init_error="NVMLError_DriverNotLoaded")
    assert fake.calls == ["nvmlInit"]                # no shutdown after a failed init
    assert d.nvml_error == "NVML not available: driver not loaded"
    assert d.gpus == [] and d.domains == [] and d.domain_keys == ["host:dgx01:cpu"]
    assert "NVML not available" in render(d)


def test_domains_from_keys_two_hosts():
    a, _ = run("dgx-h100.yaml")
    fake_b = FakeNvml.load("dgx-h100.yaml")
    host_b = fake_b.host()
    host_b.hostname = "dgx02"
    b = discover(fake_b, host=host_b)
    keys = [rank_domain_key(a, r) for r in range(8)] + [rank_domain_key(b, r) for r in range(8)]
    topo = domains_from_keys(keys)
    assert topo.name == "discovered"
    assert topo.domains == (tuple(range(8)), tuple(range(8, 16)))
    assert topo.domain_of(3) == topo.domain_of(7) != topo.domain_of(8)

    # two L40S hosts with 2 ranks each, interleaved placement, plus a CPU-only host
    l, _ = run("l40s-pcie.yaml")
    keys = [rank_domain_key(l, 0), "host:other:gpu0", rank_domain_key(l, 1), "host:cpubox:cpu", "host:cpubox:cpu"]
    assert domains_from_keys(keys).domains == ((0,), (1,), (2,), (3, 4))

    # two NVL72 trays: one global fabric domain spanning both hosts
    t1, _ = run("gb200-nvl72-tray.yaml")
    keys = [rank_domain_key(t1, r % 4) for r in range(8)]
    assert domains_from_keys(keys).domains == (tuple(range(8)),)


def test_render_and_json():
    d, _ = run("dgx-h100.yaml")
    text = render(d)
    assert "dgx01" in text and "driver 550.54.15" in text and "224 CPUs" in text
    assert "NVIDIA H100 80GB HBM3" in text and "gen5 x16" in text and "0-55,112-167" in text
    assert "NV18" in text and "GPU7" in text and "Legend" in text
    assert "host:dgx01:nvswitch" in text
    l, _ = run("l40s-pcie.yaml")
    assert "PIX" in render(l) and "SYS" in render(l)

    for name in ("dgx-h100.yaml", "gb200-nvl72-tray.yaml", "l40s-pcie.yaml", "old-gpu.yaml"):
        d, _ = run(name)
        doc = json.loads(json.dumps(to_json(d)))
        assert doc["domain_keys"] == d.domain_keys
        assert len(doc["gpus"]) == len(d.gpus)
        assert doc["host"]["hostname"] == d.host.hostname
    doc = to_json(run("gb200-nvl72-tray.yaml")[0])
    assert doc["gpus"][0]["fabric"] == ["6f1c2a3e-9b0d-4e57-8a21-3c4d5e6f7a80", 32766]
    assert doc["gpus"][0]["links_up"] == 18


def test_bus_id_and_cpu_list_helpers():
    assert normalize_bus_id("00000000:1A:00.0") == "0000:1a:00.0"
    assert normalize_bus_id("0000:1a:00.0") == "0000:1a:00.0"
    assert normalize_bus_id(b"00000009:01:00.0\0\0") == "0009:01:00.0"
    assert normalize_bus_id("") is None and normalize_bus_id(None) is None
    assert format_cpu_list([0, 1, 2, 5, 7, 8]) == "0-2,5,7-8"


# ------------------------------------------------------------------------------------- real pynvml


def test_real_pynvml_without_driver():
    d = discover()
    if d.nvml_error is None:
        pytest.skip("this machine has a working NVIDIA driver")
    assert d.nvml_error.startswith("NVML not available")
    assert d.gpus == [] and d.domains == [] and d.matrix == []
    assert d.domain_keys == [f"host:{d.host.hostname}:cpu"]
    assert d.host.cpus >= 1 and d.host.numa_nodes >= 1 and d.host.memory_bytes > 0
    assert rank_domain_key(d, 0) == rank_domain_key(d, 3) == f"host:{d.host.hostname}:cpu"
    topo = to_topology(d)
    assert topo.ranks_per_domain == 1 and topo.name == f"discovered:{d.host.hostname}"
    assert to_topology(d, ranks_per_node=4).ranks_per_domain == 4
    assert d.nvml_error in render(d)
    json.dumps(to_json(d))
