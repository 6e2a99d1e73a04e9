"""Read a GGUF file's metadata and tensors quickly, then dequantize with the ``gguf`` package.

``gguf.GGUFReader`` builds a numpy memmap view for every value it parses; on a file with a
49k-token vocabulary and 49k merges that takes seconds, at every engine start. The format's
header is simple (GGUF v2/v3: key/values, then tensor infos, then aligned data), so this module
walks it with ``struct`` over the bytes and hands each tensor's raw bytes to
``gguf.quants.dequantize``, which does the real work. Array values other than short numeric
ones are skipped (the tokenizer comes from transformers, not from here).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, GGUFValueType
from gguf.quants import dequantize

GGUF_MAGIC = b"GGUF"
_SCALARS = {
    GGUFValueType.UINT8: "<B", GGUFValueType.INT8: "<b", GGUFValueType.UINT16: "<H",
    GGUFValueType.INT16: "<h", GGUFValueType.UINT32: "<I", GGUFValueType.INT32: "<i",
    GGUFValueType.FLOAT32: "<f", GGUFValueType.BOOL: "<?", GGUFValueType.UINT64: "<Q",
    GGUFValueType.INT64: "<q", GGUFValueType.FLOAT64: "<d",
}  # fmt: skip
_MAX_KEPT_ARRAY = 64  # longer arrays (vocabularies, merges) are skipped, not decoded


@dataclass(frozen=True)
class TensorInfo:
    """One tensor of the file: name, shape in numpy order (rows first), type, byte range."""

    name: str
    shape: tuple[int, ...]
    qtype: GGMLQuantizationType
    offset: int  # absolute, in the file
    nbytes: int


class GGUFFile:
    """A GGUF file's key/values (``metadata``) and tensor table (``tensors``), little-endian."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._data = np.memmap(self.path, mode="r")
        self._buf = memoryview(self._data)  # type: ignore[arg-type]
        if len(self._data) < 24 or bytes(self._buf[:4]) != GGUF_MAGIC:
            raise ValueError(f"'{self.path}' is not a GGUF file (bad magic)")
        version, num_tensors, num_kv = struct.unpack_from("<IQQ", self._buf, 4)
        if version not in (2, 3):
            raise ValueError(f"'{self.path}': GGUF version {version} is not supported (2, 3)")
        self._pos = 24
        self.metadata: dict[str, Any] = {}
        try:
            for _ in range(num_kv):
                key = self._string()
                (vtype,) = self._unpack("<I")
                self.metadata[key] = self._value(GGUFValueType(vtype))
            infos = [self._tensor_info() for _ in range(num_tensors)]
        except (struct.error, ValueError) as exc:
            raise ValueError(f"'{self.path}' is truncated or corrupt: {exc}") from exc
        align = int(self.metadata.get("general.alignment", 32))
        data_start = -(-self._pos // align) * align
        self.tensors: dict[str, TensorInfo] = {}
        for name, dims, qtype, rel in infos:
            block, type_size = GGML_QUANT_SIZES[qtype]
            count = int(np.prod(dims)) if dims else 1
            self.tensors[name] = TensorInfo(
                name, tuple(reversed(dims)), qtype, data_start + rel, count // block * type_size
            )

    def _unpack(self, fmt: str) -> tuple[Any, ...]:
        values = struct.unpack_from(fmt, self._buf, self._pos)
        self._pos += struct.calcsize(fmt)
        return values

    def _string(self) -> str:
        (length,) = self._unpack("<Q")
        text = bytes(self._buf[self._pos : self._pos + length]).decode("utf-8", errors="replace")
        self._pos += length
        return text

    def _value(self, vtype: GGUFValueType) -> Any:
        if vtype == GGUFValueType.STRING:
            return self._string()
        if vtype in _SCALARS:
            return self._unpack(_SCALARS[vtype])[0]
        if vtype == GGUFValueType.ARRAY:
            item_type, length = self._unpack("<IQ")
            item = GGUFValueType(item_type)
            if item in _SCALARS and length > _MAX_KEPT_ARRAY:  # skip in one jump
                self._pos += length * struct.calcsize(_SCALARS[item])
                return None
            items = [self._value(item) for _ in range(length)]
            return items if length <= _MAX_KEPT_ARRAY else None
        raise ValueError(f"'{self.path}': unknown GGUF value type {vtype}")

    def _tensor_info(self) -> tuple[str, list[int], GGMLQuantizationType, int]:
        name = self._string()
        (num_dims,) = self._unpack("<I")
        dims = list(self._unpack(f"<{num_dims}Q"))
        qtype, offset = self._unpack("<IQ")
        return name, dims, GGMLQuantizationType(qtype), offset

    def load(self, name: str) -> np.ndarray:
        """Tensor ``name`` dequantized to float32, in numpy order (e.g. [out, in])."""
        info = self.tensors[name]
        raw = self._data[info.offset : info.offset + info.nbytes]
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        array = dequantize(np.asarray(raw).reshape(rows, -1), info.qtype)
        return np.array(array, dtype=np.float32).reshape(info.shape)

    def raw(self, name: str) -> np.ndarray:
        """Tensor ``name``'s stored bytes, one row per output row: ``[rows, bytes per row]``."""
        info = self.tensors[name]
        rows = int(np.prod(info.shape[:-1])) if len(info.shape) > 1 else 1
        return np.asarray(self._data[info.offset : info.offset + info.nbytes]).reshape(rows, -1)

    def iter_tensors(self) -> Iterator[tuple[str, np.ndarray]]:
        for name in self.tensors:
            yield name, self.load(name)
