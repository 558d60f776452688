"""Whether the appliance would run the model the program has.

Note [the model the appliance builds]: the model path registers a model as its class,
its config and its weights; the appliance builds ``cls(config)`` on the meta device and
loads the weights into it (appliance/models.py ``build``). Whatever the program changed
in the module itself, and that neither the config nor the weights carry, was silently
not there (a review): every block's activation swapped for ``ReLU``, a layer norm's
``eps`` set on the module, an ``lm_head`` given weights of its own while the config still
ties them (the build ties them again), a model built with ``attn_implementation=
"eager"`` (not in ``config.to_dict()``, so sdpa ran, other numbers at padded positions).
Layers dropped from ``transformer.h`` were refused as "weights missing", where eager runs.

So before a move takes the model path, the client builds the same twin on the meta
device, from the config as the appliance will get it (a few ms for GPT-2 small), and
compares: each submodule's name and class, its plain attributes (numbers, strings,
flags, functions), each parameter's and buffer's name and shape, and which parameters
are one (ties). A difference sends the model down the graph path, which runs the local
module as it is, with a warning naming the first difference. The attention
implementation travels in the config (``attn_implementation``, eager or sdpa, which the
appliance accepts): a model built with eager attention keeps the model path and runs it.
"""

from __future__ import annotations

import json
import warnings
from typing import Any

import torch

from .model_changes import MISSING, same_value

# attributes a build sets from the config or for its own bookkeeping: not the module's
# computation, or compared through the config itself
_SKIPPED = frozenset({"training", "config", "generation_config", "name_or_path"})
# settings that change no eval-mode output (checkpointing acts only while training;
# gradient_checkpointing_enable() sends no model to the graph path: a review)
_NO_OUTPUT = frozenset({"gradient_checkpointing"})


def config_dict(module: torch.nn.Module) -> dict[str, Any]:
    """The config as the appliance gets it: ``to_dict()``, plus the attention
    implementation where it is one the appliance runs."""
    config = module.config
    out = config.to_dict()
    attn = getattr(config, "_attn_implementation", None)
    if attn in ("eager", "sdpa"):
        out["attn_implementation"] = attn
    return out


def difference(module: torch.nn.Module) -> str | None:
    """The first way ``module`` differs from what the appliance builds of its class and
    config, or None (Note [the model the appliance builds])."""
    cls, config = type(module), module.config
    config_class = getattr(cls, "config_class", None) or type(config)
    try:
        wire = json.loads(json.dumps(config_dict(module), default=str))
        with torch.device("meta"), warnings.catch_warnings():
            warnings.simplefilter("ignore")
            twin = cls(config_class.from_dict(wire))
    except Exception as exc:  # the appliance could not build it either
        return f"its class does not build from its config here ({type(exc).__name__}: {exc})"
    if getattr(twin.config, "_attn_implementation", None) != getattr(
        config, "_attn_implementation", None
    ):
        return (
            f"its attention implementation is {config._attn_implementation!r}, its config "
            f"builds {twin.config._attn_implementation!r}"
        )
    mine = dict(module.named_modules(remove_duplicate=False))
    built = dict(twin.named_modules(remove_duplicate=False))
    if mine.keys() != built.keys():
        name = sorted(mine.keys() ^ built.keys())[0]
        return f"its submodule {name!r} was {'added' if name in mine else 'removed'}"
    for name, m in mine.items():
        b = built[name]
        if type(m) is not type(b):
            return f"{name or 'it'} is a {type(m).__name__}, its config builds a {type(b).__name__}"
        what = _attributes_differ(m, b)
        if what is not None:
            return f"{name + '.' if name else ''}{what}"
    for kind in ("parameters", "buffers"):
        got = _shapes(getattr(module, f"named_{kind}")(remove_duplicate=False))
        want = _shapes(getattr(twin, f"named_{kind}")(remove_duplicate=False))
        if got != want:
            name = sorted(set(got.items()) ^ set(want.items()))[0][0]
            return f"its {kind[:-1]} {name!r} is not one its config builds, or of another shape"
    if _ties(module) != _ties(twin):
        return "its parameters are tied otherwise than its config ties them"
    return None


def _attributes_differ(m: torch.nn.Module, b: torch.nn.Module) -> str | None:
    mine, built = vars(m), vars(b)
    # a setting only the local module has is one its class's code never reads (a
    # library's bookkeeping: resize_token_embeddings sets vocab_size there; a review)
    for key in sorted(built):
        if key.startswith("_") or key in _SKIPPED or key in _NO_OUTPUT:
            continue
        a, z = mine.get(key, MISSING), built.get(key, MISSING)
        if isinstance(a, (torch.Tensor, torch.nn.Module)) or isinstance(
            z, (torch.Tensor, torch.nn.Module)
        ):
            continue  # compared as parameters, buffers and submodules
        if hasattr(a, "to_dict") and hasattr(z, "to_dict"):
            continue  # a config: the one the appliance gets
        if callable(a) and callable(z):
            if getattr(a, "__func__", a) is not getattr(z, "__func__", z):
                return f"{key} is another function"
            continue
        if a is MISSING:
            return f"{key} was removed"
        if not same_value(a, z):
            return f"{key} = {a!r} (its config builds {z!r})"
    return None


def _shapes(named: Any) -> dict[str, tuple[int, ...]]:
    return {name: tuple(t.shape) for name, t in named}


def _ties(module: torch.nn.Module) -> set[frozenset[str]]:
    groups: dict[int, set[str]] = {}
    for name, p in module.named_parameters(remove_duplicate=False):
        groups.setdefault(id(p), set()).add(name)
    return {frozenset(g) for g in groups.values() if len(g) > 1}
