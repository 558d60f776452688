"""Issue 15 §1: ops that return nothing still run. Every ``torch._foreach_*`` overload,
in place or not, gives remotely what it gives locally: its outputs *and* what it wrote
into its arguments. Dropping a mutation is a silent wrong number, the worst outcome."""

from __future__ import annotations

from typing import Any

import pytest
import torch

R = "remote_accelerator:0"
SHAPES = [(2, 2), (3, 3)]  # square: _foreach_mm multiplies the lists pairwise


def _schemas() -> list[Any]:
    return sorted(
        (s for s in torch._C._jit_get_all_schemas() if s.name.startswith("aten::_foreach_")),
        key=lambda s: (s.name, s.overload_name),
    )


def _op(schema: Any) -> Any:
    packet = getattr(torch.ops.aten, schema.name.split("::")[1])
    return getattr(packet, schema.overload_name or "default")


def _args(schema: Any, gen: torch.Generator) -> tuple[list[Any], dict[str, Any]] | None:
    """Arguments built from the schema; values in (0.1, 0.9) suit every unary op's domain."""
    args: list[Any] = []
    kwargs: dict[str, Any] = {}
    for a in schema.arguments:
        kind = str(a.type)
        if kind == "List[Tensor]":
            value: Any = [torch.rand(s, generator=gen) * 0.8 + 0.1 for s in SHAPES]
        elif kind == "Tensor":
            # a CPU tensor of per-list scalars, or a one-element tensor operand
            value = torch.tensor([0.5, 0.25]) if a.name == "scalars" else torch.tensor(0.5)
        elif kind == "number":
            value = 0.5
        elif kind == "List[number]":
            value = [0.5, 0.25]
        elif kind == "bool":
            value = False
        elif kind.startswith("Optional["):
            value = None
        else:
            return None
        if a.kwarg_only:
            kwargs[a.name] = value
        else:
            args.append(value)
    return args, kwargs


def _remote(x: Any, name: str = "") -> Any:
    if isinstance(x, torch.Tensor):
        return x if name == "scalars" else x.to(R)
    if isinstance(x, list):
        return [_remote(v) for v in x]
    return x


