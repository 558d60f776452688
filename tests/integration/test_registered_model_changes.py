"""A model on the model path changed after its move (Note [a registered model changed],
djinn/frontend/remote_module.py): the appliance ran the model as registered and the
changes were silently ignored, so the numbers were the old model's. Every call now
refuses (UNSUPPORTED_OP, saying what changed); a model with hooks at its move takes the
graph path, which runs them."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, logging

from djinn.errors import DjinnError

R = "remote_accelerator:0"
CONFIG = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
logging.set_verbosity_error()


def _model(device: str = "cpu") -> GPT2LMHeadModel:
    torch.manual_seed(1)
    return GPT2LMHeadModel(CONFIG).eval().to(device)


def _ids() -> torch.Tensor:
    return torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(0))


def _other() -> dict[str, torch.Tensor]:
    torch.manual_seed(2)
    return GPT2LMHeadModel(CONFIG).state_dict()


CHANGES = {
    "written in place": lambda m: m.transformer.wpe.weight.zero_(),
    "load_state_dict": lambda m: m.load_state_dict(_other()),
    "hooks": lambda m: m.transformer.ln_f.register_forward_hook(lambda mod, i, o: o * 0),
    "replaced": lambda m: setattr(m, "lm_head", torch.nn.Linear(32, 7, bias=False)),
    "float16": lambda m: m.half(),
    "training": lambda m: m.train(),
}
WORDS = {
    "written in place": "written in place",
    "load_state_dict": "written in place",
    "hooks": "hooks were added",
    "replaced": "'lm_head' was added or replaced",
    "float16": "became torch.float16",
    "training": "training mode",
}


def test_an_unchanged_registered_model_runs_with_local_eagers_numbers(remote):
    local, moved = _model(), _model(R)
    with torch.no_grad():
        want = local(_ids()).logits
        for _ in range(2):
            assert torch.allclose(moved(_ids().to(R)).logits.cpu(), want, atol=1e-5)
        moved.train()
        moved.eval()  # back as it was registered: runs
        assert torch.allclose(moved(_ids().to(R)).logits.cpu(), want, atol=1e-5)


@pytest.mark.parametrize("change", list(CHANGES))
@pytest.mark.parametrize("called_before", [False, True], ids=["first call", "later call"])
def test_a_change_after_the_move_refuses_the_call(remote, change, called_before):
    moved = _model(R)
    with torch.no_grad():
        if called_before:
            moved(_ids().to(R)).logits.cpu()
        CHANGES[change](moved)
        with pytest.raises(DjinnError, match=WORDS[change]) as info:
            moved(_ids().to(R))
    assert info.value.code == "UNSUPPORTED_OP"


def test_a_model_with_hooks_at_its_move_takes_the_graph_path(remote):
    local, moved = _model(), _model()
    for m in (local, moved):
        m.transformer.ln_f.register_forward_hook(lambda mod, i, o: o * 0.5)
    moved.to(R)
    assert getattr(moved, "_djinn", None) is None  # not registered
    with torch.no_grad():
        got = moved(_ids().to(R)).logits.cpu()
    assert torch.allclose(got, local(_ids()).logits, atol=1e-5)
