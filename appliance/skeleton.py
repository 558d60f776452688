"""Model-call arguments in, output skeletons out.

Arguments arrive as JSON with tagged values (handles, inline tensors, remote objects,
dtypes...). Outputs go back as a *skeleton*: the structure is kept (ModelOutput classes,
tuples, lists, dicts), tensors are replaced by new session handles with their metadata,
and other objects (a transformers ``DynamicCache``) stay on the worker as remote objects
the client can pass back. The same object always gets the same id, so a cache updated in
place during decoding keeps one identity.
"""

from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Any

import torch

from djinn.errors import InvalidArgument, NotFound, ResourceExhausted
from djinn.protocol.graph import MAX_DEPTH
from djinn.protocol.tensors import describe
from djinn.protocol.values import decode_constant, inline_tensor

if TYPE_CHECKING:
    from .sessions import WorkerSession
    from .store import TensorStore

SCALARS = (bool, int, float, str, type(None))
MAX_OBJECTS = 4096  # remote objects (KV caches...) one session may hold


def decode_args(
    x: Any, s: WorkerSession, segments: list, device: torch.device, depth: int = 0
) -> Any:
    if depth > MAX_DEPTH:
        raise InvalidArgument("arguments nested too deeply")
    if isinstance(x, list):
        return [decode_args(v, s, segments, device, depth + 1) for v in x]
    if not isinstance(x, dict):
        return x
    if "$h" in x:
        return s.tensor(x["$h"])
    if "$o" in x:
        try:
            return s.objects[x["$o"]]
        except (KeyError, TypeError):
            raise NotFound(f"no remote object {x['$o']!r} in this session") from None
    if "$t" in x:
        return inline_tensor(x, segments, device)
    if "$tuple" in x and len(x) == 1 and isinstance(x["$tuple"], list):
        return tuple(decode_args(v, s, segments, device, depth + 1) for v in x["$tuple"])
    found, value = decode_constant(x, device)
    if found:
        return value
    return {k: decode_args(v, s, segments, device, depth + 1) for k, v in x.items()}


def object_refs(x: Any, depth: int = 0) -> set[str]:
    """Ids of the remote objects (KV caches) that raw call arguments name."""
    found: set[str] = set()
    if depth > MAX_DEPTH:
        return found
    if isinstance(x, list):
        for v in x:
            found |= object_refs(v, depth + 1)
    elif isinstance(x, dict):
        if isinstance(x.get("$o"), str):
            found.add(x["$o"])
        else:
            for v in x.values():
                found |= object_refs(v, depth + 1)
    return found


def _class_path(obj: Any) -> str:
    cls = type(obj)
    return f"{cls.__module__}.{cls.__qualname__}"


def encode_output(
    x: Any,
    s: WorkerSession,
    store: TensorStore,
    kept: list[str],
    allowlist: list[str],
    weights: set[int] | frozenset = frozenset(),
    depth: int = 0,
) -> Any:
    """Skeleton of a call's result; new handles are appended to ``kept`` (for rollback).
    A tensor viewing the model's own weights is copied: no session may hold a writable
    alias of weights other sessions share."""
    if depth > MAX_DEPTH:
        raise InvalidArgument("output nested too deeply")
    if isinstance(x, torch.Tensor):
        x = x.detach()
        if x.untyped_storage().data_ptr() in weights:
            x = x.clone()
        handle = store.keep(s, x)
        kept.append(handle)
        return {"$h": handle, **describe(x)}
    if isinstance(x, SCALARS):
        return x
    rec = lambda v: encode_output(v, s, store, kept, allowlist, weights, depth + 1)  # noqa: E731
    path = _class_path(x)
    if _is_model_output(x):
        return {"$mo": path, "fields": {k: rec(v) for k, v in x.items()}}
    if isinstance(x, tuple):
        return {"$tuple": [rec(v) for v in x]}
    if isinstance(x, list):
        return [rec(v) for v in x]
    if isinstance(x, dict):
        return {str(k): rec(v) for k, v in x.items()}
    if any(path.startswith(prefix) for prefix in allowlist):
        oid = s.object_ids.get(id(x))
        if oid is None or s.objects.get(oid) is not x:
            if len(s.objects) >= MAX_OBJECTS:
                raise ResourceExhausted(f"a session holds at most {MAX_OBJECTS} remote objects")
            oid = secrets.token_urlsafe(12)
            s.objects[oid] = x
            s.object_ids[id(x)] = oid
        return {"$o": oid, "class": path}
    raise InvalidArgument(f"cannot return a {path} from the appliance")


def _is_model_output(x: Any) -> bool:
    return any(
        c.__name__ == "ModelOutput" and c.__module__.startswith("transformers.")
        for c in type(x).__mro__
    )
