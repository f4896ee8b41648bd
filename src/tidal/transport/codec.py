"""msgpack with numpy arrays as typed binary extensions. Never pickle."""

from __future__ import annotations

import msgpack
import numpy as np

_NDARRAY = 1


def _default(obj):
    if isinstance(obj, np.ndarray):
        header = msgpack.packb([obj.dtype.str, list(obj.shape)])
        return msgpack.ExtType(_NDARRAY, header + np.ascontiguousarray(obj).tobytes())
    if isinstance(obj, np.generic):
        return obj.item()
    raise TypeError(f"cannot encode {type(obj).__name__} (only msgpack types and numpy arrays cross processes)")


def _ext_hook(code: int, data: bytes):
    if code != _NDARRAY:
        return msgpack.ExtType(code, data)
    unpacker = msgpack.Unpacker()
    unpacker.feed(data)
    dtype, shape = next(unpacker)
    offset = unpacker.tell()
    return np.frombuffer(data, dtype=np.dtype(dtype), offset=offset).reshape(shape)


def encode(obj) -> bytes:
    return msgpack.packb(obj, default=_default, use_bin_type=True)


def decode(data: bytes):
    return msgpack.unpackb(data, ext_hook=_ext_hook, raw=False, strict_map_key=False)
