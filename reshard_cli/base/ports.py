"""Free TCP ports for rendezvous stores this process hosts."""
from __future__ import annotations

import socket


def free_port(host: str = "") -> int:
    """A TCP port free on this machine now (for a rendezvous this process will host)."""
    with socket.socket() as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
