"""GPU topology discovery through NVML, and its conversion into a `Topology`.

`discover()` asks NVML (the `pynvml` module, or any object with the same function names: tests pass a
fake) about every GPU on this host: identity, memory, PCIe link, NUMA node, CPU affinity, NVLinks and
the GB200-style fabric clique. From that it derives NVLink domains, a globally meaningful key per
domain, and an `nvidia-smi topo -m` style matrix.

Nothing here may crash on a machine without GPUs or with an old driver: a failure of `nvmlInit` gives
a `Discovery` with no GPUs, one CPU domain and `nvml_error` saying why; a failure of any single
per-device query leaves that field `None` (or the NVLink absent).

Domains on one host, in order of precedence:
  1. GPUs whose fabric state is COMPLETED are grouped by (cluster UUID, clique id); the key
     `fabric:<uuid>:<clique>` is the same on every host of the NVL72 rack.
  2. Otherwise NVLink: every GPU with an up link to an NVSwitch joins the host's NVSwitch domain
     (`host:<hostname>:nvswitch`); up links whose remote is another GPU of this host join the two GPUs
     (union-find; islands get `host:<hostname>:nvlink:<n>`, n counting islands from 0 by lowest GPU).
     When a GPU reports no usable link data, `nvmlDeviceGetP2PStatus(..., NVLINK)` is the fallback.
  3. Otherwise the GPU is alone: `host:<hostname>:gpu<i>`. A host without GPUs is `host:<hostname>:cpu`.
"""
from __future__ import annotations

import ctypes
import dataclasses
import glob
import os
import socket
import uuid as uuidlib
from dataclasses import dataclass, field
from typing import Any, Callable

from reshard_cli.errors import ConfigError
from reshard_cli.layouts.topology import Topology
from reshard_cli.layouts.yamlio import format_ranks


__all__ = [
    "Link", "Gpu", "HostInfo", "Discovery",
    "discover", "host_info", "normalize_bus_id", "format_cpu_list",
    "render", "topo_text", "to_json", "to_topology", "domains_from_keys", "rank_domain_key", "cpu_key",
]


# --------------------------------------------------------------------------------------------- data


@dataclass
class Link:
    """One NVLink of a GPU."""

    index: int
    state: str                      # "up" / "down"
    version: int | None             # raw NVML value (NVML_NVLINK_VERSION_*: 6 = NVLink 4.0, 7 = 5.0)
    remote_type: str                # "gpu" / "switch" / "unknown"
    remote_bus_id: str | None       # normalised "dddd:bb:dd.f"


@dataclass
class Gpu:
    index: int
    name: str
    uuid: str
    bus_id: str                     # normalised "dddd:bb:dd.f" ("" when unknown)
    memory_bytes: int               # 0 when unknown
    compute_capability: tuple[int, int] | None
    cpu_affinity: str | None        # e.g. "0-55,112-167"
    numa_node: int | None
    pcie_gen: int | None
    pcie_width: int | None
    links: list[Link] = field(default_factory=list)
    fabric: tuple[str, int] | None = None   # (cluster UUID, clique id) when the fabric state is COMPLETED

    @property
    def links_up(self) -> int:
        return sum(1 for lk in self.links if lk.state == "up")


@dataclass
class HostInfo:
    hostname: str
    cpus: int
    memory_bytes: int
    numa_nodes: int


@dataclass
class Discovery:
    host: HostInfo
    driver: str | None
    nvml_error: str | None
    gpus: list[Gpu]
    domains: list[list[int]]
    domain_keys: list[str]
    matrix: list[list[str]]


# ------------------------------------------------------------------------------------------ helpers


def cpu_key(hostname: str) -> str:
    return f"host:{hostname}:cpu"


