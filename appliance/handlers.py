"""Request handlers for a session's connection on a worker.

Each handler takes (worker, session, frame) and returns (reply body, payload segments).
Errors are raised as typed ``DjinnError``s; the worker turns them into ERROR frames, and
no handler leaves a half-done change behind (a failing multi-tensor PUT keeps nothing).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Generator
from typing import TYPE_CHECKING, Any

import torch

from djinn.errors import (
    BehindFailed,
    DjinnError,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
)
from djinn.protocol.frames import Frame, Kind
from djinn.protocol.tensors import describe, from_wire, to_wire, validate

from .executor import threads
from .executor.graph import GraphRun
from .executor.plan import input_signature
from .generate_steps import call_steps
from .model_handlers import handle_call, handle_load, handle_register
from .sessions import WorkerSession, client_names
from .vmu.device import DeviceShort

if TYPE_CHECKING:
    from .worker import Worker

Reply = tuple[dict[str, Any], list[Any]]


def _list(body: dict[str, Any], key: str, limit: int = 1 << 16) -> list[Any]:
    value = body.get(key)
    if not isinstance(value, list) or len(value) > limit:
        raise InvalidArgument(f"{key} must be a list of at most {limit} items")
    return value


def handle_heartbeat(w: Worker, s: WorkerSession, frame: Frame) -> Reply:
    # the session's bytes as of now: what torch.cuda.memory_allocated() reports for it
    return {"bytes": s.data_bytes}, []


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
    return t, s.frame_slabs.pop(k, None)  # TCP bulk bytes were received into a slab


def handle_put(w: Worker, s: WorkerSession, frame: Frame) -> Reply:
    # Note [puts sent without waiting]: a client may name the handles ("name" in every
    # entry); a PUT that named them and failed, whatever the reason, leaves its error
    # under those names for the requests its client sent behind it
    names = _names(frame)
    try:
        items = _list(frame.body, "tensors", 4096)
        lease = frame.body.get("lease", [])
        if not isinstance(lease, list) or not all(type(n) is int and n > 0 for n in lease):
            raise InvalidArgument("lease must be a list of positive sizes")
        if any(n is not None for n in names):
            client_names(s, names)
        return _put(w, s, frame, items, names, lease)
    except DjinnError as exc:
        put_refused(s, frame, exc)
        raise


def _names(frame: Frame) -> list[Any]:
    """The names of a PUT's entries, by entry (None where an entry names none)."""
    items = frame.body.get("tensors") if isinstance(frame.body, dict) else None
    if not isinstance(items, list):
        return []
    return [i.get("name") if isinstance(i, dict) else None for i in items[:4096]]


def put_refused(s: WorkerSession, frame: Frame, exc: DjinnError) -> None:
    """A PUT that kept nothing, refused by its handler or before it (its payload did not
    fit the arena): its names say why (Note [puts sent without waiting])."""
    s.put_failed(_names(frame), exc)


def _put(
    w: Worker,
    s: WorkerSession,
    frame: Frame,
    items: list[Any],
    names: list[str | None],
    lease: list[int],
) -> Reply:
    # Note [staged uploads]: weights a session uploads for REGISTER stay in their arena
    # slabs (the host tier) until the model is built from them, so they never compete
    # with session data for device memory. A session is uploading between a REGISTER
    # answered cached:false and its second REGISTER (Note [one upload per fingerprint]).
    weights = w.uploads.uploading(s.id)
    staged: list[tuple[torch.Tensor, int | None]] = []
    handles: list[str] = []
    try:
        for item in items:
            staged.append(_stage(w, s, frame, item))
        while staged:
            t, slab = staged[0]
            if not w.device.adopts_host_memory and not weights:
                # DMA from the pinned arena, then give the slab back. A small tensor sent
                # inline in the frame goes to the device too: it stayed in host memory on
                # a GPU worker, where the next op mixing it with device tensors failed
                # (seen on an H200: every `x.to(remote)` of a few KiB)
                t = w.device.from_host(t)
                if slab is not None:
                    w.store.slabs.free(slab)
                staged[0] = (t, None)
                slab = None
            name = names[len(handles)]
            handles.append(w.store.keep(s, t, slab=slab, host=weights, name=name))
            staged.pop(0)
    except BaseException:
        for h in handles:
            w.store.drop(s, h)
        for _t, slab in staged:
            if slab is not None:
                w.store.slabs.free(slab)
        raise
    return {"handles": handles, **_lease_ahead(w, s, lease)}, []


