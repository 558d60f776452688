"""Note [a registered model trains] (djinn/frontend/model_leaves.py): a model moved in
eval mode is registered (the model path) and keeps no weights locally. ``.train()``, the
Hugging Face fine-tuning recipe's next step, was refused at the next call; ``.cpu()``
raised torch's untyped "Cannot copy out of meta tensor"; ``.half()`` was refused. Each now
takes the registered weights into the session and goes on on the graph path."""

from __future__ import annotations

import copy
import subprocess
import sys
import textwrap

import pytest
import torch
import transformers

from djinn.errors import UnsupportedOp

R = "remote_accelerator:0"
transformers.logging.set_verbosity_error()


def _gpt2(seed: int = 0) -> transformers.GPT2LMHeadModel:
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=500)
    return transformers.GPT2LMHeadModel(cfg).eval()  # dropout 0.1: training draws


def _steps(model, opt, ids, n: int = 3) -> list[float]:
    losses = []
    for step in range(n):
        torch.manual_seed(100 + step)  # the same dropout masks as eager's
        loss = model(ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def test_train_after_the_move_trains_as_eager(remote):
    model = _gpt2()
    ref = copy.deepcopy(model)
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(1))
    model.to(R)
    assert model._djinn is not None  # the model path
    params = list(model.parameters())
    opt = torch.optim.AdamW(params, lr=1e-3)  # built before .train(), as Trainer may
    ref_opt = torch.optim.AdamW(ref.parameters(), lr=1e-3)
    model.train()
    ref.train()
    assert model._djinn is not None  # registered until its first call in training mode
    got = _steps(model, opt, ids.to(R))
    want = _steps(ref, ref_opt, ids)
    assert getattr(model, "_djinn", None) is None  # a plain module of remote tensors
    assert type(model) is transformers.GPT2LMHeadModel
    assert list(model.parameters()) == params  # the optimizer's objects
    assert all(p.device == torch.device(R) for p in params)
    assert model.lm_head.weight is model.transformer.wte.weight  # still tied
    assert got == pytest.approx(want, abs=1e-5)
    for (name, a), b in zip(model.named_parameters(), ref.parameters(), strict=True):
        assert torch.allclose(a.detach().cpu(), b.detach(), atol=1e-5), name
    model.eval()
    ref.eval()
    with torch.no_grad():
        got = model(ids.to(R)).logits.cpu()
        assert torch.allclose(got, ref(ids).logits, atol=1e-5)


def test_hooks_set_on_its_parameters_after_the_move_stay(remote):
    """swap_tensors swaps the objects' attributes too: a post-accumulate hook (PyTorch's
    optimizer step in backward) set on the meta parameter was dropped, and the model did
    not train, silently (a review: losses 5.6417, 5.6417 where eager gives 5.6417, 5.0613)."""
    ids = torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(1))
    losses = {}
    for where in ("local", "remote"):
        model = _gpt2()
        if where == "remote":
            model.to(R)
        opts = {p: torch.optim.SGD([p], lr=0.5) for p in model.parameters()}

        def step(p: torch.Tensor, opts: dict = opts) -> None:
            opts[p].step()
            opts[p].zero_grad()

        for p in model.parameters():
            p.register_post_accumulate_grad_hook(step)
            p.tag = "mine"
        model.train()
        x = ids.to(R) if where == "remote" else ids
        losses[where] = []
        for n in range(2):
            torch.manual_seed(n)
            loss = model(x, labels=x).loss
            loss.backward()
            losses[where].append(loss.item())
        assert all(p.tag == "mine" for p in model.parameters())
    assert losses["remote"] == pytest.approx(losses["local"], abs=1e-5)
    assert losses["local"][1] < losses["local"][0] - 0.1  # it trained


