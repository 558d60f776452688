"""Request handlers for a session's connection on a worker.

Each handler takes (worker, session, frame) and returns (reply body, payload segments).
Errors are raised as typed ``DjinnError``s; the worker turns them into ERROR frames, and
no handler leaves a half-done change behind (a failing multi-tensor PUT keeps nothing).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import orjson
import torch

from djinn.errors import (
    ExecutionError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    UnsupportedOp,
)
from djinn.protocol.frames import Frame, Kind
from djinn.protocol.tensors import from_wire, to_wire, validate

from .executor.graph import GraphRun
from .sessions import WorkerSession

if TYPE_CHECKING:
    from .worker import Worker

Reply = tuple[dict[str, Any], list[Any]]


def _list(body: dict[str, Any], key: str, limit: int = 1 << 16) -> list[Any]:
    value = body.get(key)
    if not isinstance(value, list) or len(value) > limit:
        raise InvalidArgument(f"{key} must be a list of at most {limit} items")
    return value


def handle_heartbeat(w: Worker, s: WorkerSession, frame: Frame) -> Reply:
    return {}, []


def handle_alloc(w: Worker, s: WorkerSession, frame: Frame) -> Reply:
    if not s.via_unix:
        raise InvalidArgument("ALLOC is for same-host clients; TCP clients send bytes inline")
    sizes = _list(frame.body, "sizes", 1024)
    if not all(type(n) is int and n >= 0 for n in sizes):
        raise InvalidArgument("sizes must be non-negative integers")
    offsets: list[int] = []
    try:
        for n in sizes:
            offsets.append(w.store.lease(s, n))
    except ResourceExhausted:
        for off in offsets:
            del s.leases[off]
            w.store.slabs.free(off)
        raise
    return {"slabs": offsets}, []


def _stage(w: Worker, s: WorkerSession, frame: Frame, item: Any) -> tuple[torch.Tensor, int | None]:
    """Check one PUT entry; return its tensor and the slab now owned by the request."""
    if not isinstance(item, dict):
        raise InvalidArgument("each tensor entry must be an object")
    desc = item.get("desc")
    nbytes = validate(desc)[3]
    if "slab" in item:
        off = item["slab"]
        s.check_lease(off, nbytes)
        t = from_wire(desc, w.store.slab_tensor(off, nbytes))
        del s.leases[off]
        return t, off
    k = item.get("seg")
    if type(k) is not int or not 0 <= k < len(frame.segments):
        raise InvalidArgument(f"a tensor entry needs 'slab' or a valid 'seg', got {k!r}")
    seg = frame.segments[k]
    raw = (
        torch.frombuffer(seg, dtype=torch.uint8) if len(seg) else torch.empty(0, dtype=torch.uint8)
    )
    t = from_wire(desc, raw)
    return t, w.frame_slabs.pop(k, None)  # TCP bulk bytes were received into a slab


def handle_put(w: Worker, s: WorkerSession, frame: Frame) -> Reply:
    items = _list(frame.body, "tensors", 4096)
    staged: list[tuple[torch.Tensor, int | None]] = []
    handles: list[str] = []
    try:
        for item in items:
            staged.append(_stage(w, s, frame, item))
        while staged:
            t, slab = staged[0]
            if slab is not None and not w.device.adopts_host_memory:
                t = w.device.from_host(t)  # DMA from the pinned arena, then give it back
                w.store.slabs.free(slab)
                staged[0] = (t, None)
                slab = None
            handles.append(w.store.keep(s, t, slab=slab))
            staged.pop(0)
    except BaseException:
        for h in handles:
            w.store.drop(s, h)
        for _t, slab in staged:
            if slab is not None:
                w.store.slabs.free(slab)
        raise
    return {"handles": handles}, []


def handle_free(w: Worker, s: WorkerSession, frame: Frame) -> Reply:
    handles = _list(frame.body, "handles")
    missing = [h for h in handles if not isinstance(h, str) or h not in s.handles]
    if missing:
        raise NotFound(f"{len(missing)} handle(s) not in this session, nothing freed")
    for h in handles:
        w.store.drop(s, h)
    return {"freed": len(handles)}, []


def handle_get(w: Worker, s: WorkerSession, frame: Frame) -> Reply:
    handles = _list(frame.body, "handles", 4096)
    tensors = [s.tensor(h) for h in handles]
    return export(w, s, tensors)


def handle_exec(w: Worker, s: WorkerSession, frame: Frame) -> Reply:
    run = GraphRun(
        frame.body, s.tensor, frame.segments, w.device.torch_device, w.store.vmu["stack"]
    )
    run.input_storages = lambda: list(s.storages)
    try:
        keep, fetch = run.run()
    finally:
        w.store.recharge(s)  # an op may have grown a handle's storage (out=, in place)
    kept = []
    try:
        for value in keep:
            if not isinstance(value, torch.Tensor):
                raise InvalidArgument("only tensors can be kept as handles")
            desc, _ = _meta(value)
            kept.append({"handle": w.store.keep(s, value), **desc})
    except BaseException:
        for item in kept:
            w.store.drop(s, item["handle"])
        raise
    body, segments = export(w, s, [v for v in fetch if isinstance(v, torch.Tensor)])
    values = [None if isinstance(v, torch.Tensor) else _json_value(v) for v in fetch]
    body.update(kept=kept, values=values)
    return body, segments


def _meta(t: torch.Tensor) -> tuple[dict[str, Any], None]:
    from djinn.protocol.tensors import dtype_name

    return {"dtype": dtype_name(t.dtype), "shape": list(t.shape), "strides": list(t.stride())}, None


def _json_value(v: Any) -> Any:
    if isinstance(v, (bool, int, float, str)) or v is None:
        return v
    if isinstance(v, (list, tuple)) and all(isinstance(x, (bool, int, float)) for x in v):
        return list(v)
    raise InvalidArgument(f"cannot return a {type(v).__name__} by value")


def export(w: Worker, s: WorkerSession, tensors: list[torch.Tensor]) -> Reply:
    """Describe tensors for a reply: arena slabs for a same-host peer, payload otherwise."""
    out: list[dict[str, Any]] = []
    segments: list[Any] = []
    for t in tensors:
        desc, flat = to_wire(t)
        nbytes = flat.numel()
        if s.via_unix and nbytes > w.inline_max:
            off = w.store.arena_offset(flat)
            if off is None:
                off = w.store.slabs.alloc(nbytes)
                s.pending_release.append(off)  # until the client lists it in "release"
                w.store.slab_tensor(off, nbytes).copy_(flat)
            out.append({"desc": desc, "slab": off})
            continue
        if flat.device.type != "cpu":
            flat = flat.cpu()
        out.append({"desc": desc, "seg": len(segments)})
        segments.append(memoryview(flat.numpy()) if nbytes else b"")
    return {"tensors": out}, segments


def handle_load(w: Worker, s: WorkerSession, frame: Frame) -> Reply:
    """Load safetensors weights from an allowlisted directory into handles."""
    from . import weights

    directory = weights.resolve(frame.body.get("path"), w.model_roots)
    if frame.body.get("hash_only"):
        return {
            "content_hash": weights.content_hash(directory),
            "names": weights.tensor_names(directory),
        }, []
    data = w.store.vmu["data"]
    tensors = weights.load(directory, w.device.torch_device, data.capacity - data.used)
    out, kept = [], []
    try:
        for name, t in tensors.items():
            kept.append(w.store.keep(s, t))
            desc, _ = _meta(t)
            out.append({"name": name, "handle": kept[-1], **desc})
    except BaseException:
        for h in kept:
            w.store.drop(s, h)
        raise
    return {"tensors": out}, []


MAX_CONFIG_JSON = 1 << 20


def handle_register(w: Worker, s: WorkerSession, frame: Frame) -> Reply:
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
    from .models import build, import_class, sanitize_config

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
                data = w.store.vmu["data"]
                files = weights.load(directory, torch.device("cpu"), data.capacity - data.used)
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
            module = build(cls, config, tensors, w.device.torch_device)
            entry = w.models.add(fp, str(body.get("name", cls.__name__))[:128], module)
    finally:
        for handle in named:  # uploaded weights leave the session, whatever happened
            if isinstance(handle, str):
                w.store.drop(s, handle)
    w.models.attach(entry, s.id)
    s.models.add(fp)
    return {"cached": True, "bytes": entry.nbytes, "sessions": len(entry.sessions)}, []


# Keyword arguments a client may pass to generate(): sampling and length controls only.
# Others reach code, files or the network (custom_generate, trust_remote_code, streamer,
# assistant_model, generation_config...).
GENERATE_KWARGS = frozenset(
    {
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
        raise UnsupportedOp(f"generate() arguments not accepted: {', '.join(extra)}")
    for key, cap in (
        ("max_new_tokens", MAX_NEW_TOKENS),
        ("max_length", MAX_NEW_TOKENS * 2),
        ("num_beams", MAX_BEAMS),
        ("num_return_sequences", MAX_BEAMS),
    ):
        value = kwargs.get(key)
        if value is not None and (not isinstance(value, int) or not 0 <= value <= cap):
            raise InvalidArgument(f"{key} must be an integer in [0, {cap}]")


def handle_call(w: Worker, s: WorkerSession, frame: Frame) -> Reply:
    """Run a registered model's forward (or an allowlisted method) on its worker."""
    from .skeleton import decode_args, encode_output

    body = frame.body
    fp = body.get("fingerprint")
    if fp not in s.models:
        raise NotFound("this session has not registered that model")
    entry = w.models.get(fp)
    method = body.get("method", "forward")
    if method != "forward" and method not in w.model_methods:
        raise UnsupportedOp(f"method {method!r} is not allowlisted (model_methods)")
    raw_args, raw_kwargs = body.get("args", []), body.get("kwargs", {})
    _no_strings([raw_args, raw_kwargs])  # a string is how a path or a repo id gets in
    device = w.device.torch_device
    args = decode_args(raw_args, s, frame.segments, device)
    kwargs = decode_args(raw_kwargs, s, frame.segments, device)
    if not isinstance(args, list) or not isinstance(kwargs, dict):
        raise InvalidArgument("args must be a list and kwargs an object")
    if method == "generate":
        _check_generate(kwargs)
    hints = body.get("hints")
    if isinstance(hints, dict) and isinstance(hints.get("phase"), str):
        s.phase = hints["phase"][:32]
    fn = entry.module if method == "forward" else getattr(entry.module, method)
    try:
        with torch.no_grad():
            out = fn(*args, **kwargs)
    except (RuntimeError, TypeError, ValueError, IndexError, KeyError) as exc:
        raise ExecutionError(f"{entry.name}.{method}: {type(exc).__name__}: {exc}") from None
    entry.hits += 1
    kept: list[str] = []
    try:
        skeleton = encode_output(out, s, w.store, kept, w.models.allowlist, entry.storages)
    except BaseException:
        for h in kept:
            w.store.drop(s, h)
        raise
    return {"out": skeleton}, []


HANDLERS = {
    Kind.HEARTBEAT: handle_heartbeat,
    Kind.PING: handle_heartbeat,
    Kind.ALLOC: handle_alloc,
    Kind.PUT: handle_put,
    Kind.GET: handle_get,
    Kind.FREE: handle_free,
    Kind.EXEC: handle_exec,
    Kind.LOAD: handle_load,
    Kind.REGISTER: handle_register,
    Kind.CALL: handle_call,
}
