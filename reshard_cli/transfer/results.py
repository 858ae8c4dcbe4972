"""What a worker hands the command line: typed results instead of dicts with agreed private keys.

`RunReport` is what rank 0 of `reshard run` returns (the table to print, the `--json` twin, whether
verification failed); `reshard run` into a running engine (`engines.vllm.push`) returns the same type.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RunReport:
    text: str  # the table rank 0 prints
    doc: dict[str, Any]  # the JSON twin (--json), exactly what users read
    failed: bool = False  # verification failed: printed and written, then exit 1
