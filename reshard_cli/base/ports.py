"""Free TCP ports for rendezvous stores this process hosts.

A port is picked now and bound later, often by another process (the replicas of a fleet learn it before rank
0 serves it). A port the kernel hands out (`bind(0)`) comes from its ephemeral range, the same range every
outgoing connection and every gloo listener takes its local port from: in between, one of those can take the
picked port, and a peer that connects then reaches gloo's listener instead of the store ("Connection reset by
peer"). So the port is drawn at random below that range, where the kernel never hands ports out by itself,
and checked free by binding it.
"""
from __future__ import annotations

import random
import socket

EPHEMERAL = (32768, 60999)  # Linux's default, when the kernel's range cannot be read
LOWEST = 10000  # below: ports services commonly listen on
_GIVEN: set[int] = set()  # ports this process handed out: never twice


def ephemeral_range() -> tuple[int, int]:
    """The ports the kernel hands out by itself (Linux: /proc/sys/net/ipv4/ip_local_port_range)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return EPHEMERAL


def free_port(host: str = "") -> int:
    """A TCP port free on this machine now and outside the kernel's ephemeral range (see above), for a
    rendezvous this process or a peer will host; never one this process gave before."""
    low, high = ephemeral_range()
    ranges = [r for r in ((LOWEST, low - 1), (high + 1, 65535)) if r[1] - r[0] >= 1000]
    rng = random.SystemRandom()
    for _ in range(200):
        start, end = rng.choice(ranges) if ranges else (LOWEST, 65535)
        port = rng.randint(start, end)
        if port in _GIVEN:
            continue
        with socket.socket() as sock:
            try:
                sock.bind((host, port))
            except OSError:  # in use (or in TIME_WAIT): another
                continue
        _GIVEN.add(port)
        return port
    with socket.socket() as sock:  # every draw was taken: the kernel's own choice
        sock.bind((host, 0))
        return sock.getsockname()[1]
