"""A live KV cache rebuilt by a few prefills instead of its decode steps one by one.

Note [kv prefill replay]: a decode loop's journal holds, for the cache it is growing,
the call that made it and one call per generated token, each fed by the graph that
picked the token from the previous call's logits (argmax on the appliance). Replayed as
recorded (Note [lineage journal]) that is two requests and one forward of the whole
model per token: about 0.3 s each for GPT-2 small on a loaded 2-core CPU worker, seconds
for a sequence. But a cache is a function of the model and the token ids that built it
(Note [kv recompute] in appliance/recompute.py): the same cache comes out of one forward
of the concatenated ids. So before a replay, ``coalesce`` rewrites the journal: a run of
consecutive *plain steps* on a live cache (a forward of integer ids whose values the
client knows, with only SAFE_KWARGS, the same ones for every step) becomes one call of
their concatenated ids, with ``logits_to_keep`` set to the last step's token count where
the model takes it (the last step's logits come back, the same shape, and the LM head
runs on those tokens only). The values of ids that came from a handle are echoed by the
worker (``echo_ids``, Note [echoed ids]); ids sent inline are in the journal already.

What a merged run may leave out: the outputs of its steps but the last, and whatever
was computed from them (the argmax graphs, by the handles they read), must be gone
from the program. ``coalesce`` finds, in one pass, for each handle the earliest step
whose outputs it was computed from; a handle the program still holds, or one read by a
request that must still run (another model call, a registration), stops the merge
before that step. The last merged step's outputs may be live when it returned logits
only, its logits kept whole, and the model takes ``logits_to_keep``: its logits then
come back from the merged call. Later steps (their logits still held) are replayed one
by one, with their ids inline so the graphs that picked them need not run again. A
token the journal knows (echoed) is computed from nothing: where the program still
holds it, or a graph that must run reads it, it is put back from its value (a lazy put)
instead of being picked again, unless it is a view or was written since.

A run is at most PREFILL_TOKENS tokens (a longer one goes as several, each extending
the cache the last left): a prefill's attention scores grow with the square of its
length. A cache rebuilt so equals the step-by-step one to float rounding, not bit for
bit (measured: ~1e-6 on GPT-2, float32; the parity bar is 1e-5), and so do the logits
computed from it; greedy tokens stay the same unless two logits tie within that. With
``recovery_kv = "steps"`` nothing is merged and the replay is bit-exact. Calls that are
not plain steps (generate(), an attention mask, float embeddings) are always replayed
as recorded. A merged call the worker refuses fails the recovery like any replayed
request (RECOVERY_FAILED, naming the original fault); it asks nothing a step did not
(the same model, arguments and positions), but for ``logits_to_keep``, which is only
sent to a class whose forward declares it.
"""

from __future__ import annotations

import inspect
import sys
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

import torch

from djinn.errors import DjinnError
from djinn.protocol.kv import SAFE_KWARGS
from djinn.protocol.tensors import contiguous_strides, from_wire, parse_dtype, to_wire, validate

from .journal import (
    Entry,
    _handles_in,
    _objects_in,
    kept,
    strings_in,
    view_outputs,
    written_handles,
)

if TYPE_CHECKING:
    from .remote import RemoteTensor

PREFILL_TOKENS = 512  # per merged call (its attention scores grow with its square)
UNMERGED = frozenset({"input_ids", "past_key_values", "logits_to_keep"})


@dataclass
class Step:
    """A plain step: a forward of known integer ids that leaves the KV cache ``cache``."""

    index: int  # in the journal
    fingerprint: str
    cache: str
    past: str | None  # the cache it extended (None: it made it)
    ids: torch.Tensor  # (batch, tokens), on the CPU
    outputs: set[str]  # the handles it returned
    other: dict[str, Any]  # its other keyword arguments
    logits_only: bool  # its only tensor output is logits for every token it was given


# -- the ids a call read -------------------------------------------------------------
def ask_echo(body: dict[str, Any]) -> dict[str, Any]:
    """Note [echoed ids]: a forward whose ids are a handle asks the worker to send their
    values back (a few integers): the journal can then merge it into a prefill."""
    ref = _ids_ref(body)
    if isinstance(ref, dict) and "$h" in ref:
        return {**body, "echo_ids": True}
    return body


