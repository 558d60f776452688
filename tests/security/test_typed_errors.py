"""Issue 17 §3: every malformed body gets a typed error that names what was wrong.

Each session request kind is sent with each of its body fields replaced by values of
the wrong shape (lists and objects where strings or ints go: the ``unhashable type``
family, nested garbage, huge numbers). The appliance must answer each with a typed
INVALID_ARGUMENT / PROTOCOL_ERROR / NOT_FOUND / UNSUPPORTED_OP..., never INTERNAL, and
the session must keep working.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from djinn.errors import DjinnError
from djinn.protocol.frames import Kind

BAD_VALUES = [[], {}, [[]], [{}], [[1]], {"a": []}, "x", 1.5, None, -1, (1 << 63) - 1, True]
# request kind -> a well-formed body to start from; each field is then spoiled in turn
BODIES = {
    Kind.ALLOC: {"sizes": [16]},
    Kind.PUT: {"tensors": [{"desc": {"dtype": "float32", "shape": [1]}, "seg": 0}]},
    Kind.GET: {"handles": ["h"]},
    Kind.FREE: {"handles": ["h"]},
    Kind.EXEC: {
        "nodes": [{"op": "aten::add.Tensor", "args": [{"$h": "h"}, {"$h": "h"}]}],
        "keep": [{"$v": 0}],
        "fetch": [{"$v": 0, "i": 0}],
    },
    Kind.LOAD: {"path": "/nonexistent", "hash_only": True},
    Kind.REGISTER: {"fingerprint": "f" * 32, "class": "x.Y", "config_json": "{}"},
    Kind.CALL: {"fingerprint": "f" * 32, "method": "forward", "args": [], "kwargs": {}},
    Kind.HEARTBEAT: {"release": [1], "free": ["h"], "free_objects": ["o"]},
}
NODE_FIELDS = {"op": "aten::add.Tensor", "args": [], "kwargs": {}, "rng": 0}
REF_FIELDS = {"$h": "h", "$v": 0, "i": 0}


def _cases():
    for kind, body in BODIES.items():
        for field, bad in itertools.product([*sorted(body), "release", "free"], BAD_VALUES):
            yield kind, {**body, field: bad}
    base = BODIES[Kind.EXEC]
    for field, bad in itertools.product(NODE_FIELDS, BAD_VALUES):
        node = {"op": "aten::neg.default", "args": [{"$h": "h"}], field: bad}
        yield Kind.EXEC, {**base, "nodes": [node]}
    for field, bad in itertools.product(REF_FIELDS, BAD_VALUES):
        ref = {"$v": 0, field: bad}
        yield Kind.EXEC, {**base, "keep": [ref]}
        yield Kind.EXEC, {**base, "fetch": [ref]}
        node = {"op": "aten::neg.default", "args": [ref]}
        yield Kind.EXEC, {**base, "nodes": [node]}
    for tag, bad in itertools.product(
        ("$dtype", "$mf", "$layout", "$device", "$float"), BAD_VALUES
    ):
        node = {"op": "aten::add.Scalar", "args": [{"$h": "h"}, {tag: bad}]}
        yield Kind.EXEC, {**base, "nodes": [node]}


def _with_handle(x, h: str):
    """The case with its placeholder handle "h" replaced by a live one."""
    if x == "h":
        return h
    if isinstance(x, list):
        return [_with_handle(v, h) for v in x]
    if isinstance(x, dict):
        return {k: _with_handle(v, h) for k, v in x.items()}
    return x


def test_malformed_bodies_get_typed_errors_never_internal(appliance):
    internal = []
    with appliance.connect("unix") as client, client.session() as s:
        h = s.put(torch.ones(2)).handle
        for kind, body in _cases():
            try:
                s._call(kind, _with_handle(body, h))
            except DjinnError as exc:
                if exc.code == "INTERNAL":
                    internal.append(f"{kind.name} {body!r}: {exc.message[:120]}")
        assert s.put(torch.arange(3.0)).cpu().tolist() == [0.0, 1.0, 2.0]
    assert internal == [], "\n".join(internal[:20])


@pytest.mark.parametrize("bad", [[], {}, [1, 2]])
def test_unhashable_fingerprint_in_call_is_invalid_argument(appliance, bad):
    with appliance.connect("unix") as client, client.session() as s:
        with pytest.raises(DjinnError) as info:
            s._call(Kind.CALL, {"fingerprint": bad})
        assert info.value.code in ("INVALID_ARGUMENT", "NOT_FOUND")
        assert "fingerprint" in info.value.message
