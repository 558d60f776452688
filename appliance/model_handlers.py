"""Request handlers of the model path: LOAD (weights from disk), REGISTER, CALL.

Same contract as ``handlers``: (worker, session, frame) -> (reply body, payload segments),
typed errors, nothing half-done left behind. Everything a client sends here is treated as
hostile: classes come only from the allowlist, fingerprints are verified against the
bytes received, generate() takes sampling and length controls only.
"""

from __future__ import annotations

import contextlib
import functools
import time
from typing import TYPE_CHECKING, Any

import orjson
import torch

from djinn.errors import (
    ExecutionError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    UnsupportedOp,
    kernel_mark,
)
from djinn.protocol.frames import WEIGHTS_METHOD, Frame
from djinn.protocol.tensors import describe, dtype_name

from .recompute import call_ids
from .sessions import WorkerSession
from .uploads import Parked
from .vmu.device import DeviceShort

if TYPE_CHECKING:
    from .worker import Worker

Reply = tuple[dict[str, Any], list[Any]]


def handle_load(w: Worker, s: WorkerSession, frame: Frame) -> Reply:
    """Load safetensors weights from an allowlisted directory into handles."""
    from . import weights

    directory = weights.resolve(frame.body.get("path"), w.model_roots)
    if frame.body.get("hash_only"):
        return {
            "content_hash": weights.content_hash(directory),
            "names": weights.tensor_names(directory),
        }, []
    tensors = weights.load(directory, w.device.torch_device, w.store.vmu.make_room)
    out, kept = [], []
    try:
        for name, t in tensors.items():
            kept.append(w.store.keep(s, t))
            out.append({"name": name, "handle": kept[-1], **describe(t)})
    except BaseException:
        for h in kept:
            w.store.drop(s, h)
        raise
    return {"tensors": out}, []


MAX_CONFIG_JSON = 1 << 20


def handle_register(w: Worker, s: WorkerSession, frame: Frame) -> Reply | Parked:
    """Register a model under a fingerprint the worker *verifies* before caching it.

    Phase 1 (no weights named): attach to the cached model, or answer that weights are
    needed (after refusing classes outside the allowlist). Phase 2 names the weights,
    either uploaded (``state``: model name -> handle) or on the appliance's disk
    (``path`` + ``name_map`` model name -> checkpoint name, and ``buffers`` the model
    builds itself). The fingerprint is recomputed from exactly those bytes; a mismatch is
    refused, so nobody can place other weights under a model's fingerprint.
    """
    from djinn.protocol.fingerprint import model_fingerprint

    from . import weights
    from .models import build, check_build_size, import_class, sanitize_config, unique_bytes

    body = frame.body
    fp = body.get("fingerprint")
    if not isinstance(fp, str) or not 16 <= len(fp) <= 128:
        raise InvalidArgument("fingerprint must be a string of 16 to 128 characters")
    entry = w.models.entries.get(fp)
    state, path = body.get("state"), body.get("path")
    named = [
        h for part in (state, body.get("buffers")) if isinstance(part, dict) for h in part.values()
    ]
    try:
        if entry is None:
            # class and config are refused before any upload
            cls = import_class(body.get("class"), w.models.allowlist)
            config_json = body.get("config_json")
            if not isinstance(config_json, str) or len(config_json) > MAX_CONFIG_JSON:
                raise InvalidArgument("config_json must be the model config as a JSON string")
            try:
                config = sanitize_config(orjson.loads(config_json))
            except (orjson.JSONDecodeError, AttributeError):
                raise InvalidArgument("config_json is not a JSON object") from None
            if state is None and path is None:
                if w.uploads.busy(fp, s.id):  # Note [one upload per fingerprint]
                    return w.uploads.park(fp, s, frame)
                w.uploads.begin(fp, s.id)
                return {"cached": False}, []
            class_path = body["class"]
            if path is not None:
                name_map = body.get("name_map")
                buffers = body.get("buffers") or {}
                if not isinstance(name_map, dict) or not isinstance(buffers, dict):
                    raise InvalidArgument("name_map and buffers must be objects")
                directory = weights.resolve(path, w.model_roots)
                local = {n: s.tensor(h) for n, h in buffers.items()}
                expected = model_fingerprint(
                    class_path,
                    config_json,
                    local.items(),
                    content_hash=weights.content_hash(directory),
                    name_map=name_map,
                )
                if expected != fp:
                    raise InvalidArgument("fingerprint does not match these files and buffers")
                # read into host memory: only the built model takes device memory
                files = weights.load(directory, torch.device("cpu"), w.store.vmu.capacity)
                try:
                    tensors = {n: files[f] for n, f in name_map.items()}
                except (KeyError, TypeError):
                    raise InvalidArgument("name_map names a tensor the files do not hold") from None
                tensors.update(local)
            else:
                if not isinstance(state, dict):
                    raise InvalidArgument("state must map parameter names to handles")
                tensors = {n: s.tensor(h) for n, h in state.items()}
                if model_fingerprint(class_path, config_json, tensors.items()) != fp:
                    raise InvalidArgument("fingerprint does not match the uploaded weights")
            check_build_size(config, len(tensors))  # before any building work
            # the weights' device copies are charged before they are made (issue 16 §4)
            w.models.text.reserve(unique_bytes(tensors.values()))
            try:
                module = build(cls, config, tensors, w.device.torch_device)
            finally:
                w.models.text.release(unique_bytes(tensors.values()))
            entry = w.models.add(fp, str(body.get("name", cls.__name__))[:128], module)
    finally:
        for handle in named:  # uploaded weights leave the session, whatever happened
            if isinstance(handle, str):
                w.store.drop(s, handle)
        if named or path is not None:  # this session's upload is over: waiters go again
            w.requeue(w.uploads.finish(fp, s.id))
    w.models.attach(entry, s.id)
    s.models.add(fp)
    return {"cached": True, "bytes": entry.nbytes, "sessions": len(entry.sessions)}, []


