"""Where the bytes come from and go to: sources (synthetic, safetensors, shard directories, DCP with a
restricted unpickler), sinks (one safetensors file per destination rank, manifest written last and atomically),
check (`reshard check`), files (atomic writes)."""