def normalize_bus_id(bus_id: Any) -> str | None:
    """'00000000:1A:00.0' / '0000:1a:00.0' / b'...' -> '0000:1a:00.0'; None/'' -> None."""
    if bus_id is None:
        return None
    if isinstance(bus_id, (bytes, bytearray)):
        bus_id = bytes(bus_id).split(b"\0", 1)[0].decode("ascii", "replace")
    text = str(bus_id).strip().lower()
    if not text:
        return None
    parts = text.split(":")
    if len(parts) == 3:
        dom, bus, devfn = parts
    elif len(parts) == 2:
        dom, (bus, devfn) = "0", parts
    else:
        return text
    dev, _, fn = devfn.partition(".")
    try:
        return f"{int(dom[-4:] or '0', 16):04x}:{int(bus, 16):02x}:{int(dev, 16):02x}.{int(fn or '0', 16):x}"
    except ValueError:
        return text[-12:]


def format_cpu_list(cpus: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2,5' (the Linux cpulist format)."""
    return format_ranks(sorted(set(cpus)))


def _mask_to_cpus(words: Any, ncpus: int) -> list[int]:
    out: list[int] = []
    for w, word in enumerate(list(words)):
        word = int(word)
        bit = 0
        while word:
            if word & 1:
                cpu = w * 64 + bit
                if cpu < ncpus:
                    out.append(cpu)
            word >>= 1
            bit += 1
    return out


def _text(value: Any) -> str:
    if isinstance(value, (bytes, bytearray)):
        return bytes(value).split(b"\0", 1)[0].decode("utf-8", "replace")
    return str(value)


def host_info() -> HostInfo:
    """Facts about this host from the OS (never raises)."""
    try:
        hostname = socket.gethostname() or "localhost"
    except OSError:
        hostname = "localhost"
    cpus = os.cpu_count() or 1
    memory = 0
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    memory = int(line.split()[1]) * 1024
                    break
    except (OSError, ValueError, IndexError):
        pass
    if not memory:
        try:
            memory = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        except (ValueError, OSError, AttributeError):
            memory = 0
    nodes = [p for p in glob.glob("/sys/devices/system/node/node*") if p.rsplit("node", 1)[-1].isdigit()]
    return HostInfo(hostname=hostname, cpus=cpus, memory_bytes=memory, numa_nodes=len(nodes) or 1)


_INIT_REASONS = {
    "NVMLError_LibraryNotFound": "driver library not found",
    "NVMLError_DriverNotLoaded": "driver not loaded",
    "NVMLError_NoPermission": "insufficient permissions",
    "NVMLError_LibRmVersionMismatch": "driver/library version mismatch",
    "NVMLError_GpuIsLost": "a GPU is lost",
}


def _why(err: BaseException) -> str:
    reason = _INIT_REASONS.get(type(err).__name__)
    if reason:
        return reason
    try:
        text = str(err).strip()
    except Exception:  # noqa: BLE001 - str() of an NVML error may itself call into NVML
        text = ""
    text = text.splitlines()[0] if text else ""
    return text or type(err).__name__


class _Api:
    """The NVML module plus the errors to swallow on a per-call basis."""

    def __init__(self, nvml: Any, real: Any):
        self.m = nvml
        errs: list[type[BaseException]] = []
        for src in (nvml, real):
            if src is None:
                continue
            for name in ("NVMLError", "NVMLLibraryMismatchError"):
                cls = getattr(src, name, None)
                if isinstance(cls, type) and issubclass(cls, BaseException) and cls not in errs:
                    errs.append(cls)
        self.errors = tuple(errs)
        self.real = real

    def const(self, name: str, default: int) -> int:
        value = getattr(self.m, name, None)
        if value is None and self.real is not None:
            value = getattr(self.real, name, None)
        return default if value is None else int(value)

    def call(self, fn: str, *args: Any) -> Any:
        """Call nvml.<fn>(*args); None when the function is missing or raises an NVML error."""
        func = getattr(self.m, fn, None)
        if func is None:
            return None  # an older pynvml without this function
        try:
            return func(*args)
        except self.errors:
            return None

    def try_(self, thunk: Callable[[], Any]) -> Any:
        try:
            return thunk()
        except self.errors:
            return None


# ---------------------------------------------------------------------------------------- discovery


def discover(nvml: Any = None, *, host: HostInfo | None = None) -> Discovery:
    """Discover this host's GPUs and NVLink domains. Never raises for NVML trouble.

    `nvml` defaults to the `pynvml` module; `host` defaults to `host_info()` (tests pass fixed facts).
    """
    host = host or host_info()
    real = None
    try:
        import pynvml as real  # type: ignore[no-redef]
    except ImportError:
        real = None
    if nvml is None:
        if real is None:
            return _no_gpus(host, None, "NVML not available: pynvml is not installed")
        nvml = real
    api = _Api(nvml, real)
    try:
        nvml.nvmlInit()
    except api.errors as e:  # type: ignore[misc]
        return _no_gpus(host, None, f"NVML not available: {_why(e)}")
    except OSError as e:
        return _no_gpus(host, None, f"NVML not available: {e}")
    try:
        driver = api.call("nvmlSystemGetDriverVersion")
        driver = _text(driver) if driver is not None else None
        try:
            count = int(nvml.nvmlDeviceGetCount())
        except api.errors as e:  # type: ignore[misc]
            return _no_gpus(host, driver, f"NVML error: cannot count GPUs: {_why(e)}")
        handles: list[tuple[int, Any]] = []
        for i in range(count):
            h = api.call("nvmlDeviceGetHandleByIndex", i)
            if h is not None:
                handles.append((i, h))
        gpus = [_query_gpu(api, i, h, host) for i, h in handles]
        by_index = {g.index: h for g, (_, h) in zip(gpus, handles)}
        _infer_remote_types(gpus)
        domains, keys, p2p = _derive_domains(api, gpus, by_index, host.hostname)
        matrix = _matrix(api, gpus, by_index, domains, p2p)
        return Discovery(host=host, driver=driver, nvml_error=None, gpus=gpus, domains=domains,
                         domain_keys=keys, matrix=matrix)
    finally:
        try:
            nvml.nvmlShutdown()
        except api.errors:  # type: ignore[misc]
            pass


def _no_gpus(host: HostInfo, driver: str | None, why: str) -> Discovery:
    return Discovery(host=host, driver=driver, nvml_error=why, gpus=[], domains=[],
                     domain_keys=[cpu_key(host.hostname)], matrix=[])


def _query_gpu(api: _Api, index: int, h: Any, host: HostInfo) -> Gpu:
    name = api.call("nvmlDeviceGetName", h)
    uuid = api.call("nvmlDeviceGetUUID", h)
    pci = api.call("nvmlDeviceGetPciInfo", h)
    bus_id = normalize_bus_id(getattr(pci, "busId", None)) if pci is not None else None
    mem = api.call("nvmlDeviceGetMemoryInfo", h)
    memory = int(getattr(mem, "total", 0) or 0) if mem is not None else 0
    cc = api.call("nvmlDeviceGetCudaComputeCapability", h)
    cc = (int(cc[0]), int(cc[1])) if cc is not None else None
    words = max(1, (host.cpus + 63) // 64)
    mask = api.call("nvmlDeviceGetCpuAffinity", h, words)
    affinity = None
    if mask is not None:
        cpus = api.try_(lambda: _mask_to_cpus(mask, host.cpus))
        affinity = format_cpu_list(cpus) if cpus else None
    numa = api.call("nvmlDeviceGetNumaNodeId", h)
    numa = int(numa) if numa is not None and int(numa) >= 0 else None
    gen = api.call("nvmlDeviceGetCurrPcieLinkGeneration", h)
    width = api.call("nvmlDeviceGetCurrPcieLinkWidth", h)
    return Gpu(index=index, name=_text(name) if name is not None else "unknown",
               uuid=_text(uuid) if uuid is not None else "", bus_id=bus_id or "", memory_bytes=memory,
               compute_capability=cc, cpu_affinity=affinity, numa_node=numa,
               pcie_gen=int(gen) if gen is not None else None,
               pcie_width=int(width) if width is not None else None,
               links=_query_links(api, h), fabric=_query_fabric(api, h))


def _query_links(api: _Api, h: Any) -> list[Link]:
    enabled = api.const("NVML_FEATURE_ENABLED", 1)
    gpu_t = api.const("NVML_NVLINK_DEVICE_TYPE_GPU", 0)
    switch_t = api.const("NVML_NVLINK_DEVICE_TYPE_SWITCH", 2)
    links: list[Link] = []
    for li in range(api.const("NVML_NVLINK_MAX_LINKS", 18)):
        state = api.call("nvmlDeviceGetNvLinkState", h, li)
        if state is None:
            continue
        up = int(state) == enabled
        version = api.call("nvmlDeviceGetNvLinkVersion", h, li)
        remote_type, remote_bus = "unknown", None
        if up:
            rtype = api.call("nvmlDeviceGetNvLinkRemoteDeviceType", h, li)
            if rtype is not None:
                remote_type = {gpu_t: "gpu", switch_t: "switch"}.get(int(rtype), "unknown")
            rpci = api.call("nvmlDeviceGetNvLinkRemotePciInfo", h, li)
            if rpci is not None:
                remote_bus = normalize_bus_id(getattr(rpci, "busId", None))
        links.append(Link(index=li, state="up" if up else "down",
                          version=int(version) if version is not None else None,
                          remote_type=remote_type, remote_bus_id=remote_bus))
    return links


def _query_fabric(api: _Api, h: Any) -> tuple[str, int] | None:
    completed = api.const("NVML_GPU_FABRIC_STATE_COMPLETED", 3)
    success = api.const("NVML_SUCCESS", 0)
    for struct_name, fn in (("c_nvmlGpuFabricInfoV_t", "nvmlDeviceGetGpuFabricInfoV"),
                            ("c_nvmlGpuFabricInfo_t", "nvmlDeviceGetGpuFabricInfo")):
        cls = getattr(api.m, struct_name, None)
        if cls is None or not hasattr(api.m, fn):
            continue
        info = api.try_(cls)
        if info is None:
            continue
        arg = ctypes.byref(info) if isinstance(info, ctypes.Structure) else info
        if api.try_(lambda: getattr(api.m, fn)(h, arg) or True) is None:
            continue
        try:
            if int(info.state) != completed or int(getattr(info, "status", success)) != success:
                return None
            raw = bytes(bytearray(info.clusterUuid))
            if not any(raw):
                return None  # an all-zero cluster uuid would merge unrelated hosts
            cluster = str(uuidlib.UUID(bytes=raw[:16])) if len(raw) >= 16 else raw.hex()
            return cluster, int(info.cliqueId)
        except (AttributeError, TypeError, ValueError):
            return None
    return None


def _infer_remote_types(gpus: list[Gpu]) -> None:
    """An up link of unknown remote type whose remote bus id is a GPU of this host goes to that GPU."""
    local = {g.bus_id for g in gpus if g.bus_id}
    for g in gpus:
        for lk in g.links:
            if lk.state == "up" and lk.remote_type == "unknown" and lk.remote_bus_id in local:
                lk.remote_type = "gpu"


def _switch_links(g: Gpu) -> int:
    return sum(1 for lk in g.links if lk.state == "up" and lk.remote_type == "switch")


def _direct_links(g: Gpu, peer: Gpu) -> int:
    if not peer.bus_id:
        return 0
    return sum(1 for lk in g.links
               if lk.state == "up" and lk.remote_type == "gpu" and lk.remote_bus_id == peer.bus_id)


def _has_link_data(g: Gpu) -> bool:
    return any(lk.state == "up" and (lk.remote_type == "switch" or lk.remote_bus_id) for lk in g.links)


class _Components:
    """Union-find over GPU indices: GPUs joined by any NVLink evidence end in one domain."""

    def __init__(self, indices):
        self.parent = {i: i for i in indices}

    def find(self, x: int) -> int:
        parent = self.parent
        while parent[x] != x:
            parent[x] = parent[parent[x]]
            x = parent[x]
        return x

    def union(self, a: int, b: int) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            self.parent[max(ra, rb)] = min(ra, rb)


def _derive_domains(api: _Api, gpus: list[Gpu], handles: dict[int, Any], hostname: str
                    ) -> tuple[list[list[int]], list[str], set[tuple[int, int]]]:
    """Returns (domains, keys, P2P-only NVLink pairs). Evidence, strongest first: one fabric clique (multi-node
    NVLink), NVSwitch links, direct NVLink links to a GPU's bus id, and pairwise P2P status where link data
    is missing."""
    if not gpus:
        return [], [cpu_key(hostname)], set()
    comp = _Components(g.index for g in gpus)
    fabric_first: dict[tuple[str, int], int] = {}
    for g in gpus:
        if g.fabric is not None:
            if g.fabric in fabric_first:
                comp.union(fabric_first[g.fabric], g.index)
            else:
                fabric_first[g.fabric] = g.index
    plain = [g for g in gpus if g.fabric is None]
    switched = [g.index for g in plain if _switch_links(g)]
    for idx in switched[1:]:
        comp.union(switched[0], idx)
    by_bus = {g.bus_id: g for g in plain if g.bus_id}
    for g in plain:
        for lk in g.links:
            if lk.state == "up" and lk.remote_type == "gpu" and lk.remote_bus_id in by_bus:
                comp.union(g.index, by_bus[lk.remote_bus_id].index)
    p2p: set[tuple[int, int]] = set()
    nvlink_index = api.const("NVML_P2P_CAPS_INDEX_NVLINK", 2)
    ok = api.const("NVML_P2P_STATUS_OK", 0)
    for a_pos, a in enumerate(plain):
        for b in plain[a_pos + 1:]:
            if _has_link_data(a) and _has_link_data(b):
                continue
            status = api.call("nvmlDeviceGetP2PStatus", handles[a.index], handles[b.index], nvlink_index)
            if status is not None and int(status) == ok:
                p2p.add((a.index, b.index))
                comp.union(a.index, b.index)
    groups: dict[int, list[int]] = {}
    for g in gpus:
        groups.setdefault(comp.find(g.index), []).append(g.index)
    domains = sorted((sorted(v) for v in groups.values()), key=lambda d: d[0])
    return domains, _domain_keys(domains, gpus, set(switched), hostname), p2p


def _domain_keys(domains: list[list[int]], gpus: list[Gpu], switched: set, hostname: str) -> list[str]:
    """A key per domain that every process on the job derives alike (ranks with equal keys share a domain)."""
    by_index = {g.index: g for g in gpus}
    keys: list[str] = []
    islands = 0
    for dom in domains:
        fab = by_index[dom[0]].fabric
        if fab is not None:
            keys.append(f"fabric:{fab[0]}:{fab[1]}")
        elif switched & set(dom):
            keys.append(f"host:{hostname}:nvswitch")
        elif len(dom) > 1:
            keys.append(f"host:{hostname}:nvlink:{islands}")
            islands += 1
        else:
            keys.append(f"host:{hostname}:gpu{dom[0]}")
    return keys


_PCIE_NAMES = (("NVML_TOPOLOGY_INTERNAL", 0, "PIX"), ("NVML_TOPOLOGY_SINGLE", 10, "PIX"),
               ("NVML_TOPOLOGY_MULTIPLE", 20, "PXB"), ("NVML_TOPOLOGY_HOSTBRIDGE", 30, "PHB"),
               ("NVML_TOPOLOGY_NODE", 40, "NODE"), ("NVML_TOPOLOGY_SYSTEM", 50, "SYS"))


def _matrix(api: _Api, gpus: list[Gpu], handles: dict[int, Any], domains: list[list[int]],
            p2p: set[tuple[int, int]]) -> list[list[str]]:
    levels = {api.const(name, default): label for name, default, label in _PCIE_NAMES}
    dom_of = {i: n for n, dom in enumerate(domains) for i in dom}
    n = len(gpus)
    out = [["X" if r == c else "" for c in range(n)] for r in range(n)]
    for r in range(n):
        for c in range(r + 1, n):
            a, b = gpus[r], gpus[c]
            same = dom_of.get(a.index) == dom_of.get(b.index)
            direct = max(_direct_links(a, b), _direct_links(b, a))
            if direct:
                cell = f"NV{direct}"
            elif same and _switch_links(a) and _switch_links(b):
                cell = f"NV{min(_switch_links(a), _switch_links(b))}"
            elif (a.index, b.index) in p2p:
                cell = "NV?"
            else:
                level = api.call("nvmlDeviceGetTopologyCommonAncestor", handles[a.index], handles[b.index])
                cell = levels.get(int(level), "N/A") if level is not None else "N/A"
            out[r][c] = out[c][r] = cell
    return out


# ---------------------------------------------------------------------------------- render / export


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.1f}"


def render(d: Discovery) -> str:
    """Human-readable report: header, GPU table, domains, topo -m style matrix with a legend."""
    h = d.host
    lines = [f"host {h.hostname}: {h.cpus} CPUs, {_gib(h.memory_bytes)} GiB memory, "
             f"{h.numa_nodes} NUMA node{'s' if h.numa_nodes != 1 else ''}, "
             + (f"driver {d.driver}" if d.driver else (d.nvml_error or "driver unknown"))]
    if d.driver and d.nvml_error:
        lines.append(d.nvml_error)
    if not d.gpus:
        lines.append("no GPUs found")
        lines.append(f"domains: 1 (CPU) key {d.domain_keys[0] if d.domain_keys else cpu_key(h.hostname)}")
        return "\n".join(lines) + "\n"

    header = ["GPU", "name", "memory GiB", "cc", "bus id", "PCIe", "NUMA", "CPU affinity", "NVLinks up"]
    rows = []
    for g in d.gpus:
        rows.append([
            str(g.index), g.name, _gib(g.memory_bytes) if g.memory_bytes else "-",
            f"{g.compute_capability[0]}.{g.compute_capability[1]}" if g.compute_capability else "-",
            g.bus_id or "-",
            f"gen{g.pcie_gen if g.pcie_gen is not None else '?'} x{g.pcie_width if g.pcie_width is not None else '?'}"
            if (g.pcie_gen is not None or g.pcie_width is not None) else "-",
            str(g.numa_node) if g.numa_node is not None else "-",
            g.cpu_affinity or "-",
            str(g.links_up),
        ])
    lines.append("")
    lines.extend(_table(header, rows))
    lines.append("")
    lines.append(f"NVLink domains: {len(d.domains)}")
    for dom, key in zip(d.domains, d.domain_keys):
        lines.append(f"  GPUs {format_ranks(dom):<10} {key}")
    lines.append("")
    names = [f"GPU{g.index}" for g in d.gpus]
    mrows = [[names[r]] + d.matrix[r] + [d.gpus[r].cpu_affinity or "-",
                                         str(d.gpus[r].numa_node) if d.gpus[r].numa_node is not None else "-"]
             for r in range(len(d.gpus))]
    lines.extend(_table([""] + names + ["CPU Affinity", "NUMA Affinity"], mrows))
    lines += [
        "",
        "Legend:",
        "  X    = Self",
        "  SYS  = Connection traversing PCIe as well as the SMP interconnect between NUMA nodes",
        "  NODE = Connection traversing PCIe as well as the interconnect between PCIe Host Bridges within a NUMA node",
        "  PHB  = Connection traversing PCIe as well as a PCIe Host Bridge (typically the CPU)",
        "  PXB  = Connection traversing multiple PCIe bridges (without traversing the PCIe Host Bridge)",
        "  PIX  = Connection traversing at most a single PCIe bridge",
        "  NV#  = Connection traversing a bonded set of # NVLinks",
        "  NV?  = NVLink peer-to-peer reported, number of links unknown",
        "  N/A  = Relationship unknown",
    ]
    return "\n".join(lines) + "\n"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(str(x)) for x in col) for col in zip(header, *rows)]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    return [fmt.format(*header).rstrip()] + [fmt.format(*r).rstrip() for r in rows]