def _local(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.cpu()
    if isinstance(x, (list, tuple)):
        return [_local(v) for v in x]
    if isinstance(x, dict):
        return {k: _local(v) for k, v in x.items()}
    return x


def _clone(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.clone()
    if isinstance(x, list):
        return [_clone(v) for v in x]
    return x


def test_every_foreach_overload_matches_eager_outputs_and_mutations(remote):
    gen = torch.Generator().manual_seed(0)
    tried, mutating = [], []
    for schema in _schemas():
        built = _args(schema, gen)
        assert built is not None, f"{schema}: an argument type this test cannot build"
        args, kwargs = built
        op = _op(schema)
        want_args, want_kwargs = _clone(args), _clone(kwargs)
        before = _versions(want_args, want_kwargs)
        try:
            want = op(*want_args, **want_kwargs)
        except (RuntimeError, TypeError):
            continue  # eager refuses these arguments: not a test of Djinn
        names = [a.name for a in schema.arguments if not a.kwarg_only]
        rargs = [_remote(v, n) for v, n in zip(args, names, strict=True)]
        rkwargs = {k: _remote(v, k) for k, v in kwargs.items()}
        rbefore = _versions(rargs, rkwargs)
        got = op(*rargs, **rkwargs)
        label = f"{schema.name}.{schema.overload_name}"
        tried.append(label)
        # each write counts in its tensor's version, as eager's (Note [foreach writes
        # count], writes.py): autograd refuses a saved tensor written since
        assert [b - a for a, b in zip(rbefore, _versions(rargs, rkwargs), strict=True)] == [
            b - a for a, b in zip(before, _versions(want_args, want_kwargs), strict=True)
        ], label
        torch.testing.assert_close(_local(got), _local(want), msg=label, rtol=1e-5, atol=1e-5)
        if any(a.alias_info is not None and a.alias_info.is_write for a in schema.arguments):
            mutating.append(label)
        # what the op wrote into its arguments must be there too (the defect: it was not)
        torch.testing.assert_close(_local(rargs), _local(want_args), msg=label)
        torch.testing.assert_close(_local(rkwargs), _local(want_kwargs), msg=label)
    assert len(tried) > 150, len(tried)
    assert len(mutating) > 60, len(mutating)


def _versions(args: list[Any], kwargs: dict[str, Any]) -> list[int]:
    out: list[int] = []
    for v in [*args, *kwargs.values()]:
        for t in v if isinstance(v, (list, tuple)) else [v]:
            if isinstance(t, torch.Tensor):
                out.append(t._version)
    return out


def test_an_optimizer_step_between_forward_and_backward_is_refused_as_in_eager(remote):
    """The foreach step wrote weights the forward saved: eager's backward refuses it;
    Djinn's gave gradients of the stepped weights without a word (a hunt)."""
    for device in ("cpu", R):
        torch.manual_seed(0)
        m = torch.nn.Linear(3, 2).to(device)
        opt = torch.optim.SGD(m.parameters(), lr=0.5, momentum=0.9)  # foreach by default
        x = torch.randn(5, 3).to(device).requires_grad_()  # its gradient needs the weight
        m(x).pow(2).sum().backward()
        loss = m(x).pow(2).sum()
        opt.step()
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_a_foreach_write_into_inference_tensors_is_refused_outside_inference_mode(remote):
    """Eager refuses it (a review: the foreach op took it), here before anything is
    written (eager's CPU loop has written the first tensor when the second refuses);
    inside the mode it runs."""
    for device in ("cpu", R):
        with torch.inference_mode():
            xs = [torch.ones(3, device=device), torch.ones(2, device=device)]
        with pytest.raises(RuntimeError, match="Inplace update to inference tensor"):
            torch._foreach_add_(xs, 1.0)
        if device == R:
            assert [x.sum().item() for x in xs] == [3.0, 2.0]
            with torch.inference_mode():
                torch._foreach_add_(xs, 1.0)
            assert [x.sum().item() for x in xs] == [6.0, 4.0]


def test_foreach_add_in_place_on_a_remote_list(remote):
    a = [torch.ones(3, device=R)]
    torch._foreach_add_(a, 1.0)
    assert a[0].cpu().tolist() == [2.0, 2.0, 2.0]


def test_an_effect_only_op_with_no_live_output_still_runs(remote):
    """The mutated tensor is read only after other work: the write must not be lost
    however the trace is cut."""
    x = torch.zeros(4, device=R)
    torch._foreach_mul_([x.add_(1.0)], 3.0)
    y = x * 2
    assert y.cpu().tolist() == [6.0] * 4
    assert x.cpu().tolist() == [3.0] * 4


def _twins() -> tuple[torch.nn.Module, torch.nn.Module]:
    """A small model, and its copy on the remote device."""
    torch.manual_seed(0)
    local = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2))
    remote_model = torch.nn.Sequential(
        torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 2)
    )
    remote_model.load_state_dict(local.state_dict())
    return local, remote_model.to(R)


@pytest.mark.parametrize(
    "make",
    [
        pytest.param(lambda p: torch.optim.Adam(p, lr=0.05, foreach=True), id="adam-foreach"),
        pytest.param(lambda p: torch.optim.Adam(p, lr=0.05, foreach=False), id="adam-loop"),
        pytest.param(lambda p: torch.optim.Adam(p, lr=0.05, fused=True), id="adam-fused"),
        pytest.param(lambda p: torch.optim.AdamW(p, lr=0.05, foreach=True), id="adamw-foreach"),
        pytest.param(lambda p: torch.optim.AdamW(p, lr=0.05, fused=True), id="adamw-fused"),
        pytest.param(lambda p: torch.optim.AdamW(p, lr=0.05), id="adamw-default"),
        pytest.param(
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, foreach=True), id="sgd-foreach"
        ),
        pytest.param(lambda p: torch.optim.RMSprop(p, lr=0.01, foreach=True), id="rmsprop"),
        # no meta kernel and no outputs: they raised a bare StopIteration
        pytest.param(
            lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True), id="sgd-fused"
        ),
        pytest.param(lambda p: torch.optim.Adagrad(p, lr=0.05, fused=True), id="adagrad-fused"),
    ],
)
def test_optimizers_update_remote_weights_exactly_as_local(remote, make):
    local, remote_model = _twins()
    opt_l, opt_r = make(local.parameters()), make(remote_model.parameters())
    x = torch.randn(8, 6)
    for _ in range(4):
        for model, opt, inp in ((local, opt_l, x), (remote_model, opt_r, x.to(R))):
            opt.zero_grad()
            model(inp).pow(2).mean().backward()
            opt.step()
    before = torch.nn.Linear(6, 5)  # a weight that never moved: proves the update ran
    for (name, p_l), p_r in zip(local.named_parameters(), remote_model.parameters(), strict=True):
        torch.testing.assert_close(p_r.detach().cpu(), p_l.detach(), rtol=1e-5, atol=1e-6, msg=name)
    assert not torch.equal(local[0].weight.detach(), before.weight.detach())


