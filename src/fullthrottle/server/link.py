"""The messages between a multi-process server's HTTP worker processes and its engine process.

Each worker has one link to the engine: a socket pair made by the supervisor, carrying
length-prefixed messages in the format of :class:`multiprocessing.connection.Connection`'s
``send_bytes`` / ``recv_bytes`` (nothing is pickled). The engine's end is a blocking socket, read
(:class:`SocketReader`) and written by threads; the worker's end is its event loop's own non-blocking transport
(:func:`message_header`, :class:`MessageReader`), so that a send never stalls the worker's other
connections. A message holds one or more frames; a frame is a 13-byte
header (kind: u8, request id: u64, payload length: u32; little-endian) and its payload:

worker -> engine
    ``CLASSIFY``: the images of one ``/v1/classify`` request, each as ``u16`` id length, ``u32``
    data length, the id (UTF-8) and the encoded bytes. Only bytes cross: the engine reads them as
    data, never as objects.
    ``HTTP``: any other request, passed on whole: ``u32`` head length, the head (JSON: method, path,
    query string, headers, client), the body.
    ``CANCEL``: the client of that ``HTTP`` request went away.
engine -> worker
    ``RESULTS``: ``u8`` 0 and one row per image in the request's order (:func:`pack_result`:
    numbers as binary, the strings as JSON; a float's decimal form is left to the worker), or
    ``u8`` 1 and JSON ``{"error": reason, "overloaded": bool}``.
    ``START``: JSON ``{"status": int, "headers": [[name, value], ...]}`` of an ``HTTP`` request's answer.
    ``BODY``: ``u8`` more-to-come flag and a piece of that answer's body.
"""

from __future__ import annotations

import json
import mmap
import os
import struct
import sys
import tempfile

CLASSIFY, HTTP, CANCEL = 1, 2, 3
RESULTS, START, BODY = 11, 12, 13

_HEAD = struct.Struct("<BQI")
_IMAGE = struct.Struct("<HI")
_U32 = struct.Struct("<I")
_LEN, _LEN64 = struct.Struct("!i"), struct.Struct("!Q")  # (Connection's message length prefixes)


def message_header(n: int) -> bytes:
    """The length prefix that ``Connection.send_bytes`` writes before a message of ``n`` bytes."""
    return _LEN.pack(n) if n <= 0x7FFFFFFF else _LEN.pack(-1) + _LEN64.pack(n)


class MessageReader:
    """Cuts a byte stream written by ``Connection.send_bytes`` into its messages."""

    def __init__(self):
        self.buf = bytearray()

    def feed(self, data: bytes) -> list[bytes]:
        """The messages that ``data`` completes, in order (the rest is kept for the next call)."""
        self.buf += data
        out, at = [], 0
        while len(self.buf) - at >= _LEN.size:
            (n,) = _LEN.unpack_from(self.buf, at)
            start = at + _LEN.size
            if n == -1:
                if len(self.buf) - at < _LEN.size + _LEN64.size:
                    break
                (n,) = _LEN64.unpack_from(self.buf, start)
                start += _LEN64.size
            if len(self.buf) < start + n:
                break
            out.append(bytes(self.buf[start : start + n]))
            at = start + n
        if at:
            del self.buf[:at]
        return out