# Keyword arguments a client may pass to generate(): its inputs, sampling and length
# controls and other settings that are data (token ids, numbers). Others reach code, files
# or the network (custom_generate, trust_remote_code, streamer, assistant_model,
# generation_config...). The main inputs of encoder-decoder models other than text
# (Whisper's input_features: a review found generate(input_features=...) refused) and the
# data-only settings (bad_words_ids, suppress_tokens, min_p...) are among them.
GENERATE_KWARGS = frozenset(
    {
        "input_features",
        "input_values",
        "pixel_values",
        "decoder_attention_mask",
        "bad_words_ids",
        "suppress_tokens",
        "begin_suppress_tokens",
        "forced_bos_token_id",
        "forced_eos_token_id",
        "min_p",
        "epsilon_cutoff",
        "eta_cutoff",
        "exponential_decay_length_penalty",
        "encoder_repetition_penalty",
        "encoder_no_repeat_ngram_size",
        "remove_invalid_values",
        "input_ids",
        "attention_mask",
        "max_new_tokens",
        "max_length",
        "min_new_tokens",
        "min_length",
        "do_sample",
        "temperature",
        "top_k",
        "top_p",
        "typical_p",
        "num_beams",
        "num_return_sequences",
        "pad_token_id",
        "eos_token_id",
        "bos_token_id",
        "repetition_penalty",
        "no_repeat_ngram_size",
        "length_penalty",
        "early_stopping",
        "use_cache",
        "return_dict_in_generate",
        "output_scores",
        "output_logits",
        "past_key_values",
        "position_ids",
        "token_type_ids",
        "renormalize_logits",
        "decoder_input_ids",
        "encoder_outputs",
        "inputs_embeds",
    }
)
MAX_NEW_TOKENS = 8192
MAX_BEAMS = 16
MAX_NGRAM = 64


def _no_strings(x: Any) -> None:
    """Plain strings are refused in model-call arguments (tagged values such as handles
    and dtypes are checked by the decoder)."""
    if isinstance(x, str):
        raise InvalidArgument("strings are not accepted as model-call arguments")
    if isinstance(x, (list, tuple)):
        for v in x:
            _no_strings(v)
    elif isinstance(x, dict):
        if any(isinstance(k, str) and k.startswith("$") for k in x):
            if isinstance(x.get("$tuple"), list):
                _no_strings(x["$tuple"])
            return
        for v in x.values():
            _no_strings(v)


