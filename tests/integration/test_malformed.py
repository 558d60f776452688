"""A corpus of malformed frames sent over raw sockets to a real appliance.

Each case names the ERROR code the appliance must answer with. Frame-level errors (the
stream can no longer be trusted) must also close the connection; request-level errors in
a session must leave the session usable. After every case another client must still get
stats and round-trip a tensor: no malformed frame may cost more than its own connection.
"""

from __future__ import annotations

import random
import socket
import struct
from dataclasses import dataclass
from typing import Any

import pytest
import torch

import djinn
from djinn.protocol.frames import (
    HEADER_SIZE,
    MAGIC,
    MAX_BODY,
    MAX_PAYLOAD,
    MAX_PREAUTH_BODY,
    VERSION,
    Header,
    Kind,
    decode_body,
    decode_header,
    encode_body,
    encode_header,
)

RID = 77  # request id of every malformed frame
PROBE_RID = 99  # request id of the follow-up request proving a connection still works
IO_TIMEOUT_S = 5.0

PREAUTH, AUTHED, SESSION = "preauth", "authed", "session"


# -- building frames ----------------------------------------------------------------------------
def header(
    kind: int = Kind.PING,
    *,
    body_len: int = 0,
    payload_len: int = 0,
    magic: bytes = MAGIC,
    version: int = VERSION,
    flags: int = 0,
    rid: int = RID,
) -> bytes:
    """A header with any field set to anything the struct can hold."""
    return struct.pack("<4sBBHQiq", magic, version, int(kind), flags, rid, body_len, payload_len)


def frame(
    kind: Kind, body: dict[str, Any] | None = None, payload: bytes = b"", *, rid: int = RID
) -> bytes:
    raw = encode_body(body) if body is not None else b""
    return raw_frame(kind, raw, payload, rid=rid)


def raw_frame(kind: Kind, raw_body: bytes, payload: bytes = b"", *, rid: int = RID) -> bytes:
    return encode_header(kind, rid, len(raw_body), len(payload)) + raw_body + payload


def put(desc: Any, payload: bytes, rid: int = RID, **entry: Any) -> bytes:
    """A PUT of one tensor sent inline as payload segment 0."""
    body = {"tensors": [{"desc": desc, "seg": 0, **entry}], "segs": [len(payload)]}
    return frame(Kind.PUT, body, payload, rid=rid)


def exec_graph(nodes: list, **body: Any) -> bytes:
    return frame(Kind.EXEC, {"nodes": nodes, "keep": [], "fetch": [], **body})


def f32(shape: list[int], strides: list[int] | None = None) -> dict[str, Any]:
    desc: dict[str, Any] = {"dtype": "float32", "shape": shape}
    if strides is not None:
        desc["strides"] = strides
    return desc


def exec_with_nested_args(depth: int) -> bytes:
    """An EXEC whose one constant is ``depth`` nested lists (orjson parses up to 1024)."""
    args = "[" * depth + "1" + "]" * depth
    raw = '{"nodes": [{"op": "aten::zeros.default", "args": [%s]}], "keep": [], "fetch": []}'
    return raw_frame(Kind.EXEC, (raw % args).encode())


# -- reading replies ---------------------------------------------------------------------------
def recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(n - len(buf))
        if not chunk:
            raise AssertionError(f"connection closed after {len(buf)} of {n} expected bytes")
        buf += chunk
    return bytes(buf)


def read_frame(sock: socket.socket) -> tuple[Header, dict[str, Any], bytes]:
    head = decode_header(recv_exact(sock, HEADER_SIZE), authenticated=True)
    body = decode_body(recv_exact(sock, head.body_len))
    return head, body, recv_exact(sock, head.payload_len)


def read_error(sock: socket.socket) -> tuple[Header, dict[str, Any]]:
    head, body, payload = read_frame(sock)
    assert head.kind is Kind.ERROR, f"expected an ERROR frame, got {head.kind.name} {body}"
    assert payload == b""
    assert isinstance(body.get("message"), str) and body["message"]
    return head, body


def expect_closed(sock: socket.socket) -> None:
    """The appliance closed its end: EOF (or a reset), and not one byte more."""
    sock.settimeout(IO_TIMEOUT_S)
    try:
        data = sock.recv(4096)
    except ConnectionResetError:
        return
    except TimeoutError:
        raise AssertionError(f"connection still open after {IO_TIMEOUT_S}s") from None
    assert data == b"", f"unexpected bytes instead of EOF: {data[:80]!r}"