LEASE_AHEAD_MAX = 16  # slabs one PUT may lease ahead


def _lease_ahead(w: Worker, s: WorkerSession, sizes: list[int]) -> dict[str, list[int]]:
    """Note [lease ahead]: slabs for the client's next PUTs, leased with this one, as far
    as the session's arena share allows (best effort: the PUT itself has succeeded)."""
    if not s.via_unix or not sizes:
        return {}
    leased: list[int] = []
    for n in sizes[:LEASE_AHEAD_MAX]:
        try:
            leased.append(w.store.lease(s, n))
        except ResourceExhausted:  # QuotaExceeded too
            break  # the client ALLOCs when it needs one
    return {"leased": leased}


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


def _after_failed(s: WorkerSession, body: dict[str, Any]) -> None:
    """BehindFailed, before anything runs, for a graph sent behind a request of the
    session that failed (Note [replays sent ahead] in djinn/runtime/flights.py)."""
    after = body.get("after")
    if after is None:
        return
    if not isinstance(after, int) or isinstance(after, bool):
        raise InvalidArgument(f"EXEC 'after' must be a request id, got {after!r}")
    if after in s.failed_execs:
        raise BehindFailed(f"not run: request {after}, sent before it, failed")


def exec_steps(w: Worker, s: WorkerSession, frame: Frame) -> Generator[None, None, Reply]:
    """EXEC one op at a time (the worker's scheduler may run other requests between two
    ops: Note [threading model] in scheduler.py). A graph may come as a template's
    fingerprint, or ask to be kept as one (Note [graph templates])."""
    body, kept_as, record = frame.body, None, None
    _after_failed(s, body)
    named: dict[str, None] = {}  # the handles this graph resolved, for recharge
    started = time.perf_counter()

    def lookup(handle: str) -> torch.Tensor:
        t = s.tensor(handle)
        named[handle] = None
        return t

    if "graph" in body:
        run, record = _template_run(w, s, frame, lookup)
    else:
        if body.get("cache") is True:
            kept_as = w.graphs.keep(body)
        run = GraphRun(body, lookup, frame.segments, w.device.torch_device, w.store.vmu["stack"])
    run.input_storages = lambda: list(s.storages)
    # Note [a capturing client beside its worker]
    run.threads = threads.for_graph(
        w.device.torch_device.type, s.via_unix, body.get("unwaited") is True
    )
    try:
        keep, fetch = yield from run.steps()
    finally:
        w.store.recharge(s, named)  # an op may have grown a handle's storage (out=)
    if record is not None:
        record()
    kept: list[Any] = []
    try:
        for value in keep:
            if value is None and run.failed is not None:
                kept.append(None)  # its node never ran (Note [partial graphs])
                continue
            if not isinstance(value, torch.Tensor):
                raise InvalidArgument("only tensors can be kept as handles")
            kept.append({"handle": w.store.keep(s, value), **describe(value)})
    except BaseException as exc:
        for item in kept:
            if item is not None:
                w.store.drop(s, item["handle"])
        if isinstance(exc, DeviceShort) and run.wrote:  # Note [rerunnable graphs]
            raise ResourceExhausted(
                f"{exc.message} (not queued: the graph wrote in place)"
            ) from None
        raise
    held = _hold_for_rest(w, s, run)
    body, segments = export(w, s, [v for v in fetch if isinstance(v, torch.Tensor)])
    values = [
        None
        if isinstance(v, torch.Tensor)
        else {"$failed": True}
        if v is None and run.failed is not None
        else _json_value(v)
        for v in fetch
    ]
    # Note [a flight's cost]: how long the graph took here, for a client that read the
    # reply later than it came (a graph it sent without waiting)
    body.update(kept=kept, values=values, took_s=round(time.perf_counter() - started, 6))
    if kept_as is not None:
        body["graph"] = kept_as  # send it by this fingerprint from now on
    if run.failed is not None:
        node, exc = run.failed
        body["failed"] = {"node": node, "code": exc.code, "message": exc.message}
        if held:
            body["failed"]["held"] = held
    return body, segments


