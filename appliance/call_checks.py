"""Token ids checked before a registered model runs on a GPU (the model path).

Note [indices on a GPU] (executor/index_bounds.py) checks the graph path's ops. A model
call runs the registered module directly, so its embedding lookups are not ops the
appliance sees one by one: a token id past the vocabulary (a mismatched tokenizer, a
client's crafted request) reached CUDA's ``embedding``, whose device-side assert loses
the worker's context for every session on it (the worker restarts: Note [a lost GPU
context]). On a worker whose device is not the CPU, a call's ``input_ids`` (the keyword,
or the first positional argument when it is an integer tensor) must lie within the
model's input embeddings, and its ``labels`` there too or at ``-100`` (the ignored
label of transformers' losses).

Note [positions on a GPU]: a model with an absolute position table (GPT-2's ``wpe``,
BERT's ``position_embeddings``, OPT's ``embed_positions``) looks its positions up with
the same ``embedding``: a prompt longer than the table, or a decode step past it, is the
same device-side assert, and so is a BERT ``token_type_ids`` past its type table. The
table is the ``nn.Embedding`` named as one (``wpe``, ``*position*``: a vocabulary as
large as the positions, Mistral's, or DeBERTa's relative table is not) whose rows, less
an ``offset`` it declares (OPT's 2), are the config's ``max_position_embeddings``; it
holds that many positions, less RoBERTa's padding index plus one, where its positions
start. A model without one (rotary positions: Llama) is not checked. An encoder-decoder's
encoder and decoder count apart. The positions a forward uses are its ``position_ids`` or
``cache_position`` when given, else the cache's length plus the new tokens (the last
position is one less; an attention-mask cumsum, as OPT's, never passes it). A
``generate()`` call is checked for the length it may reach (the prompt plus
``max_new_tokens``, else ``max_length``, else its generation config, less one:
the last token comes from the logits of the one before it): it would
run past the table mid-way, where local PyTorch on CUDA asserts too, unless an end token
stopped it first, so such a call is refused up front, never started.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from djinn.errors import ExecutionError

IGNORED_LABEL = -100


def _vocabulary(module: Any) -> int | None:
    get = getattr(module, "get_input_embeddings", None)
    try:
        embeddings = get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None
    rows = getattr(embeddings, "num_embeddings", None)
    return rows if isinstance(rows, int) else None


def _ids(value: Any) -> torch.Tensor | None:
    """``value`` if it is a non-empty tensor of integers (token ids), else None."""
    if not isinstance(value, torch.Tensor) or not value.numel():
        return None
    integral = not (value.is_floating_point() or value.is_complex() or value.dtype == torch.bool)
    return value if integral else None


# generate() settings that name token ids a logits processor indexes the scores with
# (``scores[:, ids] = ...``): ForcedEOS's, ForcedBOS's, and the end tokens when the
# exponential decay penalises them. An id outside the vocabulary (a negative one counts
# from its end, as an index does) is CUDA's device-side assert there (a review); the CPU
# raises IndexError. Elsewhere end tokens are compared, never indexed with.
def _token_settings(kwargs: dict) -> tuple[str, ...]:
    if kwargs.get("exponential_decay_length_penalty") is not None:
        return ("forced_eos_token_id", "forced_bos_token_id", "eos_token_id")
    return ("forced_eos_token_id", "forced_bos_token_id")


def check(module: Any, name: str, args: tuple, kwargs: dict) -> None:
    _check_positions(module, name, args, kwargs)
    vocab = _vocabulary(module)
    if vocab is None:
        return
    for key in _token_settings(kwargs):
        for token in _token_list(kwargs.get(key)):
            if not -vocab <= token < vocab:
                raise ExecutionError(
                    f"{name}: {key} holds token id {token}, outside the model's vocabulary "
                    f"of {vocab}"
                )
    ids = _ids(kwargs.get("input_ids", args[0] if args else None))
    if ids is not None:
        lo, hi = (int(v) for v in torch.aminmax(ids))
        if lo < 0 or hi >= vocab:
            bad = lo if lo < 0 else hi
            raise ExecutionError(
                f"{name}: input_ids holds token id {bad}, outside the model's vocabulary of {vocab}"
            )
    labels = _ids(kwargs.get("labels"))
    if labels is not None:
        named = labels[labels != IGNORED_LABEL]
        if named.numel():
            lo, hi = (int(v) for v in torch.aminmax(named))
            if lo < 0 or hi >= vocab:
                raise ExecutionError(
                    f"{name}: labels hold {lo if lo < 0 else hi}, outside the model's "
                    f"vocabulary of {vocab} (or -100, ignored)"
                )


def _token_list(value: Any) -> list[int]:
    """A setting's token ids: an int, a list of ints, a tensor of them (others: none)."""
    if isinstance(value, torch.Tensor):
        return [int(v) for v in value.reshape(-1).tolist()] if not value.is_floating_point() else []
    if isinstance(value, int) and not isinstance(value, bool):
        return [value]
    if isinstance(value, (list, tuple)):
        return [v for v in value if isinstance(v, int) and not isinstance(v, bool)]
    return []


_TABLES: weakref.WeakKeyDictionary[torch.nn.Module, int | None] = weakref.WeakKeyDictionary()


