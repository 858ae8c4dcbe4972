"""What a worker hands the command line: typed results instead of dicts with agreed private keys.

`RunReport` is what rank 0 of `reshard run` returns (the table to print, the `--json` twin, whether
verification failed). Light on purpose (no torch): the CLI imports it before any worker runs.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass
class RunReport:
    text: str  # the table rank 0 prints
    doc: dict[str, Any]  # the JSON twin (--json), exactly what users read
    failed: bool = False  # verification failed: printed and written, then exit 1

    @classmethod
    def of(cls, result: "RunReport | dict") -> "RunReport":
        """A report from what a worker returned: a RunReport, or a dict carrying `_text` (and `_failed`), as an
        engine integration written before this type returns (its other keys are the JSON twin)."""
        if isinstance(result, RunReport):
            return result
        doc = dict(result)
        text = doc.pop("_text")
        failed = bool(doc.pop("_failed", False))
        return cls(text, doc, failed)
