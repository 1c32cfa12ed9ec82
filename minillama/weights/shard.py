"""A tensor-parallel rank's slices of a checkpoint, read at their file offsets: only their bytes.

`Slices` names, for each HF tensor a rank holds only a part of, the dimension it is split on and the range
it keeps: `{"model.layers.0.mlp.down_proj.weight": (1, 512, 1024), ...}` (distributed/tp.py makes it from the
model's units). Every tensor not named is read whole (norms, embeddings).

Why reads at offsets rather than a memory map (or safetensors' own lazy slices, which read through one): a
column slice of a row-major tensor takes a few bytes of every row, so it touches every page of the tensor,
and a mapped page counts in the process's resident memory for as long as the map lives. Reading a column
slice row by row (`os.preadv` into the rows of the output) brings in the slice's bytes only. A row-split
weight (split on its input features, dimension 1) is written straight into column-major storage
(`Llama.column_major_`'s layout), a block of rows at a time, so no row-major copy of the slice exists.

One process reads through here too (weights/load.py), its column-major weights named as whole-width column
slices (`Llama.column_major_parts`): each is copied into that layout from a map of its own pages, unmapped
once copied, so neither a row-major copy nor the pages it was read from stay beside it.
"""

from __future__ import annotations

import math
import mmap
import os
from typing import BinaryIO, Callable

import torch

Slices = dict[str, tuple[int, int, int]]
Place = Callable[[torch.Tensor], torch.Tensor]  # where each tensor goes once read (its device and dtype)


def as_read(t: torch.Tensor) -> torch.Tensor:
    """The `Place` that keeps a tensor as read."""
    return t

BLOCK_BYTES = 2 << 20  # rows of a column slice read per block before they are laid out column-major (a
# transient buffer every rank holds beside its part: small, so the part dominates the peak)


def sliced_shape(shape: tuple[int, ...], cut: tuple[int, int, int] | None) -> tuple[int, ...]:
    if cut is None:
        return tuple(shape)
    dim, a, b = cut
    return tuple(b - a if d == dim else n for d, n in enumerate(shape))


def _into(f: BinaryIO, out: torch.Tensor, offset: int) -> None:
    """Fill the contiguous tensor `out` with the file's bytes at `offset`."""
    view = memoryview(out.reshape(-1).view(torch.uint8).numpy())
    got = 0
    while got < len(view):
        n = os.preadv(f.fileno(), [view[got:]], offset + got)
        if n <= 0:
            raise EOFError(f"the file ends before the tensor's {len(view)} bytes at offset {offset}")
        got += n


def read_tensor(f: BinaryIO, offset: int, shape: tuple[int, ...], dtype: torch.dtype,
                cut: tuple[int, int, int] | None = None) -> torch.Tensor:
    """A row-major tensor stored at `offset` of an open file, or its slice `cut` = (dim, start, stop) along
    dimension 0 or 1. A slice along dimension 1 of a matrix comes back column-major."""
    item = torch.empty(0, dtype=dtype).element_size()
    if cut is not None and not (cut[0] < len(shape) and 0 <= cut[1] <= cut[2] <= shape[cut[0]]):
        raise ValueError(f"a tensor of shape {tuple(shape)} has no slice {cut[1]}:{cut[2]} along dimension {cut[0]}")
    if cut is None or cut[0] == 0:
        a, b = (0, shape[0]) if cut is None else cut[1:]
        out = torch.empty(sliced_shape(shape, cut), dtype=dtype)
        row = item * (int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1)
        if out.numel():
            _into(f, out, offset + a * row)
        return out
    if len(shape) != 2 or cut[0] != 1:
        raise ValueError(f"a slice along dimension {cut[0]} of a {len(shape)}-D tensor is not supported")
    rows, cols = shape
    _, a, b = cut
    out = torch.empty(b - a, rows, dtype=dtype)  # column-major (rows, b - a), as out.t()
    if not out.numel():
        return out.t()
    if b - a == cols:  # every column (one process's column-major weight): one transposing copy from a map of
        # the tensor's pages, unmapped once copied (a map of the whole file would keep them resident)
        out.copy_(_mapped(f, offset, rows, cols, dtype).t())  # contiguous out: ATen's blocked transpose, ~20x
        return out.t()                                        # a strided one
    step = max(1, BLOCK_BYTES // ((b - a) * item))
    # the transient rows in a map of their own, unmapped whole once dropped: taken from malloc's heap between
    # the weights it kept, they left holes there (one process's peak varied by 60-110 MB from run to run)
    block = _transient(min(rows, step), b - a, dtype)
    for r0 in range(0, rows, step):
        r1 = min(rows, r0 + step)
        for r in range(r0, r1):
            _into(f, block[r - r0], offset + (r * cols + a) * item)
        out[:, r0:r1] = block[:r1 - r0].t()
    return out.t()


def _mapped(f: BinaryIO, offset: int, rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """The row-major (rows, cols) tensor at `offset` of an open file, as a private map of its pages."""
    item = dtype.itemsize
    start = offset - offset % mmap.ALLOCATIONGRANULARITY
    size = offset - start + rows * cols * item
    if offset + rows * cols * item > os.fstat(f.fileno()).st_size:  # a map past the end faults when read
        raise EOFError(f"the file ends before the tensor's {rows * cols * item} bytes at offset {offset}")
    view = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY, offset=start)
    return torch.frombuffer(view, dtype=dtype, offset=offset - start, count=rows * cols).view(rows, cols)


def _transient(rows: int, cols: int, dtype: torch.dtype) -> torch.Tensor:
    """An uninitialised (rows, cols) tensor in an anonymous map of its own, unmapped when dropped."""
    return torch.frombuffer(mmap.mmap(-1, rows * cols * dtype.itemsize), dtype=dtype).view(rows, cols)


# The safetensors library's names for the dtypes it loads into torch (FP8 included: a whole load reads them,
# and loading casts every floating tensor to the model's dtype, so a rank's parts must read them too)
SAFETENSORS_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
                      "F8_E4M3": torch.float8_e4m3fn, "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
                      "F8_E5M2": torch.float8_e5m2, "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
                      "F8_E8M0": torch.float8_e8m0fnu, "I64": torch.int64, "I32": torch.int32, "I16": torch.int16,
                      "I8": torch.int8, "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16,
                      "U8": torch.uint8, "BOOL": torch.bool}


