"""A model call on a GPU worker checks its token ids against the model's vocabulary
before the forward (appliance/call_checks.py): CUDA's embedding asserts on the device,
which loses the worker's context for every session on it."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel

from djinn.appliance import call_checks
from djinn.errors import ExecutionError


@pytest.fixture(scope="module")
def model():
    cfg = GPT2Config(n_layer=1, n_embd=16, n_head=2, vocab_size=50, n_positions=32)
    return GPT2LMHeadModel(cfg).eval()


def test_token_ids_within_the_vocabulary_pass_and_the_cpu_agrees(model):
    ids = torch.tensor([[0, 49, 7]])
    call_checks.check(model, "m.forward", (ids,), {})
    call_checks.check(model, "m.forward", (), {"input_ids": ids, "labels": ids})
    call_checks.check(
        model, "m.forward", (), {"input_ids": ids, "labels": torch.tensor([[-100, 3, 4]])}
    )
    model(ids)  # and the forward runs


@pytest.mark.parametrize("bad", [50, -1, 10**9])
def test_a_token_id_past_the_vocabulary_is_refused_as_the_cpu_kernel_refuses(model, bad):
    ids = torch.tensor([[0, bad]])
    for args, kwargs in (((ids,), {}), ((), {"input_ids": ids})):
        with pytest.raises(ExecutionError, match=f"token id {bad}"):
            call_checks.check(model, "m.forward", args, kwargs)
    with pytest.raises(IndexError):
        model(ids)  # the CPU kernel refuses the same ids
    with pytest.raises(ExecutionError, match="labels"):
        call_checks.check(model, "m.forward", (), {"input_ids": ids[:, :1], "labels": ids})


def test_a_module_without_input_embeddings_is_not_checked():
    call_checks.check(torch.nn.Linear(2, 2), "m.forward", (torch.tensor([99]),), {})
