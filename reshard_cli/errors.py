"""Typed errors. The CLI turns each into one line on stderr and the error's exit code.

User mistakes (bad YAML, mismatched models, missing files) exit 2 and say where: `file:line: key: message`,
with a did-you-mean for an unknown key (`layouts/yamlio.py`); failures while running (a dead rank, a wrong byte)
exit 1 and name the rank. In a multi-rank run every rank's error is gathered into that one line
(`transfer/launcher.py`), so a 256-rank failure never becomes 256 tracebacks.
"""
from __future__ import annotations


class ReshardError(Exception):
    """Base class: `str(err)` is the one line the user sees."""

    exit_code = 1
    quiet = False  # True when another process already printed this error (multi-rank runs)


class ConfigError(ReshardError):
    """Something the user wrote is wrong. Name the file and the key in the message."""

    exit_code = 2

    def __init__(self, message: str, *, file: str | None = None, key: str | None = None, line: int | None = None):
        where = ""
        if file:
            where = str(file)
            if line is not None:
                where += f":{line}"
            if key:
                where += f": {key}"
            where += ": "
        elif key:
            where = f"{key}: "
        super().__init__(where + message)
        self.file, self.key, self.line = file, key, line


class RuntimeFailure(ReshardError):
    """A failure while moving or checking data (a rank died, a checksum differs)."""

    exit_code = 1