def _hold_for_rest(w: Worker, s: WorkerSession, run: GraphRun) -> list[dict[str, Any]]:
    """Handles of the values the rest of a failed graph reads (Note [values the rest
    reads] in executor/graph.py). One the session cannot hold (its quota) holds none:
    the rest then fails on the client, saying it read a value the run dropped."""
    held: list[dict[str, Any]] = []
    try:
        for ref, value in run.held_for_rest():
            held.append({"ref": ref, "handle": w.store.keep(s, value), **describe(value)})
    except DjinnError:
        for item in held:
            w.store.drop(s, item["handle"])
        return []
    return held


def _template_run(
    w: Worker, s: WorkerSession, frame: Frame, lookup: Callable[[str], torch.Tensor]
) -> tuple[GraphRun, Callable[[], Any] | None]:
    """The run of a request that names a graph template: by its plan when one fits its
    inputs, else interpreted, recording a plan when the template has come back often
    enough (Note [graph plans]). Also what to call once an interpreted run completed."""
    body, device, stack = frame.body, w.device.torch_device, w.store.vmu["stack"]
    fp = body.get("graph")
    tpl = w.graphs.template(fp)
    inputs, scalars = body.get("inputs"), body.get("scalars")
    tensors, signature = None, None
    if w.plans.after > 0 and isinstance(inputs, list) and isinstance(scalars, list):
        try:
            tensors = [lookup(h) for h in inputs]
        except NotFound:
            tensors = None  # the interpreted run says which (if a node reads it)
    if tensors is not None and all(type(v) is float for v in scalars):
        signature = input_signature(tensors)
        plan = w.plans.find(fp, signature, scalars)
        if plan is not None:  # Note [compiled plans]: compiled, or node by node
            runner = w.cuda_graphs.runner(plan, w.plans.runner(plan, fp, device), device)
            return runner(plan, fp, body, inputs, tensors, lookup, frame.segments, device,
                          stack), None  # fmt: skip
    run = GraphRun(w.graphs.expand(body, tpl), lookup, frame.segments, device, stack)
    run.template = fp
    if signature is None or not w.plans.should_record(fp):
        return run, None
    run.recording = []
    return run, lambda: w.plans.record(fp, tpl, run, signature, scalars, device)


def handle_exec(w: Worker, s: WorkerSession, frame: Frame) -> Reply:
    steps = exec_steps(w, s, frame)
    while True:
        try:
            next(steps)
        except StopIteration as stop:
            return stop.value


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
                off = w.store.slabs.alloc(nbytes, s.id)
                s.pending_release.append(off)  # until the client lists it in "release"
                w.store.slab_tensor(off, nbytes).copy_(flat)
            out.append({"desc": desc, "slab": off})
            continue
        if flat.device.type != "cpu":
            flat = flat.cpu()
        out.append({"desc": desc, "seg": len(segments)})
        segments.append(memoryview(flat.numpy()) if nbytes else b"")
    return {"tensors": out}, segments


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
# Requests that can be preempted between steps (Note [threading model] in scheduler.py).
# A CALL: a plain greedy generate() pauses between tokens to be batched with other
# sessions' decode steps (Note [cross-session batching]); other calls run whole.
STEPPED = {Kind.EXEC: exec_steps, Kind.CALL: call_steps}