def _check_generate(kwargs: dict[str, Any]) -> None:
    extra = sorted(set(kwargs) - GENERATE_KWARGS)
    if extra:
        raise UnsupportedOp(
            f"generate() arguments not accepted: {', '.join(extra)} (passed, or set in "
            "the model's generation_config: Note [generation settings])"
        )
    for key, cap in (
        ("max_new_tokens", MAX_NEW_TOKENS),
        ("max_length", MAX_NEW_TOKENS * 2),
        ("num_beams", MAX_BEAMS),
        ("num_return_sequences", MAX_BEAMS),
        # transformers lists every suffix of the tokens for each of the n in an n-gram:
        # one integer made the worker allocate without bound (a review: 4e7 took 5.5 GiB)
        ("no_repeat_ngram_size", MAX_NGRAM),
        ("encoder_no_repeat_ngram_size", MAX_NGRAM),
    ):
        value = kwargs.get(key)
        if value is not None and (not isinstance(value, int) or not 0 <= value <= cap):
            raise InvalidArgument(f"{key} must be an integer in [0, {cap}]")


def handle_call(w: Worker, s: WorkerSession, frame: Frame) -> Reply:
    """Run a registered model's forward (or an allowlisted method) on its worker."""
    from .skeleton import decode_args, object_refs

    body = frame.body
    fp = body.get("fingerprint")
    if not isinstance(fp, str):
        raise InvalidArgument("fingerprint must be a string")
    if fp not in s.models:
        raise NotFound("this session has not registered that model")
    entry = w.models.get(fp)
    method = body.get("method", "forward")
    if method == WEIGHTS_METHOD:
        if body.get("args") or body.get("kwargs"):
            raise InvalidArgument(f"{WEIGHTS_METHOD} takes no arguments")
    elif method != "forward" and method not in w.model_methods:
        raise UnsupportedOp(f"method {method!r} is not allowlisted (model_methods)")
    raw_args, raw_kwargs = body.get("args", []), body.get("kwargs", {})
    _no_strings([raw_args, raw_kwargs])  # a string is how a path or a repo id gets in
    device = w.device.torch_device
    args = decode_args(raw_args, s, frame.segments, device)
    kwargs = decode_args(raw_kwargs, s, frame.segments, device)
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise InvalidArgument("args must be a list and kwargs an object")
    if method == WEIGHTS_METHOD:
        kwargs = {"names": _weight_names(entry.module, body.get("names"))}
    if method == "generate":
        _check_generate(kwargs)
    hints = body.get("hints")
    if isinstance(hints, dict) and isinstance(hints.get("phase"), str):
        s.phase = hints["phase"][:32]
    # Make the call's working set resident and keep it so (issue 9 §2): the model and
    # the KV caches it was given are pinned, and swapped back in if they were out.
    generator = _client_generator(w, body, frame.segments)
    autocast = _autocast(w, body)
    try:  # a prepare that fails must unpin too, or others cannot evict what it pinned
        w.memory.prepare(s, entry, object_refs([raw_args, raw_kwargs]))
        with autocast, generator or contextlib.nullcontext():  # Note [a sampled model call]
            reply = _run_call(w, s, entry, method, args, kwargs, w.batcher.take(frame))
        if generator is not None:
            reply[0]["generator"] = len(reply[1])
            reply[1].append(generator.left)
    finally:
        w.memory.finish(s)
    if body.get("echo_ids") is True and method == "forward":
        _echo_ids(reply[0], args, kwargs)
    return reply


AUTOCAST_DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16}


def _autocast(w: Worker, body: dict[str, Any]) -> Any:
    """Note [a model call under autocast] (djinn/frontend/call_settings.py): the call runs
    under autocast of the worker's own device when the client's was on. Such a call is
    never batched with others (batching.py, generate_steps.py), and the cache it leaves is
    not rebuilt by a prefill without it (recompute.py, ``note_call``)."""
    name = body.get("autocast")
    if name is None:
        return contextlib.nullcontext()
    if not isinstance(name, str) or name not in AUTOCAST_DTYPES:
        raise InvalidArgument(f"autocast must be one of {sorted(AUTOCAST_DTYPES)}, not {name!r}")
    return torch.autocast(w.device.torch_device.type, dtype=AUTOCAST_DTYPES[name])


def _client_generator(w: Worker, body: dict[str, Any], segments: list) -> Any:
    """The client's generator state the call draws from, if it sent one (a payload
    segment named by ``generator``: Note [a sampled model call])."""
    from .call_generator import ClientGenerator

    k = body.get("generator")
    if k is None:
        return None
    if type(k) is not int or not 0 <= k < len(segments):
        raise InvalidArgument(f"no payload segment {k!r} for the generator state")
    return ClientGenerator(w.device.torch_device, segments[k])


