"""A model on the model path changed after its move (Note [a registered model changed],
djinn/frontend/model_changes.py): the appliance ran the model as registered and the
changes were silently ignored, so the numbers were the old model's. Every call now
refuses (UNSUPPORTED_OP, saying what changed); a model with hooks at its move takes the
graph path, which runs them."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, logging

from djinn.errors import DjinnError
from tests.model_calls import tiny_llama

R = "remote_accelerator:0"
CONFIG = GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=100, n_positions=32)
logging.set_verbosity_error()


def _model(device: str = "cpu") -> GPT2LMHeadModel:
    torch.manual_seed(1)  # a config of its own: the model keeps the one it is given
    model = GPT2LMHeadModel(copy.deepcopy(CONFIG)).eval()
    # settings a program may keep on a config, whose == is elementwise
    model.config.scales = np.array([1.0, 2.0, 3.0])
    model.config.extra = {"weights": [torch.tensor([1.0, 2.0])]}
    return model.to(device)


def _ids() -> torch.Tensor:
    return torch.randint(0, 100, (1, 5), generator=torch.Generator().manual_seed(0))


def _other() -> dict[str, torch.Tensor]:
    torch.manual_seed(2)
    return GPT2LMHeadModel(CONFIG).state_dict()


CHANGES = {
    # a weight written in place takes the model off the model path, and runs as eager:
    # test_registered_weights.py (Note [weights of a registered model])
    "hooks": lambda m: m.transformer.ln_f.register_forward_hook(lambda mod, i, o: o * 0),
    "replaced": lambda m: setattr(m, "lm_head", torch.nn.Linear(32, 7, bias=False)),
    # .half() and .train() take the model off the model path with its weights, as they
    # are: test_registered_model_trains.py (a submodule put in training mode too)
    # the config, which the forward reads (a review: pad_token_id and problem_type set
    # after the move gave other logits and another loss, silently)
    "config": lambda m: setattr(m.config, "pad_token_id", 0),
    # values whose == is elementwise, set before the move: each call raised ValueError
    # ("truth value of an array is ambiguous") before anything changed; changed in place
    # a module's own setting, which neither the config nor the weights carry (a review:
    # Llama's norm.variance_epsilon = 0.5 ran the registered model, 0.64 off)
    "module setting": lambda m: setattr(m.transformer.ln_f, "eps", 0.5),
    "config array": lambda m: m.config.scales.__setitem__(1, 9.0),
    "config nested": lambda m: m.config.extra["weights"][0].__setitem__(0, 0.5),
}
WORDS = {
    "hooks": "hooks were added",
    "replaced": "'lm_head' was added or replaced",
    "config": "config's 'pad_token_id' was changed",
    "module setting": "transformer.ln_f.eps was changed to 0.5",
    "config array": "config's 'scales' was changed",
    "config nested": "config's 'extra' was changed",
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


def test_what_transformers_itself_leaves_on_the_model_is_no_change(remote):
    """Calls asking for attentions make transformers install its output recorders (hooks)
    for good, and a classifier's first call with labels sets its config's problem_type;
    djinn.analyze runs the local module with the call's arguments, so both appeared on
    the local copy and every later call was refused (a review)."""
    from transformers import BertConfig, BertForSequenceClassification

    model, local = _model(R), _model()
    ids = _ids()
    first = model(ids, output_attentions=True, output_hidden_states=True)
    want = local(ids, output_attentions=True, output_hidden_states=True)
    assert len(first.hidden_states) == len(want.hidden_states) == 2
    assert len(first.attentions) == len(want.attentions)  # none under sdpa, as eager's
    assert torch.equal(model(ids).logits.cpu(), local(ids).logits.detach())
    torch.manual_seed(0)
    cfg = BertConfig(
        num_hidden_layers=1, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, num_labels=3,
    )  # fmt: skip
    bert = BertForSequenceClassification(cfg).eval()
    want = bert(ids, labels=torch.tensor([1])).loss.item()
    bert = bert.to(R)
    for _ in range(2):
        assert abs(bert(ids, labels=torch.tensor([1])).loss.item() - want) <= 1e-6


@pytest.mark.parametrize("change", ["written", "replaced"])
def test_a_buffer_changed_after_the_move_runs_as_eager_or_is_refused(remote, change):
    """Buffers were not compared (a review: Llama's rotary inv_freq halved in place ran
    the registered model, 0.0027 off, silently); then such a call was refused. Written in
    place, the model now leaves the model path with the written value and runs as eager
    (Note [weights of a registered model]); replaced by another tensor, the call is still
    refused (Note [a registered model changed])."""
    got = []
    for device in ("cpu", R):
        model = tiny_llama(device)
        with torch.no_grad():
            for _ in range(2):  # the call's own analysis writes nothing the check sees
                model(_ids().to(device)).logits.cpu()
            rotary = model.model.rotary_emb
            if change == "written":
                rotary.inv_freq.mul_(0.5)
            else:
                rotary.inv_freq = rotary.inv_freq * 0.5
            if change == "replaced" and device == R:
                with pytest.raises(DjinnError, match=r"'model\.rotary_emb\.inv_freq' was"):
                    model(_ids().to(device))
                return
            got.append(model(_ids().to(device)).logits.cpu())
    assert (got[0] - got[1]).abs().max().item() <= 1e-5


@pytest.mark.parametrize("setting, value", [("output_hidden_states", True), ("use_cache", False)])
def test_a_config_setting_the_forward_takes_as_an_argument_is_sent_as_one(remote, setting, value):
    """Note [call settings]: transformers' Trainer sets config.use_cache = False itself,
    and Trainer.evaluate() of a model moved in eval mode was refused (a review). Such a
    setting now travels as the forward's argument: eager's outputs."""
    local, moved = _model(), _model(R)
    for m in (local, moved):
        setattr(m.config, setting, value)
    with torch.no_grad():
        want, got = local(_ids()), moved(_ids().to(R))
    assert type(got) is type(want)
    assert torch.allclose(got.logits.cpu(), want.logits, atol=1e-5)
    if setting == "output_hidden_states":
        assert len(got.hidden_states) == len(want.hidden_states)
    else:
        assert got.past_key_values is None and want.past_key_values is None


def test_load_state_dict_after_the_move_loads(remote):
    """It wrote into meta tensors, a no-op, and the next call was refused; a Trainer
    resuming from a checkpoint does it (a review). The model now takes its weights into
    the session first (Note [a registered model trains]), then loads: eager's numbers."""
    local, moved = _model(), _model(R)
    for m in (local, moved):
        m.load_state_dict(_other())
    assert getattr(moved, "_djinn", None) is None
    with torch.no_grad():
        assert torch.allclose(moved(_ids().to(R)).logits.cpu(), local(_ids()).logits, atol=1e-5)


