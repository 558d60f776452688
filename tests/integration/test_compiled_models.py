"""``torch.compile`` of a model on the remote device (Note [torch.compile and remote
values]): it runs, with local eager's numbers."""

from __future__ import annotations

import copy

import pytest
import torch

from djinn.frontend import compile_remote

transformers = pytest.importorskip("transformers")


def test_torch_compile_of_a_graph_path_gpt2_gives_local_eagers_logits(remote):
    """Its cache positions are `torch.arange(n, device=remote)`, a graph with no remote
    input: inductor raised `KeyError: 'remote_accelerator'` at the first call."""
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=100)
    torch.manual_seed(0)
    local = transformers.GPT2LMHeadModel(cfg).eval()
    # moved in training mode, so it stays on the graph path (Note [module to])
    moved = copy.deepcopy(local).train().to(remote).eval()
    compiled = torch.compile(moved)
    ids = torch.randint(0, 100, (1, 8))
    with torch.no_grad():
        want = local(ids).logits
        for _ in range(2):  # compiled at the first call, guarded at the second
            got = compiled(ids.to(remote)).logits.cpu()
            torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_dynamos_clone_of_a_remote_tensor_is_a_clone_and_others_are_its_own(remote):
    seen = []

    def dynamo(x, *, dtype=None):
        seen.append(x)
        return "dynamo's"

    clone_input = compile_remote.clone_input_for(dynamo)
    local = torch.ones(3)
    assert clone_input(local) == "dynamo's" and seen == [local]
    x = torch.arange(3.0).to(remote).requires_grad_()
    y = clone_input(x, dtype=torch.float64)
    assert seen == [local] and y.requires_grad and y.dtype == torch.float64
    assert y.device == x.device and y.detach().cpu().tolist() == [0.0, 1.0, 2.0]
    graph = torch.fx.symbolic_trace(lambda n: n + 1)
    assert compile_remote.makes_remote(graph, [x]) and not compile_remote.makes_remote(
        graph, [local]
    )
