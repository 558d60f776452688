"""put / get through a real appliance: every dtype and odd layout, unix (arena) and TCP."""

from __future__ import annotations

import pytest
import torch

from djinn.protocol.tensors import DTYPES

VIAS = ["unix", "tcp"]


@pytest.fixture(scope="module", params=VIAS)
def session(request, appliance):
    client = appliance.connect(request.param)
    s = client.session()
    yield s
    s.close()
    client.close()


def _sample(dtype: torch.dtype, shape=(33, 17)) -> torch.Tensor:
    if dtype == torch.bool:
        return torch.rand(shape) > 0.5
    if dtype.is_complex or (dtype.is_floating_point and dtype.itemsize >= 2):
        return torch.randn(shape, dtype=torch.float32 if not dtype.is_complex else dtype).to(dtype)
    if dtype.is_floating_point:
        return torch.randn(shape).to(dtype)
    return torch.randint(0, 100, shape).to(dtype)


def _bits_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
    )


@pytest.mark.parametrize("name", sorted(DTYPES))
@pytest.mark.parametrize("size", ["small", "bulk"])
def test_every_dtype_round_trips(session, name, size):
    shape = (33, 17) if size == "small" else (512, 300)  # bulk goes through the arena
    t = _sample(DTYPES[name], shape)
    r = session.put(t)
    assert r.shape == t.shape and r.dtype == t.dtype
    assert _bits_equal(r.cpu(), t)


LAYOUTS = {
    "transposed": lambda: torch.randn(300, 200).t(),
    "channels_last": lambda: torch.randn(8, 16, 32, 32).to(memory_format=torch.channels_last),
    "strided_slice": lambda: torch.randn(400, 400)[::3, 1::2],
    "expanded": lambda: torch.randn(100).expand(500, 100),
    "scalar": lambda: torch.tensor(2.5),
    "zero_size": lambda: torch.zeros(0, 7),
    "zero_size_bool": lambda: torch.zeros(3, 0, dtype=torch.bool),
    "conj_complex": lambda: torch.randn(64, dtype=torch.complex128).conj(),
    "offset_view": lambda: torch.arange(100_000)[70_000:],
    "requires_grad": lambda: torch.randn(10, requires_grad=True),
    "non_contig_bf16": lambda: torch.randn(256, 256).bfloat16().t()[::2],
}


@pytest.mark.parametrize("name", sorted(LAYOUTS))
def test_odd_layouts_round_trip(session, name):
    t = LAYOUTS[name]()
    back = session.put(t).cpu()
    assert torch.equal(back, t.detach().resolve_conj())


def test_dense_layouts_come_back_with_their_strides(session):
    for t in (LAYOUTS["transposed"](), LAYOUTS["channels_last"]()):
        assert session.put(t).cpu().stride() == t.stride()


def test_many_tensors_in_one_put(session):
    ts = [torch.randn(10), torch.randn(512, 512), torch.arange(5), torch.zeros(0)]
    remotes = session.put_many(ts)
    for t, back in zip(ts, session.get_many(remotes), strict=False):
        assert torch.equal(t, back)


def test_a_freed_handle_is_gone(session):
    from djinn.errors import NotFound

    r = session.put(torch.randn(4))
    r.free()
    with pytest.raises(NotFound):
        session.get(r)


@pytest.mark.slow
@pytest.mark.parametrize("via", VIAS)
def test_one_gib_round_trip(fresh_appliance, via):
    # its own appliance: on a shared one, other open sessions would cap this one at
    # arena_session_max of the arena (issue 17 §4), which is the point of the cap
    appliance = fresh_appliance(arena_bytes="1536MiB")
    t = torch.empty(1 << 28, dtype=torch.float32)
    t[::4096] = torch.arange(t[::4096].numel(), dtype=torch.float32)  # cheap, distinctive
    t[1::4096] = 7.0
    with appliance.connect(via) as client, client.session() as s:
        r = s.put(t)
        back = r.cpu()
        assert back.shape == t.shape
        assert torch.equal(back[::4096], t[::4096]) and torch.equal(back[1::4096], t[1::4096])
        # bit for bit: the rest of t is whatever torch.empty left there, NaNs included,
        # and a NaN equals nothing, not even the same NaN
        assert torch.equal(back.view(torch.int32), t.view(torch.int32))
        del back
        r.free()


@pytest.mark.parametrize("shape", [(4,), (700, 300)])
def test_get_into_a_preallocated_tensor(session, shape):
    t = torch.randn(*shape)
    r = session.put(t)
    out = torch.empty(*shape)
    back = r.cpu(out=out)
    assert back is out and torch.equal(out, t)
    tt = session.put(torch.randn(300, 200).t())  # a transposed layout into a contiguous out
    out2 = torch.empty(200, 300)
    assert torch.equal(tt.cpu(out=out2), tt.cpu())
    with pytest.raises(ValueError):
        r.cpu(out=torch.empty(3, dtype=torch.float64))
