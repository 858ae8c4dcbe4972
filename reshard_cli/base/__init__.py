"""The bottom layer: helpers every other layer may use, importing nothing of reshard's but `errors`.

geometry (boxes, DTensor-exact shard boxes), checksums and rowsum (the position-aware checksum, in torch and in
numpy), fragments (a source box kept in several places), files (atomic writes), ports (free TCP ports), text
(tables, byte figures, JSON written atomically).
"""