def request(sock: socket.socket, kind: Kind, body: dict[str, Any] | None = None, rid: int = 1):
    sock.sendall(frame(kind, body, rid=rid))
    head, reply, _ = read_frame(sock)
    assert head.kind is Kind.REPLY, f"{kind.name} failed: {reply}"
    assert head.request_id == rid
    return reply


# -- connecting ----------------------------------------------------------------------------------
def connect_raw(appliance, via: str) -> socket.socket:
    if via == "unix":
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(IO_TIMEOUT_S)
        sock.connect(appliance.socket_path)
    else:
        sock = socket.create_connection(("127.0.0.1", appliance.tcp_port), IO_TIMEOUT_S)
    sock.settimeout(IO_TIMEOUT_S)
    return sock


def hello(sock: socket.socket, appliance, via: str) -> None:
    body = {"client": "malformed-corpus", "protocol": VERSION}
    if via == "tcp":
        body["token"] = appliance.token
    assert request(sock, Kind.HELLO, body, rid=1)["protocol"] == VERSION


def open_session(sock: socket.socket) -> dict[str, Any]:
    reply = request(sock, Kind.SESSION_OPEN, {"client": "malformed-corpus"}, rid=2)
    assert reply["session"]
    return reply


def assert_appliance_serves(appliance) -> None:
    """A well-behaved client still gets stats and round-trips a tensor in a session."""
    with djinn.connect(appliance.unix) as client:
        assert "workers" in client.stats()
        with client.session() as session:
            t = torch.arange(12, dtype=torch.float32).reshape(3, 4)
            assert torch.equal(session.put(t).cpu(), t)


# -- the corpus ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Case:
    data: bytes
    code: str | None  # the ERROR code expected; None: no reply at all, just a close
    via: str = "unix"
    stage: str = PREAUTH  # how far the connection got before ``data`` is sent
    closes: bool = True  # frame-level error: the appliance must drop the connection
    eof: bool = False  # shutdown(SHUT_WR) right after sending ``data``


def case(id: str, data: bytes, code: str | None, **kw: Any):
    return pytest.param(Case(data, code, **kw), id=id)


def session_case(id: str, data: bytes, code: str, via: str = "unix", closes: bool = False):
    return case(id, data, code, via=via, stage=SESSION, closes=closes)


_GARBAGE = random.Random(1234).randbytes(1000)
_HTTP = b"GET / HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\n\r\n"
_TLS_HELLO = bytes.fromhex("16030100f4010000f00303") + bytes(64)
_ERROR_V2 = encode_body({"code": "INTERNAL", "message": "from the future"})

