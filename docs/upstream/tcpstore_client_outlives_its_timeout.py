"""A TCPStore client pointed at a port where something other than a store listens outlives its timeout.

Standalone, CPU only: `python tcpstore_client_outlives_its_timeout.py`. A plain socket listens on a free port
and either resets every connection it accepts, or accepts and never answers (what a peer finds when the port
it was told belongs to another program). A TCPStore client (is_master=False) with a 2 s and a 6 s timeout
connects there, in a child process this script gives up on after 60 s. It prints how long each took.
"""
import socket
import subprocess
import sys
import threading
import time

CHILD = """
import sys, time, datetime
import torch.distributed as dist
t0 = time.monotonic()
try:
    dist.TCPStore("127.0.0.1", int(sys.argv[1]), is_master=False,
                  timeout=datetime.timedelta(seconds=float(sys.argv[2])))
    print("connected", flush=True)
except Exception as e:
    print(f"{type(e).__name__} after {time.monotonic() - t0:.1f} s", flush=True)
"""
GIVE_UP = 60


def listen(mode: str) -> int:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    sock.listen()
    held = []

    def serve() -> None:
        while True:
            conn, _ = sock.accept()
            if mode == "reset":  # linger 0: close sends RST
                conn.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, (1).to_bytes(4, "little") + bytes(4))
                conn.close()
            else:
                held.append(conn)  # accepted, never answered

    threading.Thread(target=serve, daemon=True).start()
    return sock.getsockname()[1]


def main() -> None:
    import torch

    print(f"torch {torch.__version__}")
    for mode in ("reset", "silent"):
        port = listen(mode)
        for timeout in (2, 6):
            t0 = time.monotonic()
            try:
                out = subprocess.run([sys.executable, "-c", CHILD, str(port), str(timeout)], capture_output=True,
                                     text=True, timeout=GIVE_UP).stdout.strip()
            except subprocess.TimeoutExpired:
                out = f"still connecting after {GIVE_UP} s (stopped)"
            print(f"listener that {'resets' if mode == 'reset' else 'never answers'}, client timeout {timeout} s: "
                  f"{out}; {time.monotonic() - t0:.1f} s in all")


if __name__ == "__main__":
    main()
