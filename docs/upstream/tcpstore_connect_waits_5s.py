"""Six processes each open ten TCPStore clients to one store: some of those connections take about 5 s.

Standalone, CPU only: `python tcpstore_connect_waits_5s.py`. Rank 0 serves a TCPStore; every rank (rank 0
included) then opens ten client connections to it, one after the other, and times each. Run once with the
libuv server and once with the classic one. Some connections wait 5.0 s, more with six processes than with
two, with either server; plain socket connections to the same port, made the same way just after, do not.
"""
import socket
import time
from datetime import timedelta

import torch.distributed as dist
import torch.multiprocessing as mp

WORLD, CLIENTS = 6, 10


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def rank_main(rank: int, world: int, port: int, libuv: bool, results) -> None:
    timeout = timedelta(seconds=60)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=rank == 0, use_libuv=libuv, timeout=timeout)
    kept, waits = [], []
    for _ in range(CLIENTS):
        t0 = time.monotonic()
        kept.append(dist.TCPStore("127.0.0.1", port, is_master=False, wait_for_workers=False, use_libuv=libuv,
                                  timeout=timeout))
        waits.append(time.monotonic() - t0)
    raw = []
    for _ in range(CLIENTS):  # plain TCP connections to the same server
        t0 = time.monotonic()
        kept.append(socket.create_connection(("127.0.0.1", port)))
        raw.append(time.monotonic() - t0)
    store.add("done", 1)
    while rank == 0 and int(store.get("done")) < world:  # the server stays until every rank is through
        time.sleep(0.05)
    results.put((rank, waits, raw))


def run(world: int, libuv: bool) -> list:
    ctx = mp.get_context("spawn")
    results, port = ctx.Queue(), free_port()
    procs = [ctx.Process(target=rank_main, args=(r, world, port, libuv, results)) for r in range(world)]
    for p in procs:
        p.start()
    got = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    return [w for _, waits, _ in got for w in waits], [w for _, _, raw in got for w in raw]


if __name__ == "__main__":
    import torch

    print(f"torch {torch.__version__}")
    for world in (2, WORLD):
        for libuv in (True, False):
            waits, raw = run(world, libuv)
            slow = [w for w in waits if w > 1.0]
            print(f"{world} processes, {'libuv' if libuv else 'classic'} server: {len(slow)} of {len(waits)} "
                  f"TCPStore clients took over 1 s ({', '.join(f'{w:.2f}' for w in sorted(slow)[-3:]) or '-'} s), "
                  f"the others at most {max(w for w in waits if w <= 1.0):.3f} s; plain sockets at most "
                  f"{max(raw):.3f} s")