PRE_AUTH = [
    # not a Djinn peer at all
    case("bad-magic", header(magic=b"XXXX", kind=Kind.HELLO), "PROTOCOL_ERROR"),
    case("bad-magic-tcp", header(magic=b"NJDD", kind=Kind.HELLO), "PROTOCOL_ERROR", via="tcp"),
    case("lowercase-magic", header(magic=b"djnn", kind=Kind.HELLO), "PROTOCOL_ERROR"),
    case("http-request-tcp", _HTTP, "PROTOCOL_ERROR", via="tcp"),
    case("tls-client-hello-tcp", _TLS_HELLO, "PROTOCOL_ERROR", via="tcp"),
    case("zero-bytes", bytes(64), "PROTOCOL_ERROR"),
    case("random-garbage", _GARBAGE, "PROTOCOL_ERROR"),
    case("random-garbage-tcp", _GARBAGE, "PROTOCOL_ERROR", via="tcp"),
    # another protocol version
    case("version-0", header(Kind.HELLO, version=0), "VERSION_MISMATCH"),
    case("version-2", header(Kind.HELLO, version=VERSION + 1), "VERSION_MISMATCH"),
    case("version-255-tcp", header(Kind.HELLO, version=255), "VERSION_MISMATCH", via="tcp"),
    case(
        "error-frame-from-version-2-is-read-then-refused-before-hello",
        header(Kind.ERROR, version=VERSION + 1, body_len=len(_ERROR_V2)) + _ERROR_V2,
        "AUTH_FAILED",
    ),
    # header fields out of range
    case("kind-0", header(0), "PROTOCOL_ERROR"),
    case("kind-99", header(99), "PROTOCOL_ERROR"),
    case("kind-255-tcp", header(255), "PROTOCOL_ERROR", via="tcp"),
    case("flag-bit-0", header(Kind.HELLO, flags=0x0001), "PROTOCOL_ERROR"),
    case("flag-bit-15-tcp", header(Kind.HELLO, flags=0x8000), "PROTOCOL_ERROR", via="tcp"),
    case("negative-body-len", header(Kind.HELLO, body_len=-1), "PROTOCOL_ERROR"),
    case("negative-payload-len", header(Kind.HELLO, payload_len=-1), "PROTOCOL_ERROR"),
    case(
        "most-negative-lengths-tcp",
        header(Kind.HELLO, body_len=-(2**31), payload_len=-(2**63)),
        "PROTOCOL_ERROR",
        via="tcp",
    ),
    # too big for an unauthenticated peer
    case(
        "preauth-body-over-limit",
        header(Kind.HELLO, body_len=MAX_PREAUTH_BODY + 1),
        "FRAME_TOO_LARGE",
    ),
    case(
        "preauth-body-2gib-tcp",
        header(Kind.HELLO, body_len=2**31 - 1),
        "FRAME_TOO_LARGE",
        via="tcp",
    ),
    case("preauth-payload-1-byte", header(Kind.HELLO, payload_len=1), "FRAME_TOO_LARGE"),
    case(
        "preauth-payload-max-tcp",
        header(Kind.HELLO, payload_len=MAX_PAYLOAD),
        "FRAME_TOO_LARGE",
        via="tcp",
    ),
    # requests before authenticating
    case("stats-before-hello", frame(Kind.STATS), "AUTH_FAILED"),
    case("session-open-before-hello", frame(Kind.SESSION_OPEN, {}), "AUTH_FAILED"),
    case("put-before-hello-tcp", frame(Kind.PUT, {"tensors": []}), "AUTH_FAILED", via="tcp"),
    case("hello-tcp-without-token", frame(Kind.HELLO, {"client": "x"}), "AUTH_FAILED", via="tcp"),
    case("hello-tcp-wrong-token", frame(Kind.HELLO, {"token": "guess"}), "AUTH_FAILED", via="tcp"),
    case("hello-tcp-empty-token", frame(Kind.HELLO, {"token": ""}), "AUTH_FAILED", via="tcp"),
    case("hello-tcp-integer-token", frame(Kind.HELLO, {"token": 0}), "AUTH_FAILED", via="tcp"),
    case("hello-tcp-null-token", frame(Kind.HELLO, {"token": None}), "AUTH_FAILED", via="tcp"),
    case(
        "hello-tcp-list-token",
        frame(Kind.HELLO, {"token": ["test-token-0123456789"]}),
        "AUTH_FAILED",
        via="tcp",
    ),
    case(
        "hello-tcp-token-prefix",
        frame(Kind.HELLO, {"token": "test-token-0123"}),
        "AUTH_FAILED",
        via="tcp",
    ),
    # bodies that are not one JSON object
    case("hello-invalid-json", raw_frame(Kind.HELLO, b'{"client": '), "PROTOCOL_ERROR"),
    case("hello-not-utf8-tcp", raw_frame(Kind.HELLO, b"\xff\xfe{}"), "PROTOCOL_ERROR", via="tcp"),
    case("hello-json-array", raw_frame(Kind.HELLO, b'["token"]'), "PROTOCOL_ERROR"),
    case("hello-json-string-tcp", raw_frame(Kind.HELLO, b'"hi"'), "PROTOCOL_ERROR", via="tcp"),
    case("hello-json-number", raw_frame(Kind.HELLO, b"1"), "PROTOCOL_ERROR"),
    case("hello-segs-without-payload", frame(Kind.HELLO, {"segs": [1]}), "PROTOCOL_ERROR"),
    case("hello-segs-negative", frame(Kind.HELLO, {"segs": [-1, 1]}), "PROTOCOL_ERROR"),
    case("hello-segs-not-a-list-tcp", frame(Kind.HELLO, {"segs": 0}), "PROTOCOL_ERROR", via="tcp"),
    # truncated, then EOF: nothing to answer, the connection is simply dropped
    case("eof-before-any-byte", b"", None, eof=True),
    case("eof-mid-header", frame(Kind.HELLO, {})[: HEADER_SIZE // 2], None, eof=True),
    case(
        "eof-mid-body-tcp",
        frame(Kind.HELLO, {"client": "x" * 100})[: HEADER_SIZE + 20],
        None,
        via="tcp",
        eof=True,
    ),
]

AFTER_HELLO = [
    case(
        "authed-body-over-max-body",
        header(Kind.STATS, body_len=MAX_BODY + 1),
        "FRAME_TOO_LARGE",
        stage=AUTHED,
    ),
    case(
        "authed-payload-over-max-payload-tcp",
        header(Kind.STATS, payload_len=MAX_PAYLOAD + 1),
        "FRAME_TOO_LARGE",
        via="tcp",
        stage=AUTHED,
    ),
    case("authed-bad-magic", header(magic=b"DJNX"), "PROTOCOL_ERROR", stage=AUTHED),
    case("authed-version-2-tcp", header(version=2), "VERSION_MISMATCH", via="tcp", stage=AUTHED),
    case(
        # the supervisor takes no payload at all: refused on the header, before the segs
        "authed-any-payload-to-the-supervisor",
        frame(Kind.STATS, {"segs": [3]}, b"ab"),
        "FRAME_TOO_LARGE",
        stage=AUTHED,
    ),
    case("authed-json-array", raw_frame(Kind.STATS, b"[]"), "PROTOCOL_ERROR", stage=AUTHED),
    # a well-formed frame the supervisor cannot serve: refused, connection kept
    case(
        "authed-put-before-session-open",
        frame(Kind.PUT, {"tensors": []}),
        "PROTOCOL_ERROR",
        stage=AUTHED,
        closes=False,
    ),
    case(
        "authed-eof-mid-header-tcp",
        header(Kind.STATS)[:10],
        None,
        via="tcp",
        stage=AUTHED,
        eof=True,
    ),
]

IN_SESSION = [
    # PUT with a descriptor that does not describe its bytes
    session_case(
        "put-unknown-dtype", put({"dtype": "float128", "shape": [2]}, bytes(8)), "INVALID_ARGUMENT"
    ),
    session_case(
        "put-dtype-not-a-string", put({"dtype": 7, "shape": [2]}, bytes(2)), "INVALID_ARGUMENT"
    ),
    session_case(
        "put-overlapping-strides",
        put(f32([2, 2], [1, 1]), bytes(16)),
        "INVALID_ARGUMENT",
        via="tcp",
    ),
    session_case("put-expanded-stride-0", put(f32([4], [0]), bytes(16)), "INVALID_ARGUMENT"),
    session_case("put-negative-shape", put(f32([-1]), b""), "INVALID_ARGUMENT"),
    session_case(
        "put-negative-stride-tcp", put(f32([2], [-1]), bytes(8)), "INVALID_ARGUMENT", via="tcp"
    ),
    session_case("put-strides-wrong-length", put(f32([2, 2], [2]), bytes(16)), "INVALID_ARGUMENT"),
    session_case(
        "put-shape-not-a-list", put({"dtype": "float32", "shape": 4}, bytes(16)), "INVALID_ARGUMENT"
    ),
    session_case("put-desc-not-an-object", put([4], bytes(16)), "INVALID_ARGUMENT"),
    session_case("put-payload-too-short", put(f32([4]), bytes(8)), "INVALID_ARGUMENT"),
    session_case(
        "put-payload-too-long-tcp", put(f32([1]), bytes(8)), "INVALID_ARGUMENT", via="tcp"
    ),
    session_case(
        "put-shape-2-pow-80-elements", put(f32([2**40, 2**40]), bytes(16)), "INVALID_ARGUMENT"
    ),
    session_case("put-seg-out-of-range", put(f32([1]), bytes(4), seg=3), "INVALID_ARGUMENT"),
    session_case(
        "put-tensors-not-a-list",
        frame(Kind.PUT, {"tensors": {"desc": f32([1])}}),
        "INVALID_ARGUMENT",
    ),
    # PUT naming an arena slab this session never leased
    session_case(
        "put-slab-not-leased",
        frame(Kind.PUT, {"tensors": [{"desc": f32([2]), "slab": 0}]}),
        "NOT_FOUND",
    ),
    session_case(
        "put-slab-not-an-integer",
        frame(Kind.PUT, {"tensors": [{"desc": f32([2]), "slab": "0"}]}),
        "NOT_FOUND",
    ),
    # handles that do not exist
    session_case("get-unknown-handle", frame(Kind.GET, {"handles": ["nope"]}), "NOT_FOUND"),
    session_case(
        "get-integer-handle-tcp", frame(Kind.GET, {"handles": [123]}), "NOT_FOUND", via="tcp"
    ),
    session_case(
        "get-handles-not-a-list", frame(Kind.GET, {"handles": "nope"}), "INVALID_ARGUMENT"
    ),
    session_case("free-unknown-handle", frame(Kind.FREE, {"handles": ["nope"]}), "NOT_FOUND"),
    session_case(
        "free-list-handle-tcp", frame(Kind.FREE, {"handles": [["x"]]}), "NOT_FOUND", via="tcp"
    ),
    session_case(
        "exec-unknown-handle",
        exec_graph([{"op": "aten::neg.default", "args": [{"$h": "nope"}]}]),
        "NOT_FOUND",
    ),
    # op names outside torch.ops.aten / prims
    session_case(
        "exec-builtins-eval",
        exec_graph([{"op": "builtins::eval", "args": ["1+1"]}]),
        "UNSUPPORTED_OP",
    ),
    session_case(
        "exec-aten-dunder-class",
        exec_graph([{"op": "aten::__class__", "args": []}]),
        "UNSUPPORTED_OP",
    ),
    session_case(
        "exec-overload-dunder-class-tcp",
        exec_graph([{"op": "aten::add.__class__", "args": []}]),
        "UNSUPPORTED_OP",
        via="tcp",
    ),
    session_case(
        "exec-no-such-aten-op", exec_graph([{"op": "aten::no_such_op_xyz"}]), "UNSUPPORTED_OP"
    ),
    session_case("exec-python-path", exec_graph([{"op": "torch.ops.aten.add"}]), "UNSUPPORTED_OP"),
    session_case(
        "exec-os-system", exec_graph([{"op": "os::system", "args": ["true"]}]), "UNSUPPORTED_OP"
    ),
    session_case("exec-op-not-a-string", exec_graph([{"op": ["aten::add"]}]), "UNSUPPORTED_OP"),
    # graphs that do not hold together
    session_case(
        "exec-reference-to-later-node",
        exec_graph(
            [
                {"op": "aten::neg.default", "args": [{"$v": 1}]},
                {"op": "aten::zeros.default", "args": [[2]]},
            ]
        ),
        "INVALID_ARGUMENT",
    ),
    session_case(
        "exec-reference-to-itself-tcp",
        exec_graph([{"op": "aten::neg.default", "args": [{"$v": 0}]}]),
        "INVALID_ARGUMENT",
        via="tcp",
    ),
    session_case(
        "exec-fetch-missing-node",
        exec_graph([{"op": "aten::zeros.default", "args": [[2]]}], fetch=[{"$v": 5}]),
        "INVALID_ARGUMENT",
    ),
    session_case(
        "exec-keep-node-ref-is-a-list",
        exec_graph([{"op": "aten::zeros.default", "args": [[2]]}], keep=[{"$v": [0]}]),
        "INVALID_ARGUMENT",
    ),
    session_case(
        "exec-unknown-tagged-constant",
        exec_graph([{"op": "aten::zeros.default", "args": [{"$eval": "1"}]}]),
        "INVALID_ARGUMENT",
    ),
    session_case(
        "exec-args-nested-too-deeply",
        exec_with_nested_args(1000),
        "INVALID_ARGUMENT",
    ),
    session_case("exec-nodes-not-a-list", frame(Kind.EXEC, {"nodes": {}}), "INVALID_ARGUMENT"),
    # ALLOC is for same-host clients
    session_case(
        "alloc-over-tcp", frame(Kind.ALLOC, {"sizes": [64]}), "INVALID_ARGUMENT", via="tcp"
    ),
    session_case("alloc-negative-size", frame(Kind.ALLOC, {"sizes": [-1]}), "INVALID_ARGUMENT"),
    # a well-formed frame that is not a session request
    session_case("hello-inside-session", frame(Kind.HELLO, {}), "PROTOCOL_ERROR"),
    # frame-level errors inside a session: the worker drops the connection
    session_case("session-bad-magic", header(magic=b"XJNN"), "PROTOCOL_ERROR", closes=True),
    session_case("session-bad-magic-tcp", _GARBAGE, "PROTOCOL_ERROR", via="tcp", closes=True),
    session_case("session-version-0", header(version=0), "VERSION_MISMATCH", closes=True),
    session_case("session-unknown-kind", header(200), "PROTOCOL_ERROR", closes=True),
    session_case(
        "session-unknown-flags-tcp", header(flags=4), "PROTOCOL_ERROR", via="tcp", closes=True
    ),
    session_case("session-negative-body-len", header(body_len=-8), "PROTOCOL_ERROR", closes=True),
    session_case(
        "session-body-over-max-body",
        header(Kind.EXEC, body_len=MAX_BODY + 1),
        "FRAME_TOO_LARGE",
        closes=True,
    ),
    session_case(
        "session-payload-over-max-payload-tcp",
        header(Kind.PUT, payload_len=MAX_PAYLOAD + 1),
        "FRAME_TOO_LARGE",
        via="tcp",
        closes=True,
    ),
    session_case(
        "session-invalid-json", raw_frame(Kind.PUT, b"{tensors}"), "PROTOCOL_ERROR", closes=True
    ),
    session_case(
        "session-segs-mismatch",
        frame(Kind.PUT, {"tensors": [], "segs": [4, 4]}, bytes(4)),
        "PROTOCOL_ERROR",
        closes=True,
    ),
    case(
        "session-eof-mid-payload",
        put(f32([4]), bytes(16))[:-5],
        None,
        stage=SESSION,
        eof=True,
    ),
]


@pytest.mark.parametrize("case", PRE_AUTH + AFTER_HELLO + IN_SESSION)
def test_malformed_frame_gets_its_error_code_and_the_appliance_keeps_serving(appliance, case):
    sock = connect_raw(appliance, case.via)
    try:
        if case.stage in (AUTHED, SESSION):
            hello(sock, appliance, case.via)
        if case.stage == SESSION:
            open_session(sock)
        if case.data:
            sock.sendall(case.data)
        if case.eof:
            sock.shutdown(socket.SHUT_WR)
        if case.code is not None:
            head, body = read_error(sock)
            assert body["code"] == case.code, body["message"]
            assert head.request_id in (0, RID)
        if case.closes:
            expect_closed(sock)
        else:
            assert head.request_id == RID  # a request-level error answers that request
            probe = Kind.HEARTBEAT if case.stage == SESSION else Kind.PING
            assert request(sock, probe, rid=PROBE_RID) in ({}, {"bytes": 0})  # still serving
    finally:
        sock.close()
    assert_appliance_serves(appliance)


def test_corpus_has_at_least_30_cases_with_unique_ids():
    ids = [p.id for p in PRE_AUTH + AFTER_HELLO + IN_SESSION]
    assert len(ids) >= 30
    assert len(set(ids)) == len(ids)


def test_session_answers_pipelined_bad_requests_in_order_then_round_trips_a_tensor(appliance):
    cases = [p.values[0] for p in IN_SESSION]
    bad = [c.data for c in cases if c.via == "unix" and c.code and not c.closes]
    sock = connect_raw(appliance, "unix")
    with sock:
        hello(sock, appliance, "unix")
        open_session(sock)
        sock.sendall(b"".join(bad))  # pipelined: each answered in turn, none fatal
        for _ in bad:
            head, _body = read_error(sock)
            assert head.request_id == RID
        data = torch.arange(4, dtype=torch.float32).numpy().tobytes()
        sock.sendall(put(f32([4]), data, rid=5))
        head, reply, _ = read_frame(sock)
        assert (head.kind, head.request_id) == (Kind.REPLY, 5), reply
        sock.sendall(frame(Kind.GET, {"handles": reply["handles"]}, rid=6))
        head, reply, payload = read_frame(sock)
        assert (head.kind, head.request_id) == (Kind.REPLY, 6), reply
        assert payload == data
    assert_appliance_serves(appliance)


def test_huge_payload_declared_to_the_supervisor_is_refused_before_allocating(fresh_appliance):
    # No supervisor request (STATS, PING, KILL_SESSION, SESSION_OPEN) carries a payload, so
    # a header announcing MAX_PAYLOAD bytes must be refused on the header alone, not
    # answered by reserving 64 GiB for bytes that will never be used.
    app = fresh_appliance()
    sock = connect_raw(app, "unix")
    with sock:
        hello(sock, app, "unix")
        sock.sendall(header(Kind.STATS, payload_len=MAX_PAYLOAD))
        _head, body = read_error(sock)
        assert body["code"] == "FRAME_TOO_LARGE", body["message"]
        expect_closed(sock)
    assert app.proc.poll() is None, f"appliance died:\n{app.log()[-3000:]}"
    assert_appliance_serves(app)
