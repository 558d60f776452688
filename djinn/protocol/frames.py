"""Frame codec for the Djinn wire protocol (pure: no sockets, no torch).

Every message is one frame::

     0        4    5    6         8                  16         20                 28
     +--------+----+----+---------+------------------+----------+------------------+
     | magic  |ver |kind| flags   | request_id       | body_len | payload_len      |
     | "DJNN" | u8 | u8 | u16     | u64              | i32      | i64              |
     +--------+----+----+---------+------------------+----------+------------------+
     | body: body_len bytes of UTF-8 JSON (an object)                              |
     +-----------------------------------------------------------------------------+
     | payload: payload_len raw bytes = the segments listed in body["segs"]        |
     +-----------------------------------------------------------------------------+

All integers are little-endian. Lengths are *signed* so that a negative length is seen
as such and refused, instead of wrapping into a huge allocation. Every limit below is
checked on the header alone, before a single byte of body or payload is allocated.
Before a connection has authenticated only tiny frames are accepted
(``MAX_PREAUTH_BODY``, no payload), so an unauthenticated peer cannot make the
appliance reserve memory.

The layout of the first 8 bytes and of ERROR frames is frozen across versions, so a peer
speaking another version always gets a readable VERSION_MISMATCH error frame.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from enum import IntEnum
from typing import Any

import orjson

from djinn.errors import FrameTooLarge, ProtocolError, VersionMismatch

MAGIC = b"DJNN"
VERSION = 1

HEADER = struct.Struct("<4sBBHQiq")
HEADER_SIZE = HEADER.size  # 28

MAX_BODY = 16 << 20  # a large op graph is a few MiB of JSON
MAX_PAYLOAD = 64 << 30  # bulk tensor bytes in one frame
MAX_PREAUTH_BODY = 4096  # HELLO and nothing else fits before authentication
MAX_SEGMENTS = 4096  # payload segments listed in one body

FLAG_MASK = 0x0000  # no flags are defined in version 1: any set bit is an error


class Kind(IntEnum):
    """Message kinds. Requests go client -> appliance; REPLY / ERROR answer them."""

    HELLO = 1
    REPLY = 2
    ERROR = 3
    STATS = 10
    SESSION_OPEN = 11
    HEARTBEAT = 12
    SESSION_CLOSE = 13
    KILL_SESSION = 14
    PING = 15
    ALLOC = 20
    PUT = 21
    GET = 22
    FREE = 23
    EXEC = 24
    LOAD = 25
    REGISTER = 26
    CALL = 27


_KINDS = frozenset(int(k) for k in Kind)

# CALL's method that copies a registered model's weights into session handles, for a
# program that goes on to train it (Note [a registered model trains]); "$" keeps it apart
# from any module attribute an operator could allowlist
WEIGHTS_METHOD = "$weights"


@dataclass(frozen=True, slots=True)
class Header:
    kind: Kind
    flags: int
    request_id: int
    body_len: int
    payload_len: int
    version: int = VERSION


@dataclass(slots=True)
class Frame:
    header: Header
    body: dict[str, Any]
    segments: list[memoryview]
    error: Any = None  # set by the reader when the payload could not be placed (drained)

    @property
    def kind(self) -> Kind:
        return self.header.kind

    @property
    def request_id(self) -> int:
        return self.header.request_id


def encode_header(
    kind: Kind, request_id: int, body_len: int, payload_len: int = 0, flags: int = 0
) -> bytes:
    return HEADER.pack(MAGIC, VERSION, int(kind), flags, request_id, body_len, payload_len)


def decode_header(buf: bytes | bytearray | memoryview, *, authenticated: bool) -> Header:
    """Validate a 28-byte header; raise a typed ProtocolError before anything is allocated."""
    if len(buf) != HEADER_SIZE:
        raise ProtocolError(f"truncated header: {len(buf)} of {HEADER_SIZE} bytes")
    magic, version, kind, flags, request_id, body_len, payload_len = HEADER.unpack(buf)
    if magic != MAGIC:
        raise ProtocolError(f"bad magic {bytes(magic)!r}: not a Djinn peer")
    # An error frame from a peer of another version is still readable (frozen layout).
    readable_error = kind == Kind.ERROR and 0 <= body_len <= MAX_PREAUTH_BODY and not payload_len
    if version != VERSION and not readable_error:
        raise VersionMismatch(f"peer speaks protocol version {version}, this side speaks {VERSION}")
    if kind not in _KINDS:
        raise ProtocolError(f"unknown message kind {kind}")
    if flags & ~FLAG_MASK:
        raise ProtocolError(f"unknown flag bits 0x{flags:04x}")
    if body_len < 0 or payload_len < 0:
        raise ProtocolError(f"negative length (body {body_len}, payload {payload_len})")
    if not authenticated:
        if body_len > MAX_PREAUTH_BODY or payload_len:
            raise FrameTooLarge(
                f"frame of {body_len}+{payload_len} bytes before authentication "
                f"(limit {MAX_PREAUTH_BODY}, no payload)"
            )
    elif body_len > MAX_BODY:
        raise FrameTooLarge(f"body of {body_len} bytes exceeds MAX_BODY={MAX_BODY}")
    elif payload_len > MAX_PAYLOAD:
        raise FrameTooLarge(f"payload of {payload_len} bytes exceeds MAX_PAYLOAD={MAX_PAYLOAD}")
    return Header(Kind(kind), flags, request_id, body_len, payload_len, version)


def encode_body(body: dict[str, Any]) -> bytes:
    return orjson.dumps(body)


def decode_body(buf: bytes | bytearray | memoryview) -> dict[str, Any]:
    if not buf:
        return {}
    try:
        body = orjson.loads(buf)
    except orjson.JSONDecodeError as exc:
        raise ProtocolError(f"body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise ProtocolError(f"body must be a JSON object, got {type(body).__name__}")
    return body


def segment_lengths(body: dict[str, Any], payload_len: int) -> list[int]:
    """The payload split declared by ``body["segs"]``; must add up to ``payload_len``."""
    segs = body.get("segs")
    if segs is None:
        return [payload_len] if payload_len else []
    if not isinstance(segs, list) or len(segs) > MAX_SEGMENTS:
        raise ProtocolError(f"segs must be a list of at most {MAX_SEGMENTS} lengths")
    for n in segs:
        if type(n) is not int or n < 0:
            raise ProtocolError(f"bad segment length {n!r}")
    if sum(segs) != payload_len:
        raise ProtocolError(f"segments add up to {sum(segs)} bytes, header says {payload_len}")
    return segs


def encode_frame(
    kind: Kind,
    request_id: int,
    body: dict[str, Any] | None = None,
    segments: list[memoryview | bytes] | tuple = (),
) -> list[bytes | memoryview]:
    """Buffers to write in order (header+body joined; payload segments left uncopied)."""
    body = dict(body or {})
    if segments:
        body["segs"] = [memoryview(s).nbytes for s in segments]
    raw = encode_body(body) if body else b""
    total = sum(memoryview(s).nbytes for s in segments)
    return [encode_header(kind, request_id, len(raw), total) + raw, *segments]


def encode_error(request_id: int, code: str, message: str) -> bytes:
    raw = encode_body({"code": code, "message": message[:2000]})
    return encode_header(Kind.ERROR, request_id, len(raw)) + raw


def decode_frame(buf: bytes | bytearray | memoryview, *, authenticated: bool = True) -> Frame:
    """Decode exactly one complete frame held in ``buf`` (trailing bytes are an error)."""
    view = memoryview(buf)
    header = decode_header(view[:HEADER_SIZE], authenticated=authenticated)
    end = HEADER_SIZE + header.body_len + header.payload_len
    if len(view) < end:
        raise ProtocolError(f"truncated frame: {len(view)} of {end} bytes")
    if len(view) > end:
        raise ProtocolError(f"{len(view) - end} trailing bytes after the frame")
    body = decode_body(view[HEADER_SIZE : HEADER_SIZE + header.body_len])
    segs = segment_lengths(body, header.payload_len)
    out, pos = [], HEADER_SIZE + header.body_len
    for n in segs:
        out.append(view[pos : pos + n])
        pos += n
    return Frame(header, body, out)
