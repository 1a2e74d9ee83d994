"""Reading a GGUF file's header: metadata and tensor infos, checked against the file's size."""

from __future__ import annotations

import mmap
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ...errors import ModelError
from .quants import BLOCKS

__all__ = ["GGML_TYPES", "SUPPORTED_TYPES", "TensorInfo", "read_header"]

GGUF_MAGIC = b"GGUF"

GGML_TYPES = {
    0: "F32",
    1: "F16",
    2: "Q4_0",
    3: "Q4_1",
    6: "Q5_0",
    7: "Q5_1",
    8: "Q8_0",
    9: "Q8_1",
    10: "Q2_K",
    11: "Q3_K",
    12: "Q4_K",
    13: "Q5_K",
    14: "Q6_K",
    15: "Q8_K",
    16: "IQ2_XXS",
    17: "IQ2_XS",
    18: "IQ3_XXS",
    19: "IQ1_S",
    20: "IQ4_NL",
    21: "IQ3_S",
    22: "IQ2_S",
    23: "IQ4_XS",
    24: "I8",
    25: "I16",
    26: "I32",
    27: "I64",
    28: "F64",
    29: "IQ1_M",
    30: "BF16",
    34: "TQ1_0",
    35: "TQ2_0",
    39: "MXFP4",
}
# Types the converter reads (quants.py): (weights per block, bytes per block).
SUPPORTED_TYPES = BLOCKS

# GGUF metadata value types: struct format of the scalar ones.
_SCALAR_FORMATS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: numpy-order shape, GGML type and where its data starts in the file (absolute offset)."""

    name: str
    shape: tuple[int, ...]
    ggml_type: int
    offset: int


class _Truncated(Exception):
    pass


class _HeaderReader:
    """Sequential little-endian reader over a memory-mapped GGUF file."""

    def __init__(self, buf: mmap.mmap) -> None:
        self.buf = buf
        self.pos = 0

    def unpack(self, fmt: str) -> Any:
        size = struct.calcsize("<" + fmt)
        if self.pos + size > len(self.buf):
            raise _Truncated
        (value,) = struct.unpack_from("<" + fmt, self.buf, self.pos)
        self.pos += size
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        if self.pos + n > len(self.buf):
            raise _Truncated
        data = self.buf[self.pos : self.pos + n]
        self.pos += n
        return data.decode("utf-8", "replace")

    def value(self, vtype: int) -> Any:
        if vtype == _STRING:
            return self.string()
        if vtype == _ARRAY:
            etype, count = self.unpack("I"), self.unpack("Q")
            if etype == _STRING:
                return [self.string() for _ in range(count)]
            if etype not in _SCALAR_FORMATS:
                raise ValueError(f"unknown metadata array type {etype}")
            fmt = f"<{count}{_SCALAR_FORMATS[etype]}"
            size = struct.calcsize(fmt)
            if self.pos + size > len(self.buf):
                raise _Truncated
            values = list(struct.unpack_from(fmt, self.buf, self.pos))
            self.pos += size
            return values
        if vtype not in _SCALAR_FORMATS:
            raise ValueError(f"unknown metadata value type {vtype}")
        return self.unpack(_SCALAR_FORMATS[vtype])


def read_header(path: Path) -> tuple[dict[str, Any], list[TensorInfo]]:
    """Parse metadata and tensor infos, checking every tensor's data lies inside the file."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < 24:
                raise ModelError(f"cannot read GGUF file {path}: file is truncated or empty")
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as buf:
                return _parse_header(path, buf, size)
    except OSError as e:
        raise ModelError(f"cannot read GGUF file {path}: {e.strerror or e}") from None


def _parse_header(path: Path, buf: mmap.mmap, size: int) -> tuple[dict[str, Any], list[TensorInfo]]:
    if buf[:4] != GGUF_MAGIC:
        raise ModelError(f"cannot read GGUF file {path}: not a GGUF file (bad magic)")
    r = _HeaderReader(buf)
    r.pos = 4
    try:
        version = r.unpack("I")
        if version not in (2, 3):
            raise ModelError(f"cannot read GGUF file {path}: unsupported GGUF version {version}")
        n_tensors, n_kv = r.unpack("Q"), r.unpack("Q")
        metadata: dict[str, Any] = {}
        for _ in range(n_kv):
            key = r.string()
            metadata[key] = r.value(r.unpack("I"))
        tensors = []
        for _ in range(n_tensors):
            name = r.string()
            n_dims = r.unpack("I")
            if n_dims > 8:
                raise ValueError(f"tensor {name} has {n_dims} dimensions")
            dims = tuple(r.unpack("Q") for _ in range(n_dims))
            ggml_type, offset = r.unpack("I"), r.unpack("Q")
            # GGUF lists dimensions innermost first; numpy/MLX order is the reverse.
            tensors.append(TensorInfo(name, dims[::-1], ggml_type, offset))
    except _Truncated:
        raise ModelError(
            f"cannot read GGUF file {path}: header extends past the end of the file "
            "(truncated or corrupt download?)"
        ) from None
    except (ValueError, struct.error, MemoryError) as e:
        raise ModelError(f"cannot read GGUF file {path}: corrupt header ({e})") from None

    alignment = metadata.get("general.alignment", 32)
    if not isinstance(alignment, int) or alignment <= 0:
        alignment = 32
    data_start = -(-r.pos // alignment) * alignment
    tensors = [TensorInfo(t.name, t.shape, t.ggml_type, data_start + t.offset) for t in tensors]
    for t in tensors:
        if t.ggml_type not in SUPPORTED_TYPES:
            continue  # reported by the caller, which knows what is supported
        block, block_bytes = SUPPORTED_TYPES[t.ggml_type]
        n = 1
        for d in t.shape:
            n *= d
        if t.offset + n // block * block_bytes > size:
            raise ModelError(
                f"cannot read GGUF file {path}: tensor {t.name} extends past the end of the file "
                "(truncated or corrupt download?)"
            )
    return metadata, tensors
