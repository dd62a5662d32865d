"""The tensor table of a GGUF file, read without decoding its metadata.

`gguf.GGUFReader` decodes every metadata value, SmolLM2's 49,152 tokens and 48,900 merges among
them, which takes seconds; `read_gguf_tensors` skips those values and lists the same tensors in
tens of milliseconds. Notebook 01 reads SmolLM2's weights through it.
"""

from __future__ import annotations

import struct
from pathlib import Path

import numpy as np

from decodelab.model.gguf_import import GGUFError

# GGUF metadata value types (gguf.GGUFValueType): the size of each scalar, and the two others.
_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
_ITEM_DTYPES = {
    "F32": np.float32,
    "F16": np.float16,
    "F64": np.float64,
    "I8": np.int8,
    "I16": np.int16,
    "I32": np.int32,
    "I64": np.int64,
}


def read_gguf_tensors(path: str | Path) -> list:
    """A GGUF file's tensors, as `gguf.GGUFReader(path).tensors` lists them, without its metadata.

    Each is a `gguf.ReaderTensor` (``field`` is None): ``name``, ``tensor_type``, ``shape`` (dims
    innermost first), ``data`` (read-only, mapped from the file: a float array of the reversed
    shape, or for a quantized type its raw bytes, one row of blocks per innermost row). The
    metadata values are skipped, not decoded: tens of milliseconds instead of seconds.
    """
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType, ReaderTensor
    from gguf.quants import quant_shape_to_byte_shape

    data = np.memmap(path, mode="r")
    buffer, offset = memoryview(data), 0

    def take(fmt: str) -> tuple:
        nonlocal offset
        values = struct.unpack_from("<" + fmt, buffer, offset)
        offset += struct.calcsize("<" + fmt)
        return values

    def read_string() -> str:
        nonlocal offset
        (length,) = take("Q")
        offset += length
        return bytes(buffer[offset - length : offset]).decode()

    def skip_value(kind: int) -> None:
        nonlocal offset
        if kind == _STRING:
            (length,) = take("Q")  # (not `offset += take(...)`: that adds to the offset read before take)
            offset += length
        elif kind == _ARRAY:
            item_kind, count = take("IQ")
            if item_kind in _SCALAR_BYTES:
                offset += count * _SCALAR_BYTES[item_kind]
            elif item_kind == _STRING:  # a vocabulary: ~50,000 strings, so the loop is kept tight
                length_at = struct.Struct("<Q").unpack_from
                for _ in range(count):
                    offset += 8 + length_at(buffer, offset)[0]
            else:
                for _ in range(count):
                    skip_value(item_kind)
        else:
            offset += _SCALAR_BYTES[kind]

    try:
        magic, version, tensor_count, kv_count = take("4sIQQ")
        if magic != b"GGUF" or version not in (2, 3):
            raise GGUFError(f"{path} is not a little-endian GGUF file of version 2 or 3")
        alignment = 32
        for _ in range(kv_count):
            key = read_string()
            (kind,) = take("I")
            if key == "general.alignment":
                (alignment,) = take("I")
            else:
                skip_value(kind)
        infos = []
        for _ in range(tensor_count):
            name = read_string()
            (n_dims,) = take("I")
            dims = take(f"{n_dims}Q")
            infos.append((name, dims, *take("IQ")))
    except struct.error as exc:
        raise GGUFError(f"{path} ends inside its GGUF header: {exc}") from None
    start = -(-offset // alignment) * alignment  # the tensor data begins at the next aligned offset
    tensors = []
    for name, dims, kind, relative in infos:
        tensor_type = GGMLQuantizationType(kind)
        block_size, type_size = GGML_QUANT_SIZES[tensor_type]
        n_elements = int(np.prod(dims))
        n_bytes = n_elements * type_size // block_size
        shape = tuple(reversed(dims))
        at = start + relative
        if at + n_bytes > len(data):
            raise GGUFError(f"{path}: tensor {name!r} ends beyond the end of the file")
        item = _ITEM_DTYPES.get(tensor_type.name)
        if item is None:
            array = data[at : at + n_bytes].reshape(quant_shape_to_byte_shape(shape, tensor_type))
        else:
            array = data[at : at + n_bytes].view(item).reshape(shape)
        tensors.append(
            ReaderTensor(
                name=name,
                tensor_type=tensor_type,
                shape=np.array(dims, dtype=np.uint64),
                n_elements=n_elements,
                n_bytes=n_bytes,
                data_offset=at,
                data=array,
                field=None,
            )
        )
    return tensors


__all__ = ["read_gguf_tensors"]
