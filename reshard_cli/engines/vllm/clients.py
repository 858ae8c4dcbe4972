"""The trainer's side of vLLM's control plane: clients of the weight-transfer calls (an `LLM` in this process,
vLLM's HTTP client of a running `vllm serve`), a fleet member as the engine-neutral fleet reaches one
(`VLLMMember`), and the checks and layout text `reshard run` needs before pushing into a server."""
from __future__ import annotations

import json
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from reshard_cli.engines.fleet.client import Member
from reshard_cli.engines.vllm import compat
from reshard_cli.errors import ConfigError
from reshard_cli.plan.fleet import fleet_of


class LLMClient:
    """vLLM's client protocol (`VLLMWeightSyncClient`) over an `LLM` in this process, whose own methods take
    request dicts; `HTTPVLLMWeightSyncClient(url)` is the same for a running `vllm serve`."""

    def __init__(self, llm, name: str | None = None):
        self.llm = llm
        self.replicas = compat.llm_replicas(llm)  # the layout replicas it drives (its data parallelism)
        self.name = name  # what a fleet's reports call this member (None: the client's repr)

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: dict) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def update_weight_version(self, new_version: str) -> None:
        self.llm.update_weight_version(new_version)

    def shutdown_weight_transfer_engine(self) -> None:
        self.llm.shutdown_weight_transfer_engine()

    def pause(self) -> None:
        """Pause generation as a server's pause route does (mode keep): `generate` calls wait, their requests
        queued, until `resume` (which a complete refit does for an engine reshard paused)."""
        compat.llm_scheduler(self.llm, "pause_scheduler", "keep", False)

    def resume(self) -> None:
        compat.llm_scheduler(self.llm, "resume_scheduler")

    def is_paused(self) -> bool:
        return bool(compat.llm_scheduler(self.llm, "is_scheduler_paused"))


ROUTES = ("reset_prefix_cache", "pause", "resume", "shutdown_weight_transfer_engine")


def control(client, route: str, query: str = "") -> bool:
    """One of vLLM's control routes (`ROUTES`) on an engine: the client's own method when it has one, else a
    POST to the server's route when the client holds its `base_url` (vLLM's `HTTPVLLMWeightSyncClient` has no
    method for the prefix cache or for pausing). False: this client cannot reach it (no such method, no URL)."""
    method = getattr(client, route, None)
    if callable(method):
        method()
        return True
    base = getattr(client, "base_url", None)
    if not base:
        return False
    url = f"{str(base).rstrip('/')}/{route}" + (f"?{query}" if query else "")
    request = urllib.request.Request(url, data=b"", method="POST")
    with urllib.request.urlopen(request, timeout=float(getattr(client, "timeout", 60) or 60)):  # noqa: S310
        return True


def http_client(url: str, timeout: float):
    """vLLM's own HTTP client of the weight-transfer routes, which also drops the server's prefix cache."""
    return compat.http_client(url, timeout)


class VLLMMember(Member):
    """A vLLM engine of a fleet (`fleet.client.Member`) through any client of vLLM's protocol: its update
    session through the client's own calls, the prefix cache and pausing through `control`."""

    def start(self) -> None:
        """vLLM's start_weight_update; one vLLM refuses (a session still open: an update a failure ended on
        the trainer's side only) is finished first and started again."""
        try:
            self.client.start_weight_update()
        except Exception:  # noqa: BLE001 - vLLM's RuntimeError, or an HTTP 500 carrying it
            try:
                self.client.finish_weight_update(None)
            except Exception:  # noqa: BLE001 - none was open after all
                pass
            self.client.start_weight_update()

    def finish(self, version: str | None, *, changed: bool) -> None:
        """vLLM's finish_weight_update with its new weight version (None: unchanged), and what a changed model
        needs: the prefix cache dropped (the KV of earlier prompts was computed with the old weights, and vLLM
        does not drop it on a weight update). Every worker's session is open until here (the workers never end
        it themselves); an engine that refuses the finish anyway gets the version on its own."""
        try:
            self.client.finish_weight_update(version)
        except Exception:  # noqa: BLE001 - vLLM's RuntimeError, or an HTTP error carrying it
            setter = getattr(self.client, "update_weight_version", None)
            if version is not None and setter is not None:
                setter(version)
        if changed:  # the client's own method, or the server's route through vLLM's HTTP client's base_url
            control(self.client, "reset_prefix_cache")

    def pause(self) -> bool:
        """vLLM's pause route, mode keep: requests stay queued."""
        return control(self.client, "pause", "mode=keep")

    def resume(self) -> None:
        control(self.client, "resume")

    def shutdown(self) -> None:
        control(self.client, "shutdown_weight_transfer_engine")


