"""Note [graph templates] end to end: a graph sent again goes by fingerprint, its bytes
do not grow with its ops, and its results are eager's; a template the worker let go is
sent whole again, transparently."""

from __future__ import annotations

import gc

import torch

from djinn.frontend.session import default_session
from djinn.protocol.frames import Kind

R = "remote_accelerator:0"


def _chain(x: torch.Tensor, n: int) -> torch.Tensor:
    for _ in range(n):
        x = torch.tanh(x * x + x)  # no float arguments: no scalars to send
    return x


def _sent(fn) -> tuple[int, torch.Tensor]:
    """Bytes of the graphs ``fn`` sends (handles freed earlier, which ride along with the
    next request, are sent first). Only EXEC counts: heartbeats (the session's thread,
    whenever it has been idle for half an interval) and a recovering session's checkpoint
    GETs (on a timer, Note [lineage journal]) are not the graph's."""
    session = default_session()
    gc.collect()
    session._call(Kind.HEARTBEAT)
    channel = session.channel

    def sent() -> int:
        return channel.sent_by_kind[Kind.EXEC]

    before = sent()
    out = fn()
    return sent() - before, out


def test_a_repeated_graph_costs_the_same_bytes_whatever_its_length(remote):
    x = torch.randn(64) / 8
    xr = x.to(R)
    xr.cpu()  # the upload goes in a graph of its own
    sizes = {}
    for n in (20, 200):
        whole, first = _sent(lambda n=n: _chain(xr, n).cpu())
        again, second = _sent(lambda n=n: _chain(xr, n).cpu())
        assert torch.equal(first, second) and torch.equal(first, _chain(x, n))
        sizes[n] = (whole, again)
    assert sizes[200][0] > 5 * sizes[20][0]  # sent whole: grows with the ops
    assert sizes[200][1] == sizes[20][1]  # by fingerprint: constant
    assert sizes[200][1] < sizes[20][0]


def test_scalars_travel_with_the_fingerprint(remote):
    x = torch.randn(32)
    xr = x.to(R)

    def step(lr: float) -> torch.Tensor:
        y = xr
        for _ in range(20):
            y = y * lr + 0.5
        return y.cpu()

    for lr in (0.1, 0.2, 0.3):  # one template, three scalars
        want = x
        for _ in range(20):
            want = want * lr + 0.5
        assert torch.equal(step(lr), want)


def test_a_template_the_appliance_does_not_have_is_sent_whole(remote, monkeypatch):
    """The client believes the appliance keeps a template it never kept (as after a
    worker let it go): the appliance answers NOT_FOUND and the graph goes whole."""
    from djinn.protocol import templates

    session = default_session()
    real_call = session._call

    def kept_nothing(kind, body=None, segments=(), **kw):
        if body and body.get("cache"):
            body = {k: v for k, v in body.items() if k != "cache"}
            reply = real_call(kind, body, segments, **kw)
            reply.body["graph"] = templates.fingerprint(templates.template(body)[0])
            return reply
        return real_call(kind, body, segments, **kw)

    x = torch.randn(16)
    xr = x.to(R)
    monkeypatch.setattr(session, "_call", kept_nothing)
    assert torch.equal(_chain(xr, 37).cpu(), _chain(x, 37))
    monkeypatch.undo()
    assert torch.equal(_chain(xr, 37).cpu(), _chain(x, 37))  # by fingerprint: NOT_FOUND
    assert torch.equal(_chain(xr, 37).cpu(), _chain(x, 37))  # kept for real this time


def test_an_optimizer_step_of_a_few_nodes_over_many_tensors_goes_by_fingerprint(remote):
    """Adam's step is 7 ``_foreach_`` nodes over every parameter: a small graph by its
    node count, a big one by its values (TEMPLATE_MIN_WEIGHT)."""
    torch.manual_seed(0)
    local = [torch.randn(16, requires_grad=True) for _ in range(24)]
    grads = [torch.randn(16) for _ in local]
    remote_params = [p.detach().to(R).requires_grad_() for p in local]
    opts = [torch.optim.Adam(ps, lr=0.1, foreach=True) for ps in (local, remote_params)]
    sizes = []
    for _ in range(4):
        for p, g in zip(local, grads, strict=True):
            p.grad = g.clone()
        for p, g in zip(remote_params, grads, strict=True):
            p.grad = g.to(R)
        torch.cat([p.grad for p in remote_params]).cpu()  # the uploads go first
        opts[0].step()
        sent, _ = _sent(lambda: (opts[1].step(), remote_params[0].detach().cpu()))
        sizes.append(sent)
    # step 1 makes the state, step 2 is the steady graph's first time (whole), 3 and 4
    # go by fingerprint with their new bias corrections
    assert max(sizes[2:]) * 2 < sizes[1], sizes  # the handles and floats only
    for p, q in zip(local, remote_params, strict=True):
        assert torch.equal(p.detach(), q.detach().cpu())