# Note [echoed ids]: a decode step's ids are usually a handle (the argmax of the last
# logits, computed here), so the client never saw their values. A recovering client asks
# for them back: with them its journal can rebuild the KV cache with one prefill instead
# of replaying every step (Note [kv prefill replay] in djinn/runtime/kv_replay.py). A
# few integers per step; a large input is not echoed (its replay stays as recorded).
ECHO_IDS_MAX = 4096


def _echo_ids(reply: dict[str, Any], args: list, kwargs: dict) -> None:
    ids = call_ids(args, kwargs)
    if ids is not None and ids.numel() <= ECHO_IDS_MAX:
        values = ids.tolist()
        reply["ids"] = {
            "dtype": dtype_name(ids.dtype),
            "strides": list(ids.stride()),
            "values": values,
        }


def _run_call(
    w: Worker,
    s: WorkerSession,
    entry: Any,
    method: str,
    args: list,
    kwargs: dict,
    batched: Any = None,
) -> Reply:
    """``batched``: this decode step's result, computed in a batch with other sessions'
    steps (Note [cross-session batching]); it stands in for the model's forward."""
    from . import call_checks, callmemory
    from .skeleton import encode_output

    if method == "forward":
        fn = entry.module
    elif method == WEIGHTS_METHOD:  # Note [a registered model trains]
        fn = functools.partial(_weight_copies, entry.module)
    else:
        fn = getattr(entry.module, method)
    if batched is not None:
        fn = batched
    # Reserve what the call will add before it runs (issue 16 §4): the cache growth and
    # outputs in data, generate()'s private cache in the stack. After the call the
    # reservation gives way to the bytes actually held.
    growth = callmemory.estimate(entry.module, method, args, kwargs)
    data, stack = w.store.vmu["data"], w.store.vmu["stack"]
    w.store.check_quota(s, growth.data)  # issue 9 §4: the cache would grow past the quota
    data.reserve(growth.data)
    try:
        stack.reserve(growth.stack)
    except BaseException:
        data.release(growth.data)
        raise
    lengths = _cache_lengths([args, kwargs])  # Note [calls run once]
    started = time.perf_counter()
    try:
        if w.device.torch_device.type != "cpu":  # a CPU kernel raises; a GPU's asserts
            call_checks.check(entry.module, f"{entry.name}.{method}", args, kwargs)
        with torch.no_grad():
            out = fn(*args, **kwargs)
    except ExecutionError:  # a check's own (call_checks): already says what and where
        _crop(lengths)
        raise
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError) as exc:
        _crop(lengths)
        # marked as eager's class where a program catches it by name (Note [linear
        # algebra errors]): a ValueError of generate()'s checks is the client's ValueError
        mark = kernel_mark(exc) or f"{type(exc).__name__}: "
        raise ExecutionError(f"{entry.name}.{method} (model call): {mark}{exc}") from None
    finally:
        data.release(growth.data)
        stack.release(growth.stack)
    entry.hits += 1
    seconds = time.perf_counter() - started
    kept: list[str] = []
    objects_before = set(s.objects)
    try:
        skeleton = encode_output(out, s, w.store, kept, w.models.allowlist, entry.storages)
        w.store.charge_objects(s)  # the KV cache grew: charge it like any session data
        w.store.check_quota(s, 0)  # the estimate fell short and the session is over
        vmu = w.store.vmu
        if vmu.used > vmu.capacity:  # the estimate fell short (Note [one device budget])
            raise ResourceExhausted(
                f"session data (handles and KV caches) overflows device memory by "
                f"{vmu.used - vmu.capacity} bytes; free objects or handles"
            )
    except BaseException as exc:
        for h in kept:
            w.store.drop(s, h)
        for oid in set(s.objects) - objects_before:  # a cache made by the refused call
            s.object_ids.pop(id(s.objects.pop(oid)), None)
        _crop(lengths)  # and the caches it was given are as they were before it
        w.store.charge_objects(s)
        w.memory.forget_objects(s)  # a host copy of the cache it made goes too
        if isinstance(exc, DeviceShort):  # the model ran: it must not be queued to run again
            raise ResourceExhausted(f"{exc.message} (after the call ran: not queued)") from None
        raise
    # the tokens that built the caches it left, to rebuild them (Note [kv recompute])
    under_autocast = torch.is_autocast_enabled(w.device.torch_device.type)
    w.memory.kv.note_call(
        s, entry.fingerprint, method, args, kwargs, out, seconds, rebuildable=not under_autocast
    )
    reply: dict[str, Any] = {"out": skeleton}
    sizes = _object_lengths(s, [c for c, _ in lengths] + [c for c, _ in _cache_lengths(out)])
    if sizes:
        reply["lengths"] = sizes
    return reply, []


