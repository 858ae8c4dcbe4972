"""Pure planning: no torch.distributed, the same result on every rank by construction.

geometry (boxes with DTensor's exact shard semantics, tested against torch's own
`_compute_local_shape_and_global_offset`) → planner (`Plan`: intersections → pieces with a local rotation
rule for the sending replica, gather→broadcast, statistics) → schedule (which bytes travel in which message,
in a deadlock-free global order; broadcast packs) → cost (predicted seconds and the network lower bound).
"""
