"""What a registered model's local copy may not change: Note [a registered model changed].

The model path (remote_module.py) runs a model on the appliance as it was registered;
these walks find, at each call, whatever the program changed on the local copy since.
"""

from __future__ import annotations

from typing import Any

import torch

MISSING = object()  # a setting a module or config does not have


# Note [a registered model changed]: a model on the model path runs on the appliance as
# it was registered when it moved; its local copy keeps only meta tensors. What the program
# did to the local module afterwards was silently ignored, and the numbers were the
# registered model's: ``wpe.weight.zero_()`` or ``load_state_dict(other)`` (both write
# into meta tensors, no-ops), ``.half()``, a submodule replaced (a 7-way ``lm_head`` still
# gave 100 logits), a forward hook that changes an output, ``.train()`` (no dropout, no
# autograd). So the module's structure, training flags and parameters (each one's
# identity, version counter and dtype) are recorded when it is registered, and every call
# compares them, and looks for hooks, first: a change refuses the call (UNSUPPORTED_OP,
# saying what changed) rather than run the stale model. A model that has hooks when it
# moves takes the graph path, which runs them. The move itself replaces every parameter
# (a new meta Parameter, its version counter at 0), so the parameters' identities are
# taken at the first call, which requires each version still 0 and each dtype the one
# registered. A model built weightless on this side (``djinn.from_pretrained``) is
# recorded as it is at its first call. Buffers are compared as parameters are, and each
# module's plain settings (numbers, strings, flags, tuples of them: a norm's eps) by value
# (a review: Llama's rotary ``inv_freq`` halved, a norm's ``variance_epsilon`` set, ran
# the registered model); what the model was before the move is Note [the model the
# appliance builds] (model_twin.py).
def modules_of(module: torch.nn.Module) -> tuple:
    return tuple((name, id(m), m.training) for name, m in module.named_modules())


def registered_modules(module: torch.nn.Module) -> tuple:
    """``modules_of`` as the appliance runs the model: every module in eval mode (its build
    ends with ``.eval()``). A module in training mode here is then a change, whenever it
    was made: a deep copy or a weightless model, recorded at its first call, put in
    training mode before it ran eval-mode numbers with no word (a review), and so did a
    submodule left in training mode at the move (Note [a registered model trains])."""
    return tuple((name, id(m), False) for name, m in module.named_modules())


def version_of(t: torch.Tensor) -> int:
    """A tensor's version counter; -1 for an inference tensor, which keeps none (reading it
    raised: a model moved inside ``torch.inference_mode`` failed its first call)."""
    return -1 if t.is_inference() else t._version


def _tensors_of(named: Any) -> tuple:
    """(name, identity, version, dtype) of each of a module's parameters or buffers."""
    return tuple((name, id(t), version_of(t), t.dtype) for name, t in named)


def _tensor_changed(kind: str, now: tuple, was: tuple) -> str | None:
    """How a module's parameters or buffers (``_tensors_of``) differ from their record."""
    if now == was:
        return None
    before_by_name = {name: rest for name, *rest in was}
    for name, ident, version, dtype in now:
        before = before_by_name.get(name)
        if before is None or before[0] != ident:
            return f"its {kind} {name!r} was added or replaced"
        if before[1] != version:
            return f"its {kind} {name!r} was written in place (load_state_dict, an edit)"
        if before[2] != dtype:
            return f"its {kind} {name!r} became {dtype} (.half(), .to(dtype))"
    return f"a {kind} was removed"


# a module's settings a forward reads besides its tensors (a norm's eps, a flag, a size):
# these types, compared by value; the rest (tensors, modules, configs, functions) is
# compared as what it is elsewhere, or not at all
_SCALARS = (int, float, bool, str, type(None))


def _is_plain(v: Any) -> bool:
    return type(v) in _SCALARS or (type(v) is tuple and all(type(x) in _SCALARS for x in v))


def plain_settings(m: torch.nn.Module) -> list[tuple[str, Any]]:
    return [
        (k, v) for k, v in m.__dict__.items() if k[0] != "_" and k != "training" and _is_plain(v)
    ]


def attributes_of(module: torch.nn.Module) -> tuple:
    """Each submodule's plain settings, by name (Note [a registered model changed])."""
    return tuple(
        (name, key, value) for name, m in module.named_modules() for key, value in plain_settings(m)
    )


