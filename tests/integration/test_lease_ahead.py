"""Note [lease ahead] end to end: a put of a size put before is one round trip, its values
are the tensor's, spare slabs are given back and never cost a put that would fit, and a
PUT's lease request is checked before anything is kept."""

from __future__ import annotations

import pytest
import torch

from djinn.errors import InvalidArgument, ResourceExhausted
from djinn.protocol.frames import Kind
from djinn.runtime.slabs import IDLE_PUTS
from tests.conftest import wait_for

MIB = 1 << 20


def _row(appliance, session) -> dict:
    return next(r for r in appliance.stats()["sessions"] if r["id"] == session.id)


def test_a_size_put_again_goes_in_one_round_trip(appliance):
    with appliance.connect() as client, client.session() as s:
        channel = s.channel
        seen = []
        for i in range(6):
            t = torch.randn(MIB // 4) + i  # 1 MiB: through the arena
            seen.append((channel.sent_by_kind[Kind.ALLOC], s.put(t), t))
        allocs = [a for a, _, _ in seen] + [channel.sent_by_kind[Kind.ALLOC]]
        assert allocs[0] == 0 and allocs[1] > 0  # the first put ALLOCs
        assert len(set(allocs[2:])) == 1  # the third and later: no ALLOC at all
        for _, r, t in seen:
            assert torch.equal(r.cpu(), t)
        # the spare for the next put (stats are pushed a moment later)
        wait_for(lambda: _row(appliance, s)["arena_leases"] >= 1)


@pytest.mark.parametrize("wait", [True, False], ids=["waited", "not-waited"])
def test_two_sizes_put_in_turn_go_without_alloc(appliance, wait):
    """An input and its mask moved in at every step: each size was put two puts before,
    not just before, and still goes in one round trip (and, not waited for, without
    waiting for anything else)."""
    with appliance.connect() as client, client.session() as s:
        channel = s.channel
        kept = []
        for i in range(8):
            if i == 2:
                allocs = channel.sent_by_kind[Kind.ALLOC]
            for n in (MIB // 4, MIB // 8):  # 1 MiB and 512 KiB: through the arena
                t = torch.randn(n) + i
                kept.append((s.put(t, wait=wait), t))
        assert allocs > 0 and channel.sent_by_kind[Kind.ALLOC] == allocs
        for r, t in kept:
            assert torch.equal(r.cpu(), t)


def test_spares_of_a_size_no_longer_put_are_given_back(appliance):
    with appliance.connect() as client, client.session() as s:
        for _ in range(3):
            s.put(torch.randn(MIB // 4))
        assert s._spares.held == MIB
        for _ in range(IDLE_PUTS + 2):
            s.put(torch.randn(3 * MIB // 4))  # another size
        assert s._spares.take([MIB]) == [None]
        s._call(Kind.HEARTBEAT)  # the release rides along
        # what the session holds: its tensors are freed, one 3 MiB spare is left
        spares = len(s._spares.drain())
        wait_for(lambda: _row(appliance, s)["arena_leases"] == spares)


def test_an_alloc_the_arena_refuses_gives_the_spares_back_and_tries_again(appliance):
    with appliance.connect() as client, client.session() as s:
        for _ in range(3):
            s.put(torch.randn(MIB // 4))
        assert s._spares.held == MIB
        real = s._call
        refused = []

        def full_once(kind, body=None, segments=(), **kw):
            if kind == Kind.ALLOC and not refused:
                refused.append(body)
                raise ResourceExhausted("host arena: no free slab (test)")
            return real(kind, body, segments, **kw)

        s._call = full_once
        sent = []
        orig = s.channel.call
        s.channel.call = lambda kind, body=None, *a, **kw: (
            sent.append((kind, body)) or orig(kind, body, *a, **kw)
        )
        t = torch.randn(MIB // 2)  # 2 MiB: a size without a spare
        r = s.put(t)
        assert refused and s._spares.held == 0
        alloc = next(b for k, b in sent if k == Kind.ALLOC)
        assert len(alloc["release"]) == 1  # the 1 MiB spare went back with the retry
        assert torch.equal(r.cpu(), t)


def test_a_put_with_a_bad_lease_is_refused_and_keeps_nothing(appliance):
    with appliance.connect() as client, client.session() as s:
        desc = {"dtype": "float32", "shape": [2], "strides": [1]}
        body = {"tensors": [{"desc": desc, "seg": 0}]}
        before = _row(appliance, s)["handles"]
        for lease in (["x"], [0], [-4096], "4096", [True]):
            with pytest.raises(InvalidArgument):
                s._call(Kind.PUT, {**body, "lease": lease}, [torch.ones(2).numpy().data])
        assert _row(appliance, s)["handles"] == before
        # more than the arena could give is not an error: the PUT happened, nothing leased
        reply = s._call(Kind.PUT, {**body, "lease": [1 << 50]}, [torch.ones(2).numpy().data])
        assert reply.body["leased"] == [] and len(reply.body["handles"]) == 1


def test_an_unused_lease_given_back_frees_its_slab(appliance):
    with appliance.connect() as client, client.session() as s:
        (off,) = s._call(Kind.ALLOC, {"sizes": [4 * MIB]}).body["slabs"]
        wait_for(lambda: _row(appliance, s)["arena_leases"] == 1)
        s._call(Kind.HEARTBEAT, {"release": [off]})
        wait_for(lambda: _row(appliance, s)["arena_leases"] == 0)
        with pytest.raises(Exception, match="not leased"):
            desc = {"dtype": "uint8", "shape": [16], "strides": [1]}
            s._call(Kind.PUT, {"tensors": [{"desc": desc, "slab": off}]})
