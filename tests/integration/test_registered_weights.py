"""Note [weights of a registered model] (djinn/frontend/registered_weights.py): a model on
the model path keeps meta tensors locally. Reading one of its weights raised torch's
untyped "Cannot copy out of meta tensor"; writing one wrote into a meta tensor (and inside
``inference_mode`` nothing noticed); ``torch.save(model.state_dict())`` saved meta
tensors. A use now runs on a session copy of the weight: reads under ``no_grad`` keep the
model path; a write, a view kept or a use with gradients takes the model off it (its
weights copied into the session, warned once) and goes on as eager. Every case is
compared with the same code on the CPU; the shared copy stays as it was."""

from __future__ import annotations

import copy
import gc
import io
import warnings

import pytest
import torch
import transformers

from djinn.errors import UnsupportedOp
from tests.conftest import in_threads
from tests.model_calls import tiny_llama

R = "remote_accelerator:0"
transformers.logging.set_verbosity_error()
IDS = torch.tensor([[1, 2, 3, 4, 5]])


def _gpt2(device: str = "cpu") -> transformers.GPT2LMHeadModel:
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=16)
    return transformers.GPT2LMHeadModel(cfg).eval().to(device)


def _logits(model: torch.nn.Module) -> torch.Tensor:
    with torch.no_grad():
        out = model(IDS.to(next(model.parameters()).device)).logits
    return out.cpu()


