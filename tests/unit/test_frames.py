"""The pure frame codec (djinn.protocol.frames) and the FrameReader state machine.

Round trips are checked with hypothesis; so is the promise that hostile bytes only ever
raise ``ProtocolError`` (or a subclass), never anything else. Each header and body
validation then has a targeted test that names the rule it proves.
"""

from __future__ import annotations

import socket
import struct

import orjson
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from djinn.errors import FrameTooLarge, ProtocolError, VersionMismatch
from djinn.protocol.frames import (
    HEADER,
    HEADER_SIZE,
    MAGIC,
    MAX_BODY,
    MAX_PAYLOAD,
    MAX_PREAUTH_BODY,
    MAX_SEGMENTS,
    VERSION,
    Frame,
    Kind,
    decode_body,
    decode_frame,
    decode_header,
    encode_body,
    encode_error,
    encode_frame,
    encode_header,
    segment_lengths,
)
from djinn.transport.framing import FrameReader, PeerClosed

I32_MAX, I32_MIN = 2**31 - 1, -(2**31)
I64_MAX, I64_MIN = 2**63 - 1, -(2**63)
U64_MAX = 2**64 - 1

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def raw_header(
    *,
    magic: bytes = MAGIC,
    version: int = VERSION,
    kind: int = Kind.PING,
    flags: int = 0,
    request_id: int = 1,
    body_len: int = 0,
    payload_len: int = 0,
) -> bytes:
    """A header with every field under the caller's control (invalid ones included)."""
    return HEADER.pack(magic, version, int(kind), flags, request_id, body_len, payload_len)


def joined(buffers: list) -> bytes:
    return b"".join(bytes(memoryview(b)) for b in buffers)


def frame_bytes(kind: Kind, body: dict | None = None, segments=(), request_id: int = 7) -> bytes:
    return joined(encode_frame(kind, request_id, body, list(segments)))


def body_frame(raw_body: bytes, *, payload: bytes = b"", kind: Kind = Kind.PING) -> bytes:
    header = encode_header(kind, 3, len(raw_body), len(payload))
    return header + raw_body + payload


# -- strategies ---------------------------------------------------------------------------
json_text = st.text(alphabet=st.characters(blacklist_categories=("Cs",)), max_size=20)
json_scalars = (
    st.none()
    | st.booleans()
    | st.integers(min_value=I64_MIN, max_value=U64_MAX)
    | st.floats(allow_nan=False, allow_infinity=False)
    | json_text
)
json_values = st.recursive(
    json_scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(json_text, inner, max_size=4),
    max_leaves=20,
)
bodies = st.dictionaries(json_text.filter(lambda k: k != "segs"), json_values, max_size=6)
segment_lists = st.lists(st.binary(max_size=300), max_size=6)
kinds = st.sampled_from(list(Kind))
request_ids = st.integers(min_value=0, max_value=U64_MAX)

# Lengths that are either small enough to read quickly or far beyond every limit (so they
# are refused on the header alone): arbitrary mid-sized ones would make a reader allocate.
small_or_absurd_body = (
    st.integers(I32_MIN, -1) | st.integers(0, 512) | st.integers(MAX_BODY + 1, I32_MAX)
)
any_body_len = st.integers(I32_MIN, I32_MAX)
any_payload_len = st.integers(I64_MIN, I64_MAX)
small_or_absurd_payload = (
    st.integers(I64_MIN, -1) | st.integers(0, 512) | st.integers(MAX_PAYLOAD + 1, I64_MAX)
)


@st.composite
def hostile_frames(draw, body_lens=any_body_len, payload_lens=any_payload_len) -> bytes:
    """Header fields drawn near and across each limit, followed by arbitrary bytes."""
    magic = draw(st.sampled_from([MAGIC, MAGIC, MAGIC, b"DJNX", b"\x00" * 4]))
    version = draw(st.sampled_from([VERSION, VERSION, VERSION, 0, 2, 255]))
    kind = draw(st.sampled_from([int(k) for k in Kind]) | st.integers(0, 255))
    flags = draw(st.sampled_from([0, 0, 0, 1, 0x8000]) | st.integers(0, 0xFFFF))
    body_len = draw(st.sampled_from([0, 2, 16, MAX_PREAUTH_BODY, MAX_PREAUTH_BODY + 1]) | body_lens)
    payload_len = draw(st.sampled_from([0, 0, 1, 8]) | payload_lens)
    header = raw_header(
        magic=magic,
        version=version,
        kind=kind,
        flags=flags,
        request_id=draw(request_ids),
        body_len=body_len,
        payload_len=payload_len,
    )
    body = draw(
        st.sampled_from([b"", b"{}", b"[]", b'{"segs": [1]}', b'{"segs": [-1, 1]}', b"{"])
        | st.binary(max_size=64)
        | st.builds(orjson.dumps, bodies)
    )
    tail = draw(st.binary(max_size=64))
    return header + body + tail