class SocketReader:
    """Reads the messages of a blocking socket written as by ``Connection.send_bytes``, many per
    ``recv_into`` when many are waiting, into one buffer: a message's bytes are copied once, from
    the kernel, and handed out as memoryviews, which stay valid for as long as they are held (the
    images of a ``CLASSIFY`` frame go into the pipeline as such views, with no copy of their own).

    No byte of a buffer is written while a view of it is held: when the next message does not fit,
    it goes to another buffer (``size`` bytes, or the message's size if larger; what came of it
    already is copied there). That is a buffer of ``size`` used before, once no view of it is left
    (at most :attr:`SPARES` are kept: their pages stay resident, nothing is zeroed), or else a fresh
    anonymous mapping, whose pages the kernel zeroes as ``recv_into`` first touches them. (A
    ``bytearray`` is zeroed when made, under the GIL, and an image copied out of it costs the GIL
    again; a fresh mapping for every fill costs ~25 page faults per 100 kB image.)"""

    #: buffers of ``size`` kept for use again once no view of them is left
    SPARES = 2

    def __init__(self, sock, size: int = 16 << 20):
        self.sock, self.size = sock, size
        self._spares: list[mmap.mmap] = []
        self._map = self._take(size)
        self.buf = memoryview(self._map)
        self.start = self.end = 0  # the bytes not handed out yet: buf[start:end]

    def _take(self, n: int) -> mmap.mmap:
        if n == self.size:
            for i in range(len(self._spares)):
                if sys.getrefcount(self._spares[i]) <= 2:  # (the list's and the call's: no view of it is left)
                    return self._spares.pop(i)
        return mmap.mmap(-1, n, flags=mmap.MAP_PRIVATE) if hasattr(mmap, "MAP_PRIVATE") else mmap.mmap(-1, n)

    def read(self) -> list[memoryview]:
        """The messages complete now (at least one: blocks until there is). Raises EOFError when
        the other end has closed (OSError: the socket failed)."""
        while True:
            out = self._messages()
            if out:
                return out
            nxt = self._next()
            need = sum(nxt) if nxt else _LEN.size + _LEN64.size  # (the message begun at start)
            if self.start + need > len(self.buf):  # it does not fit where it began: into another buffer
                tail = self.end - self.start
                old, old_map = self.buf, self._map
                self._map = self._take(max(self.size, need))
                self.buf = memoryview(self._map)
                self.buf[:tail] = old[self.start : self.end]
                old.release()  # (the views handed out of it hold it on their own)
                if len(old_map) == self.size:
                    self._spares = [*self._spares, old_map][-self.SPARES :]
                self.start, self.end = 0, tail
            n = self.sock.recv_into(self.buf[self.end :])
            if n == 0:
                raise EOFError
            self.end += n

    def _next(self) -> tuple[int, int] | None:
        """(length prefix's size, message's size) of the message at ``start``, once its prefix is in."""
        have = self.end - self.start
        if have < _LEN.size:
            return None
        (n,) = _LEN.unpack_from(self.buf, self.start)
        if n != -1:
            return _LEN.size, n
        if have < _LEN.size + _LEN64.size:
            return None
        return _LEN.size + _LEN64.size, _LEN64.unpack_from(self.buf, self.start + _LEN.size)[0]

    def _messages(self) -> list[memoryview]:
        out, view = [], self.buf
        while (nxt := self._next()) is not None and self.end - self.start >= sum(nxt):
            head, n = nxt
            out.append(view[self.start + head : self.start + head + n])
            self.start += head + n
        return out


def frame(kind: int, req_id: int, *parts: bytes) -> list[bytes]:
    """The pieces of one frame (join the frames of a message with ``b"".join``)."""
    return [_HEAD.pack(kind, req_id, sum(map(len, parts))), *parts]


def frames(msg: bytes):
    """Yield ``(kind, request id, payload memoryview)`` for every frame of a message.

    Raises:
        ValueError: a frame runs past the end of the message.
    """
    view, at = memoryview(msg), 0
    while at < len(view):
        if at + _HEAD.size > len(view):
            raise ValueError("truncated frame header")
        kind, req_id, n = _HEAD.unpack_from(view, at)
        at += _HEAD.size
        if at + n > len(view):
            raise ValueError("truncated frame")
        yield kind, req_id, view[at : at + n]
        at += n


def pack_images(images: list[tuple[str, bytes]]) -> list[bytes]:
    """The payload pieces of a ``CLASSIFY`` frame."""
    out = []
    for item_id, data in images:
        b = item_id.encode("utf-8", "replace")[:65535]
        out += [_IMAGE.pack(len(b), len(data)), b, data]
    return out


def unpack_images(payload: memoryview) -> list[tuple[str, memoryview]]:
    """The ``(id, data)`` images of a ``CLASSIFY`` payload, each ``data`` a view of ``payload`` (no
    copy). Raises ValueError if it is malformed."""
    out, at = [], 0
    while at < len(payload):
        if at + _IMAGE.size > len(payload):
            raise ValueError("truncated image header")
        n_id, n_data = _IMAGE.unpack_from(payload, at)
        at += _IMAGE.size
        if at + n_id + n_data > len(payload):
            raise ValueError("truncated image")
        item_id = bytes(payload[at : at + n_id]).decode("utf-8", "replace")
        out.append((item_id, payload[at + n_id : at + n_id + n_data]))
        at += n_id + n_data
    return out


