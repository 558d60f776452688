"""An empty KV cache the program made, passed to a registered model.

Note [a cache the program made]: transformers' own recipe for a hand-written decoding loop
makes the cache first and passes it to every call, and many loops keep using that object,
never ``out.past_key_values``, since eager fills it in place::

    past = DynamicCache()
    out = model(ids, past_key_values=past, use_cache=True)
    out = model(next_ids, past_key_values=past, use_cache=True)  # the same object

On the model path a KV cache lives on the appliance (a ``RemoteObject``), and a local
cache object cannot be sent: this was refused (InvalidArgument). An *empty*
``DynamicCache`` holds nothing but which layers it will make, so such a call now sends
no cache, and the model makes its own on the appliance, as it does when given none.
What comes back as ``out.past_key_values`` is bound to the program's object: its class
becomes ``CacheOnAppliance`` (a ``DynamicCache`` subclass for ``isinstance``), it refers
to the remote cache, and it is what later calls send and what their outputs hold
(``out.past_key_values is past``, as in eager). Its length is the remote cache's
(``get_seq_length``); any other use says that it lives on the appliance, as a
``RemoteObject`` does.

The stand-in is taken only where it changes nothing: the cache's exact class is
``DynamicCache``, it is empty, not offloading, passed by keyword to a forward that will
use a cache (``use_cache``, else the config's) and return a dict, of a model that is not
an encoder-decoder (whose eager call wraps the cache in another), and its layers are
those the model makes for itself (``DynamicCache(config=model.config)``: none yet, for a
model whose layers are all full-attention ones, or the same layer classes). Anything
else is refused as before.
``generate(past_key_values=DynamicCache())`` is sent with ``return_dict_in_generate``,
where the cache generate made is found (the same sequences: it changes what generate
returns, not what it does), and the program gets the sequences alone unless it asked for
the dict.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import torch

from .remote_objects import RemoteObject

KEY = "past_key_values"


def stand_in(module: Any, method: str, kwargs: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """``kwargs`` with an empty program-made cache taken out (None in its place), and that
    cache (None when there is none to bind). A ``generate`` asks for its dict, where the
    cache it made is found (``unwrap`` says to return its sequences alone)."""
    cache = kwargs.get(KEY)
    if method not in ("forward", "generate") or cache is None:
        return kwargs, None
    if not _empty_dynamic(cache, module, kwargs, method):
        return kwargs, None
    kwargs = {**kwargs, KEY: None}
    if method == "generate" and not _asks_dict(module, kwargs):
        kwargs["return_dict_in_generate"] = True
        return kwargs, Made(cache, unwrap=True)
    return kwargs, Made(cache, unwrap=False)


def _asks_dict(module: Any, kwargs: dict[str, Any]) -> bool:
    """Whether a ``generate()`` returns its dict: its argument, else its
    ``generation_config=``'s, else the model's generation config's (a review: the
    model's own setting was overridden, and the program got the sequences alone)."""
    given = getattr(kwargs.get("generation_config"), "__dict__", {})
    for source in (kwargs, given):
        if source.get("return_dict_in_generate") is not None:
            return bool(source["return_dict_in_generate"])
    own = getattr(module, "generation_config", None)
    return bool(getattr(own, "return_dict_in_generate", False))


class Made:
    """A program's cache a call stands in for, and whether the call's dict is the
    program's answer or only where the cache is found (a generate's sequences)."""

    __slots__ = ("cache", "unwrap")

    def __init__(self, cache: Any, unwrap: bool) -> None:
        self.cache, self.unwrap = cache, unwrap


