"""reshard inside vLLM: the `reshard` weight-transfer backend (worker and trainer engines) and `reshard run`
pushing into a running `vllm serve`."""