# Note [a registered model trains]: a model registered in eval mode (the model path: the
# appliance's one shared copy, the client's local module of meta tensors) that the program
# then puts in training mode, the Hugging Face recipe (``from_pretrained``, ``.to(...)``,
# ``.train()`` or ``Trainer``), needs weights of its own to train, and the client has
# none. CALL with method ``$weights`` copies every parameter and buffer of the registered
# model (a tied weight once) into new handles of the session, reserved and charged as any
# call's outputs are; the client puts them in its local parameters and runs the model on
# the graph path from then on (djinn/frontend/model_leaves.py). The shared copy is not
# touched, and stays registered for the session.
def _weight_copies(module: torch.nn.Module, names: list[str] | None) -> dict[str, torch.Tensor]:
    from .callmemory import own_tensors

    tensors = own_tensors(module)
    return {name: tensors[name].clone() for name in (tensors if names is None else names)}


def _weight_names(module: torch.nn.Module, names: Any) -> list[str] | None:
    """The weights a ``$weights`` call asks copies of: all (None), or these, each once
    (Note [weights of a registered model] in djinn/frontend/registered_weights.py)."""
    from .callmemory import own_tensors

    if names is None:
        return None
    tensors = own_tensors(module)
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise InvalidArgument(f"{WEIGHTS_METHOD} names must be a list of strings")
    if len(set(names)) != len(names) or not 0 < len(names) <= len(tensors):
        raise InvalidArgument(f"{WEIGHTS_METHOD} names must be distinct, 1 to {len(tensors)}")
    unknown = next((n for n in names if n not in tensors), None)
    if unknown is not None:
        raise NotFound(f"the model has no weight named {unknown[:200]!r}")
    return names


# Note [cache lengths]: a program's decode loop asks its KV cache how long it is
# (``past_key_values.get_seq_length()``, to number the next positions); the cache stays
# here and the client holds a RemoteObject for it. So every model call says how long each
# cache it was given or returned is now, by id, and the client's RemoteObject answers
# ``get_seq_length()`` from that: what the cache says, with no request of its own. Only
# model calls grow or crop a cache the client names.
def _object_lengths(s: WorkerSession, caches: list[Any]) -> dict[str, int]:
    sizes: dict[str, int] = {}
    for cache in caches:
        oid = s.object_ids.get(id(cache))
        if oid is not None and s.objects.get(oid) is cache:
            sizes[oid] = int(cache.get_seq_length())
    return sizes


# Note [calls run once]: a model call grows the KV caches it is given in place, before its
# outputs are charged. If the call is refused after that (its outputs do not fit, a quota),
# the caches are cropped back to their lengths before it, so a client that retries does
# not apply the step twice; and the refusal is never DEVICE_SHORT, which would queue the
# call (Note [admission queue]) and run it again on the caches it already grew.
def _cache_lengths(values: Any) -> list[tuple[Any, int]]:
    found: list[tuple[Any, int]] = []

    def visit(x: Any) -> None:
        if isinstance(x, (list, tuple)):
            for v in x:
                visit(v)
        elif isinstance(x, dict):
            for v in x.values():
                visit(v)
        elif callable(getattr(x, "crop", None)) and callable(getattr(x, "get_seq_length", None)):
            found.append((x, int(x.get_seq_length())))

    visit(values)
    return found


def _crop(lengths: list[tuple[Any, int]]) -> None:
    for cache, n in lengths:
        extra = cache.get_seq_length() - n
        if extra > 0:
            try:  # transformers 5: a negative crop removes that many tokens
                cache.crop(-extra)
            except (ValueError, TypeError):  # caches that take the length to keep
                cache.crop(n)