def _positions(module: Any) -> int | None:
    """How many positions the model's absolute position table holds (Note [positions on
    a GPU]); None when it has none. Looked for once per model: a walk of its modules."""
    config = getattr(module, "config", None)
    most = getattr(config, "max_position_embeddings", None)
    if not isinstance(most, int) or not isinstance(module, torch.nn.Module):
        return None
    if module not in _TABLES:
        _TABLES[module] = next(
            (
                _held(sub)
                for name, sub in module.named_modules()
                if isinstance(sub, torch.nn.Embedding)
                and _named_as_positions(name)
                and sub.num_embeddings - _offset(sub) == most
            ),
            None,
        )
    return _TABLES[module]


def _named_as_positions(name: str) -> bool:
    """A position table by its name: a vocabulary as large as the positions (Mistral's)
    or DeBERTa's relative table of that size are not one."""
    last = name.rpartition(".")[2].lower()
    return last == "wpe" or "position" in last


def _offset(table: torch.nn.Embedding) -> int:
    offset = getattr(table, "offset", 0)  # OPT's, BART's: rows before position 0
    return offset if isinstance(offset, int) else 0


def _held(table: torch.nn.Embedding) -> int:
    """Positions a table holds: RoBERTa's count from its padding index plus one."""
    rows = table.num_embeddings - _offset(table)
    pad = table.padding_idx
    return rows - (pad + 1) if isinstance(pad, int) and 0 <= pad < rows else rows


def _tokens(args: tuple, kwargs: dict) -> int | None:
    """How many new positions a call takes: its ids' last dimension, or its embeddings'
    second last."""
    ids = kwargs.get("input_ids", args[0] if args else None)
    if isinstance(ids, torch.Tensor) and ids.dim() >= 1:
        return int(ids.shape[-1])
    embeds = kwargs.get("inputs_embeds")
    if isinstance(embeds, torch.Tensor) and embeds.dim() >= 2:
        return int(embeds.shape[-2])
    return None


def _cached(kwargs: dict) -> int:
    length = getattr(kwargs.get("past_key_values"), "get_seq_length", None)
    try:
        return int(length()) if callable(length) else 0
    except (TypeError, ValueError, AttributeError, IndexError):
        return 0


def _given(kwargs: dict, *keys: str) -> int | None:
    """One past the largest position ``kwargs`` names; a negative one as it is."""
    for key in keys:
        given = _ids(kwargs.get(key))
        if given is not None:
            lo, hi = (int(v) for v in torch.aminmax(given))
            return hi + 1 if lo >= 0 else lo  # a negative position is refused as well
    return None


def _length(value: Any) -> int | None:
    return int(value.shape[-1]) if isinstance(value, torch.Tensor) and value.dim() else None


def _reach(module: Any, method: str, args: tuple, kwargs: dict) -> int | None:
    """One past the last position the call may look up (Note [positions on a GPU])."""
    config = getattr(module, "config", None)
    seq2seq = bool(getattr(config, "is_encoder_decoder", False))
    if method == "generate":
        return _generated(module, args, kwargs, seq2seq)
    given = _given(kwargs, "position_ids", "cache_position")
    if given is not None:
        return given
    tokens = _tokens(args, kwargs)
    if seq2seq:  # the encoder's positions, and the decoder's after its cache
        decoder = _length(kwargs.get("decoder_input_ids"))
        decoder = None if decoder is None else _cached(kwargs) + decoder
        return max((n for n in (tokens, decoder) if n is not None), default=None)
    return None if tokens is None else _cached(kwargs) + tokens


def _generated(module: Any, args: tuple, kwargs: dict, seq2seq: bool) -> int | None:
    """The reach of ``generate()``: its ``input_ids`` are the whole sequence (a cache it
    is given covers a prefix of them), and a sequence-to-sequence model's decoder starts
    from one token."""
    new, longest = kwargs.get("max_new_tokens"), kwargs.get("max_length")
    config = kwargs.get("generation_config") or getattr(module, "generation_config", None)
    if new is None and longest is None:
        new = getattr(config, "max_new_tokens", None)
        longest = getattr(config, "max_length", None)
    prompt = _tokens(args, kwargs) or 0
    start = 1 if seq2seq else max(prompt, (_given(kwargs, "position_ids") or 0))
    # the last new token comes from the logits of the one before: no lookup of its own
    if isinstance(new, int):
        reach = start + max(new - 1, 0)
    elif isinstance(longest, int):
        reach = max(start, longest - 1)
    else:
        return None
    return max(reach, prompt) if seq2seq else reach


def _check_positions(module: Any, name: str, args: tuple, kwargs: dict) -> None:
    types = _ids(kwargs.get("token_type_ids"))
    kinds = getattr(getattr(module, "config", None), "type_vocab_size", None)
    if types is not None and isinstance(kinds, int):
        lo, hi = (int(v) for v in torch.aminmax(types))
        if lo < 0 or hi >= kinds:
            raise ExecutionError(
                f"{name}: token_type_ids holds {lo if lo < 0 else hi}, outside the "
                f"model's {kinds} token types"
            )
    most = _positions(module)
    if most is None:
        return
    reach = _reach(module, name.rpartition(".")[2], args, kwargs)
    if reach is None or 0 < reach <= most:
        return
    if reach <= 0:
        raise ExecutionError(f"{name}: a negative position id ({reach}) is outside its table")
    raise ExecutionError(
        f"{name}: this call reaches position {reach - 1}, past the model's "
        f"{most} positions (max_position_embeddings); shorten the prompt, or the cache, "
        f"or the tokens asked for"
    )
