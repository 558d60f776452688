"""A registered model that leaves the model path for the graph path, its weights copied
into the session: Note [a registered model trains] (appliance/model_handlers.py).

The Hugging Face fine-tuning recipe is ``from_pretrained`` (a model in eval mode), a move
to the GPU, then ``.train()`` or a ``Trainer``, which calls it. Under Djinn the move of an
eval-mode model registers it (the model path): the appliance keeps one copy of its
weights for every program, and the local module keeps meta tensors. ``.train()`` was then
refused at the next call, and a program could not train the model it had moved, nor move
it back (``.cpu()`` raised torch's "Cannot copy out of meta tensor", untyped), nor cast it
(``.half()``).

So a call made in training mode (``.train()``, or a submodule's), a conversion of the
weights and ``load_state_dict`` (a Trainer resuming from a checkpoint) first ask the
appliance to copy the registered weights into handles of
the session (CALL ``$weights``), puts them in the local module's meta tensors, and drops
the registration from the module: it is a module of remote tensors from then on, as if it
had moved in training mode, and runs on the graph path, op by op, with autograd. Only the
call does it, not ``.train()`` itself: ``.train()`` then ``.eval()`` with no call between
(Trainer's evaluation does it) leaves the model registered, and the KV caches it returned
usable; a session's copy of the weights is made only for a model that trains. Each
parameter keeps its identity (``torch.utils.swap_tensors``, as the move itself does: Note
[parameters keep their identity] in ties.py), so an optimizer built over
``model.parameters()`` before ``.train()`` steps the copies, and ties stay ties. A
parameter or buffer that the program wrote in place while it was meta here (an edit after
the move wrote nothing) has no value anywhere, nor has one added or renamed since
(``get_peft_model``): refused, typed, before anything is sent. One the program replaced
by a tensor of its own keeps it.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch

from djinn.errors import InvalidArgument, UnsupportedOp
from djinn.protocol.frames import WEIGHTS_METHOD

from . import ties
from .device import is_remote, mapped_source
from .model_changes import version_of
from .registered_weights import registered_name, replaced


def take_weights(
    module: torch.nn.Module, binding: Any, decode: Any, given: dict | None = None
) -> None:
    """Put copies of the registered weights into ``module``'s meta tensors (Note [a
    registered model trains]); ``decode`` makes the reply's handles remote tensors;
    ``given``: copies the session has already for some, to put in instead (Note [weights
    of a registered model]). The caller holds ``binding.lock`` and makes the module a
    plain one after."""
    lost = _written_while_meta(module, binding)
    if lost is not None:
        raise UnsupportedOp(
            f"{type(module).__name__} is registered on the appliance (the model path) and "
            f"its {lost} was written since the move, where it holds no value (a meta "
            "tensor): its weights cannot be taken back to train or move it. Load weights "
            "before the move, or move it in training mode (model.train().to(...)) (Note [a "
            "registered model trains])"
        )
    registered = binding.dtypes or None  # by name, for a model that moved (not a ghost)
    added = next(
        (n for n, _ in _meta_parameters(module) if registered and n not in registered), None
    )
    if added is not None:
        raise _added(module, added)
    held = next((name for name, p in _meta_parameters(module) if not ties.swappable(p)), None)
    if held is not None:  # asked before the copies are made
        raise UnsupportedOp(
            f"{type(module).__name__}'s parameter {held!r} is held where its object cannot "
            "take its weights (a weak reference): move the model in training mode "
            "(model.train().to(...)) (Note [a registered model trains])"
        )
    copies = weights_of(binding, None, decode)
    if isinstance(copies, dict) and given:
        copies.update(given)
    _fill(module, copies)


def weights_of(binding: Any, names: list[str] | None, decode: Any) -> Any:
    """Copies of the registered weights in the session, by name: all, or those ``names``
    (Note [weights of a registered model]); the model stays registered."""
    body = {"fingerprint": binding.fingerprint, "method": WEIGHTS_METHOD}
    if names is not None:
        body["names"] = names
    reply = binding.session.call_model({**body, "args": [], "kwargs": {}})
    # made outside the program's inference mode: a use may make a copy the weight itself
    with torch.inference_mode(False):
        copies = decode(reply["out"], binding.session)
    if names is not None and (not isinstance(copies, dict) or set(copies) != set(names)):
        raise InvalidArgument("the appliance sent other weights than those asked for")
    return copies


def _written_while_meta(module: torch.nn.Module, binding: Any) -> str | None:
    """The first meta parameter or buffer the program wrote since the registration, named:
    the move left each at version 0; a model built weightless (``djinn.from_pretrained``)
    as its first call recorded it."""
    was = {name: version for name, _, version, _ in (*binding.weights, *(binding.buffers or ()))}
    tensors = itertools.chain(
        (("parameter", n, t) for n, t in module.named_parameters(remove_duplicate=False)),
        (("buffer", n, t) for n, t in module.named_buffers(remove_duplicate=False)),
    )
    for kind, name, t in tensors:
        if not t.is_meta:
            continue
        base = was.get(name, 0 if binding.dtypes else None)
        if base is not None and version_of(t) not in (base, -1):  # -1: keeps no count
            return f"{kind} {name!r}"
    return None


def _added(module: torch.nn.Module, name: str) -> UnsupportedOp:
    """A meta parameter the registered model has not, or not of that shape: added or
    renamed since the move (``get_peft_model``, ``resize_token_embeddings``), built on the
    meta device, so with no value anywhere (a review: it said "the appliance sent no
    weight")."""
    return UnsupportedOp(
        f"{type(module).__name__} is registered on the appliance (the model path), and its "
        f"parameter {name!r} was added or reshaped since the move (a submodule replaced or "
        "wrapped: get_peft_model, resize_token_embeddings), on the meta device: it holds no "
        "value to train. Make such changes before the move, or move the model in training "
        "mode (model.train().to(...)) (Note [a registered model trains])"
    )


def _meta_parameters(module: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """Its parameters still meta (one the program replaced by a tensor of its own keeps
    it), a tied one once, under the name it was registered by (a submodule wrapped since,
    as peft's LoRA wraps one, renames its weight: Note [weights of a registered model]),
    else its first name."""
    return [(registered_name(p, n), p) for n, p in module.named_parameters() if p.is_meta]


def _fill(module: torch.nn.Module, copies: Any) -> None:
    """Put each copy into the meta tensor of its name: a parameter keeps its object, a
    buffer's slot gets the copy (as a move gives each slot a new buffer)."""
    if not isinstance(copies, dict):
        raise InvalidArgument("the appliance sent no weights")
    pairs = []  # every copy checked before any is put in: no half-filled module
    for name, p in _meta_parameters(module):
        value = copies.get(name)
        if value is None or value.shape != p.shape or value.dtype != p.dtype:
            raise _added(module, name)
        pairs.append((p, torch.nn.Parameter(value, requires_grad=p.requires_grad)))
    for p, new in pairs:
        # swap_tensors swaps the objects' attributes and tensor hooks too: what the program
        # set on the parameter since the move stays on it (a review: a post-accumulate
        # hook, the optimizer step in backward, was dropped and the model did not train)
        own = ties.own_state(p)
        torch.utils.swap_tensors(p, new)
        ties.give_state(p, own)
    given: dict[int, torch.Tensor] = {}
    for name, b in module.named_buffers():  # one buffer in two modules: once
        if b.is_meta:
            value = copies.get(registered_name(b, name))
            if value is None or value.shape != b.shape or value.dtype != b.dtype:
                raise InvalidArgument(f"the appliance sent no buffer {name!r}")
            given[id(b)] = value
    for m in module.modules():
        for key, b in list(m._buffers.items()):
            if b is not None and id(b) in given:
                m._buffers[key] = given[id(b)]
                replaced(b, given[id(b)])


def converts_nothing(module: torch.nn.Module, fn: Any) -> bool:
    """Whether ``fn`` leaves every tensor of a registered model where and what it is:
    asked of an empty meta tensor of each of its dtypes (its own tensors are meta)."""
    dtypes = {t.dtype for t in itertools.chain(module.parameters(), module.buffers())}
    for dtype in dtypes:
        probe = torch.empty(0, dtype=dtype, device="meta")
        try:
            out = fn(probe)
        except Exception:  # .cpu(): "Cannot copy out of meta tensor"
            return False
        if out.dtype != dtype or not (out.is_meta or on_appliance(out.device)):
            return False
    return True


def put_in_training(module: torch.nn.Module, binding: Any) -> bool:
    """Whether the program put a module the model was registered with in training mode (a
    module it added is in training mode as built: that is a change, refused)."""
    registered = {ident for _, ident, _ in binding.modules}
    return any(m.training and id(m) in registered for m in module.modules())


def on_appliance(device: torch.device) -> bool:
    """Whether ``device`` is the appliance's: the remote device, or the one ``djinn run``
    maps to it (cuda)."""
    return is_remote(device) or device.type == mapped_source()