def echoed(reply: dict[str, Any]) -> torch.Tensor | None:
    """The ids the worker echoed (``{"dtype", "strides", "values"}``): a CPU tensor laid
    out as the handle's was (it may be restored from them, Note [kv prefill replay])."""
    echo = reply.get("ids")
    if not isinstance(echo, dict):
        return None
    try:
        ids = torch.tensor(echo["values"], dtype=parse_dtype(echo["dtype"]), device="cpu")
        strides = echo.get("strides", contiguous_strides(list(ids.shape)))
        desc = {"dtype": echo["dtype"], "shape": list(ids.shape), "strides": strides}
        validate(desc)
        if list(ids.stride()) != strides:
            ids = torch.empty_strided(ids.shape, strides, dtype=ids.dtype, device="cpu").copy_(ids)
    except (KeyError, TypeError, ValueError, RuntimeError, DjinnError):
        return None
    return ids if ids.dim() == 2 and not ids.is_floating_point() else None


def _ids_ref(body: Any) -> Any:
    if not isinstance(body, dict) or body.get("method", "forward") != "forward":
        return None
    args, kwargs = body.get("args") or [], body.get("kwargs") or {}
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        return None
    if "input_ids" in kwargs:
        return None if args else kwargs["input_ids"]
    return args[0] if len(args) == 1 else None


def ids_of(e: Entry) -> torch.Tensor | None:
    """The ids a recorded call was given: from its inline bytes, or echoed."""
    ref = _ids_ref(e.body)
    if isinstance(ref, dict) and "$h" in ref:
        return e.ids
    if not isinstance(ref, dict) or type(ref.get("$t")) is not int or ref["$t"] >= len(e.data):
        return None
    raw = torch.frombuffer(bytearray(e.data[ref["$t"]]), dtype=torch.uint8)
    try:
        ids = from_wire(ref.get("desc"), raw).clone()
    except (DjinnError, RuntimeError, ValueError):  # unreadable: not a plain step
        return None
    return ids if ids.dim() == 2 and not ids.is_floating_point() else None


def step_of(e: Entry, index: int) -> Step | None:
    """``e`` as a plain step (Note [kv prefill replay]), or None."""
    if e.kind != "call" or not e.replayable or not isinstance(e.body, dict):
        return None
    if e.body.get("autocast") is not None:  # Note [a model call under autocast]: as sent
        return None
    kwargs = e.body.get("kwargs") or {}
    if not isinstance(kwargs, dict) or not set(kwargs) <= SAFE_KWARGS:
        return None
    if kwargs.get("use_cache") is False:
        return None
    ids = ids_of(e)
    if ids is None:
        return None
    past = kwargs.get("past_key_values")
    if past is not None and not (isinstance(past, dict) and set(past) == {"$o"}):
        return None
    made = _objects_in(e.out)
    if len(made) != 1:
        return None
    cache = next(iter(made))
    past_oid = None if past is None else past["$o"]
    if past_oid is not None and past_oid != cache:
        return None
    other = {k: v for k, v in kwargs.items() if k not in UNMERGED}
    if _handles_in(other) or _objects_in(other):
        return None
    return Step(
        index,
        str(e.body.get("fingerprint")),
        cache,
        past_oid,
        ids,
        _handles_in(e.out),
        other,
        _logits_only(e.out, int(ids.shape[1])),
    )


def _logits_only(out: Any, tokens: int) -> bool:
    """A ModelOutput whose only tensor is logits for each of the ``tokens`` ids."""
    if not isinstance(out, dict) or "$mo" not in out or not isinstance(out.get("fields"), dict):
        return False
    fields = out["fields"]
    logits = fields.get("logits")
    if not isinstance(logits, dict) or "$h" not in logits:
        return False
    shape = logits.get("shape")
    if not isinstance(shape, list) or len(shape) != 3 or shape[1] != tokens:
        return False
    rest = {k: v for k, v in fields.items() if k not in ("logits", "past_key_values")}
    return not _handles_in(rest) and not _objects_in(rest)


