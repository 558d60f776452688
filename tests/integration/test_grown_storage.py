"""A graph whose ``out=`` op grows a handle's storage: the session is charged the growth
(``TensorStore.recharge``), found through the handles the graph named."""

from __future__ import annotations

import torch

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