optim = torch.optim
# Note [foreach by default]: a remote model takes each optimizer's foreach path where local
# eager on a CPU takes its single-tensor loop; both must end at the same weights. Every
# optimizer of torch.optim that steps without a closure or sparse gradients, at its
# defaults and with the options that change its update (capturable=True is refused by
# local eager on a CPU; test_replayable_training runs it remotely).
DEFAULT_PATHS = {
    "sgd": (optim.SGD, {}),
    "sgd-nesterov-decay": (optim.SGD, {"momentum": 0.9, "nesterov": True, "weight_decay": 0.01}),
    "sgd-dampening-maximize": (optim.SGD, {"momentum": 0.9, "dampening": 0.1, "maximize": True}),
    "adam": (optim.Adam, {}),
    "adam-amsgrad-decay-maximize": (
        optim.Adam,
        {"amsgrad": True, "weight_decay": 0.01, "maximize": True},
    ),
    "adamw": (optim.AdamW, {}),
    "adamw-amsgrad": (optim.AdamW, {"amsgrad": True}),
    "adamax": (optim.Adamax, {}),
    "adamax-decay-maximize": (optim.Adamax, {"weight_decay": 0.01, "maximize": True}),
    "nadam": (optim.NAdam, {}),
    "nadam-decoupled": (optim.NAdam, {"weight_decay": 0.01, "decoupled_weight_decay": True}),
    "radam": (optim.RAdam, {}),
    "radam-decoupled": (optim.RAdam, {"weight_decay": 0.01, "decoupled_weight_decay": True}),
    "adagrad": (optim.Adagrad, {}),
    "adagrad-decay": (optim.Adagrad, {"weight_decay": 0.01, "lr_decay": 0.01}),
    "adadelta": (optim.Adadelta, {}),
    "adadelta-decay-maximize": (optim.Adadelta, {"weight_decay": 0.01, "maximize": True}),
    "rmsprop": (optim.RMSprop, {}),
    "rmsprop-centered-momentum": (optim.RMSprop, {"centered": True, "momentum": 0.9}),
    "asgd": (optim.ASGD, {}),
    "rprop": (optim.Rprop, {}),
    "adafactor": (optim.Adafactor, {}),
}


@pytest.mark.parametrize("clip", [False, True], ids=["", "clip_grad_norm"])
@pytest.mark.parametrize("name", list(DEFAULT_PATHS))
def test_each_optimizers_default_path_ends_at_local_eagers_weights(remote, name, clip):
    cls, options = DEFAULT_PATHS[name]
    lr = 0.01 if cls in (optim.Adadelta, optim.Adafactor) else 0.05
    local, remote_model = _twins()
    opt_l = cls(local.parameters(), lr=lr, **options)
    opt_r = cls(remote_model.parameters(), lr=lr, **options)
    x = torch.randn(8, 6)
    for _ in range(4):
        for model, opt, inp in ((local, opt_l, x), (remote_model, opt_r, x.to(R))):
            opt.zero_grad()
            model(inp).pow(2).mean().backward()
            if clip:  # its default is the foreach path too, remotely
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
            opt.step()
    for (label, p_l), p_r in zip(local.named_parameters(), remote_model.parameters(), strict=True):
        got = p_r.detach().cpu()
        torch.testing.assert_close(got, p_l.detach(), rtol=1e-5, atol=1e-6, msg=label)
    torch.manual_seed(0)
    start = torch.nn.Linear(6, 5)  # the seed's first weight: the steps moved it
    assert not torch.equal(local[0].weight.detach(), start.weight.detach())