def _empty_dynamic(cache: Any, module: Any, kwargs: dict[str, Any], method: str) -> bool:
    cache_utils = sys.modules.get("transformers.cache_utils")
    if cache_utils is None or type(cache) is not cache_utils.DynamicCache:
        return False
    config = getattr(module, "config", None)
    if method == "forward" and (
        kwargs.get("return_dict") is False or not getattr(config, "return_dict", True)
    ):
        return False  # a tuple out: no place to find the cache the call left
    if getattr(config, "is_encoder_decoder", False) or getattr(
        config, "add_cross_attention", False
    ):
        return False  # eager wraps the program's cache in another (EncoderDecoderCache)
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(config, "use_cache", False)
    if not use_cache or getattr(cache, "offloading", False):
        return False
    try:
        if cache.get_seq_length() != 0:
            return False
        made = cache_utils.DynamicCache(config=config).layers
        if cache.layers:
            # the same classes *and* settings (a review: a sliding window of another
            # width passed on its class, and the model used its own on the appliance)
            return [_layer(x) for x in cache.layers] == [_layer(x) for x in made]
        replicated = getattr(cache, "layer_class_to_replicate", None)
        fresh = _layer(replicated()) if replicated is not None else None
        return fresh is not None and all(_layer(x) == fresh for x in made)
    except Exception:  # another transformers' cache: not one this can vouch for
        return False


def _layer(layer: Any) -> tuple:
    """An empty cache layer's class and settings (a tensor setting as its values)."""
    settings = {k: v.tolist() if isinstance(v, torch.Tensor) else v for k, v in vars(layer).items()}
    return type(layer), sorted(settings.items(), key=lambda kv: kv[0])


def bind(made: Made, out: Any) -> Any:
    """Make the program's cache the remote cache the call left in ``out`` (the Note),
    and ``out`` hold it; a call that left none leaves the program's cache as it was.
    What the program gets: ``out``, or a generate's sequences alone."""
    cache, remote = made.cache, _field(out)
    if isinstance(remote, RemoteObject) and remote.cls.rsplit(".", 1)[-1] == "DynamicCache":
        cache.__dict__.clear()
        cache.__class__ = _cache_class(type(cache))
        object.__setattr__(cache, "_djinn_remote", remote)
        # on the object, not by its id: a recovery renames the id (a review)
        remote.bound = weakref.ref(cache)
        out[KEY] = cache
    return out["sequences"] if made.unwrap and isinstance(out, dict) else out


def remote_of(value: Any) -> RemoteObject | None:
    """The remote cache a bound program cache refers to (None for anything else)."""
    if getattr(type(value), "_djinn_bound_cache", False):
        return object.__getattribute__(value, "_djinn_remote")
    return None


def rebound(out: Any) -> Any:
    """``out`` holding the program's cache where the call left the remote cache bound to
    it (a later call with ``past_key_values=past``: ``out.past_key_values is past``)."""
    remote = _field(out)
    if isinstance(remote, RemoteObject) and remote.bound is not None:
        cache = remote.bound()
        if cache is not None and remote_of(cache) is remote:
            out[KEY] = cache
    return out


def _field(out: Any) -> Any:
    """The cache a call's output holds (a ModelOutput is a dict), else None."""
    return out.get(KEY) if isinstance(out, dict) else None


_CLASSES: dict[type, type] = {}


def _cache_class(base: type) -> type:
    cls = _CLASSES.get(base)
    if cls is None:
        cls = _CLASSES[base] = type(
            "CacheOnAppliance",
            (base,),
            {
                "__doc__": "A program's cache bound to one on the appliance (Note [a cache "
                "the program made] in djinn/frontend/local_caches.py).",
                "__module__": __name__,
                "_djinn_bound_cache": True,
                "__getattribute__": _forwarded,
                "__repr__": lambda self: f"{base.__name__} on the appliance ({remote_of(self)!r})",
                "__deepcopy__": lambda self, memo: remote_of(self).__deepcopy__(memo),
                "__reduce_ex__": lambda self, protocol: remote_of(self).__reduce_ex__(protocol),
            },
        )
    return cls


_OWN = frozenset({"__class__", "__dict__", "_djinn_remote", "__repr__", "__deepcopy__"})


def _forwarded(self: Any, name: str) -> Any:
    """Everything but the binding itself is the remote cache's: its length, and for any
    other name the typed word that it stays on the appliance."""
    if name in _OWN or name == "__reduce_ex__":
        return object.__getattribute__(self, name)
    remote = object.__getattribute__(self, "_djinn_remote")
    if name == "get_seq_length":
        return remote.get_seq_length
    return getattr(remote, name)
