"""The machine: NVML discovery of GPUs, NVLink domains and fabric cliques (every call wrapped: NotSupported
is normal), and bandwidth probes for `reshard topo --bandwidth`."""
