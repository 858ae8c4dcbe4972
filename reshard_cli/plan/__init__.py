"""Pure planning: no torch.distributed, the same result on every rank by construction.

The modules import one way, each only from those before it:
terms (the shared vocabulary: `Route`, `Traffic`, `MODES`, `Piece`, `Bcast`, `ClassRoutes`, `no_gc`) →
planner (`TensorClasses`: geometry with DTensor's exact shard semantics, `base.geometry`, intersections →
pieces with a local rotation rule for the sending replica, gather→broadcast; `Plan`: the routes of a mode,
statistics, rank views) → schedule (which bytes travel in which message, in a deadlock-free global order;
broadcast packs) → cost (predicted seconds and the network lower bound; mode auto's route chooser, which hands
a plan its per-class routes: `cost.with_auto_routes`).
"""
