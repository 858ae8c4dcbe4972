"""What the fleet needs of an engine's client (`Member`: the one interface a second engine implements), and a
blocking call of one (its init or update, `Call`) run on a thread beside this rank's own part of the transfer."""
from __future__ import annotations

import threading


class Member:
    """One engine of a fleet as the fleet's code reaches it, on trainer rank 0 (the rank that drives the
    engines). This is all an engine must offer; a second engine subclasses it around its own client:

      client     the engine's client as the user passed it (`add` / `remove` name a member by it)
      name       what the reports call it: the client's `base_url` (its server), else its `name`, else the client
      key        the engine itself, the same through any client of it: its `base_url`, else the client's identity
                 (what reshard paused stays paused, and a session left open is found, across `trainer_init`)
      replicas   the client's `replicas`: the layout replicas it drives (`replicas.Replicas`); none said: one,
                 or the whole layout for a lone client
      start()    open an update session on every worker (a stale one, that the engine refuses to start over,
                 finished first)
      finish(version, changed=)  close it; the engine's weight version becomes `version` (None: unchanged);
                 `changed`: the weights changed, so drop what the old ones left (vLLM's prefix cache)
      pause()    stop generating, requests kept queued: whether the engine could be reached to do it
      resume()   generate again
      shutdown() end the engine's side of the refit group

    The calls may raise; the fleet's code expects that of an engine that is gone. The engine's own update
    and init calls (run on a thread beside the transfer, `Call`) stay with its trainer engine."""

    def __init__(self, client):
        self.client = client

    @property
    def name(self) -> str:
        return str(getattr(self.client, "base_url", None) or getattr(self.client, "name", None) or self.client)

    @property
    def key(self):
        return getattr(self.client, "base_url", None) or id(self.client)

    @property
    def replicas(self) -> int | None:
        return getattr(self.client, "replicas", None)

    def start(self) -> None:
        raise NotImplementedError

    def finish(self, version: str | None, *, changed: bool) -> None:
        raise NotImplementedError

    def pause(self) -> bool:
        raise NotImplementedError

    def resume(self) -> None:
        raise NotImplementedError

    def shutdown(self) -> None:
        raise NotImplementedError


class Call:
    """A blocking control-plane call (an engine's client) run on a thread beside this rank's transfer; `join`
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