# -- round trips ----------------------------------------------------------------------------
@FAST
@given(kind=kinds, request_id=request_ids, body=bodies, segments=segment_lists)
def test_encode_then_decode_returns_the_same_frame(kind, request_id, body, segments):
    buf = joined(encode_frame(kind, request_id, body, segments))
    frame = decode_frame(buf, authenticated=True)
    assert frame.kind is kind
    assert frame.request_id == request_id
    assert frame.header.flags == 0
    assert frame.header.version == VERSION
    assert frame.header.payload_len == sum(len(s) for s in segments)
    expected = dict(body)
    if segments:
        expected["segs"] = [len(s) for s in segments]
    assert frame.body == expected
    assert [bytes(s) for s in frame.segments] == segments


@FAST
@given(kind=kinds, request_id=request_ids, body=bodies, segments=segment_lists)
def test_frame_reader_reads_back_what_encode_frame_wrote(kind, request_id, body, segments):
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        a.sendall(joined(encode_frame(kind, request_id, body, segments)))
        reader = FrameReader(b, authenticated=True)
        frame = reader.poll()
        assert frame is not None
        assert (frame.kind, frame.request_id) == (kind, request_id)
        assert [bytes(s) for s in frame.segments] == segments
        assert reader.poll() is None  # nothing else arrived: would block


def test_frame_reader_reads_pipelined_frames_one_at_a_time():
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        a.sendall(frame_bytes(Kind.PING, {"n": 1}) + frame_bytes(Kind.PUT, {}, [b"abc", b""]))
        reader = FrameReader(b, authenticated=True)
        first, second = reader.poll(), reader.poll()
        assert first.body == {"n": 1}
        assert [bytes(s) for s in second.segments] == [b"abc", b""]
        a.close()
        with pytest.raises(PeerClosed):
            reader.poll()


def test_encode_frame_with_no_body_and_no_segments_sends_an_empty_body():
    buf = frame_bytes(Kind.HEARTBEAT)
    assert len(buf) == HEADER_SIZE
    frame = decode_frame(buf, authenticated=False)
    assert frame.body == {}
    assert frame.segments == []


def test_encode_error_is_readable_before_authentication_and_truncates_long_messages():
    frame = decode_frame(encode_error(42, "NOT_FOUND", "x" * 5000), authenticated=False)
    assert frame.kind is Kind.ERROR
    assert frame.request_id == 42
    assert frame.body["code"] == "NOT_FOUND"
    assert len(frame.body["message"]) == 2000


def test_header_is_28_bytes_little_endian():
    buf = encode_header(Kind.PUT, 0x0102030405060708, 0x10, 0x20)
    assert len(buf) == HEADER_SIZE == 28
    assert buf[:4] == MAGIC
    assert buf[4] == VERSION
    assert buf[5] == Kind.PUT
    assert buf[8:16] == bytes([8, 7, 6, 5, 4, 3, 2, 1])
    assert struct.unpack_from("<iq", buf, 16) == (0x10, 0x20)


# -- hostile bytes: ProtocolError and nothing else --------------------------------------------
def decodes_or_refuses(buf: bytes, authenticated: bool) -> None:
    try:
        frame = decode_frame(buf, authenticated=authenticated)
    except ProtocolError:
        return
    assert isinstance(frame, Frame)
    assert isinstance(frame.body, dict)


@FAST
@given(buf=st.binary(max_size=200), authenticated=st.booleans())
def test_decode_frame_of_arbitrary_bytes_returns_a_frame_or_raises_protocol_error(
    buf, authenticated
):
    decodes_or_refuses(buf, authenticated)


@FAST
@given(buf=hostile_frames(), authenticated=st.booleans())
def test_decode_frame_of_hostile_headers_returns_a_frame_or_raises_protocol_error(
    buf, authenticated
):
    decodes_or_refuses(buf, authenticated)