def dtypes_of(module: torch.nn.Module, dtype: torch.dtype | None) -> dict[str, torch.dtype]:
    def cast(t: torch.Tensor) -> torch.dtype:  # what Module.to(dtype) leaves
        return dtype if dtype is not None and (t.is_floating_point() or t.is_complex()) else t.dtype

    return {name: cast(p) for name, p in module.named_parameters(remove_duplicate=False)}


_HOOKS = ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks")
# transformers' own recorders, which it installs the first time a call asks for attentions
# or hidden states and leaves in place (in eager too); they change no output. djinn.analyze
# runs the local module with the call's arguments, so they appeared there, and every
# later call was refused ("hooks were added": a review)
_OWN_HOOKS = "transformers.utils.output_capturing"
# config attributes transformers sets itself, or that only say where a config came from
_CONFIG_VOLATILE = frozenset(
    {
        "_attn_implementation_internal",
        "_experts_implementation_internal",
        "_name_or_path",
        "_commit_hash",
        "_post_init_done",
        "transformers_version",
    }
)


# Config settings a forward reads as the default of its argument of the same name
# (``use_cache = use_cache if use_cache is not None else self.config.use_cache``). A change
# of one is sent as that argument, not refused: transformers' Trainer sets
# ``config.use_cache = False`` itself, and ``Trainer.evaluate()`` of a model moved in eval
# mode was refused (a review). Note [call settings] in remote_module.py.
# output_attentions is not one: set on the config, transformers 5 changes the attention
# implementation with it, and the appliance's model returned empty attentions (a review)
CALL_SETTINGS = ("use_cache", "output_hidden_states")


def config_snapshot(module: torch.nn.Module) -> dict[str, Any]:
    """What of ``module.config`` a call compares with the registered one."""
    config = getattr(module, "config", None)
    if config is None:
        return {}
    return {
        k: v
        for k, v in vars(config).items()
        if k not in _CONFIG_VOLATILE and k not in CALL_SETTINGS
    }


def call_settings(module: torch.nn.Module) -> dict[str, Any]:
    """The ``CALL_SETTINGS`` of ``module.config``, as a call compares them."""
    config = getattr(module, "config", None)
    return {k: getattr(config, k, None) for k in CALL_SETTINGS}


