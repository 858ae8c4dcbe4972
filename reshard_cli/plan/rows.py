"""The cost model's tables (`plan.cost`): the entries of some tensor classes as flat numpy arrays of pair keys
and elements, and the forwards of their split intersections, which the model scales by its tensors' bytes
and sums per pair of ranks. Nothing here imports numpy until a table is built."""
from __future__ import annotations

from reshard_cli.plan.terms import Traffic


def numpy_():
    """numpy, imported on first use: planning without link figures never needs it."""
    import numpy

    return numpy


# the per-entry columns of a class (`classes.Columns`) that `Table` concatenates over classes
_CONCAT = ("fixed_src", "fixed_dst", "fixed_numel", "fixed_kind", "rotating_sid", "rotating_dst", "rotating_numel",
           "rotating_key", "rotating_kind", "senders")


class Table:
    """The entries of some tensor classes (with forwarding, or direct) as flat arrays: what the model sums.

    Per class position `pos`: fixed rows (one possible sender) fixed_start[pos] .. + fixed_count[pos], rotating
    rows rot_start[pos] .. + rot_count[pos], forward rows fwd_start[pos] .. + fwd_count[pos]. A fixed or forward
    row is a pair key (kind * world + sender) * world + receiver and its elements; a rotating row is its pair key
    without the sender (kind * world * world + receiver), its senders' row in `sender_table`, its rotation key,
    its number of senders L and its elements: tensor t's copy goes from sender_table[row, (t + key) % L]. A
    phase-0 entry's senders are all inside the receiver's domain or all outside it, so its kind (network or
    NVLink) does not depend on which one sends. A row's elements are what `count` counts of its piece
    (`TensorClass.columns`; None: its elements).
    """

    def __init__(self, classes: list, direct: bool, world: int, count: str | None = None):
        np = numpy_()
        cat: dict[str, list] = {f: [] for f in _CONCAT}  # every class's columns, one after another
        fixed_start, fixed_count, rot_start, rot_count, senders_base = [], [], [], [], []
        blocks_by_k: dict[int, tuple] = {}  # forward blocks by domain size k: (class positions, G rows, m rows)
        for pos, c in enumerate(classes):
            col = c.columns(direct, count)
            for group, parts in col.blocks:
                acc = blocks_by_k.get(len(group))
                if acc is None:
                    acc = blocks_by_k[len(group)] = ([], [], [])
                acc[0].append(pos)
                acc[1].append(group)
                acc[2].append(parts)
            fixed_start.append(len(cat["fixed_src"]))
            rot_start.append(len(cat["rotating_sid"]))
            senders_base.append(len(cat["senders"]))
            fixed_count.append(len(col.fixed_src))
            rot_count.append(len(col.rotating_sid))
            for f, xs in cat.items():
                xs += getattr(col, f)
        i64, f64 = np.int64, np.float64
        self.world = world
        self.fixed_start, self.fixed_count, self.rot_start, self.rot_count = (
            np.array(x, dtype=i64) for x in (fixed_start, fixed_count, rot_start, rot_count))
        self.fixed_pair = pair_key(np.array(cat["fixed_kind"], dtype=i64), np.array(cat["fixed_src"], dtype=i64),
                                   np.array(cat["fixed_dst"], dtype=i64), world)
        self.fixed_numel = np.array(cat["fixed_numel"], dtype=f64)
        self.rot_pair = pair_key(np.array(cat["rotating_kind"], dtype=i64), 0,
                                 np.array(cat["rotating_dst"], dtype=i64), world)
        # a rotating row's senders: its class's first senders row + its position among the class's
        self.rot_senders_row = (np.array(cat["rotating_sid"], dtype=i64)
                                + np.repeat(np.array(senders_base, dtype=i64), self.rot_count))
        self.rot_key = np.array(cat["rotating_key"], dtype=i64)
        self.rot_numel = np.array(cat["rotating_numel"], dtype=f64)
        self.sender_table, nsenders = sender_table(cat["senders"])
        self.rot_nsenders = nsenders[self.rot_senders_row] if len(self.rot_senders_row) else np.zeros(0, dtype=i64)
        self.fwd_pair, self.fwd_numel, self.fwd_start, self.fwd_count = forward_rows(blocks_by_k, len(classes),
                                                                                    world)

    def rows(self, pos, gid, total, rpos, rgid, residue, weights) -> tuple:
        """Pair keys, bytes and group id of every row of some tensors: per (class position `pos`, group `gid`),
        `total` Σ item bytes of its tensors (for the fixed and forward rows); per (class position `rpos`, group
        `rgid`, rotation residue `residue`), `weights` Σ item bytes of its tensors at that residue (for the
        rotating rows)."""
        np = numpy_()
        keys, vals, gids = [], [], []
        for start, count, pair, numel in ((self.fixed_start, self.fixed_count, self.fixed_pair, self.fixed_numel),
                                          (self.fwd_start, self.fwd_count, self.fwd_pair, self.fwd_numel)):
            cnt = count[pos]
            idx = ranges(start[pos], cnt)
            keys.append(pair[idx])
            vals.append(numel[idx] * np.repeat(total, cnt))
            gids.append(np.repeat(gid, cnt))
        cnt = self.rot_count[rpos]
        if cnt.sum():
            idx = ranges(self.rot_start[rpos], cnt)
            pick = (np.repeat(residue, cnt) + self.rot_key[idx]) % self.rot_nsenders[idx]
            sender = self.sender_table[self.rot_senders_row[idx], pick]
            keys.append(self.rot_pair[idx] + sender * self.world)
            vals.append(self.rot_numel[idx] * np.repeat(weights, cnt))
            gids.append(np.repeat(rgid, cnt))
        return np.concatenate(keys), np.concatenate(vals), np.concatenate(gids)