@FAST
@given(
    body=st.binary(max_size=100) | st.builds(orjson.dumps, json_values),
    payload=st.binary(max_size=20),
    authenticated=st.booleans(),
)
def test_decode_frame_of_any_body_under_a_valid_header_returns_a_frame_or_raises_protocol_error(
    body, payload, authenticated
):
    decodes_or_refuses(body_frame(body, payload=payload), authenticated)


def drain_reader(data: bytes, *, authenticated: bool, close: bool) -> list[Frame]:
    """Feed ``data`` to a non-blocking FrameReader; frames until None, or the error."""
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        a.sendall(data)
        if close:
            a.shutdown(socket.SHUT_WR)
        reader = FrameReader(b, authenticated=authenticated)
        frames: list[Frame] = []
        for _ in range(len(data) + 2):
            try:
                frame = reader.poll()
            except (ProtocolError, PeerClosed):
                return frames
            if frame is None:
                assert not close, "a reader at EOF must raise PeerClosed, not wait"
                return frames
            assert isinstance(frame, Frame)
            frames.append(frame)
        raise AssertionError("FrameReader.poll() kept returning frames from finite input")


@FAST
@given(data=st.binary(max_size=300), close=st.booleans())
def test_frame_reader_before_auth_yields_only_frames_none_or_protocol_errors(data, close):
    drain_reader(data, authenticated=False, close=close)


@FAST
@given(data=hostile_frames(), close=st.booleans())
def test_frame_reader_before_auth_refuses_hostile_headers_with_protocol_errors(data, close):
    drain_reader(data, authenticated=False, close=close)


@FAST
@given(
    data=hostile_frames(body_lens=small_or_absurd_body, payload_lens=small_or_absurd_payload),
    close=st.booleans(),
)
def test_frame_reader_after_auth_yields_only_frames_none_or_protocol_errors(data, close):
    # Declared lengths stay small or beyond every limit: a valid header may announce up to
    # MAX_PAYLOAD bytes, which the default sink would really allocate.
    drain_reader(data, authenticated=True, close=close)


# -- header validation, one rule at a time ---------------------------------------------------
def test_bad_magic_is_a_protocol_error_not_a_djinn_peer():
    with pytest.raises(ProtocolError, match="bad magic") as err:
        decode_header(raw_header(magic=b"HTTP"), authenticated=True)
    assert err.value.code == "PROTOCOL_ERROR"


@pytest.mark.parametrize("length", [0, 1, HEADER_SIZE - 1, HEADER_SIZE + 1])
def test_header_of_the_wrong_size_is_a_truncation_error(length):
    with pytest.raises(ProtocolError, match="truncated header"):
        decode_header(raw_header().ljust(HEADER_SIZE + 1, b"\0")[:length], authenticated=True)


@pytest.mark.parametrize("version", [0, VERSION + 1, 255])
def test_other_protocol_version_is_a_version_mismatch(version):
    with pytest.raises(VersionMismatch) as err:
        decode_header(raw_header(version=version, kind=Kind.HELLO), authenticated=False)
    assert err.value.code == "VERSION_MISMATCH"
    assert isinstance(err.value, ProtocolError)


def test_error_frame_from_another_version_is_still_decodable():
    raw = encode_body({"code": "VERSION_MISMATCH", "message": "upgrade"})
    buf = raw_header(version=VERSION + 1, kind=Kind.ERROR, body_len=len(raw)) + raw
    frame = decode_frame(buf, authenticated=False)
    assert frame.kind is Kind.ERROR
    assert frame.header.version == VERSION + 1
    assert frame.body["code"] == "VERSION_MISMATCH"


@pytest.mark.parametrize(
    ("body_len", "payload_len"),
    [(MAX_PREAUTH_BODY + 1, 0), (16, 1), (-1, 0)],
    ids=["body-too-big", "with-payload", "negative-body"],
)
def test_error_frame_from_another_version_must_stay_small_to_be_readable(body_len, payload_len):
    buf = raw_header(
        version=VERSION + 1, kind=Kind.ERROR, body_len=body_len, payload_len=payload_len
    )
    with pytest.raises(VersionMismatch):
        decode_header(buf, authenticated=True)


@pytest.mark.parametrize("kind", [0, 4, 9, 16, 28, 99, 255])
def test_unknown_message_kind_is_a_protocol_error(kind):
    with pytest.raises(ProtocolError, match="unknown message kind") as err:
        decode_header(raw_header(kind=kind), authenticated=True)
    assert type(err.value) is ProtocolError


