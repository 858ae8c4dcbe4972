"""The trainer's side of vLLM's control plane: clients of the weight-transfer calls (an `LLM` in this process,
vLLM's HTTP client of a running `vllm serve`), a blocking call run beside the transfer, and the checks and
layout text `reshard run` needs before pushing into a server."""
from __future__ import annotations

import json
import threading
import urllib.error
import urllib.request
from pathlib import Path

import yaml

from reshard_cli.engines.vllm import compat
from reshard_cli.errors import ConfigError
from reshard_cli.layouts.layout import replicated_doc
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


class Call:
    """A blocking control-plane call (vLLM's client) run on a thread beside this rank's transfer; `join`
    re-raises its error."""

    def __init__(self, fn, arg):
        self.error = None

        def run():
            try:
                fn(arg)
            except BaseException as e:  # noqa: BLE001 - re-raised by join
                self.error = e

        self.thread = threading.Thread(target=run, daemon=True)
        self.thread.start()

    def failure(self) -> str | None:
        """Why the call failed, once it has (polled while waiting for the peers it should have started)."""
        if self.error is None:
            return None
        return f"the engine refused: {_one_line(self.error)}"

    def join(self, timeout: float | None = None, *, quiet: bool = False) -> None:
        """Wait for the call (at most `timeout` seconds: an engine that does not answer is named, not waited
        on forever); re-raise its error unless `quiet`."""
        self.thread.join(timeout)
        if quiet:
            return
        if self.thread.is_alive():
            raise RuntimeError(f"reshard: the engine did not answer within {timeout:.0f} s")
        if self.error is not None:
            raise RuntimeError(f"reshard: {self.failure()}") from self.error


def _one_line(e: BaseException) -> str:
    """An HTTP error with the server's own message, or the first line of any other error."""
    response = getattr(e, "response", None)
    if response is not None:
        try:
            detail = response.json()
            detail = detail.get("error") or detail.get("detail") or detail.get("message") or detail
        except ValueError:
            detail = response.text[:300]
        return f"HTTP {response.status_code} from {response.url}: {detail}"
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


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


def fleet_layout(text: str, urls: list | None, replicas: int) -> str:
    """A fleet layout's YAML text (`portable_layout`) for its members only (`layouts.layout.replicated_doc`): the
    `dp` of its mesh their replica count (added first where the layout has none: one replica), the replicas'
    own parallelism unchanged, and with `urls` its `engine.url` the members' URLs."""
    doc = yaml.safe_load(text)
    if not isinstance(doc, dict):
        raise ConfigError(f"expected a layout mapping, got {type(doc).__name__}", key="dst")
    return yaml.safe_dump(replicated_doc(doc, replicas, file="dst", urls=urls), sort_keys=False)


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