def test_train_then_eval_with_no_call_between_stays_registered(remote):
    """A toggle (an evaluation helper's) copies no weights, and the KV cache the model
    returned before it still serves (a review: it raised a misleading AttributeError)."""
    model = _gpt2()
    ref = copy.deepcopy(model)
    ids = torch.tensor([[5, 17, 99, 3]])
    model.to(R)
    with torch.no_grad():
        out = model(ids, use_cache=True)
        model.train()
        model.eval()
        nxt = torch.tensor([[7]])
        got = model(nxt, past_key_values=out.past_key_values).logits.cpu()
        assert model._djinn is not None
        past = ref(ids, use_cache=True).past_key_values
        want = ref(nxt, past_key_values=past).logits
    assert torch.allclose(got, want, atol=1e-5)


def test_a_submodule_in_training_mode_trains_as_eager(remote):
    """Fine-tuning a head alone, the rest frozen in eval mode: was refused ("put in
    training mode")."""
    torch.manual_seed(0)
    cfg = transformers.BertConfig(
        num_hidden_layers=2,
        hidden_size=32,
        intermediate_size=64,
        num_attention_heads=2,
        vocab_size=100,
        num_labels=3,
    )
    model = transformers.BertForSequenceClassification(cfg).eval()
    ref = copy.deepcopy(model)
    ids, labels = (
        torch.randint(0, 100, (4, 9), generator=torch.Generator().manual_seed(3)),
        torch.tensor([0, 1, 2, 1]),
    )
    model.to(R)
    for m in (model, ref):
        m.requires_grad_(False)
        m.classifier.requires_grad_(True)
        m.classifier.train()
        m.dropout.train()
    got_opt = torch.optim.Adam(model.classifier.parameters(), lr=1e-2)
    want_opt = torch.optim.Adam(ref.classifier.parameters(), lr=1e-2)
    for n in range(3):
        for m, opt, x, y in (
            (model, got_opt, ids.to(R), labels.to(R)),
            (ref, want_opt, ids, labels),
        ):
            torch.manual_seed(n)
            m(x, labels=y).loss.backward()
            opt.step()
            opt.zero_grad()
    got, want = model.classifier.weight.detach().cpu(), ref.classifier.weight.detach()
    assert torch.allclose(got, want, atol=1e-5), (got - want).abs().max()


@pytest.mark.parametrize("how", ["deep copy", "ghost loaded"])
def test_a_copied_or_ghost_loaded_model_trains_too(remote, how):
    """Their modules are recorded at their first call, which took the training flags set
    before it for the registered state: eval-mode numbers, no autograd, no word (a
    review: loss 6.1904, eager's eval loss, where training mode gives 6.1694)."""
    if how == "deep copy":
        ref = _gpt2()
        model = copy.deepcopy(copy.deepcopy(ref).to(R))
        inputs = {
            "input_ids": torch.randint(0, 500, (2, 12), generator=torch.Generator().manual_seed(1))
        }
        inputs["labels"] = inputs["input_ids"]
    else:
        import djinn
        from tests.conftest import minilm_dir

        ref = transformers.BertModel.from_pretrained(minilm_dir())
        model = djinn.from_pretrained(minilm_dir(), transformers.BertModel)
        inputs = {"input_ids": torch.tensor([[101, 7592, 2088, 102]])}
    assert model._djinn is not None and not model._djinn.modules
    model.train()
    ref.train()
    torch.manual_seed(5)
    got = model(**{k: v.to(R) for k, v in inputs.items()})
    torch.manual_seed(5)
    want = ref(**inputs)
    assert getattr(model, "_djinn", None) is None  # it left for the graph path
    key = "loss" if how == "deep copy" else "last_hidden_state"
    assert got[key].grad_fn is not None
    assert torch.allclose(got[key].detach().cpu(), want[key].detach(), atol=1e-5)


