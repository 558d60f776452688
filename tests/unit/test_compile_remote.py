"""Note [torch.compile and remote values]: which graphs inductor is spared
(djinn/frontend/compile_remote.py; tests/integration/test_compiled_models.py runs them)."""

from __future__ import annotations

import torch
import torch.fx

from djinn.frontend import compile_remote


def _graph(device: str) -> torch.fx.GraphModule:
    """``arange(4, device=device) + n``, as dynamo hands it over: a factory whose only
    sign of its device is its keyword."""
    g = torch.fx.Graph()
    n = g.placeholder("n")
    made = g.call_function(torch.arange, (4,), {"device": device})
    g.output(g.call_function(torch.add, (made, n)))
    return torch.fx.GraphModule(torch.nn.Module(), g)


def test_a_graph_that_makes_a_remote_tensor_runs_as_it_is_and_others_go_to_inductor():
    calls = []

    def inductor(gm, inputs, *args, **kwargs):
        calls.append(gm)
        return "compiled"

    compile_fx = compile_remote.compile_fx_for(inductor)
    local = _graph("cpu")
    assert compile_fx(local, [torch.ones(1)]) == "compiled" and calls == [local]
    remote = _graph("remote_accelerator:0")  # a factory's device, no remote input
    assert compile_fx(remote, [1]) == remote.forward and calls == [local]
    assert compile_fx(local, [torch.ones(1, device="meta")]) == "compiled"
