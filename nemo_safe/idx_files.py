"""Cheap validity check of IDX files (MNIST and family) without reading the data.

An IDX file is a 4-byte magic (two zero bytes, a type code, the number of
dimensions), one big-endian uint32 per dimension, then the items. A file whose
size is not exactly header + product(dims) x item size was truncated (or is
empty), and torchvision would crash loading it; it gets rebuilt instead.
"""

from __future__ import annotations

import math
import os
import struct

#: IDX type code -> item size in bytes (uint8, int8, int16, int32, float32, float64).
ITEM_SIZE = {0x08: 1, 0x09: 1, 0x0B: 2, 0x0C: 4, 0x0D: 4, 0x0E: 8}


def problem(path: str | os.PathLike[str]) -> str | None:
    """None when ``path`` is a complete IDX file, else what is wrong with it."""
    try:
        with open(path, "rb") as fh:
            magic = fh.read(4)
            if len(magic) < 4:
                return f"{len(magic)} bytes, shorter than the IDX magic"
            zero, type_code, ndim = struct.unpack(">HBB", magic)
            if zero != 0 or type_code not in ITEM_SIZE or not 1 <= ndim <= 4:
                return f"not an IDX file (magic {magic.hex()})"
            raw_dims = fh.read(4 * ndim)
            if len(raw_dims) < 4 * ndim:
                return "truncated inside the IDX header"
            size = os.fstat(fh.fileno()).st_size
    except FileNotFoundError:
        return "missing"
    dims = struct.unpack(f">{ndim}I", raw_dims)
    expected = 4 + 4 * ndim + math.prod(dims) * ITEM_SIZE[type_code]
    if size != expected:
        return f"{size} bytes, but its header {list(dims)} needs {expected}"
    return None