# What reading a .safetensors file may raise for a file that is cut short or not one (the callers' one line)
CORRUPT = (OSError, ValueError, EOFError)

MAX_HEADER_BYTES = 100_000_000  # the safetensors library's own limit on the JSON header


def safetensors_index(f: BinaryIO) -> dict[str, tuple[int, tuple[int, ...], torch.dtype | str]]:
    """Each tensor of an open .safetensors file: (offset in the file, shape, dtype). The format: an 8-byte
    little-endian header length, a JSON header of {name: {dtype, shape, data_offsets}}, then the data. A file
    that is not one raises ValueError (OSError where it cannot be read), as the library refuses it. A dtype
    minillama does not read (the library's sub-byte ones) is given as its name: refused where the tensor is
    needed (hf.py `_check_readable`), passed over where it is not."""
    import json

    f.seek(0)
    head, total = f.read(8), os.fstat(f.fileno()).st_size
    n = int.from_bytes(head, "little")
    if len(head) < 8 or n > min(total - 8, MAX_HEADER_BYTES):  # checked before the header is read into memory
        raise ValueError(f"a header of {n} bytes in a file of {total}" if len(head) == 8
                         else f"a file of {total} bytes, shorter than its header's length")
    try:
        header = json.loads(f.read(n))
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ValueError(f"the header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"the header is a JSON {type(header).__name__}, not an object")
    out, spans = {}, []
    for name, t in header.items():
        if name == "__metadata__":
            continue
        if not (isinstance(t, dict) and isinstance(t.get("shape"), list) and isinstance(t.get("data_offsets"), list)
                and all(_count(x) for x in t["shape"] + t["data_offsets"]) and len(t["data_offsets"]) == 2):
            raise ValueError(f"tensor {name}: not an entry of dtype, shape and data_offsets ({str(t)[:80]})")
        if not isinstance(t.get("dtype"), str):
            raise ValueError(f"tensor {name} has dtype {t.get('dtype')!r}, not a dtype's name")
        shape, dtype = tuple(t["shape"]), SAFETENSORS_DTYPES.get(t["dtype"], t["dtype"])
        begin, end = t["data_offsets"]
        if isinstance(dtype, torch.dtype) and end - begin != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {name}: data_offsets {begin}..{end} do not hold its shape {list(shape)} "
                             f"of {t['dtype']}")
        out[name] = (8 + n + begin, shape, dtype)
        spans.append((begin, end, name))
    # as the safetensors library reads a file: the tensors' bytes one after another, the data and no more
    # (offsets that overlap would load one tensor's bytes as another's)
    at, size = 0, total - 8 - n
    for begin, end, name in sorted(spans):
        if begin != at:
            raise ValueError(f"invalid offset for tensor {name} ({begin}, where {at} was due)")
        at = end
    if at != size:
        raise ValueError(f"the tensors hold {at} bytes of data, the file {size}")
    return out


def _count(x: object) -> bool:
    """A JSON whole number a shape's dimension or an offset may be: 0 to 2**63 - 1, as torch sizes a tensor
    (not a float, not true or false)."""
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x < 1 << 63