def pair_key(kind, sender, receiver, world: int):
    """(kind * world + sender) * world + receiver: one (kind, sender, receiver) as one integer."""
    return (kind * world + sender) * world + receiver


def sender_table(senders: list) -> tuple:
    """(the sender tuples as rows of a zero-padded array, each row's length)."""
    np = numpy_()
    lens = np.array([len(x) for x in senders] or [1], dtype=np.int64)
    table = np.zeros((max(len(senders), 1), int(lens.max())), dtype=np.int64)
    for j, x in enumerate(senders):
        table[j, :len(x)] = x
    return table, lens


def forward_rows(blocks_by_k: dict, nclasses: int, world: int) -> tuple:
    """The forwards of some blocks (see `classes.Columns`): G[j] -> G[g] (g != j) carries m_j, expanded per block
    and sorted by class position: (pair keys, elements, first row per class, rows per class)."""
    np = numpy_()
    i64, f64 = np.int64, np.float64
    keys, vals, owner = [np.zeros(0, dtype=i64)], [np.zeros(0, dtype=f64)], [np.zeros(0, dtype=i64)]
    for k, (positions, groups, parts) in blocks_by_k.items():
        group = np.array(groups, dtype=i64)  # blocks x k
        numel = np.array(parts, dtype=f64)
        pair = pair_key(int(Traffic.FWD), group[:, :, None], group[:, None, :], world)  # blocks x j x g
        elems = np.broadcast_to(numel[:, :, None], pair.shape)
        keep = (~np.eye(k, dtype=bool))[None, :, :] & (elems > 0)
        keys.append(pair[keep])
        vals.append(elems[keep])
        owner.append(np.repeat(np.array(positions, dtype=i64), keep.reshape(len(groups), -1).sum(axis=1)))
    owners = np.concatenate(owner)
    order = np.argsort(owners, kind="stable")
    count = np.bincount(owners, minlength=nclasses).astype(i64)
    return np.concatenate(keys)[order], np.concatenate(vals)[order], np.cumsum(count) - count, count


def ranges(starts, counts):
    """Concatenated aranges starts[i] .. starts[i] + counts[i]."""
    np = numpy_()
    total = int(counts.sum())
    if not total:
        return np.zeros(0, dtype=np.int64)
    offsets = np.cumsum(counts) - counts
    return np.repeat(starts - offsets, counts) + np.arange(total, dtype=np.int64)