def same_value(a: Any, b: Any) -> bool:
    """``a == b`` for config values and module settings, whatever they are: a numpy
    array or a tensor set on a config (its ``==`` is elementwise, and its truth raised
    ValueError at every call) is compared by its values, nested in lists and dicts too."""
    try:
        return bool(a == b)
    except Exception:  # elementwise == somewhere inside
        pass
    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same_value(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(same_value(x, y) for x, y in zip(a, b, strict=True))
    try:
        shape_a, shape_b = getattr(a, "shape", None), getattr(b, "shape", None)
        return shape_a == shape_b and bool((a == b).all())
    except Exception:
        return False  # not comparable: taken as changed, which refuses, never runs stale


def _user_hooks(m: torch.nn.Module) -> bool:
    return any(
        getattr(h, "__module__", None) != _OWN_HOOKS
        for name in _HOOKS
        for h in getattr(m, name, {}).values()
    )


def _global_hooks() -> bool:
    from torch.nn.modules import module as module_mod

    return any(getattr(module_mod, f"_global{h}", None) for h in _HOOKS)


def hooked(module: torch.nn.Module) -> bool:
    return _global_hooks() or any(_user_hooks(m) for m in module.modules())


def plain_keys(module: torch.nn.Module) -> dict[int, tuple[str, ...]]:
    """Each submodule's plain settings' names, by its id: what ``_glance`` reads of it
    (reading every module's whole ``__dict__`` doubled the glance: 108 to 242 µs a call,
    GPT-2 small)."""
    return {id(m): tuple(k for k, _ in plain_settings(m)) for m in module.modules()}


def _glance(module: torch.nn.Module, keys: dict[int, tuple[str, ...]]) -> list:
    """One walk over ``module``: each submodule's identity, training flag and hooks, each
    of its own parameters' identity, version and dtype, each buffer's identity and
    version, and its plain settings (by the names in ``keys``). Compared with its value at
    the last call that found nothing changed, it spares a call the named walks below
    (GPT-2 small: 315 µs of them a call)."""
    out: list = []
    add = out.append
    todo = [module]
    while todo:  # not named_modules(): its names cost more than the rest
        m = todo.pop()
        add(id(m))
        add(m.training)
        hooked = m._forward_hooks or m._forward_pre_hooks or m._backward_hooks
        add(bool(hooked or m._backward_pre_hooks) and _user_hooks(m))
        for p in m._parameters.values():
            if p is not None:
                add(id(p))
                add(version_of(p))
                add(p.dtype)
        for b in m._buffers.values():
            if b is not None:
                add(id(b))
                add(version_of(b))
        d = m.__dict__
        for k in keys.get(id(m), ()):  # a new module: its id is new already
            v = d.get(k, MISSING)
            # a scalar by value; anything else by identity (a tuple made again equal, or a
            # setting that became a tensor, whose == is elementwise): _what_changed decides
            add(v if type(v) in _SCALARS else id(v))
        todo.extend(c for c in m._modules.values() if c is not None)
    return out


def changed(module: torch.nn.Module, binding: Any) -> str | None:
    """What changed in ``module`` since it was registered, or None (Note [a registered
    model changed])."""
    if binding.plain_keys is None:  # built weightless (djinn.from_pretrained)
        binding.plain_keys = plain_keys(module)
    seen = _glance(module, binding.plain_keys)
    same_config = binding.config is None or same_value(config_snapshot(module), binding.config)
    if seen == binding.seen and same_config and not _global_hooks():
        return None
    what = _what_changed(module, binding)
    if what is None:
        binding.seen = seen
    return what


def _not_meta(module: torch.nn.Module) -> str | None:
    """The first parameter or buffer of a model that moved which is not a meta tensor."""
    for kind in ("parameter", "buffer"):
        for name, t in getattr(module, f"named_{kind}s")(remove_duplicate=False):
            if not t.is_meta:
                return f"its {kind} {name!r} was added or replaced"
    return None


def _what_changed(module: torch.nn.Module, binding: Any) -> str | None:
    modules = modules_of(module)
    if not binding.modules:  # built weightless (djinn.from_pretrained), a deep copy: now
        binding.modules = registered_modules(module)
    if modules != binding.modules:
        was = {name: (ident, training) for name, ident, training in binding.modules}
        for name, ident, training in modules:
            if name not in was or was[name][0] != ident:
                return f"its submodule {name or 'itself'!r} was added or replaced"
            if was[name][1] != training:
                return f"{name or 'it'} was put in {'training' if training else 'eval'} mode"
        return "a submodule was removed"
    weights = _tensors_of(module.named_parameters(remove_duplicate=False))
    if not binding.weights and binding.dtypes:  # the first call: as the move left them
        # (all meta: one that is not was put there since, ``load_state_dict(assign=True)``
        # through a wrapper, and was taken for the registered one: a review, 0.383 off)
        placed = _not_meta(module)
        if placed is not None:
            return placed
        binding.weights = tuple(
            (n, ident, min(v, 0), binding.dtypes.get(n)) for n, ident, v, _ in weights
        )  # unwritten (0), or an inference tensor's -1
    elif not binding.weights:  # built weightless: its own initialisation wrote its meta tensors
        binding.weights = weights
    buffers = _tensors_of(module.named_buffers(remove_duplicate=False))
    if binding.buffers is None:  # the first call: as the move left them (new, unwritten)
        moved = bool(binding.dtypes)
        binding.buffers = tuple((n, i, min(v, 0) if moved else v, d) for n, i, v, d in buffers)
    what = _tensor_changed("parameter", weights, binding.weights)
    what = what or _tensor_changed("buffer", buffers, binding.buffers)
    if what is not None:
        return what
    attributes = attributes_of(module)
    if binding.attributes is None:  # built weightless (djinn.from_pretrained): as first called
        binding.attributes = attributes
    was_a = {(name, key): value for name, key, value in binding.attributes}
    for name, key, value in attributes:
        before = was_a.pop((name, key), MISSING)
        if not same_value(before, value):
            return f"{name + '.' if name else ''}{key} was changed to {value!r}"
    for name, key in was_a:  # no longer a plain setting: removed, or another kind of value
        now = module.get_submodule(name).__dict__.get(key, MISSING)
        return f"{name + '.' if name else ''}{key} was changed to {type(now).__name__}"
    if hooked(module):
        return "hooks were added, which the appliance does not run"
    if binding.config is not None:
        now = config_snapshot(module)
        for key in sorted(set(now) | set(binding.config)):
            if not same_value(now.get(key, MISSING), binding.config.get(key, MISSING)):
                return (
                    f"its config's {key.lstrip('_')!r} was changed (the appliance runs the "
                    "config it was registered with; a setting the forward takes as an "
                    "argument can be passed to the call instead)"
                )
    return None