def _close(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and (a - b).abs().max().item() <= 1e-5


def test_reading_a_weight_gives_its_values_and_keeps_the_model_path(remote):
    local, model = _gpt2(), _gpt2(R)
    assert next(model.parameters()).device == torch.device(R)  # as eager's is the GPU
    with torch.no_grad(), warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        out = model(IDS.to(R), use_cache=True)
        wte = model.transformer.wte.weight.cpu()  # was: "Cannot copy out of meta tensor"
        norm = model.transformer.h[0].mlp.c_fc.weight.norm().item()
        text = str(model.transformer.wpe.weight)
        lone = copy.deepcopy(model.transformer.wpe.weight)  # a copy of its values
        assert model._djinn is not None  # still on the model path: its cache goes on
        step = model(torch.tensor([[7]]).to(R), past_key_values=out.past_key_values).logits
        want = local(
            torch.tensor([[7]]), past_key_values=local(IDS, use_cache=True).past_key_values
        )
    assert not [w for w in caught if "registered on the appliance" in str(w.message)]
    assert torch.equal(wte, local.transformer.wte.weight.detach())
    assert abs(norm - local.transformer.h[0].mlp.c_fc.weight.norm().item()) <= 1e-5
    assert "meta" not in text and "..." not in text
    assert isinstance(lone, torch.nn.Parameter) and lone.device == torch.device(R)
    assert torch.equal(lone.cpu(), local.transformer.wpe.weight.detach())
    assert _close(step.cpu(), want.logits)


def test_a_use_with_gradients_on_takes_the_weights_and_says_so_once(remote):
    """Eager's result would take gradients back to the parameter itself."""
    local, model = _gpt2(), _gpt2(R)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        twice = model.transformer.wte.weight * 2  # gradients on
        model.transformer.wpe.weight.sum()
    said = [w for w in caught if "registered on the appliance" in str(w.message)]
    assert len(said) == 1 and said[0].filename == __file__  # once, at the program's line
    assert getattr(model, "_djinn", None) is None  # off the model path, on the graph path
    twice.sum().backward()
    assert torch.equal(model.transformer.wte.weight.grad.cpu(), torch.full((100, 32), 2.0))
    assert _close(_logits(model), _logits(local))


def test_a_state_dict_reads_and_saves_the_weights(remote):
    local = _gpt2()

    def saved() -> dict:
        model = _gpt2(R)
        _logits(model)
        state = model.state_dict()  # aliases, no weight taken yet
        assert state.keys() == local.state_dict().keys()
        buf = io.BytesIO()
        torch.save(state, buf)  # saved meta tensors, no weight at all
        assert model._djinn is not None
        return state

    state = saved()  # the model is gone: its state outlives it, as eager's does
    gc.collect()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    loaded = torch.load(buf, map_location="cpu")
    for name, want in local.state_dict().items():
        assert loaded[name].device.type == "cpu" and torch.equal(loaded[name], want), name
    fresh = _gpt2()
    with torch.no_grad():
        for p in fresh.parameters():
            p.zero_()
    fresh.load_state_dict(loaded)
    assert torch.equal(_logits(fresh), _logits(local))


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("called_before", [False, True], ids=["first call", "later call"])
def test_a_weight_written_in_place_runs_as_eager_and_the_shared_copy_stays(
    remote, mode, called_before
):
    """Writes into the meta weights were a no-op; inside ``inference_mode`` (no version
    counted) the model path then ran the registered weights, silently."""
    local, model, other = _gpt2(), _gpt2(R), _gpt2(R)  # other: the same registered model
    before = _logits(local)
    if called_before:
        _logits(model)
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with context:
        for m in (local, model):
            m.transformer.wpe.weight.zero_()
            m.transformer.ln_f.bias.add_(0.5)
    want = _logits(local)
    assert not _close(want, before)
    assert _close(_logits(model), want)
    assert other._djinn is not None and _close(_logits(other), before)


def test_a_state_dict_alias_follows_the_model_as_eagers_does(remote):
    local, model = _gpt2(), _gpt2(R)
    got = {}
    for key, m in (("local", local), ("remote", model)):
        state = m.state_dict()  # eager's values alias the parameters
        m.train()
        opt = torch.optim.SGD(m.parameters(), lr=0.1)
        torch.manual_seed(5)  # the same dropout masks as eager's
        m(
            IDS.to(next(m.parameters()).device), labels=IDS.to(next(m.parameters()).device)
        ).loss.backward()
        opt.step()
        with torch.no_grad():
            state["transformer.ln_f.weight"].mul_(3.0)  # a write through the alias
        got[key] = (state["transformer.h.0.mlp.c_fc.weight"].cpu(), m.transformer.ln_f.weight.cpu())
    for a, b in zip(got["local"], got["remote"], strict=True):
        assert _close(a.detach(), b.detach())


def test_an_averaged_copy_of_a_registered_model_is_eagers(remote):
    """``AveragedModel`` deep-copies the model (another module on the same registered
    weights), then writes its own weights: they were meta no-ops."""
    from torch.optim.swa_utils import AveragedModel

    results = []
    for device in ("cpu", R):
        model = _gpt2(device)
        ema = AveragedModel(model)
        assert device == "cpu" or ema.module._djinn is not None
        ema.update_parameters(model)  # a copy of the model's weights
        with torch.no_grad():
            model.transformer.wpe.weight.mul_(0.5)
        ema.update_parameters(model)  # their mean with the new ones
        results.append((_logits(ema.module), _logits(model)))
    assert _close(results[0][0], results[1][0]) and _close(results[0][1], results[1][1])
    assert not _close(results[1][0], results[1][1])


def test_a_weight_replaced_while_registered_holds_no_value(remote):
    model = _gpt2(R)
    old = model.transformer.ln_f.weight
    model.transformer.ln_f.weight = torch.nn.Parameter(torch.ones(32, device=R))
    with pytest.raises(UnsupportedOp, match=r"'transformer\.ln_f\.weight' was replaced"):
        old.sum()


def test_written_inside_inference_mode_then_trained_as_eager(remote):
    """The copies taken inside the program's inference mode were inference tensors: the
    training that followed failed, untyped (a review)."""
    losses = []
    for device in ("cpu", R):
        model = _gpt2(device)
        with torch.inference_mode():
            model.transformer.wpe.weight.mul_(0.5)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        ids = IDS.to(device)
        for step in range(2):
            torch.manual_seed(step)  # the same dropout masks as eager's
            loss = model(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        with torch.no_grad():
            model.transformer.wte.weight.add_(1.0)  # and written after, outside the mode
    assert all(abs(a - b) <= 1e-5 for a, b in zip(losses[:2], losses[2:], strict=True))


def test_a_buffer_the_program_holds_stays_that_buffer(remote):
    """A held buffer was refused at its second use, once the model had left (a review)."""
    got = []
    for device in ("cpu", R):
        model = tiny_llama(device)
        inv = model.model.rotary_emb.inv_freq
        with torch.no_grad():
            inv.mul_(0.5)
            first, second = inv.sum().item(), (inv * 2).sum().item()
        got.append((first, second, _logits(model)))
    assert got[0][:2] == pytest.approx(got[1][:2], abs=1e-6)
    assert _close(got[0][2], got[1][2])


def test_save_pretrained_saves_the_weights(remote, tmp_path):
    """Every weight's data_ptr was a meta tensor's 0, so transformers took them all for
    one shared tensor and refused, untyped (a review)."""
    local, model = _gpt2(), _gpt2(R)
    _logits(model)
    model.save_pretrained(tmp_path)
    loaded = transformers.GPT2LMHeadModel.from_pretrained(tmp_path).eval()
    assert _close(_logits(loaded), _logits(local))


def test_weight_copies_by_name_are_checked_on_the_appliance(remote):
    """CALL ``$weights`` with names: only known, distinct names, refused typed before
    anything is copied."""
    from djinn.errors import InvalidArgument, NotFound

    model = _gpt2(R)
    _logits(model)
    binding = model._djinn

    def call(names):
        body = {"fingerprint": binding.fingerprint, "method": "$weights", "names": names}
        return binding.session.call_model({**body, "args": [], "kwargs": {}})

    with pytest.raises(NotFound, match="no weight named 'nope'"):
        call(["transformer.wpe.weight", "nope"])
    for bad in ([1], ["transformer.wpe.weight"] * 2, [], "transformer.wpe.weight"):
        with pytest.raises(InvalidArgument, match="names must be"):
            call(bad)
    out = call(["transformer.wpe.weight"])["out"]
    assert list(out) == ["transformer.wpe.weight"] or len(str(out)) < 2000


WRITES = {
    "through a state-dict alias's view": lambda m: m.state_dict()["transformer.wpe.weight"][
        0
    ].fill_(0.0),
    "through a view": lambda m: m.transformer.wte.weight.view(-1).mul_(0.5),
    "through .data": lambda m: m.transformer.ln_f.weight.data.add_(1.0),
    "by .data =": lambda m: setattr(
        m.transformer.h[0].mlp.c_fc.bias, "data", torch.ones(128, device=m.device)
    ),
    "as out=": lambda m: torch.add(torch.ones(32, device=m.device), 1, out=m.transformer.ln_f.bias),
    "by nn.init": lambda m: torch.nn.init.constant_(m.transformer.h[0].attn.c_proj.bias, 0.25),
    "by set_": lambda m: m.transformer.h[0].mlp.c_fc.bias.set_(torch.ones(128, device=m.device)),
}


@pytest.mark.parametrize("way", list(WRITES))
def test_each_way_of_writing_a_weight_lands_as_eagers(remote, way):
    """A write the copy's version does not count (``.data =`` rebinds) was lost: the
    model path then ran the registered weights (0.46 off). Each way is eager's now."""
    got = []
    for device in ("cpu", R):
        model = _gpt2(device)
        with torch.no_grad():
            _logits(model)
            WRITES[way](model)
        got.append(_logits(model))
    assert _close(got[0], got[1])


def test_a_registered_model_pickles_as_its_own_class_with_its_weights(remote):
    """``torch.save(model)`` raised PicklingError: its class is Djinn's, made at the move."""
    import pickle

    local, model = _gpt2(), _gpt2(R)
    _logits(model)
    buf = io.BytesIO()
    torch.save(model, buf)
    assert model._djinn is not None  # its weights were read: it stays on the model path
    buf.seek(0)
    back = torch.load(buf, weights_only=False, map_location="cpu")
    assert type(back) is transformers.GPT2LMHeadModel
    assert next(back.parameters()).device.type == "cpu"
    assert torch.equal(_logits(back), _logits(local))
    again = pickle.loads(pickle.dumps(model))  # on the remote device, as pickled
    assert type(again) is transformers.GPT2LMHeadModel
    assert _close(_logits(again), _logits(local))


def test_threads_writing_one_models_weights_lose_no_write(remote):
    """Each thread wrote a copy, and the first to take the model off the model path took
    its own alone: the others' writes were lost, silently (a review)."""
    import threading

    model = _gpt2(R)
    a, b = model.transformer.h[0].ln_1.bias, model.transformer.h[1].ln_2.bias  # zeros
    start = threading.Barrier(4)

    def write(p: torch.Tensor) -> None:
        start.wait()
        with torch.no_grad():
            p.add_(1.0)

    errors = in_threads(write, [(a,), (b,), (a,), (b,)])
    assert not errors, errors
    with torch.no_grad():
        assert (a.sum().item(), b.sum().item()) == (64.0, 64.0)


def test_in_place_on_a_weight_returns_the_weight_and_grad_and_sharing_are_eagers(remote):
    """``p += 1`` on a module's weight raised "cannot assign ... as parameter" (the use
    returned the copy); ``p.grad = g`` and ``p.share_memory_()`` raised (a review)."""
    local, model = _gpt2(), _gpt2(R)
    for m in (local, model):
        with torch.no_grad():
            m.transformer.wpe.weight += 1.0  # Module.__setattr__ gets the weight back
            w = m.transformer.ln_f.weight
            assert w.mul_(2.0) is w
        p = m.transformer.h[0].mlp.c_fc.bias
        p.grad = torch.ones(128, device=p.device)
        assert torch.equal(p.grad.cpu(), torch.ones(128))
        assert p.share_memory_() is p
    assert _close(_logits(model), _logits(local))


def test_lora_wrapped_around_a_registered_model_trains_as_eager(remote):
    """peft's ``get_peft_model`` after the move (the usual order: load, move, wrap) was
    refused: it renames each wrapped weight (``c_attn.base_layer.weight``)."""
    from peft import LoraConfig, get_peft_model

    losses = []
    for device in ("cpu", R):
        model = _gpt2(device)
        torch.manual_seed(1)
        config = LoraConfig(
            r=4, target_modules=["c_attn"], lora_dropout=0.0, init_lora_weights=False
        )
        lora = get_peft_model(model, config)
        lora.train()
        opt = torch.optim.SGD([p for p in lora.parameters() if p.requires_grad], lr=0.1)
        ids = IDS.to(device)
        for _ in range(3):
            torch.manual_seed(7)  # the same dropout masks as eager's
            loss = lora(ids, labels=ids).loss
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
    assert all(abs(a - b) <= 1e-5 for a, b in zip(losses[:3], losses[3:], strict=True)), losses


def test_a_parametrization_registered_on_a_weight_runs_as_eager(remote):
    """``register_parametrization`` sets the weight to itself with ``set_``, which passes
    no ``__torch_function__``: its version moved, and the model was refused as written
    while meta (a review)."""
    from torch.nn.utils import parametrize

    class Half(torch.nn.Module):
        def forward(self, w: torch.Tensor) -> torch.Tensor:
            return w * 0.5

    got = []
    for device in ("cpu", R):
        model = _gpt2(device)
        _logits(model)
        parametrize.register_parametrization(model.transformer.wpe, "weight", Half())
        got.append(_logits(model))
    assert _close(got[0], got[1])


class Wrapped(torch.nn.Module):
    """A submodule wrapped as peft's LoRA wraps one (``base_layer``), without its
    delegation of ``weight``."""

    def __init__(self, base: torch.nn.Module) -> None:
        super().__init__()
        self.base_layer = base

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base_layer(x)


def test_a_wrapped_weight_reads_while_registered_and_a_held_alias_follows_it(remote):
    """A weight renamed by a wrap was looked up by its registered name, which no longer
    resolves: an untyped AttributeError at any use (a read of the change)."""
    got = []
    for device in ("cpu", R):
        model = _gpt2(device)
        alias = model.state_dict()["transformer.h.0.attn.c_attn.weight"]
        attn = model.transformer.h[0].attn
        attn.c_attn = Wrapped(attn.c_attn)
        base = attn.c_attn.base_layer.weight
        with torch.no_grad():
            norm = base.norm().item()  # a read: the model stays registered
            assert device == "cpu" or model._djinn is not None
            base.mul_(2.0)  # a write: it leaves, the wrapped weight written
            got.append((norm, alias.sum().item(), model.transformer.wte.weight.sum().item()))
    assert got[0] == pytest.approx(got[1], abs=1e-4)