@pytest.mark.parametrize("flags", [0x0001, 0x0002, 0x0100, 0x8000, 0xFFFF])
def test_any_flag_bit_is_a_protocol_error_in_version_1(flags):
    with pytest.raises(ProtocolError, match="unknown flag bits") as err:
        decode_header(raw_header(flags=flags), authenticated=True)
    assert type(err.value) is ProtocolError


@pytest.mark.parametrize("authenticated", [False, True])
@pytest.mark.parametrize(
    ("body_len", "payload_len"),
    [(-1, 0), (I32_MIN, 0), (0, -1), (0, I64_MIN), (-5, -5)],
)
def test_negative_lengths_are_refused_not_wrapped(body_len, payload_len, authenticated):
    buf = raw_header(body_len=body_len, payload_len=payload_len)
    with pytest.raises(ProtocolError, match="negative length") as err:
        decode_header(buf, authenticated=authenticated)
    assert type(err.value) is ProtocolError


@pytest.mark.parametrize("body_len", [MAX_BODY + 1, I32_MAX])
def test_body_over_max_body_is_frame_too_large(body_len):
    with pytest.raises(FrameTooLarge, match="MAX_BODY") as err:
        decode_header(raw_header(body_len=body_len), authenticated=True)
    assert err.value.code == "FRAME_TOO_LARGE"


@pytest.mark.parametrize("payload_len", [MAX_PAYLOAD + 1, I64_MAX])
def test_payload_over_max_payload_is_frame_too_large(payload_len):
    with pytest.raises(FrameTooLarge, match="MAX_PAYLOAD"):
        decode_header(raw_header(payload_len=payload_len), authenticated=True)


def test_lengths_exactly_at_the_limits_are_accepted_after_auth():
    header = decode_header(
        raw_header(body_len=MAX_BODY, payload_len=MAX_PAYLOAD), authenticated=True
    )
    assert (header.body_len, header.payload_len) == (MAX_BODY, MAX_PAYLOAD)


@pytest.mark.parametrize("body_len", [MAX_PREAUTH_BODY + 1, 65536, MAX_BODY, I32_MAX])
def test_body_over_max_preauth_body_before_auth_is_frame_too_large(body_len):
    buf = raw_header(kind=Kind.HELLO, body_len=body_len)
    with pytest.raises(FrameTooLarge, match="before authentication"):
        decode_header(buf, authenticated=False)


@pytest.mark.parametrize("payload_len", [1, 4096, MAX_PAYLOAD, I64_MAX])
def test_any_payload_before_auth_is_frame_too_large(payload_len):
    with pytest.raises(FrameTooLarge, match="before authentication"):
        decode_header(raw_header(kind=Kind.HELLO, payload_len=payload_len), authenticated=False)


def test_body_of_exactly_max_preauth_body_is_accepted_before_auth():
    header = decode_header(
        raw_header(kind=Kind.HELLO, body_len=MAX_PREAUTH_BODY), authenticated=False
    )
    assert header.body_len == MAX_PREAUTH_BODY


def test_checks_run_in_order_magic_then_version_then_kind_then_flags_then_lengths():
    with pytest.raises(ProtocolError, match="bad magic"):
        decode_header(raw_header(magic=b"XXXX", version=9, kind=99), authenticated=True)
    with pytest.raises(VersionMismatch):
        decode_header(raw_header(version=9, kind=99, flags=1), authenticated=True)
    with pytest.raises(ProtocolError, match="kind"):
        decode_header(raw_header(kind=99, flags=1, body_len=-1), authenticated=True)
    with pytest.raises(ProtocolError, match="flag"):
        decode_header(raw_header(flags=1, body_len=-1), authenticated=True)
    with pytest.raises(ProtocolError, match="negative"):
        decode_header(raw_header(body_len=-1, payload_len=1), authenticated=False)


# -- body and segment validation ---------------------------------------------------------------
@pytest.mark.parametrize(
    "raw", [b"[]", b"[1, 2]", b'"text"', b"42", b"null", b"true"], ids=lambda r: r.decode()
)
def test_body_that_is_json_but_not_an_object_is_a_protocol_error(raw):
    with pytest.raises(ProtocolError, match="must be a JSON object"):
        decode_frame(body_frame(raw), authenticated=True)