def takes_logits_to_keep(class_path: Any) -> bool:
    """Whether a registered transformers class's forward takes ``logits_to_keep``. Looked
    up among the modules the program imported (it built the model from it): nothing is
    imported here."""
    if not isinstance(class_path, str) or not class_path.startswith("transformers."):
        return False
    module, _, name = class_path.rpartition(".")
    cls = getattr(sys.modules.get(module), name, None)
    try:
        return cls is not None and "logits_to_keep" in inspect.signature(cls.forward).parameters
    except (TypeError, ValueError):
        return False


# -- the rewrite ----------------------------------------------------------------------
def _chain(entries: list[Entry], oid: str) -> list[Step]:
    """The plain steps that built the cache ``oid``, from the one that made it, until the
    first call on it that is not one like them (it and what follows replay as
    recorded)."""
    chain: list[Step] = []
    for i, e in enumerate(entries):
        if e.kind != "call" or oid not in (_objects_in(e.body) | _objects_in(e.out)):
            continue
        st = step_of(e, i)
        ok = st is not None and st.cache == oid
        if ok and not chain:
            ok = st.past is None
        elif ok and chain:
            first = chain[0]
            ok = (
                st.past == oid
                and st.fingerprint == first.fingerprint
                and st.ids.shape[0] == first.ids.shape[0]
                and st.other == first.other
            )
        if not ok:
            break
        chain.append(st)
    return chain


def known_values(
    entries: list[Entry], live: set[str], fits: Callable[[str, torch.Tensor], bool] | None
) -> dict[str, torch.Tensor]:
    """Handles whose value the journal holds: a plain step's ids, echoed. Such a handle
    comes back from that value (a put) instead of from the graph that picked it, when
    that graph made it (not a view, which shares its base's bytes), nothing wrote into
    it since, and, if the program holds it, ``fits`` says its holder's dtype, shape and
    strides are the value's."""
    values: dict[str, torch.Tensor] = {}
    written: set[str] = set()
    made: set[str] = set()
    for i, e in enumerate(entries):
        if e.kind == "call":
            ref = _ids_ref(e.body)
            if isinstance(ref, dict) and "$h" in ref and step_of(e, i) is not None:
                values.setdefault(ref["$h"], e.ids)
        elif e.kind == "exec":
            nodes = e.body.get("nodes", [])
            for node in nodes:
                written |= written_handles(node)
            for ref, h in zip(e.body.get("keep", []), e.out, strict=False):
                if h is not None and _made_whole(ref, nodes):
                    made.add(h)
    return {
        h: t
        for h, t in values.items()
        if h in made and h not in written and (h not in live or (fits is not None and fits(h, t)))
    }


def _made_whole(ref: Any, nodes: list) -> bool:
    """Whether a graph's kept output is an op's own new tensor (not a view, an input)."""
    if not isinstance(ref, dict) or type(ref.get("$v")) is not int or ref["$v"] >= len(nodes):
        return False
    views = view_outputs(str(nodes[ref["$v"]].get("op", "")))
    k = ref.get("i", 0)
    return isinstance(k, int) and k < len(views) and not views[k]


def _exec_made(e: Entry) -> set[str]:
    made = {h for h in e.out if h is not None}
    for node in e.body.get("nodes", []):
        made |= written_handles(node)
    return made