def topo_text(d) -> str:
    """`render(d)`; without NVML, first a line saying so, then the CPU host as one domain."""
    text = render(d)
    if not d.gpus and d.nvml_error:
        text = d.nvml_error + "\n" + text.replace(f", {d.nvml_error}\n", "\n", 1)
    return text


def to_json(d: Discovery) -> dict:
    """A plain dict (lists, str, int, None) of everything in the discovery."""
    def plain(x: Any) -> Any:
        if isinstance(x, dict):
            return {str(k): plain(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [plain(v) for v in x]
        return x

    out = plain(dataclasses.asdict(d))
    for g, src in zip(out["gpus"], d.gpus):
        g["links_up"] = src.links_up
    return out


def to_topology(d: Discovery, *, ranks_per_node: int | None = None) -> Topology:
    """This host's topology in local ranks (local rank i runs GPU i).

    One domain (or no GPUs) -> `ranks_per_domain` = its size, capped at `ranks_per_node` when given,
    so consecutive blocks of ranks (one block per node) share a domain. Several domains -> explicit
    `domains` of local ranks (ranks >= ranks_per_node dropped when it is given).
    """
    if ranks_per_node is not None and (not isinstance(ranks_per_node, int) or ranks_per_node < 1):
        raise ConfigError("must be a positive integer", key="ranks_per_node")
    name = f"discovered:{d.host.hostname}"
    if not d.gpus:
        return Topology(name=name, ranks_per_domain=ranks_per_node or 1, links={})
    if ranks_per_node is not None:
        known = {g.index for g in d.gpus}
        missing = [r for r in range(ranks_per_node) if r not in known]
        if missing:
            raise ConfigError(f"{ranks_per_node} ranks per node but no GPU {missing[0]} on "
                              f"{d.host.hostname} ({len(d.gpus)} GPUs found)", key="ranks_per_node")
    if len(d.domains) == 1:
        size = len(d.domains[0])
        if ranks_per_node is not None:
            size = min(size, ranks_per_node)
        return Topology(name=name, ranks_per_domain=size, links={})
    doms = [sorted(r for r in dom if ranks_per_node is None or r < ranks_per_node) for dom in d.domains]
    doms = [dom for dom in doms if dom]
    if len(doms) == 1:
        return Topology(name=name, ranks_per_domain=len(doms[0]), links={})
    return Topology(name=name, domains=tuple(tuple(dom) for dom in sorted(doms, key=lambda x: x[0])), links={})


def domains_from_keys(keys_per_rank: list[str]) -> Topology:
    """Global ranks reporting equal domain keys share a domain (domains ordered by first rank)."""
    groups: dict[str, list[int]] = {}
    for rank, key in enumerate(keys_per_rank):
        groups.setdefault(str(key), []).append(rank)
    domains = tuple(tuple(v) for v in sorted(groups.values(), key=lambda v: v[0]))
    return Topology(name="discovered", domains=domains, links={})


def rank_domain_key(d: Discovery, local_rank: int) -> str:
    """The domain key of the GPU with index `local_rank` (the CPU key on a host without GPUs)."""
    if not d.gpus:
        return cpu_key(d.host.hostname)
    for dom, key in zip(d.domains, d.domain_keys):
        if local_rank in dom:
            return key
    raise ConfigError(f"local rank {local_rank} has no GPU on {d.host.hostname} "
                      f"(GPUs: {format_ranks(sorted(g.index for g in d.gpus))})")
