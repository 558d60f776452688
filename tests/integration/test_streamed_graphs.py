"""Note [streamed graphs] (djinn/frontend/trace.py): a thread that captures a long run of
ops sends every ``graph_chunk_ops`` of them without waiting, and every value stays what
eager PyTorch computes."""

from __future__ import annotations

import pytest
import torch

from djinn.errors import ExecutionError
from djinn.frontend import trace
from djinn.runtime.session import Session


@pytest.fixture
def streamed(remote, monkeypatch):
    """The frontend with this thread's trace cut every 16 ops; counts the graphs sent
    without waiting and the longest trace the thread held."""
    tr = trace.current()
    # what an earlier test on this thread captured and never read runs first: the counts
    # are this test's (a CI run's first part held 70 such ops)
    trace.flush(tr)
    monkeypatch.setattr(tr, "chunk_ops", 16)
    seen = {"async": [], "longest": 0}
    real_async, real_add = Session.run_graph_async, trace.Trace.add

    def counting(self, nodes, keep, inline):
        seen["async"].append(len(nodes))
        return real_async(self, nodes, keep, inline)

    def add(self, node):
        real_add(self, node)
        seen["longest"] = max(seen["longest"], len(self.nodes))

    monkeypatch.setattr(Session, "run_graph_async", counting)
    monkeypatch.setattr(trace.Trace, "add", add)
    return remote, seen


def _chain(x: torch.Tensor, n: int) -> torch.Tensor:
    keep = []
    for i in range(n):
        x = torch.tanh(x * 1.01 + i * 0.001)
        if i % 7 == 0:
            keep.append(x)  # some intermediates stay alive across cuts
    return x + sum(keep)


def test_a_long_chain_is_sent_in_parts_and_equals_eager(streamed):
    device, seen = streamed
    x = torch.randn(32, 32, generator=torch.Generator().manual_seed(0))
    got = _chain(x.to(device), 60).cpu()
    want = _chain(x, 60)
    assert (got - want).abs().max().item() <= 1e-5
    # 60 iterations of 3 ops (plus the sums): at least ten parts went without waiting,
    # each at most the chunk, and the thread never held more than one chunk
    assert len(seen["async"]) >= 10
    assert max(seen["async"]) <= 16
    assert seen["longest"] <= 16


def test_with_streaming_off_the_graph_waits_for_a_value(streamed, monkeypatch):
    device, seen = streamed
    monkeypatch.setattr(trace.current(), "chunk_ops", 0)
    x = torch.randn(8, 8, generator=torch.Generator().manual_seed(0))
    got = _chain(x.to(device), 30).cpu()
    assert (got - _chain(x, 30)).abs().max().item() <= 1e-5
    assert seen["async"] == []
    assert seen["longest"] >= 30 * 3  # 3 ops an iteration, all in one trace


def test_a_part_that_fails_fails_only_what_depends_on_it(streamed):
    device, seen = streamed
    ints = torch.arange(1, 5).to(device)
    bad = ints ** (-1)  # integer to a negative power: the worker's kernel refuses it
    x = torch.ones(4).to(device)
    for _ in range(40):  # cuts land the failed part while this keeps capturing
        x = x * 1.5 - 0.25
    assert len(seen["async"]) >= 2
    assert torch.equal(x.cpu(), _float_chain(40))
    with pytest.raises(ExecutionError, match="pow"):
        (bad + 1).cpu()


def _float_chain(n: int) -> torch.Tensor:
    x = torch.ones(4)
    for _ in range(n):
        x = x * 1.5 - 0.25
    return x


def test_a_repeated_forward_is_cut_at_the_same_ops_and_reuses_its_templates(streamed):
    device, seen = streamed
    torch.manual_seed(0)
    model = torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(12)])
    x = torch.randn(4, 16)
    want = model(x)
    remote_model = model.to(device)
    with torch.no_grad():
        outs = [remote_model(x.to(device)).cpu()]  # its first part carries the weights too
        seen["async"].clear()
        outs += [remote_model(x.to(device)).cpu() for _ in range(3)]
    parts = seen["async"]
    assert len(parts) >= 3 and len(parts) % 3 == 0
    third = len(parts) // 3
    assert parts[:third] == parts[third : 2 * third] == parts[2 * third :]
    from djinn.frontend.session import default_session

    cached = len(default_session()._graphs)
    with torch.no_grad():
        again = remote_model(x.to(device)).cpu()
    assert len(default_session()._graphs) == cached  # no new template: the same parts
    for out in [*outs, again]:
        assert (out - want.detach()).abs().max().item() <= 1e-5


def test_small_uploads_in_a_loop_never_grow_the_trace(streamed):
    """Each is a put sent without waiting (Note [puts sent without waiting]), not a node
    of the trace: a loop of them holds nothing on the client and sends no graph."""
    device, seen = streamed
    parts = [torch.full((2,), float(i)).to(device) for i in range(50)]
    assert seen["longest"] == 0 and not seen["async"]
    want = torch.arange(50.0).repeat_interleave(2).view(50, 2)
    assert torch.equal(torch.stack(parts).cpu(), want)


def test_a_loop_past_the_appliances_graph_limit_runs_with_the_default(remote):
    # Unstreamed, 100,010 ops make one graph the appliance refuses (at most 100,000 ops):
    # INVALID_ARGUMENT at the first read. The default cut sends it in parts.
    from djinn import config
    from djinn.protocol.graph import MAX_NODES

    assert 0 < trace.current().chunk_ops == config.load().graph_chunk_ops <= MAX_NODES
    x = torch.zeros(2).to(remote)
    for _ in range(MAX_NODES + 10):
        x.add_(1)
    assert torch.equal(x.cpu(), torch.full((2,), float(MAX_NODES + 10)))