def _first_blocked(
    entries: list[Entry], chain: list[Step], live: set[str], known: dict[str, torch.Tensor]
) -> int:
    """The first step of ``chain`` whose outputs, or values computed from them, the
    program holds or a request that must still run reads: ``len(chain)`` when none. A
    handle whose value is ``known`` is computed from nothing: it is put back."""
    at = {st.index: k for k, st in enumerate(chain)}
    plain: dict[int, bool] = {}  # calls whose only handle is their (known) ids
    origin: dict[str, int] = {}  # handle -> the earliest step it was computed from
    blocked = len(chain)
    for i in range(chain[0].index, len(entries)):
        e = entries[i]
        if i in at:
            for h in chain[at[i]].outputs:
                origin[h] = at[i]
            continue
        if e.kind == "exec":
            ks = [origin[h] for h in _handles_in(e.body) if h in origin]
            if ks:
                k = min(ks)
                for h in _exec_made(e) - set(known):
                    origin[h] = min(origin.get(h, k), k)
        elif e.kind == "call":
            if i not in plain:
                plain[i] = step_of(e, i) is not None
            if not plain[i]:  # a plain step's ids are sent inline instead
                ks = [origin[h] for h in _handles_in(e.body) if h in origin]
                blocked = min([blocked, *ks])
        elif e.kind in ("register", "load"):
            ks = [origin[h] for h in strings_in(e.body, set()) if h in origin]
            blocked = min([blocked, *ks])
    ks = [origin[h] for h in live if h in origin]
    return min([blocked, *ks])


def _inline(e: Entry, ids: torch.Tensor) -> Entry:
    """``e`` with its ids sent inline (their values are known) instead of by handle."""
    ref = _ids_ref(e.body)
    if isinstance(ref, dict) and "$t" in ref:
        return e  # inline already
    desc, raw = to_wire(ids)
    ref = {"$t": len(e.data), "desc": desc}
    body = {**e.body, "args": list(e.body.get("args") or [])}
    body["kwargs"] = dict(body.get("kwargs") or {})
    if "input_ids" in body["kwargs"]:
        body["kwargs"]["input_ids"] = ref
    else:
        body["args"][0] = ref
    body.pop("echo_ids", None)
    return replace(e, body=body, data=[*e.data, bytes(raw.numpy())], ids=ids)


def _merged(entries: list[Entry], run: list[Step], keep_logits: bool) -> Entry:
    """One call for the steps of ``run``: the first one's, with every step's ids; the
    reply pairs like the last one's."""
    first, last = entries[run[0].index], entries[run[-1].index]
    ids = torch.cat([st.ids for st in run], 1).contiguous()
    body = {**first.body, "args": [], "kwargs": dict(first.body.get("kwargs") or {})}
    body["kwargs"].pop("input_ids", None)
    body["kwargs"].pop("logits_to_keep", None)
    body.pop("echo_ids", None)
    if keep_logits:
        body["kwargs"]["logits_to_keep"] = int(run[-1].ids.shape[1])
    desc, raw = to_wire(ids)
    body["kwargs"]["input_ids"] = {"$t": 0, "desc": desc}
    seconds = sum(entries[st.index].seconds for st in run)
    nbytes = sum(entries[st.index].nbytes for st in run)
    data = [bytes(raw.numpy())]
    merged = sum(entries[st.index].merged for st in run)
    return Entry("call", body, data, last.out, nbytes, True, seconds, ids=ids, merged=merged)


def coalesce(
    entries: list[Entry], live: set[str], holders: dict[str, RemoteTensor] | None = None
) -> list[Entry]:
    """Note [kv prefill replay]: ``entries`` with the decode steps of every live cache
    merged into prefills where nothing the program holds needs them one by one.
    ``live``: the handles and objects the program holds; ``holders``: its RemoteTensors
    by handle (which of them may be put back from a value, ``known_values``)."""
    classes = _classes(entries)
    fits = None if holders is None else _fits(holders)
    caches: set[str] = set()
    for e in entries:
        if e.kind == "call":
            _objects_in(e.out, caches)
    known = known_values(entries, live, fits)
    if known:
        entries = _put_back(entries, known)
    for oid in sorted(caches & live):
        chain = _chain(entries, oid)
        if len(chain) < 2:
            continue
        blocked = _first_blocked(entries, chain, live, known)
        keep = takes_logits_to_keep(classes.get(chain[0].fingerprint))
        # the last merged step: the blocked one when its logits can come back from the
        # merged call, else the one before it
        last = blocked if blocked < len(chain) else len(chain) - 1
        if blocked < len(chain) and not (keep and chain[blocked].logits_only):
            last = blocked - 1
        if last < 1:
            continue
        merged = chain[: last + 1]
        entries = _rewrite(entries, merged, min(last + 1, blocked), keep, known)
    return entries