def _family(name: str) -> torch.nn.Module:
    import transformers

    torch.manual_seed(0)
    if name == "bert classifier":  # its forward takes use_cache through **kwargs
        cfg = transformers.BertConfig(
            num_hidden_layers=1, hidden_size=32, intermediate_size=64, num_attention_heads=2,
            vocab_size=100,
        )  # fmt: skip
        return transformers.BertForSequenceClassification(cfg).eval()
    cfg = transformers.T5Config(  # its stacks read configs of their own: eager ignores it
        d_model=32, d_ff=64, num_layers=1, num_heads=2, vocab_size=100, d_kv=16,
        decoder_start_token_id=0,
    )  # fmt: skip
    return transformers.T5ForConditionalGeneration(cfg).eval()


@pytest.mark.parametrize("name", ["bert classifier", "t5"])
@pytest.mark.parametrize("setting, value", [("use_cache", False), ("output_hidden_states", True)])
def test_call_settings_follow_which_modules_read_them(remote, name, setting, value):
    """Note [call settings]: the first version refused use_cache for a BERT classifier
    (Trainer.evaluate() of any of them) and sent T5 a use_cache its stacks never read from
    the top-level config (a review: no cache where eager returns one)."""
    local, moved = _family(name), _family(name).to(R)
    for m in (local, moved):
        setattr(m.config, setting, value)
    kwargs = {"input_ids": _ids().remainder(100)}
    if name == "t5":
        kwargs["decoder_input_ids"] = kwargs["input_ids"][:, :3]
    with torch.no_grad():
        want = local(**kwargs)
        got = moved(**{k: v.to(R) for k, v in kwargs.items()})
    assert got.keys() == want.keys()
    assert torch.allclose(got.logits.cpu(), want.logits, atol=1e-5)


def test_generate_after_a_call_setting_changed_runs(remote):
    """config.output_hidden_states = True then generate(): refused as a generate()
    argument the appliance does not take (a review); eager's generation_config rules."""
    local, moved = _model(), _model(R)
    for m in (local, moved):
        m.config.output_hidden_states = True
    ids = _ids()
    got = moved.generate(ids.to(R), max_new_tokens=4, do_sample=False, pad_token_id=0)
    assert (
        got.cpu().tolist()
        == local.generate(ids, max_new_tokens=4, do_sample=False, pad_token_id=0).tolist()
    )


def test_weights_assigned_through_a_wrapper_before_the_first_call_are_found(remote):
    """load_state_dict(assign=True) through a wrapper put CPU parameters in the registered
    model before its first call, which took them for the registered ones: the registered
    weights ran, 0.383 off eager (a review)."""

    class Wrap(torch.nn.Module):
        def __init__(self, m: torch.nn.Module) -> None:
            super().__init__()
            self.m = m

    moved = _model(R)
    Wrap(moved).load_state_dict({f"m.{k}": v for k, v in _other().items()}, assign=True)
    with pytest.raises(DjinnError, match="was added or replaced") as info:
        moved(_ids().to(R))
    assert info.value.code == "UNSUPPORTED_OP"
