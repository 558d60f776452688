"""A graph whose ``out=`` op grows a handle's storage: the session is charged the growth
(``TensorStore.recharge``), found through the handles the graph named."""

from __future__ import annotations

import pytest
import torch

import djinn
from djinn.errors import InvalidArgument
from djinn.frontend import session as frontend_session
from tests.conftest import wait_for

R = "remote_accelerator:0"
MIB = 1 << 20


def test_a_handle_grown_by_an_out_argument_is_charged_to_its_session(own_frontend):
    app = own_frontend
    bystanders = [torch.full((4,), float(i), device=R) for i in range(64)]
    for b in bystanders:
        b.cpu()  # handles of their own, which the graph below does not name
    x = torch.ones(MIB // 4, device=R)  # 1 MiB
    out = torch.empty(0, device=R)
    x.cpu(), out.cpu()
    sid = frontend_session.default_session().id

    def held() -> int:
        return next(s for s in app.stats()["sessions"] if s["id"] == sid)["bytes"]

    before = wait_for(held)
    torch.add(x, 1, out=out)  # resizes ``out`` on the appliance: 0 bytes -> 1 MiB
    assert torch.equal(out.cpu(), torch.full((MIB // 4,), 2.0))
    wait_for(lambda: held() - before >= MIB)
    assert [b.cpu()[0].item() for b in bystanders] == [float(i) for i in range(64)]


def test_reading_a_grown_handle_into_an_out_of_its_old_shape_is_refused(appliance):
    """The client checks ``out=`` against the shape it knows, which an ``out=`` op on the
    appliance may have outgrown. Copying the reply's bytes into ``out`` wrote past its end
    (a SIGSEGV in a reviewer's probe); it is refused, the slab given back, and the session
    goes on."""
    with djinn.connect(appliance.unix) as client, client.session() as s:
        seed = s.put(torch.zeros(4))
        (small,), _ = s.execute(
            [{"op": "aten::add.Tensor", "args": [seed.ref(), 1.0]}], keep=[{"$v": 0}]
        )
        big = s.put(torch.ones(4 * MIB // 4))
        s.execute(
            [
                {
                    "op": "aten::add.out",
                    "args": [big.ref(), big.ref()],
                    "kwargs": {"out": small.ref()},
                }
            ]
        )
        guard = torch.full((MIB,), 7.0)
        dest = torch.zeros(4)
        with pytest.raises(InvalidArgument, match=r"now \[1048576\]"):
            small.cpu(out=dest)
        assert torch.equal(dest, torch.zeros(4)) and bool((guard == 7).all())
        assert torch.equal(small.cpu(), torch.full((MIB,), 2.0))  # read whole, it is there
        assert s.memory_allocated() > 0 and not s._spares.held  # and the session goes on
