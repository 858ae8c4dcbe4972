"""Where the bytes come from and go to: sources (synthetic, safetensors, shard directories, DCP with a
restricted unpickler, Megatron torch_dist), sinks (one safetensors file per destination rank, manifest written
last and atomically), mapped (rank files and checkpoints as raw-bits numpy views), check (`reshard check`)."""
