"""The messages between the pipeline and a GPU decoder process (:mod:`~fullthrottle.data.gpu_decode_procs`,
:mod:`~fullthrottle.data.gpu_decoder_worker`): a request is ``n``, where the bytes are (inline on the socket,
or in the process's input arena from an offset), then ``(pool row, byte length)`` per image; a reply is one
status per image (ok, the item's error, its file's read error, with the message) and the batch's times."""

from __future__ import annotations

import os
import struct
from collections.abc import Sequence

from .load import LoadError

_N = struct.Struct("<I")  # items in a request or reply


_WHERE = struct.Struct("<BQ")  # request: 0 bytes follow inline / 1 bytes in the arena, from this offset


_ITEM = struct.Struct("<II")  # request: pool row, byte length


_STATUS = struct.Struct("<BI")  # reply: 0 ok / 1 the item's error / 2 its file's read error, message length


_TIMES = struct.Struct("<ddI")  # reply: seconds the process spent launching the batch, and in all; images it


#: buffers per ``os.pwritev`` call (the system's IOV_MAX)
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024


def encode_request(
    items: Sequence[tuple[bytes, int]], arena=None, base: int = 0, fd: int | None = None, iov_max: int = _IOV_MAX
) -> bytes:
    """A batch request. With ``arena`` (a writable buffer) the bytes are copied there from ``base``,
    back to back, and only their lengths travel; without, they follow the request.

    With ``fd`` (the file behind ``arena``: a memfd) the copy is ``os.pwritev``: one system call for
    the batch, made without the GIL, where a slice assignment per image holds it for a memcpy of the
    image (~100 kB), time taken from every other thread of the pipeline (``iov_max`` buffers per
    call at most: the system's IOV_MAX). ``items``' data: bytes-like with one-byte items (``bytes``,
    ``bytearray``).

    Raises:
        ValueError: the bytes do not fit in ``arena`` from ``base``.
        OSError: the write failed (``pwritev``: no memory for the memfd's pages, say).
    """
    heads = [_ITEM.pack(row, len(d)) for d, row in items]
    if arena is None:
        return b"".join([_N.pack(len(items)), _WHERE.pack(0, 0)] + heads + [bytes(d) for d, _ in items])
    total = sum(len(d) for d, _ in items)
    if base < 0 or base + total > len(arena):  # (pwritev would grow the file past the mapping, silently)
        raise ValueError(f"{total} bytes from offset {base} do not fit in the {len(arena)}-byte arena")
    off, k = base, 0
    if fd is not None and hasattr(os, "pwritev"):
        while k < len(items):
            chunk = [d for d, _ in items[k : k + iov_max]]
            want = sum(len(d) for d in chunk)
            done = os.pwritev(fd, chunk, off)
            if done != want:  # a short write: the rest by hand, from the first image it cut
                for d in chunk:
                    if done >= len(d):
                        done -= len(d)
                        off += len(d)
                        k += 1
                        continue
                    break
                break
            off += want
            k += len(chunk)
    for d, _ in items[k:]:  # (no pwritev, or after a short write: from the first image not fully written)
        arena[off : off + len(d)] = d
        off += len(d)
    return b"".join([_N.pack(len(items)), _WHERE.pack(1, base)] + heads)


def decode_request(msg, arena=None) -> list[tuple[memoryview, int]]:
    """``[(bytes view, pool row), ...]`` of a request: slices of the request or of ``arena`` (no copy)."""
    (n,) = _N.unpack_from(msg)
    inline, base = _WHERE.unpack_from(msg, _N.size)
    off, heads = _N.size + _WHERE.size, []
    for _ in range(n):
        heads.append(_ITEM.unpack_from(msg, off))
        off += _ITEM.size
    view = memoryview(msg) if inline == 0 else memoryview(arena)
    if inline == 1:
        off = base
    out = []
    for row, length in heads:
        out.append((view[off : off + length], row))
        off += length
    return out


def encode_reply(
    statuses: Sequence[str | None], launch_s: float = 0.0, total_s: float = 0.0, cpu_decoded: int = 0
) -> bytes:
    parts = [_N.pack(len(statuses)), _TIMES.pack(launch_s, total_s, cpu_decoded)]
    for s in statuses:
        m = b"" if s is None else str(s).encode("utf-8", "replace")[:60000]
        parts += [_STATUS.pack(0 if s is None else 2 if isinstance(s, LoadError) else 1, len(m)), m]
    return b"".join(parts)


def decode_reply(msg: bytes) -> tuple[list, float, float, int]:
    """``(statuses, launch_s, total_s, cpu_decoded)``: per image None, its error (``str``: to be
    prefixed with its id) or its file's :class:`~fullthrottle.data.load.LoadError` (the whole error); the
    process's time on the batch; how many of its images went to its CPU decoder (crops and errors alike)."""
    (n,) = _N.unpack_from(msg)
    launch_s, total_s, cpu_decoded = _TIMES.unpack_from(msg, _N.size)
    off, out = _N.size + _TIMES.size, []
    for _ in range(n):
        code, length = _STATUS.unpack_from(msg, off)
        off += _STATUS.size
        text = msg[off : off + length].decode("utf-8", "replace")
        out.append(None if code == 0 else LoadError(text) if code == 2 else text)
        off += length
    return out, launch_s, total_s, cpu_decoded
