"""Zero-copy reads of safetensors files: the file mapped into memory, tensors as views of the mapping.

`array(name)` gives a stored tensor's raw bits as a numpy array (int16 for bf16, int32 for float32, ...: see
`rowsum.bits_dtype`), which is what `reshard check` compares and checksums, without torch; `tensor(name)` gives
the same bytes as a torch tensor of the stored dtype.

The header is parsed by our restricted parser (`read_safetensors_header`: JSON only, every entry's dtype known
and its bytes inside the file), never by pickle; the data is never copied: a tensor is a view of the mapped
bytes, and the kernel maps page-cache pages as they are touched. The mapping is private (copy-on-write), so an
accidental in-place write changes this process's copy of one page, never the file.
"""
from __future__ import annotations

import mmap
from pathlib import Path

import numpy as np

from reshard_cli.errors import ConfigError
from reshard_cli.layouts.models import _SAFETENSORS_DTYPES, DTYPE_SIZES, read_safetensors_header
from reshard_cli.base.rowsum import bits_dtype


class MappedSafetensors:
    """One safetensors file, mapped. `tensor(name)` is a zero-copy view of a whole stored tensor.

    ConfigError (naming the file) when the header is corrupt or the file is shorter than the header says.
    Close it (or use it as a context manager) when done; views still alive keep the mapping until they die.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.header, self.start = read_safetensors_header(self.path)
        end = self.start + max((e["data_offsets"][1] for e in self.header.values()), default=0)
        with open(self.path, "rb") as fh:
            self._mm = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_COPY)
        if len(self._mm) < end:  # changed since the header was read
            self._mm.close()
            raise ConfigError(f"truncated safetensors file: {len(self._mm)} bytes, the header needs {end}",
                              file=str(self.path))
        self._bytes: np.ndarray | None = np.frombuffer(self._mm, dtype=np.uint8)

    def dtype(self, name: str) -> str | None:
        """The stored dtype of `name` as a torch dtype name ("bfloat16"), None when the file has no such tensor."""
        e = self.header.get(name)
        return None if e is None else _SAFETENSORS_DTYPES[e["dtype"]]

    def array(self, name: str) -> np.ndarray | None:
        """The stored tensor `name` (its header's shape) as a view of the mapping holding each element's raw bits
        as a signed integer of the element's size; None when the file has no such tensor. Any alignment."""
        e = self.header.get(name)
        if e is None or self._bytes is None:
            return None
        b0, b1 = e["data_offsets"]
        return self._bytes[self.start + b0:self.start + b1].view(
            bits_dtype(DTYPE_SIZES[_SAFETENSORS_DTYPES[e["dtype"]]])).reshape(e["shape"])

    def tensor(self, name: str):
        """The stored tensor `name` (its header's shape and dtype) as a torch view of the mapping; None when the
        file has no such tensor or its bytes are not aligned to its element size (callers then read a copy)."""
        import torch

        a = self.array(name)
        if a is None:
            return None
        dtype = getattr(torch, _SAFETENSORS_DTYPES[self.header[name]["dtype"]])
        if a.size == 0:
            return torch.empty(a.shape, dtype=dtype)
        if (self.start + self.header[name]["data_offsets"][0]) % dtype.itemsize:
            return None
        return torch.from_numpy(a).view(dtype)

    def close(self) -> None:
        self._bytes = None
        mm, self._mm = self._mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # views are still alive: the mapping goes when they do
                pass

    def __enter__(self) -> "MappedSafetensors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


__all__ = ["MappedSafetensors"]