def _put_back(entries: list[Entry], known: dict[str, torch.Tensor]) -> list[Entry]:
    """The graphs that made only known values become puts of them, and the plain steps
    that read one get it inline: nothing then ties a token the program holds to the
    calls and logits it was picked from (a finished sequence's last token, still held,
    would otherwise replay the whole sequence: a model call and what it names are needed
    together, Note [lineage pruning])."""
    names = set(known)
    out: list[Entry] = []
    for i, e in enumerate(entries):
        if e.kind == "exec":
            made = _exec_made(e)
            if made and made <= names:
                for h in (h for h in e.out if h is not None):
                    t = known[h]
                    out.append(Entry("put", None, [kept(t)], [h], t.numel() * t.itemsize))
                continue
        elif e.kind == "call" and _reads(e, names):
            st = step_of(e, i)
            if st is not None:
                e = _inline(e, st.ids)
        out.append(e)
    return out


def _classes(entries: list[Entry]) -> dict[str, Any]:
    """Fingerprint -> the registered model's class path."""
    return {
        e.body.get("fingerprint"): e.body.get("class")
        for e in entries
        if e.kind == "register" and isinstance(e.body, dict) and "class" in e.body
    }


def _fits(holders: dict[str, RemoteTensor]) -> Callable[[str, torch.Tensor], bool]:
    """Whether a held handle can be put back from ``value``: its holder is no view and
    was told the value's dtype, shape and strides."""

    def fits(handle: str, value: torch.Tensor) -> bool:
        r = holders.get(handle)
        return (
            r is not None
            and not r.view
            and r.dtype == value.dtype
            and tuple(r.shape) == tuple(value.shape)
            and tuple(r.strides) == tuple(value.stride())
        )

    return fits


def _rewrite(
    entries: list[Entry],
    merged: list[Step],
    dead: int,
    keep: bool,
    known: dict[str, torch.Tensor],
) -> list[Entry]:
    """``merged`` as prefills; the outputs of its first ``dead`` steps, and the graphs
    computed from them, are no longer held: those graphs are left out, and so are the
    graphs that made only values the journal knows; those values are put back, and a
    plain step whose ids one of them picked gets its ids inline."""
    origin: set[str] = set()
    for st in merged[:dead]:
        origin |= st.outputs
    dropped: dict[int, list[str]] = {}  # graph -> what it made that is put back
    for i in range(merged[0].index, len(entries)):
        e = entries[i]
        if e.kind != "exec":
            continue
        made = _exec_made(e)
        if _handles_in(e.body) & origin or (made and made <= known.keys()):
            dropped[i] = [h for h in e.out if h in known]
            origin |= made - known.keys()
    runs: list[list[Step]] = [[]]
    for st in merged:
        tokens = sum(int(s.ids.shape[1]) for s in runs[-1])
        if runs[-1] and tokens + int(st.ids.shape[1]) > PREFILL_TOKENS:
            runs.append([])
        runs[-1].append(st)
    at: dict[int, Entry] = {}
    for run in runs:
        if len(run) == 1:  # nothing to merge: as recorded, its ids inline
            at[run[0].index] = _inline(entries[run[0].index], run[0].ids)
        else:  # its logits come back whole where its last step's are the only output
            at[run[0].index] = _merged(entries, run, keep and run[-1].logits_only)
    skip = {st.index for st in merged}
    inlined = origin | set(known)
    out: list[Entry] = []
    for i, e in enumerate(entries):
        if i in at:
            out.append(at[i])
        elif i in dropped:
            for h in dropped[i]:
                t = known[h]
                out.append(Entry("put", None, [kept(t)], [h], t.numel() * t.itemsize))
        elif i in skip:
            continue
        elif e.kind == "call" and _reads(e, inlined):  # a plain step
            st = step_of(e, i)
            out.append(e if st is None else _inline(e, st.ids))
        else:
            out.append(e)
    return out


def _reads(e: Entry, handles: set[str]) -> bool:
    ref = _ids_ref(e.body)
    return isinstance(ref, dict) and ref.get("$h") in handles
