"""KV caches dropped under pressure and rebuilt from their tokens (issue 9 §3).

Note [kv recompute]: a KV cache is a function of the model and the token ids that built
it. The model path records those ids for every cache a forward call leaves behind
(``note_call``: the ids of each call, appended in call order, per session and remote
object). When the memory policy picks a cache as a victim, the memory manager asks
``choose`` whether to swap it to the host tier or to *drop* it: its storages are resized
to 0 bytes like a swap-out (Note [swap by storage resize]) but nothing is copied and
nothing waits in the arena. Before the next call that names the cache runs, ``rebuild``
empties the cache object (the client keeps its id) and runs one prefill of the recorded
ids through the model's base (no output head: its logits are not needed), which fills
the same cache object again.

The choice (``kv_recompute``): ``auto`` recomputes when the prefill is cheaper than the
copy back, both measured on this worker (the prefill rate from the model's own prefills,
the copy rate from swap-ins), and also when the cache cannot be swapped (the arena or
the session's host quota is full); ``always`` and ``never`` force one side. A cache is
recomputable only when every call that built it was a plain forward of integer ids
(``SAFE_KWARGS``: no attention mask, positions or embeddings, which the record would not
reproduce), its length equals the recorded tokens, and no other remote object views its
storages (those views would be left empty). A cache touched any other way (generate(),
an unsafe argument) loses its record and is always swapped.

A rebuilt cache equals the dropped one to float rounding, not bit for bit: one prefill
of n tokens computes the same keys and values as the calls that built it, but with
differently shaped matrix products (measured: 1.1e-6 largest difference on GPT-2, float32;
the parity bar is 1e-5). A swap is bit-exact.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from djinn.errors import ExecutionError
from djinn.protocol.kv import SAFE_KWARGS

from .store import _tensors_in

log = logging.getLogger("djinn.appliance.recompute")

MODES = ("auto", "always", "never")
PREFILL_MIN_TOKENS = 16  # a call with this many new tokens and no past measures the prefill
DEFAULT_COPY_BPS = 5e9  # host -> device bytes/s before the first swap-in is measured
EWMA = 0.3


@dataclass
class Record:
    """The token ids that built one cache, in call order (on the CPU)."""

    fingerprint: str  # the model that built it
    chunks: list[torch.Tensor]
    tokens: int
    batch: int


@dataclass
class Dropped:
    fingerprint: str
    nbytes: int


def _cache_of(x: Any) -> Any:
    cache = getattr(x, "past_key_values", None)
    if cache is None and isinstance(x, tuple) and len(x) > 1:
        cache = x[1]
    length = getattr(cache, "get_seq_length", None)
    return cache if callable(length) and callable(getattr(cache, "crop", None)) else None


def call_ids(args: list, kwargs: dict) -> torch.Tensor | None:
    """The integer ids (batch, tokens) a forward was given, or None."""
    ids = kwargs.get("input_ids")
    if ids is None and len(args) == 1:
        ids = args[0]
    if len(args) > 1 or (args and "input_ids" in kwargs):
        return None
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2 or ids.is_floating_point():
        return None
    return ids


class KvRecompute:
    def __init__(self, mode: str = "auto") -> None:
        if mode not in MODES:
            raise ValueError(f"kv_recompute must be one of {', '.join(MODES)}")
        self.mode = mode
        self.records: dict[tuple[str, str], Record] = {}
        self.dropped: dict[tuple[str, str], Dropped] = {}
        self.s_per_token: dict[str, float] = {}  # measured prefill seconds per token
        self.seconds = 0.0  # spent rebuilding

    # -- recording ------------------------------------------------------------------------
    def note_call(
        self,
        s: Any,
        fingerprint: str,
        method: str,
        args: list,
        kwargs: dict,
        out: Any,
        seconds: float,
        rebuildable: bool = True,
    ) -> None:
        """After a model call succeeded: extend the record of the cache it left, or
        forget the records of caches it changed in a way a prefill would not repeat
        (``rebuildable=False``: a call under autocast, which a prefill would not repeat)."""
        given = kwargs.get("past_key_values")
        given_oid = s.object_ids.get(id(given)) if given is not None else None
        cache = _cache_of(out) if method == "forward" else None
        ids = call_ids(args, kwargs) if method == "forward" else None
        safe = rebuildable and ids is not None and set(kwargs) <= SAFE_KWARGS
        prev = self.records.get((s.id, given_oid)) if given_oid is not None else None
        if given is not None and (prev is None or prev.fingerprint != fingerprint):
            safe = False  # built from something unrecorded
        if given_oid is not None:
            self.records.pop((s.id, given_oid), None)
        if cache is None:
            return
        oid = s.object_ids.get(id(cache))
        if oid is None:
            return
        self.records.pop((s.id, oid), None)
        if not safe or ids is None:
            return
        batch, new = int(ids.shape[0]), int(ids.shape[1])
        chunks = [*(prev.chunks if prev else ()), ids.detach().to("cpu", copy=True)]
        tokens = (prev.tokens if prev else 0) + new
        if (prev is not None and prev.batch != batch) or cache.get_seq_length() != tokens:
            return
        self.records[(s.id, oid)] = Record(fingerprint, chunks, tokens, batch)
        if prev is None and new >= PREFILL_MIN_TOKENS and seconds > 0:
            rate = seconds / (batch * new)
            old = self.s_per_token.get(fingerprint)
            self.s_per_token[fingerprint] = rate if old is None else (1 - EWMA) * old + EWMA * rate

    # -- the choice -----------------------------------------------------------------------
    def recomputable(self, s: Any, oid: str, storages: list) -> Record | None:
        rec = self.records.get((s.id, oid))
        obj = s.objects.get(oid)
        if rec is None or obj is None or obj.get_seq_length() != rec.tokens:
            return None
        mine = {st.data_ptr() for st in storages}
        for other_oid, other in s.objects.items():  # Note [kv recompute]: no shared views
            if other_oid != oid and any(
                t.untyped_storage().data_ptr() in mine for t in _tensors_in(other)
            ):
                return None
        return rec

    def choose(self, rec: Record | None, nbytes: int, copy_bps: float, can_swap: bool) -> bool:
        """True: drop the cache and recompute it later; False: swap it to the host."""
        if rec is None or self.mode == "never":
            return False
        if self.mode == "always" or not can_swap:
            return True
        rate = self.s_per_token.get(rec.fingerprint)
        if rate is None:
            return False  # no prefill measured yet: the copy is the known cost
        return rec.tokens * rec.batch * rate < nbytes / max(copy_bps, 1.0)

    def prefill_estimate(self, key: tuple[str, str]) -> float | None:
        rec = self.records.get(key)
        rate = self.s_per_token.get(rec.fingerprint) if rec else None
        return None if rate is None or rec is None else rate * rec.tokens * rec.batch

    # -- the mechanism --------------------------------------------------------------------
    def drop(self, key: tuple[str, str], storages: list) -> int:
        """Free a cache's storages without copying them anywhere."""
        rec = self.records[key]
        nbytes = sum(st.nbytes() for st in storages)
        for st in storages:
            st.resize_(0)
        self.dropped[key] = Dropped(rec.fingerprint, nbytes)
        return nbytes

    def rebuild(self, key: tuple[str, str], cache: Any, module: torch.nn.Module) -> None:
        """Fill a dropped cache again with one prefill of its recorded ids."""
        rec = self.records.get(key)
        if rec is None:
            raise ExecutionError("a dropped KV cache lost its token record; start the prompt again")
        param = next(iter(module.parameters()), None)
        device = param.device if param is not None else torch.device("cpu")
        ids = torch.cat(rec.chunks, 1).to(device)
        started = time.perf_counter()
        n = int(cache.get_seq_length())
        if n:
            cache.crop(-n)  # empty: its tensors view 0-byte storages, nothing reads them
        base = getattr(module, "base_model", None)
        runner = base if isinstance(base, torch.nn.Module) else module
        try:
            with torch.no_grad():
                runner(input_ids=ids, past_key_values=cache, use_cache=True)
        except (RuntimeError, TypeError, ValueError, IndexError, KeyError) as exc:
            raise ExecutionError(
                f"rebuilding a dropped KV cache failed: {type(exc).__name__}: {exc}"
            ) from None
        if cache.get_seq_length() != rec.tokens:
            raise ExecutionError("a rebuilt KV cache does not have its recorded length")
        del self.dropped[key]
        self.seconds += time.perf_counter() - started

    def stack_bytes(self, key: tuple[str, str], module: torch.nn.Module) -> int:
        """Activations of the rebuilding prefill, roughly: a few hidden-state-sized
        buffers per token and one layer's attention scores."""
        rec = self.records.get(key)
        config = getattr(module, "config", None)
        hidden = getattr(config, "hidden_size", None) or getattr(config, "n_embd", 0) or 0
        heads = getattr(config, "num_attention_heads", None) or getattr(config, "n_head", 1) or 1
        if rec is None or not isinstance(hidden, int) or not isinstance(heads, int):
            return 0
        n = rec.tokens * rec.batch
        return 4 * (8 * n * hidden + heads * rec.batch * rec.tokens * rec.tokens)

    def forget(self, session_id: str, keep: set[str] | frozenset = frozenset()) -> None:
        """Records of a session's objects it no longer holds (all, with no ``keep``)."""
        for table in (self.records, self.dropped):
            for key in [k for k in table if k[0] == session_id and k[1] not in keep]:
                del table[key]

    def stats(self) -> dict[str, Any]:
        return {
            "kv_recompute": self.mode,
            "kv_dropped": len(self.dropped),
            "dropped_bytes": sum(d.nbytes for d in self.dropped.values()),
            "recompute_s": round(self.seconds, 6),
        }
