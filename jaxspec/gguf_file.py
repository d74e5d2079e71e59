"""The header of a GGUF file read in one pass: metadata as Python values, tensors mapped from the file.

`gguf.GGUFReader` builds a numpy view for every element of every metadata array, one at a time: opening
SmolLM2-135M (a 49,152-token vocabulary and its merges) takes about 7 s and Gemma-3-270M (262,144 tokens) about 22 s
on the 2-core development machine, before any weight is read, on every `jaxspec` command. `GGUFFile` parses the same
header with `struct` and `numpy.frombuffer` (well under a second) and exposes what jaxspec reads: `metadata`,
`get`, and `tensors` with the attributes of `gguf.ReaderTensor` that `gguf.quants.dequantize` needs (`name`,
`tensor_type`, `shape`, `data`). Dequantization stays with the gguf package. Only little-endian files of GGUF
versions 2 and 3 (every file llama.cpp has written since 2023) are read; anything else raises ValueError.
"""

from __future__ import annotations

import dataclasses
import os
import struct
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

MAGIC = b"GGUF"
DEFAULT_ALIGNMENT = 32

# GGUF metadata value types: (struct format, numpy dtype) of the fixed-size ones
_SCALARS = {0: ("<B", np.uint8), 1: ("<b", np.int8), 2: ("<H", np.uint16), 3: ("<h", np.int16),
            4: ("<I", np.uint32), 5: ("<i", np.int32), 6: ("<f", np.float32), 7: ("<?", np.bool_),
            10: ("<Q", np.uint64), 11: ("<q", np.int64), 12: ("<d", np.float64)}
_STRING, _ARRAY = 8, 9

# tensor types whose data is an array of plain numbers; every other type is quantized blocks of bytes
_PLAIN_TENSORS = {GGMLQuantizationType.F16: np.float16, GGMLQuantizationType.F32: np.float32,
                  GGMLQuantizationType.F64: np.float64, GGMLQuantizationType.I8: np.int8,
                  GGMLQuantizationType.I16: np.int16, GGMLQuantizationType.I32: np.int32,
                  GGMLQuantizationType.I64: np.int64}


@dataclasses.dataclass(frozen=True)
class GGUFTensor:
    """One tensor of a GGUF file. shape: GGUF's dimension order (innermost first, the reverse of numpy's);
    data: a read-only view of the file, shaped as `gguf.GGUFReader` shapes it (numpy order; quantized types as
    uint8 rows of blocks), the input of `gguf.quants.dequantize(data, tensor_type)`."""

    name: str
    tensor_type: GGMLQuantizationType
    shape: tuple[int, ...]
    data: np.ndarray


class _Cursor:
    """Reads little-endian values from a buffer, advancing an offset."""

    def __init__(self, buffer):
        self.buffer = buffer
        self.offset = 0

    def scalar(self, fmt: str):
        size = struct.calcsize(fmt)
        if self.offset + size > len(self.buffer):
            raise ValueError("the header runs past the end of the file (truncated)")
        value = struct.unpack_from(fmt, self.buffer, self.offset)[0]
        self.offset += size
        return value

    def string(self) -> str:
        n = self.scalar("<Q")
        end = self.offset + n
        if end > len(self.buffer):
            raise ValueError(f"a string of {n} bytes runs past the end of the file")
        text = bytes(self.buffer[self.offset:end]).decode("utf-8", errors="replace")
        self.offset = end
        return text

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.scalar(_SCALARS[kind][0])
        if kind == _STRING:
            return self.string()
        if kind == _ARRAY:
            item_kind, count = self.scalar("<I"), self.scalar("<Q")
            if item_kind in _SCALARS:  # numbers: one frombuffer for the whole array
                dtype = np.dtype(_SCALARS[item_kind][1]).newbyteorder("<")
                if self.offset + count * dtype.itemsize > len(self.buffer):
                    raise ValueError("an array runs past the end of the file (truncated)")
                values = np.frombuffer(self.buffer, dtype, count, self.offset)
                self.offset += count * dtype.itemsize
                return values.tolist()
            return [self.value(item_kind) for _ in range(count)]
        raise ValueError(f"unknown GGUF metadata value type {kind}")


class GGUFFile:
    """A GGUF file's metadata (`metadata`: key -> int, float, bool, str or a list of them; `get`) and tensors
    (`tensors`: GGUFTensor, data mapped from the file, read only when used). Raises ValueError for a file that is
    not GGUF, of an unsupported version, or truncated."""

    def __init__(self, path: str | os.PathLike):
        self.path = os.fspath(path)
        mapped = np.memmap(self.path, mode="r")  # uint8[file size]
        cursor = _Cursor(memoryview(mapped))
        if len(mapped) < 24 or bytes(mapped[:4]) != MAGIC:
            raise ValueError("not a GGUF file (no 'GGUF' magic at its start)")
        cursor.offset = 4
        version = cursor.scalar("<I")
        if version not in (2, 3):
            raise ValueError(f"GGUF version {version} (or a big-endian file) is not supported; versions 2 and 3 are")
        num_tensors, num_fields = cursor.scalar("<Q"), cursor.scalar("<Q")
        self.metadata: dict[str, Any] = {}
        for _ in range(num_fields):
            key = cursor.string()
            self.metadata[key] = cursor.value(cursor.scalar("<I"))
        infos = []
        for _ in range(num_tensors):
            name = cursor.string()
            dims = tuple(cursor.scalar("<Q") for _ in range(cursor.scalar("<I")))
            infos.append((name, dims, GGMLQuantizationType(cursor.scalar("<I")), cursor.scalar("<Q")))
        alignment = int(self.metadata.get("general.alignment", DEFAULT_ALIGNMENT))
        data_start = -(-cursor.offset // alignment) * alignment
        self.tensors: list[GGUFTensor] = []
        seen = set()
        for name, dims, kind, offset in infos:
            if name in seen:
                raise ValueError(f"the tensor '{name}' appears twice")
            seen.add(name)
            block_size, type_size = GGML_QUANT_SIZES[kind]
            elements = int(np.prod(dims, dtype=np.int64))
            numpy_shape = tuple(reversed(dims))
            start = data_start + offset
            if kind in _PLAIN_TENSORS:
                dtype = np.dtype(_PLAIN_TENSORS[kind])
                size = elements * dtype.itemsize
            else:  # quantized: rows of blocks, as bytes
                dtype = np.dtype(np.uint8)
                size = elements // block_size * type_size
                numpy_shape = (*numpy_shape[:-1], numpy_shape[-1] // block_size * type_size)
            if start + size > len(mapped):
                raise ValueError(f"the tensor '{name}' runs past the end of the file (truncated)")
            data = np.frombuffer(mapped, dtype, size // dtype.itemsize, start).reshape(numpy_shape)
            self.tensors.append(GGUFTensor(name=name, tensor_type=kind, shape=dims, data=data))

    def get(self, key: str, default: Any = None) -> Any:
        """The metadata value of `key`, or `default` when the file has none."""
        return self.metadata.get(key, default)