def test_a_cast_converts_the_buffers_too(remote):
    """A bf16 Llama keeps its rotary inv_freq in float32; .to(torch.bfloat16) casts it in
    eager. The shortcut for a cast that changes nothing looked at the parameters alone,
    so the model stayed registered with the float32 buffer: 0.0039 off (a review)."""
    torch.manual_seed(0)
    cfg = transformers.LlamaConfig(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        vocab_size=100,
    )
    model = transformers.LlamaForCausalLM._from_config(cfg, torch_dtype=torch.bfloat16).eval()
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32
    model.to(R)
    model.to(torch.bfloat16)
    assert getattr(model, "_djinn", None) is None
    assert model.model.rotary_emb.inv_freq.dtype == torch.bfloat16


def test_threads_calling_a_model_that_leaves_all_get_answers(remote):
    """A second thread waited on the lock while the first took the model off the model
    path, then tried again: an untyped AttributeError (a review)."""
    import threading

    model, ref = _gpt2(), _gpt2()
    ids = torch.tensor([[5, 17, 99, 3]])
    model.to(R)
    model.train()
    model.transformer.drop.p = model.transformer.h[0].attn.resid_dropout.p = 0.0
    ref.transformer.drop.p = ref.transformer.h[0].attn.resid_dropout.p = 0.0
    errors, got = [], []

    def run() -> None:
        try:
            with torch.no_grad():
                got.append(model(ids.to(R)).logits.cpu())
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors, errors
    assert getattr(model, "_djinn", None) is None and len(got) == 3


def test_parameters_added_after_the_move_are_refused_typed_and_a_wrap_trains(remote):
    """A submodule wrapped (peft's get_peft_model renames c_attn.weight to
    c_attn.base_layer.weight) after the move said "the appliance sent no weight" (a
    review), then was refused: the renamed weight is found by the name it was registered
    by now (Note [weights of a registered model]), and the model trains as eager. A meta
    parameter the program added holds no value: refused, typed, the model still
    registered."""

    class Wrapped(torch.nn.Module):
        def __init__(self, base: torch.nn.Module) -> None:
            super().__init__()
            self.base_layer = base

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.base_layer(x)

    ids = torch.tensor([[1, 2, 3]])
    losses = []
    for device in ("cpu", R):
        model = _gpt2().to(device)
        attn = model.transformer.h[0].attn
        attn.c_attn = Wrapped(attn.c_attn)
        model.train()
        losses.append(_steps(model, torch.optim.SGD(model.parameters(), lr=0.1), ids.to(device)))
    assert all(abs(a - b) <= 1e-5 for a, b in zip(*losses, strict=True)), losses
    model = _gpt2().to(R)
    model.transformer.h[0].attn.extra = torch.nn.Parameter(torch.empty(3, device="meta"))
    model.train()
    with pytest.raises(UnsupportedOp, match="was added or reshaped since the move"):
        model(ids.to(R))
    assert model._djinn is not None


def test_training_one_copy_leaves_the_shared_model_as_it_was(remote):
    """The copies are the session's: another handle on the same registered weights (one
    model on the appliance for both) still runs the weights as registered."""
    a, b = _gpt2(), _gpt2()
    ref = copy.deepcopy(a)
    ids = torch.randint(0, 500, (1, 8), generator=torch.Generator().manual_seed(2))
    a.to(R)
    b.to(R)
    assert a._djinn.fingerprint == b._djinn.fingerprint
    from djinn.frontend.session import default_session

    before = default_session().memory_allocated()
    a.train()
    opt = torch.optim.SGD(a.parameters(), lr=0.5)  # no state of its own
    _steps(a, opt, ids.to(R), n=2)
    weights = sum(p.nbytes for p in ref.parameters()) + sum(t.nbytes for t in ref.buffers())
    # charged to the session (less what earlier tests' tensors freed meanwhile: bytes)
    assert default_session().memory_allocated() - before >= 0.9 * weights
    with torch.no_grad():
        assert torch.equal(b(ids).logits.cpu(), ref(ids).logits)
        a.eval()
        assert not torch.allclose(a(ids.to(R)).logits.cpu(), ref(ids).logits, atol=1e-3)


