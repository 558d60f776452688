"""Decode steps of one model from different sessions, run as one batched forward.

Note [cross-session batching]: on a worker, a decode step reads every weight of the
model to compute one token, so N sessions decoding the same registered model one after
the other read the weights N times where one batched step reads them once. When the
scheduler runs a decode step (Note [threading model]), it takes the decode steps of the
same model that other sessions have waiting (``Scheduler.take_riders``, at most
``batch_max``, held at most ``batch_wait_us`` for them to arrive) and the worker runs
them here as one forward:

- each session keeps its own KV cache. The caches, of lengths L_i, are left-padded to
  the longest and stacked along the batch; the attention mask hides the padding and the
  position ids are each row's own L_i, so every row computes what it would have alone;
- the batched output is cut back into one result per session: its logits row and its
  own cache grown by one token (the padding dropped).

The batch only *precomputes*: each member then goes through its ordinary CALL handler,
which finds its result ready instead of running the model (``take``). So everything a
model call does besides the forward (quotas, charging the grown cache, Note [calls run
once]: a refused call's cache is cropped back, replies and their order) is the same code
for a batched step as for a lone one. A member that turns out not to be a plain decode
step (its cache is not a DynamicCache, a padded attention mask, an error in its
arguments), or a batch that cannot get the memory it needs, simply runs alone.

``generate()`` takes part too: a plain greedy ``generate()`` runs as a loop of decode
steps (generate_steps.py) that pauses at every token with a ``DecodeStep``; paused loops
and model calls of the same model are batched alike, so sessions join and leave the
batch token by token (iteration-level batching, as Orca and vLLM do).

Batching is only done for model families whose attention honours a left-padding mask
with explicit position ids (``FAMILIES``), and whose attention patterns survive the
padding (Note [sliding windows in a batch]); results match the lone step to float
rounding (tests/integration/test_batching.py: greedy tokens identical, logits within
1e-4).

Note [sliding windows in a batch]: a model whose config sets ``sliding_window`` (every
Mistral by default, 4096; Qwen2 with ``use_sliding_window``) masks keys more than a
window behind the query, and transformers builds its cache from the config with a
``DynamicSlidingWindowLayer`` per such layer. Two things follow for a batched step:

- the mask. The batch evaluates the model's mask function on left-padded rows, so a
  row's query and keys are all shifted by its padding. A causal or sliding-window mask
  depends only on how far a key is behind its query, so the shift changes nothing and
  the padding mask hides the rest. A chunked mask (``attention_chunk_size``, Llama 4)
  cuts at absolute positions, and a shifted row would be cut in the wrong place: a
  model with any layer type but those two runs alone (``batchable_family``);
- the cache. A sliding layer counts the tokens it has seen in ``cumulative_length``
  (what ``get_seq_length()`` and the mask sizes read) and keeps only the last
  window - 1 of them. A member's cache therefore grows through its own ``update`` with
  the one new token, as the model's attention grows it in a lone step (assigning the
  grown keys and values left ``cumulative_length`` behind: the next step numbered its
  position and padded its cache from a stale length, and greedy tokens went wrong).
  And a row is batched only while every layer still holds every token it has seen
  (``plain_cache``): the batch pads by what a layer holds and numbers the position by
  what it has seen, which differ once a window has dropped tokens; from then on the
  session's steps run alone (exactly as transformers runs them).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

from djinn.errors import DjinnError

if TYPE_CHECKING:
    from .worker import Worker

log = logging.getLogger("djinn.appliance.batching")

# Keyword arguments a batchable decode step may have: anything else (output_attentions,
# cache_position, inputs_embeds...) runs alone.
BATCH_KWARGS = frozenset({"input_ids", "past_key_values", "use_cache", "attention_mask"})
# config.model_type of the families whose batched step with a left-padding mask and
# position ids is the lone step (learned or rotary positions, masked softmax attention)
FAMILIES = frozenset({"gpt2", "llama", "mistral", "qwen2"})
# transformers' layer types whose mask depends only on how far a key is behind its query,
# so left padding leaves it as it is (Note [sliding windows in a batch])
SHIFTABLE_ATTENTION = frozenset({"full_attention", "sliding_attention"})
# cache layers whose growth the batch reproduces with their own update()
PLAIN_LAYERS = frozenset({"DynamicLayer", "DynamicSlidingWindowLayer"})


def batch_key(body: dict[str, Any]) -> str:
    """The key under which a model call can be batched with others, or "": a forward of
    one input position on a KV cache (``past_key_values`` a remote object), nothing
    else. Read from the request as sent; ``precompute`` checks the decoded values."""
    fp = body.get("fingerprint")
    args, kwargs = body.get("args", []), body.get("kwargs", {})
    if body.get("method", "forward") != "forward" or not isinstance(fp, str):
        return ""
    if not isinstance(args, list) or not isinstance(kwargs, dict) or len(args) > 1:
        return ""
    if set(kwargs) - BATCH_KWARGS or (args and "input_ids" in kwargs):
        return ""
    if kwargs.get("use_cache", True) is not True:
        return ""
    cache = kwargs.get("past_key_values")
    if not isinstance(cache, dict) or set(cache) != {"$o"}:
        return ""
    return "model:" + fp


@dataclass
class BatchStats:
    batches: int = 0  # batched forwards run
    calls: int = 0  # decode steps they served
    largest: int = 0
    alone: int = 0  # steps taken for a batch that ran alone after all
    sizes: dict[int, int] = field(default_factory=dict)  # batch size -> batches

    def as_dict(self) -> dict[str, Any]:
        return {
            "batches": self.batches,
            "calls": self.calls,
            "largest": self.largest,
            "alone": self.alone,
            "mean": round(self.calls / self.batches, 2) if self.batches else 0.0,
            "sizes": {str(k): v for k, v in sorted(self.sizes.items())},
        }


@dataclass
class _Member:
    session: Any
    fingerprint: str
    oid: str | None  # the cache's remote object id (a generate() loop's own cache: None)
    ids: torch.Tensor
    cache: Any
    length: int


class DecodeStep:
    """What a paused ``generate()`` loop yields: the step it needs, and where the batch
    leaves the result (a stand-in for the model's forward), if it ran it."""

    __slots__ = ("key", "member", "result", "since")

    def __init__(self, member: _Member) -> None:
        self.key = "model:" + member.fingerprint
        self.member = member
        self.result: Callable[..., Any] | None = None
        self.since = 0.0


def plain_cache(cache: Any) -> int | None:
    """The length of a KV cache that can be batched, else None: a DynamicCache of batch
    one whose every layer still holds every token it has seen (a sliding window that
    has dropped some cannot be padded like the others: Note [sliding windows in a
    batch])."""
    layers = getattr(cache, "layers", None)
    if type(cache).__name__ != "DynamicCache" or not layers:
        return None
    length = int(cache.get_seq_length())
    for layer in layers:
        if type(layer).__name__ not in PLAIN_LAYERS or not layer.is_initialized:
            return None
        if getattr(layer, "record_past", False):  # keeps what its window would drop
            return None
        if layer.keys.shape[0] != 1 or layer.keys.shape[-2] != length:
            return None
        if int(layer.get_seq_length()) != length:  # a window's count of tokens seen
            return None
    return length


def batchable_family(module: Any) -> bool:
    """A model whose batched decode step is its lone step: a family that honours a
    left-padding mask with position ids, with masks that padding does not change (Note
    [sliding windows in a batch])."""
    config = getattr(module, "config", None)
    if getattr(config, "model_type", None) not in FAMILIES:
        return False
    if getattr(config, "attention_chunk_size", None) is not None:
        return False  # chunks start at absolute positions
    kinds = getattr(config, "layer_types", None) or ["full_attention"]
    return set(kinds) <= SHIFTABLE_ATTENTION


class Batcher:
    """Precomputed results of batched decode steps, until each member's handler takes
    its own (all within the slice that ran the batch)."""

    def __init__(self, max_size: int) -> None:
        self.max_size = max_size
        self.stats = BatchStats()
        self._ready: dict[int, Callable[..., Any]] = {}  # id(frame) -> the call's stand-in

    def take(self, frame: Any) -> Callable[..., Any] | None:
        """The batched result for this request, as a stand-in for the model's forward."""
        return self._ready.pop(id(frame), None)

    def discard(self, frames: list[Any]) -> None:
        for frame in frames:
            self._ready.pop(id(frame), None)

    def precompute(self, w: Worker, works: list[Any]) -> None:
        """Run the decode steps of ``works`` (scheduler Work items of one batch key) as
        one forward and leave each member's result for it (marking it ``batched``).
        Members that are not plain decode steps, or a batch that cannot run, are left to
        run alone."""
        found = [(work, _step_of(w, work)) for work in works]
        found = [(work, m) for work, m in found if m is not None]
        if len(works) > 1:
            self.stats.alone += len(works) - len(found)
        if len(found) < 2:
            return
        members = [m for _, m in found]
        entry = w.models.get(members[0].fingerprint)
        if not batchable_family(entry.module):
            self.stats.alone += len(members)
            return
        try:
            results = _run(w, entry, members)
        except (DjinnError, RuntimeError, TypeError, ValueError, IndexError) as exc:
            # short of memory, or a model that refuses the batched form: each runs alone
            log.debug("batch of %d decode steps runs alone: %s", len(members), exc)
            self.stats.alone += len(members)
            return
        for (work, _), stand_in in zip(found, results, strict=True):
            if work.step is not None:
                work.step.result = stand_in
            else:
                self._ready[id(work.frame)] = stand_in
            work.batched = True
        self.stats.batches += 1
        self.stats.calls += len(members)
        self.stats.largest = max(self.stats.largest, len(members))
        self.stats.sizes[len(members)] = self.stats.sizes.get(len(members), 0) + 1


def _step_of(w: Worker, work: Any) -> _Member | None:
    """The decode step of a paused generate() loop or of a model call, or None if it must
    run alone."""
    if work.step is not None:
        member = work.step.member
        return member if plain_cache(member.cache) == member.length else None
    if work.steps is not None:
        return None
    return _member(w, work.session, work.frame)


def _member(w: Worker, s: Any, frame: Any) -> _Member | None:
    """The decoded ids and cache of a decode step, or None if it must run alone."""
    from .skeleton import decode_args

    body = frame.body
    fp = body.get("fingerprint")
    if fp not in s.models or body.get("autocast") is not None:  # under autocast: alone
        return None  # its handler says why
    device = w.device.torch_device
    try:
        args = decode_args(body.get("args", []), s, frame.segments, device)
        kwargs = decode_args(body.get("kwargs", {}), s, frame.segments, device)
    except DjinnError:
        return None
    ids = args[0] if args else kwargs.get("input_ids")
    cache = kwargs.get("past_key_values")
    if not isinstance(ids, torch.Tensor) or ids.shape != (1, 1) or ids.is_floating_point():
        return None
    length = plain_cache(cache)
    if length is None:
        return None
    mask = kwargs.get("attention_mask")
    if mask is not None:  # only the mask a lone step means anyway: every position attended
        if not isinstance(mask, torch.Tensor) or mask.shape != (1, length + 1):
            return None
        if not bool(mask.bool().all()):
            return None
    oid = body["kwargs"]["past_key_values"]["$o"]
    return _Member(s, fp, oid, ids.to(torch.long), cache, length)


def _run(w: Worker, entry: Any, members: list[_Member]) -> list[Callable[..., Any]]:
    """The batched forward; one stand-in per member that applies its result."""
    from . import callmemory

    device = w.device.torch_device
    longest = max(m.length for m in members)
    rows = len(members)
    ids = torch.cat([m.ids for m in members]).to(device)
    # what runs only during the batch: the padded copy of the caches, the batched cache
    # it grows into, and the logits (the members' own growth is charged by each handler)
    per_token = callmemory.kv_bytes_per_token(entry.module)
    growth = callmemory.estimate(entry.module, "forward", [], {"input_ids": ids, "use_cache": True})
    need = growth.data + 2 * rows * (longest + 1) * per_token
    stack = w.store.vmu["stack"]
    prepared = []
    try:
        for m in members:  # every member's model and cache resident, and pinned
            prepared.append(m.session)
            w.memory.prepare(m.session, entry, {m.oid} if m.oid else set())
        stack.reserve(need)
        try:
            out = _forward(entry.module, ids, members, longest, device)
        finally:
            stack.release(need)
    finally:
        for s in prepared:
            w.memory.finish(s)
    results = []
    for row, m in enumerate(members):
        # only the token this step added: the member's layers grow by it themselves
        grown = [
            (
                layer.keys[row : row + 1, :, -1:].clone(),
                layer.values[row : row + 1, :, -1:].clone(),
            )
            for layer in out.past_key_values.layers
        ]
        fields = {k: v for k, v in out.items() if k not in ("logits", "past_key_values")}
        mine = type(out)(
            **fields, logits=out.logits[row : row + 1].clone(), past_key_values=m.cache
        )
        results.append(_stand_in(m.cache, grown, mine))
    return results


def _forward(
    module: Any, ids: torch.Tensor, members: list[_Member], longest: int, device: Any
) -> Any:
    from transformers import DynamicCache

    batched = DynamicCache()
    for i in range(len(members[0].cache.layers)):
        keys, values = [], []
        for m in members:
            layer, pad = m.cache.layers[i], longest - m.length
            keys.append(torch.nn.functional.pad(layer.keys, (0, 0, pad, 0)))
            values.append(torch.nn.functional.pad(layer.values, (0, 0, pad, 0)))
        batched.update(torch.cat(keys), torch.cat(values), i)
    mask = torch.zeros(len(members), longest + 1, dtype=torch.long, device=device)
    for row, m in enumerate(members):
        mask[row, longest - m.length :] = 1
    positions = torch.tensor([[m.length] for m in members], dtype=torch.long, device=device)
    with torch.no_grad():
        return module(
            input_ids=ids,
            past_key_values=batched,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
        )


def _stand_in(
    cache: Any, grown: list[tuple[torch.Tensor, torch.Tensor]], out: Any
) -> Callable[..., Any]:
    """What the member's handler calls in place of the model: its cache grows by the
    token the batch computed, through the cache's own ``update`` as the model's
    attention would grow it (a sliding window counts the token and drops what falls out:
    Note [sliding windows in a batch]), and the output is its row's."""

    def forward(*_args: Any, **_kwargs: Any) -> Any:
        for i, (keys, values) in enumerate(grown):
            cache.update(keys, values, i)
        return out

    return forward
