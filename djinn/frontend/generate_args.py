"""A registered model's ``generate()`` arguments, taken on the client: Note [generation
settings] and Note [generation objects]. Used by remote_module.py."""

from __future__ import annotations

import copy
from typing import Any

import torch

from djinn.errors import InvalidArgument

from . import model_changes


# Note [generation settings]: the appliance builds a registered model from its config, so
# its generation_config is the one transformers derives from that config; the client's
# may say otherwise: set by the program (``model.generation_config.do_sample = True``) or
# read from a ``generation_config.json``. Run with the appliance's, a model meant to
# sample decoded greedily, with no error. So every ``generate()`` sends the settings
# where the client's generation_config differs from the config's own as arguments (what
# the call passes wins, as in transformers); one the appliance does not take for
# ``generate()`` is refused, typed, naming it, rather than left out.
def _generation_settings(module: torch.nn.Module, given: Any = None) -> dict[str, Any]:
    mine, config = getattr(module, "generation_config", None), getattr(module, "config", None)
    if given is not None:
        mine = _given_generation_config(given, mine)
    if mine is None or config is None:
        return {}
    from transformers import GenerationConfig

    base = GenerationConfig.from_model_config(config).to_dict()
    return {
        k: v
        for k, v in mine.to_dict().items()
        if not k.startswith("_")
        and k != "transformers_version"
        and base.get(k) != v
        and not (v is None and k in CONFIG_MIRRORS)
    }


# Settings a generation_config leaves None to mean "the model config's" (a forward given
# None reads its config): a generation_config.json written by hand, as most checkpoints
# on the hub ship (``{"bos_token_id": ..., "eos_token_id": ...}``), has None for them
# where one derived from the config has the config's values, and generate() of every such
# checkpoint was refused, "arguments not accepted: output_attentions, ..." (a review).
CONFIG_MIRRORS = frozenset({"use_cache", "output_attentions", "output_hidden_states"})


# Note [generation objects]: two Python objects of ``generate()``'s arguments are taken on
# the client, since neither can cross to the appliance (code would run there):
# - ``generation_config=``: as transformers does, its settings that are set (not None) win
#   over the model's ``generation_config``, which fills the rest; the result is sent as
#   arguments (Note [generation settings]), and the call's own arguments win over both.
# - ``streamer`` (``TextStreamer``, ``TextIteratorStreamer``): given what eager gives it, the
#   prompt, then each new token, then ``end()``, once the call returns: generation runs
#   whole on the appliance, so the tokens arrive together, not one by one as they are
#   made. The text is the same; a program that shows tokens as they come shows them at
#   the end. A batch of more than one is refused by the streamer itself, as in eager.
# ``stopping_criteria``, ``logits_processor`` and the like are code: refused, typed.
def generate_kwargs(
    module: torch.nn.Module, registered: dict[str, Any], kwargs: dict[str, Any]
) -> dict[str, Any]:
    """A ``generate()`` call's arguments as sent: its ``generation_config=`` merged, the
    model's own generation settings (Note [generation settings]), the call's over both.
    ``registered``: the model's call settings as registered (Note [call settings]); one
    that only follows a changed config is not a generation setting the program set."""
    settings = _generation_settings(module, kwargs.pop("generation_config", None))
    for key in model_changes.CALL_SETTINGS:
        if key in settings and settings[key] == registered.get(key, settings[key]):
            del settings[key]
    return {**settings, **kwargs}


def take_streamer(module: torch.nn.Module, kwargs: dict[str, Any]) -> Any:
    """Pop the ``streamer`` (and take ``inputs=`` as eager does), refusing beams with one
    before anything runs, as eager does."""
    streamer = kwargs.pop("streamer", None)
    if "inputs" in kwargs:  # generate()'s name for the model's main input
        kwargs[getattr(module, "main_input_name", "input_ids")] = kwargs.pop("inputs")
    if streamer is not None and _beams(module, kwargs) > 1:
        raise ValueError(
            "`streamer` cannot be used with beam search (yet!). Make sure that "
            "`num_beams` is set to 1."
        )
    return streamer


def _given_generation_config(given: Any, mine: Any) -> Any:
    from transformers import GenerationConfig

    if not isinstance(given, GenerationConfig):
        raise InvalidArgument(f"generation_config must be a GenerationConfig, not {type(given)}")
    merged = copy.deepcopy(given)
    for key, value in (mine.to_dict() if mine is not None else {}).items():
        if getattr(merged, key, None) is None:
            setattr(merged, key, value)
    return merged


def _beams(module: torch.nn.Module, kwargs: dict) -> int:
    """The beams a ``generate()`` call would search with: its argument, else its
    ``generation_config=``'s, else the model's."""
    for source in (kwargs, getattr(kwargs.get("generation_config"), "__dict__", {})):
        if source.get("num_beams") is not None:
            return int(source["num_beams"])
    return int(getattr(getattr(module, "generation_config", None), "num_beams", None) or 1)


def stream(module: torch.nn.Module, streamer: Any, args: tuple, kwargs: dict, out: Any) -> None:
    """Give ``streamer`` what eager's generate() would have (Note [generation objects])."""
    sequences = getattr(out, "sequences", out)
    tokens = (
        sequences.cpu()
        if isinstance(sequences, torch.Tensor)
        else torch.as_tensor(sequences, device="cpu")
    )
    if getattr(module.config, "is_encoder_decoder", False):
        given = kwargs.get("decoder_input_ids")  # else the decoder's start token
        prompt = int(given.shape[-1]) if isinstance(given, torch.Tensor) else 1
    else:
        ids = args[0] if args else kwargs.get("input_ids", kwargs.get("inputs"))
        prompt = int(ids.shape[-1]) if isinstance(ids, torch.Tensor) else 0
    streamer.put(tokens[:, :prompt])
    for step in range(prompt, tokens.shape[-1]):
        streamer.put(tokens[:, step])
    streamer.end()