@pytest.mark.parametrize(
    "raw",
    [b"{", b"{'a': 1}", b"{}}", b"\xff\xfe", b'{"a": NaN}', b"\x00", b" "],
    ids=["unclosed", "single-quotes", "extra-brace", "not-utf8", "nan", "nul", "blank"],
)
def test_body_that_is_not_valid_json_is_a_protocol_error(raw):
    with pytest.raises(ProtocolError, match="not valid JSON"):
        decode_frame(body_frame(raw), authenticated=True)


def test_empty_body_decodes_as_an_empty_object():
    assert decode_body(b"") == {}


@pytest.mark.parametrize(
    ("segs", "payload"),
    [([1, 1], b"abc"), ([4], b"abc"), ([], b"abc"), ([3, 1], b"abc")],
    ids=["short", "long", "empty-list", "one-extra"],
)
def test_segments_that_do_not_add_up_to_the_payload_are_a_protocol_error(segs, payload):
    buf = body_frame(orjson.dumps({"segs": segs}), payload=payload)
    with pytest.raises(ProtocolError, match="add up"):
        decode_frame(buf, authenticated=True)


@pytest.mark.parametrize(
    "segs",
    [[-1, 4], [1.5, 1.5], ["3"], [True, 2], [None], [[3]]],
    ids=["negative", "float", "string", "bool", "null", "nested"],
)
def test_bad_segment_lengths_are_a_protocol_error(segs):
    buf = body_frame(orjson.dumps({"segs": segs}), payload=b"abc")
    with pytest.raises(ProtocolError, match="bad segment length"):
        decode_frame(buf, authenticated=True)


@pytest.mark.parametrize("segs", ["3", 3, {"a": 3}], ids=["string", "int", "object"])
def test_segs_that_is_not_a_list_is_a_protocol_error(segs):
    with pytest.raises(ProtocolError, match="segs must be a list"):
        segment_lengths({"segs": segs}, 3)


def test_more_than_max_segments_is_a_protocol_error():
    with pytest.raises(ProtocolError, match="at most"):
        segment_lengths({"segs": [0] * (MAX_SEGMENTS + 1)}, 0)
    assert segment_lengths({"segs": [0] * MAX_SEGMENTS}, 0) == [0] * MAX_SEGMENTS


def test_payload_without_segs_is_one_segment():
    frame = decode_frame(body_frame(b"{}", payload=b"abcd"), authenticated=True)
    assert [bytes(s) for s in frame.segments] == [b"abcd"]
    assert segment_lengths({}, 0) == []


# -- whole-frame framing ------------------------------------------------------------------------
@pytest.mark.parametrize("cut", [1, 5, 17, 30])
def test_truncated_frame_is_a_protocol_error(cut):
    buf = frame_bytes(Kind.PUT, {"tensors": []}, [b"0123456789"])
    with pytest.raises(ProtocolError, match="truncated"):
        decode_frame(buf[: len(buf) - cut], authenticated=True)


@pytest.mark.parametrize("extra", [b"\0", b"DJNN", b"x" * 100])
def test_trailing_bytes_after_the_frame_are_a_protocol_error(extra):
    with pytest.raises(ProtocolError, match="trailing bytes"):
        decode_frame(frame_bytes(Kind.PING, {"a": 1}) + extra, authenticated=True)


def test_frame_reader_refuses_a_payload_before_auth_without_reading_it():
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        a.sendall(raw_header(kind=Kind.HELLO, payload_len=MAX_PAYLOAD))
        with pytest.raises(FrameTooLarge):
            FrameReader(b, authenticated=False).poll()


def test_frame_reader_waits_for_the_rest_of_a_split_frame():
    buf = frame_bytes(Kind.PUT, {"tensors": []}, [b"x" * 1000])
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        reader = FrameReader(b, authenticated=True)
        sent = 0
        for cut in (10, HEADER_SIZE + 3, len(buf) - 1):  # mid-header, mid-body, mid-payload
            a.sendall(buf[sent:cut])
            sent = cut
            assert reader.poll() is None
        a.sendall(buf[sent:])
        frame = reader.poll()
        assert bytes(frame.segments[0]) == b"x" * 1000


def test_frame_reader_reports_eof_mid_frame_as_peer_closed():
    a, b = socket.socketpair()
    with a, b:
        b.setblocking(False)
        a.sendall(frame_bytes(Kind.PING, {"pad": "x" * 100})[:50])
        a.shutdown(socket.SHUT_WR)
        reader = FrameReader(b, authenticated=True)
        with pytest.raises(PeerClosed):
            reader.poll()
