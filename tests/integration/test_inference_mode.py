"""Note [composite ops under inference mode]: torch.inference_mode() skips the autograd
keys, where composite ops (linear, layer_norm, attention...) are decomposed; remote code
under it runs as it does under no_grad, with local eager's numbers."""

from __future__ import annotations

import torch


def test_a_model_runs_under_inference_mode_with_local_eagers_numbers(remote):
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.LayerNorm(32), torch.nn.Linear(32, 4)
    ).eval()
    x = torch.randn(8, 16)
    with torch.inference_mode():
        want = model(x)
    remote_model = torch.nn.Sequential(*(m for m in model)).train().to(remote).eval()
    with torch.inference_mode():
        got = remote_model(x.to(remote)).cpu()  # linear arrived whole: UNSUPPORTED_OP
    assert (got - want).abs().max().item() <= 1e-5


def test_softmax_under_inference_mode_still_runs_as_one_op(remote):
    x = torch.randn(4, 6)
    with torch.inference_mode():
        got = torch.softmax(x.to(remote), -1).cpu()
    assert torch.equal(got, torch.softmax(x, -1))


VIEWS = {
    "split": lambda t: t.split(2)[1],
    "chunk": lambda t: t.chunk(2)[0],
    "t": lambda t: t.t(),
    "narrow": lambda t: t.narrow(0, 1, 2),
    "view": lambda t: t.view(24),
    "a view of an inference tensor": lambda t: (t + 1).t(),
    "detach": lambda t: t.detach(),
    "data": lambda t: t.data,
}


def test_views_of_a_tensor_moved_before_inference_mode_are_eagers(remote):
    """Note [views in inference mode]: each raised "Cannot set version_counter for
    inference tensor" (a view of a normal tensor is a normal tensor, which the wrapper was
    not), and a put or a checkpoint of an inference tensor read its missing version."""
    base = torch.randn(4, 6)
    x = base.to(remote)
    with torch.inference_mode():
        for name, view in VIEWS.items():
            got, want = view(x), view(base)
            assert got.is_inference() == want.is_inference(), name
            assert torch.equal(got.cpu(), want), name
        made = torch.ones(3)  # an inference tensor, put as is
        assert torch.equal((made.to(remote) * 2).cpu(), made * 2)


def test_a_transformer_decodes_under_inference_mode_as_in_eager(remote):
    import copy

    torch.manual_seed(0)
    model = torch.nn.Transformer(32, 4, 1, 1, 64, dropout=0.0, batch_first=True).eval()
    src, tgt = torch.randn(2, 5, 32), torch.randn(2, 3, 32)
    moved = copy.deepcopy(model).to(remote)
    with torch.inference_mode():
        want = model(src, tgt)
        got = moved(src.to(remote), tgt.to(remote)).cpu()
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_a_module_moved_inside_inference_mode_runs_as_in_eager(remote):
    """Its tensors are inference tensors, which keep no version counter: reading one
    raised, so any ``.to(device)`` inside ``inference_mode`` failed, untyped (a review),
    and so did a registered model's first call after such a move."""
    import copy

    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    with torch.inference_mode():
        lin = torch.nn.Linear(4, 2)
        x = torch.ones(1, 4)
        assert torch.equal(copy.deepcopy(lin).to(remote)(x.to(remote)).cpu(), lin(x))
    cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=300)
    local = GPT2LMHeadModel(cfg).eval()
    ids = torch.tensor([[3, 4, 5]])
    want = local.generate(ids, max_new_tokens=4, do_sample=False)
    moved = copy.deepcopy(local)
    with torch.inference_mode():
        moved.to(remote)
        assert moved.generate(ids.to(remote), max_new_tokens=4, do_sample=False).tolist() == (
            want.tolist()
        )
    with torch.inference_mode():  # built inside it too
        torch.manual_seed(0)
        built = GPT2LMHeadModel(cfg).eval()
    built.to(remote)
    with torch.inference_mode():
        got = built.generate(ids.to(remote), max_new_tokens=4, do_sample=False)
    assert got.tolist() == want.tolist()