def check_engine(url: str, per_replica: int, timeout: float = 30.0) -> int:
    """The replicas (data-parallel ranks) of a running `vllm serve` at `url` with the weight-transfer routes and
    `per_replica` workers per replica (the layout's TP × PP); otherwise one ConfigError that says which."""
    sizes = [_world_size(url, dp, timeout) for dp in ("true", "false")]
    if sizes[1] != per_replica:
        raise ConfigError(f"the engine at {url} runs {sizes[1]} worker(s) per replica, the layout's replicas have "
                          f"{per_replica}", key="engine.url")
    return sizes[0] // sizes[1]


class EngineDown(ConfigError):
    """No engine answers at the URL (refused, timed out, no route): it is down, not misconfigured."""


def check_fleet(urls: tuple, dst, timeout: float = 30.0, *, require_all: bool = True) -> tuple[list, dict]:
    """The engines of a fleet (`engine: {url: [...]}`): each reachable one with the layout's replica shape, and
    as many replicas in all as the layout's `dp`. Returns (each engine's replica count, None for one that is
    down; {url: why} of those down). `require_all`: a down engine is an error; otherwise the fleet is the
    reachable engines (at least one), each down one counted as at least one of the layout's replicas. Any
    other mismatch is one ConfigError naming the engine."""
    fleet = fleet_of(dst)
    counts: list = []
    down: dict[str, str] = {}
    for url in urls:
        try:
            counts.append(check_engine(url, fleet.per_replica, timeout))
        except EngineDown as e:
            if require_all or len(urls) == 1:
                raise
            counts.append(None)
            down[url] = str(e)
    if len(down) == len(urls):
        raise ConfigError(f"no engine of the fleet answers: {'; '.join(down.values())}", key="engine.url")
    up = sum(c for c in counts if c is not None)
    if (up != fleet.replicas) if not down else (up + len(down) > fleet.replicas):
        shown = " + ".join("down" if c is None else str(c) for c in counts)
        raise ConfigError(f"the layout has {fleet.replicas} replica(s) (dp {fleet.replicas}), the engine(s) at "
                          f"{', '.join(urls)} run {up} ({shown})", key="engine.url")
    return counts, down


def _world_size(url: str, include_dp: str, timeout: float) -> int:
    try:
        with urllib.request.urlopen(f"{url}/get_world_size?include_dp={include_dp}", timeout=timeout) as r:  # noqa: S310
            return int(json.loads(r.read())["world_size"])
    except urllib.error.HTTPError as e:
        if e.code == 404:
            raise ConfigError(f"the engine at {url} does not expose vLLM's weight-transfer routes: start it with "
                              f"VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config '{{\"backend\": \"reshard\"}}'",
                              key="engine.url") from None
        raise ConfigError(f"the engine at {url} answered HTTP {e.code}", key="engine.url") from None
    except (urllib.error.URLError, OSError, ValueError, KeyError) as e:
        reason = getattr(e, "reason", None) or e
        raise EngineDown(f"cannot reach a vLLM engine at {url}: {reason}", key="engine.url") from None


def portable_layout(file: str) -> str:
    """A layout's YAML text for the engine's processes, which may run elsewhere: a model path made absolute,
    the source left out (only this side reads it)."""
    with open(file) as f:
        doc = yaml.safe_load(f)
    model = doc.get("model")
    if isinstance(model, str) and (Path(file).parent / model).exists():
        doc["model"] = str((Path(file).parent / model).resolve())
    doc.pop("source", None)
    return yaml.safe_dump(doc, sort_keys=False)
