"""``generate()`` as a loop of decode steps that other sessions' steps can join.

A plain greedy ``generate()`` (no sampling, one beam, no logits processors, batch of
one) is run here token by token instead of by transformers' loop: one prefill, then a
decode step per token. Between two tokens the loop yields a ``DecodeStep``, so the
scheduler can compute its step in one batched forward with the decode steps of other
sessions on the same model, model calls and other ``generate()`` loops alike (Note
[cross-session batching], batching.py); a step nobody joins runs alone. The tokens are
transformers' own greedy choice: the argmax of the last position's logits, until
``max_new_tokens`` (or ``max_length``) or an end-of-sequence token, and the result is
what ``generate()`` returns, the prompt followed by the new tokens.

Everything else (sampling, beams, processors such as a repetition penalty, an attention
mask with padding, ``return_dict_in_generate``...) goes to ``handle_call``, which runs
transformers' ``generate()`` whole.
"""

from __future__ import annotations

from collections.abc import Generator
from typing import TYPE_CHECKING, Any

import torch

from djinn.errors import DjinnError, ExecutionError
from djinn.protocol.frames import Frame

from .batching import DecodeStep, _Member, batchable_family
from .model_handlers import Reply, _check_generate, _run_call, handle_call
from .sessions import WorkerSession

if TYPE_CHECKING:
    from .worker import Worker

PLAIN_KWARGS = frozenset(
    {"input_ids", "attention_mask", "max_new_tokens", "max_length", "do_sample"}
    | {"pad_token_id", "eos_token_id", "use_cache"}
)
# generation_config values under which transformers' greedy search is a bare argmax
NEUTRAL = {
    "do_sample": (None, False),
    "num_beams": (None, 1),
    "num_return_sequences": (None, 1),
    "repetition_penalty": (None, 1.0),
    "encoder_repetition_penalty": (None, 1.0),
    "no_repeat_ngram_size": (None, 0),
    "encoder_no_repeat_ngram_size": (None, 0),
    "min_length": (None, 0),
    "min_new_tokens": (None, 0),
    "bad_words_ids": (None,),
    "force_words_ids": (None,),
    "forced_bos_token_id": (None,),
    "forced_eos_token_id": (None,),
    "suppress_tokens": (None,),
    "begin_suppress_tokens": (None,),
    "sequence_bias": (None,),
    "exponential_decay_length_penalty": (None,),
    "max_time": (None,),
    "stop_strings": (None,),
    "guidance_scale": (None, 1.0),
    "watermarking_config": (None,),
    "output_scores": (None, False),
    "output_logits": (None, False),
    "return_dict_in_generate": (None, False),
    "diversity_penalty": (None, 0.0),
}


def call_steps(w: Worker, s: WorkerSession, frame: Frame) -> Generator[Any, None, Reply]:
    """A model call (CALL). A plain greedy ``generate()`` runs as decode steps, pausing
    at each token; any other call runs whole (``handle_call``)."""
    plan = _plain_generate(w, s, frame)
    if plan is None:
        return handle_call(w, s, frame)
    entry, args, kwargs, ids, new, eos = plan
    from . import callmemory

    growth = callmemory.estimate(entry.module, "generate", args, kwargs)
    stack = w.store.vmu["stack"]
    stack.reserve(growth.stack)  # the loop's own KV cache, while it runs
    try:
        tokens: list[torch.Tensor] = []
        out = _forward(w, s, entry, input_ids=ids, use_cache=True)  # the prefill
        for i in range(new):
            token = out.logits[:, -1, :].argmax(-1, keepdim=True)
            tokens.append(token)
            if int(token) in eos or i == new - 1:
                break
            cache = out.past_key_values
            step = DecodeStep(
                _Member(s, entry.fingerprint, None, token, cache, cache.get_seq_length())
            )
            yield step  # the scheduler may batch it with other sessions' steps
            if step.result is not None:
                out = step.result()
            else:
                out = _forward(w, s, entry, input_ids=token, past_key_values=cache, use_cache=True)
        sequences = torch.cat([ids, *tokens], dim=1)
    finally:
        stack.release(growth.stack)
    # the reply as a whole generate() call's: charged, encoded, quota-checked alike
    return _run_call(w, s, entry, "generate", args, kwargs, lambda *_a, **_k: sequences)


def _forward(w: Worker, s: WorkerSession, entry: Any, **kwargs: Any) -> Any:
    """One forward of the loop, with the model resident and pinned while it runs."""
    w.memory.prepare(s, entry, set())
    try:
        with torch.no_grad():
            return entry.module(**kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError) as exc:
        raise ExecutionError(f"{entry.name}.generate: {type(exc).__name__}: {exc}") from None
    finally:
        w.memory.finish(s)


def _plain_generate(w: Worker, s: WorkerSession, frame: Frame) -> tuple | None:
    """(entry, args, kwargs, input ids, new tokens, end-of-sequence ids) for a plain
    greedy generate() on a model whose steps can be batched, else None."""
    from .skeleton import decode_args

    body = frame.body
    fp, raw_args, raw_kwargs = body.get("fingerprint"), body.get("args"), body.get("kwargs")
    if body.get("method") != "generate" or w.batcher.max_size <= 1 or fp not in s.models:
        return None
    if body.get("autocast") is not None:  # Note [a model call under autocast]: whole
        return None
    if not isinstance(raw_args, list) or not isinstance(raw_kwargs, dict) or len(raw_args) > 1:
        return None
    if set(raw_kwargs) - PLAIN_KWARGS or (raw_args and "input_ids" in raw_kwargs):
        return None
    entry = w.models.entries.get(fp)
    if entry is None or not batchable_family(entry.module):
        return None
    config = getattr(entry.module, "generation_config", None)
    if config is None or any(getattr(config, k, None) not in ok for k, ok in NEUTRAL.items()):
        return None
    try:
        device = w.device.torch_device
        args = decode_args(raw_args, s, frame.segments, device)
        kwargs = decode_args(raw_kwargs, s, frame.segments, device)
        _check_generate(kwargs)
    except DjinnError:
        return None  # handle_call gives the error
    ids = args[0] if args else kwargs.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.shape[0] != 1:
        return None
    if ids.is_floating_point() or ids.shape[1] == 0:
        return None
    mask = kwargs.get("attention_mask")
    if mask is not None and (
        not isinstance(mask, torch.Tensor) or mask.shape != ids.shape or not bool(mask.all())
    ):
        return None
    if kwargs.get("do_sample") not in (None, False) or kwargs.get("use_cache") not in (None, True):
        return None
    new = _new_tokens(config, kwargs, ids.shape[1])
    eos = _eos(config, kwargs)
    if new is None or eos is None:
        return None
    return entry, args, kwargs, ids.to(torch.long), new, eos


def _new_tokens(config: Any, kwargs: dict[str, Any], prompt: int) -> int | None:
    """How many tokens generate() would add: max_new_tokens wins over max_length."""
    new = kwargs.get("max_new_tokens")
    if new is None and kwargs.get("max_length") is not None:
        new = kwargs["max_length"] - prompt
    if new is None:
        new = config.max_new_tokens
    if new is None and isinstance(config.max_length, int):
        new = config.max_length - prompt
    return new if isinstance(new, int) and new > 0 else None


def _eos(config: Any, kwargs: dict[str, Any]) -> set[int] | None:
    eos = kwargs.get("eos_token_id", config.eos_token_id)
    if eos is None:
        return set()
    if isinstance(eos, int):
        return {eos}
    if isinstance(eos, (list, tuple)) and all(isinstance(e, int) for e in eos):
        return set(eos)
    return None
