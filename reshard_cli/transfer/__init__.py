"""Executing a plan over torch.distributed.

comm (the default group or a refit group of its own; its data plane and watchdog-guarded waits) · rendezvous
(a refit group's store: joining, checking in, aborting, releasing a broken group) · agree (every rank raises the same one-line error) ·
launcher (one way to start or join a torchrun job; a stage's errors gathered from every rank into one line) ·
shards (local shards; sentinel-filled destination buffers) · engine (runs a rank's schedule) · linktest (the
plan's traffic as raw send/recv) · verify (each destination shard's checksum against the sources') ·
pipeline (the steps `run`, `bench` and `Refit` share: plan, shards, engine, link limit, timed rounds, exact
expected values) · run (`reshard run`'s worker) · results (what a worker hands the CLI) · live (`Refit`, the
API for running trainer and inference processes) · versions (the weight version that says what a destination
holds after a failed update) · dryrun (torchrun command lines and the rank map, without torch).
"""
