"""Executing a plan over torch.distributed.

launcher (one way to start or join a torchrun job; errors gathered from every rank into one line) ·
shards (local shards; sentinel-filled destination buffers) · engine (runs a rank's schedule) · verify
(position-aware checksums, exact comparison) · linktest (the plan's traffic as raw send/recv) · run
(`reshard run`'s worker, step by step) · live (`Refit`, the API for running trainer and inference processes)
· dryrun (torchrun command lines and the rank map, without torch).
"""