_ROW = struct.Struct("<dIII")  # a result row: latency (ms), class ids, probabilities, bytes of its strings


def pack_result(r) -> bytes:
    """One image's row of a ``RESULTS`` frame, from its :class:`~fullthrottle.workloads.classify.result.Result`:
    ``f64`` latency (ms), ``u32`` k, ``u32`` m, ``u32`` n, k ``i64`` class ids, m ``f64``
    probabilities, and ``[id, error, labels]`` as n bytes of JSON."""
    k, m = len(r.class_ids), len(r.probs)
    s = json.dumps([r.id, r.error, r.labels]).encode()
    return b"".join((_ROW.pack(r.latency_ms, k, m, len(s)), struct.pack(f"<{k}q{m}d", *r.class_ids, *r.probs), s))


def results_payload(rows: list[bytes]) -> list[bytes]:
    """The payload pieces of a ``RESULTS`` frame with these rows (:func:`pack_result`)."""
    return [b"\x00", *rows]


def error_payload(reason: str, overloaded: bool) -> bytes:
    """The payload of a ``RESULTS`` frame that fails the whole request."""
    return b"\x01" + json.dumps({"error": reason, "overloaded": overloaded}).encode()


def unpack_results(payload) -> dict:
    """A ``RESULTS`` payload: ``{"results": [[id, labels, class_ids, probs, error, latency_ms], ...]}``
    or ``{"error": reason, "overloaded": bool}``. Raises ValueError if it is malformed."""
    view = memoryview(payload)
    if not len(view) or view[0] not in (0, 1):
        raise ValueError("malformed RESULTS payload")
    if view[0] == 1:
        return json.loads(bytes(view[1:]))
    rows, at = [], 1
    try:
        while at < len(view):
            latency_ms, k, m, n = _ROW.unpack_from(view, at)
            at += _ROW.size
            nums = struct.unpack_from(f"<{k}q{m}d", view, at)
            at += 8 * (k + m)
            if at + n > len(view):
                raise ValueError("truncated row")
            item_id, error, labels = json.loads(bytes(view[at : at + n]))
            at += n
            rows.append([item_id, labels, list(nums[:k]), list(nums[k:]), error, latency_ms])
    except struct.error as e:
        raise ValueError(f"malformed RESULTS row: {e}") from None
    return {"results": rows}


def pack_http(head: dict, body: bytes) -> list[bytes]:
    """The payload pieces of an ``HTTP`` frame."""
    h = json.dumps(head).encode()
    return [_U32.pack(len(h)), h, body]


def unpack_http(payload: memoryview) -> tuple[dict, bytes]:
    (n,) = _U32.unpack_from(payload, 0)
    return json.loads(bytes(payload[4 : 4 + n])), bytes(payload[4 + n :])


class Backlog:
    """How many images wait in the engine's classification queue, shared by the engine and its HTTP
    workers through one 4-byte file mapping (``fd``: inherited by the workers; None: a new one).
    The engine writes it as images join the queue, leave it for the pipeline or leave with their
    client; a worker reads it before it sends a request, and refuses one that the queue cannot take
    (503) without a round trip to the engine, which then spends no time on load it would refuse. The
    engine's own check stays the authority: what a worker reads may be a moment old."""

    _N = struct.Struct("i")  # (native: packed with one aligned store, which a reader never sees half done)

    def __init__(self, fd: int | None = None):
        if fd is None:
            with tempfile.TemporaryFile() as f:
                f.truncate(self._N.size)
                fd = os.dup(f.fileno())
        self.fd = fd
        self._map = mmap.mmap(fd, self._N.size)

    def set(self, images: int) -> None:
        self._N.pack_into(self._map, 0, images)

    def get(self) -> int:
        return self._N.unpack_from(self._map, 0)[0]