def test_a_registered_model_moves_back_and_casts(remote):
    model, ref = _gpt2(), _gpt2()
    model.to(R)
    params = list(model.parameters())
    model.cpu()  # was: NotImplementedError, "Cannot copy out of meta tensor"
    assert list(model.parameters()) == params  # the same objects, as a CUDA move keeps them
    for (name, a), b in zip(model.state_dict().items(), ref.state_dict().values(), strict=True):
        assert a.device.type == "cpu" and torch.equal(a, b), name
    half = _gpt2()
    half.to(R)
    half.half()  # was: "a model registered on the appliance cannot move back"
    w = half.transformer.h[0].mlp.c_fc.weight
    assert w.dtype == torch.float16 and w.device == torch.device(R)
    assert torch.equal(w.cpu(), ref.transformer.h[0].mlp.c_fc.weight.half())


def test_weights_written_after_the_move_train_as_eager(remote):
    """An in-place edit after the move wrote into a meta tensor, and training then was
    refused; ``resize_token_embeddings`` too. The edit now takes the weights first (Note
    [weights of a registered model]), and training goes on from the edited values."""
    ids = torch.tensor([[1, 2, 3]])
    losses = []
    for device in ("cpu", R):
        model = _gpt2().to(device)
        with torch.no_grad():
            model.transformer.wte.weight.mul_(2)
        model.resize_token_embeddings(512, mean_resizing=False)
        model.train()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses.append(_steps(model, opt, ids.to(device), n=2))
        assert model.lm_head.weight.shape == (512, 64)
    assert all(abs(a - b) <= 1e-5 for a, b in zip(*losses, strict=True)), losses


RECIPE = textwrap.dedent("""
    import sys, torch, transformers
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments
    transformers.logging.set_verbosity_error()
    model = AutoModelForCausalLM.from_pretrained(sys.argv[1])  # eval mode
    device = "cuda" if torch.cuda.is_available() else "cpu"
    model.to(device)
    g = torch.Generator().manual_seed(1)
    rows = [{"input_ids": x, "labels": x} for x in torch.randint(0, 500, (16, 12), generator=g)]
    args = TrainingArguments(
        output_dir=sys.argv[2], per_device_train_batch_size=4, max_steps=4, logging_steps=1,
        report_to=[], save_strategy="no", use_cpu=device == "cpu", dataloader_pin_memory=False,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=rows)
    trainer.train()
    print("device", next(model.parameters()).device.type)
    print("losses", [round(h["loss"], 5) for h in trainer.state.log_history if "loss" in h])
    print("lm_head %.5f" % model.lm_head.weight.detach().cpu().abs().sum().item())
""")


def test_the_hugging_face_fine_tuning_recipe_runs_unchanged_under_djinn_run(appliance, tmp_path):
    """from_pretrained, .to("cuda"), Trainer: the script as it is, the numbers local CPU
    eager gives (dropout off: CUDA's generator and the CPU's draw other masks)."""
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(
        n_layer=2, n_embd=64, n_head=4, vocab_size=500, resid_pdrop=0, embd_pdrop=0, attn_pdrop=0
    )
    transformers.GPT2LMHeadModel(cfg).save_pretrained(tmp_path / "ckpt")
    script = tmp_path / "finetune.py"
    script.write_text(RECIPE)
    from tests.integration.test_run import _env

    def run(*cmd: str, **env: str) -> str:
        argv = [*cmd, str(script), str(tmp_path / "ckpt"), str(tmp_path / "out")]
        done = subprocess.run(argv, env=_env(**env), capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-3000:]
        return done.stdout

    local = run(sys.executable)
    remote_out = run(sys.executable, "-m", "djinn.cli.main", "run", DJINN_ADDRESS=appliance.unix)
    assert "device cpu" in local and "device remote_accelerator" in remote_out
    mine = lambda out: [x for x in out.splitlines() if x.startswith(("losses", "lm_head"))]  # noqa: E731
    assert len(mine(local)) == 2 and mine(local) == mine(remote_out), (local, remote_out)
