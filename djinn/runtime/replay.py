"""Replaying a lineage journal into a reopened session (Note [lineage journal] in
lineage.py): the requests the live handles and objects still depend on, in order,
with their handles renamed to those of the new session."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from djinn.errors import DjinnError, RecoveryFailed, copy_of

from . import kv_replay
from .journal import Entry, kept, needed, pair_ids, remap, strings_in

if TYPE_CHECKING:
    from .lineage import Lineage


def replay(lin: Lineage) -> tuple[dict[str, str], list[Entry]]:
    """Replay ``lin``'s journal into its session, reopened on a new worker: every entry
    the live handles and objects still need, puts uploaded when first needed. Returns
    the renaming (old handle or object id -> new) and the journal of the new session."""
    s = lin.s
    mapping: dict[str, str] = {}
    pending: dict[str, tuple[torch.Tensor, int]] = {}  # puts not replayed yet
    order: dict[str, int] = {}  # where each put came in the journal
    out: list[Entry] = []
    cached: dict[str, bool] = {}
    entries = lin.entries
    live = lin._live()
    objects = lin._objects()
    with s._lists_lock:  # dropped while the worker was dying: not needed
        dropped = set(s._pending_free) | set(s._pending_free_objects)
    held = (set(live) | set(objects)) - dropped
    if lin.policy.kv_prefill:  # Note [kv prefill replay]
        entries = kv_replay.coalesce(entries, held, live)
    keep = needed(entries, held)

    def materialize(names: set[str]) -> None:
        # in the order they were put: one that failed on the lost worker (put_apart)
        # fails again, not one put before it that the quota then has no room for
        need = sorted((h for h in names if h in pending), key=order.__getitem__)
        if not need:
            return
        for h in need:
            t, version = pending[h]
            if t._version != version:
                raise RecoveryFailed(
                    "a tensor uploaded earlier was changed in place since, so the "
                    "value the appliance held cannot be rebuilt"
                )
        tensors = [pending.pop(h)[0] for h in need]
        try:
            remotes = s._put_many(tensors)
        except DjinnError as exc:
            if exc.code in lin.policy.errors:
                raise
            need, tensors, remotes = put_apart(need, tensors)
        for h, r in zip(need, remotes, strict=True):
            mapping[h] = r.handle
            r._finalizer.detach()  # the old handle's holder owns it (rebound below)
        data = [kept(t) for t in tensors]
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        out.append(Entry("put", None, data, [r.handle for r in remotes], nbytes))

    def put_apart(
        names: list[str], tensors: list[torch.Tensor]
    ) -> tuple[list[str], list[torch.Tensor], list]:
        """Note [puts sent without waiting]: a put the journal recorded as it was sent
        may have failed on the lost worker before its client read why (over a quota).
        It fails again here, and is that put's own failure, not the recovery's: its
        tensor holds the error, and the rest is put one by one."""
        put_names, put_tensors, remotes = [], [], []
        for h, t in zip(names, tensors, strict=True):
            try:
                remotes += s._put_many([t])
            except DjinnError as exc:
                if exc.code in lin.policy.errors:
                    raise
                if h in live:
                    live[h].failed = copy_of(exc)  # Note [raising a kept error]
                    live[h]._finalizer.detach()  # nothing on the appliance to free
                continue
            put_names.append(h)
            put_tensors.append(t)
        return put_names, put_tensors, remotes

    spent: dict[str, float] = {}  # seconds per kind of request (puts: by who needed them)
    last, t_last = "", time.perf_counter()
    for i, e in enumerate(entries):
        now = time.perf_counter()
        spent[last] = spent.get(last, 0.0) + now - t_last
        last, t_last = "prefill" if e.merged > 1 else e.kind, now
        if e.kind == "put":
            pending.update(zip(e.out, e.data, strict=True))
            order.update((h, len(order)) for h in e.out)
            continue
        if e.kind in ("free", "free_objects"):
            gone = [mapping.pop(h) for h in e.body if h in mapping]
            for h in e.body:
                pending.pop(h, None)
            if gone:
                key = "free" if e.kind == "free" else "free_objects"
                s._call_raw("HEARTBEAT", {key: gone})
                out.append(Entry(e.kind, gone, nbytes=32 * len(gone)))
            continue
        if e.kind == "register":
            fp = e.body.get("fingerprint")
            second = "state" in e.body or "path" in e.body
            if second and cached.get(fp):
                # the worker had it: keep what a later replay may need, as it was
                names = strings_in(e.body.get("state"), set())
                strings_in(e.body.get("buffers"), names)
                held = [(h, pending[h]) for h in names if h in pending]
                if held:
                    out.append(
                        Entry(
                            "put",
                            None,
                            [d for _, d in held],
                            [h for h, _ in held],
                            sum(t.numel() * t.element_size() for _, (t, _) in held),
                        )
                    )
                out.append(e)
                continue
            materialize(strings_in(e.body, set()))
            body = remap(e.body, mapping)
            reply = s._call_raw("REGISTER", body)
            if not second:
                cached[fp] = bool(reply.get("cached"))
            out.append(Entry("register", body, nbytes=e.nbytes))
            continue
        if not keep[i]:
            continue  # Note [lineage pruning]: nothing it made is used any more
        if e.kind == "call" and not e.replayable:
            raise RecoveryFailed(
                "a sampled generate() made values the session still uses, and a "
                "replay would sample different ones"
            )
        materialize(strings_in(e.body, set()))
        body = remap(e.body, mapping)
        if e.kind == "exec":
            reply = s._exec_body({**body, "fetch": []}, e.data)
            # the appliance's Note [values the rest reads]: what the rest of a failed graph
            # read is in the recorded keep when it was held then; held only now (more room
            # than then), nothing reads it: freed at once, before what follows is replayed
            # against the session's quota (a review: a later put was refused)
            unread = [h["handle"] for h in (reply.get("failed") or {}).get("held", ())]
            if unread:
                s._call_raw("HEARTBEAT", {"free": unread})
            handles = [None if k is None else k["handle"] for k in reply.get("kept", [])]
            for old, new in zip(e.out, handles, strict=False):
                if old is not None and new is not None:
                    mapping[old] = new
            out.append(Entry("exec", {**body, "fetch": []}, e.data, handles, e.nbytes))
        elif e.kind == "call":
            reply = s._call_raw("CALL", body, e.data)
            pair_ids(e.out, reply.get("out"), mapping)
            ids = kv_replay.echoed(reply) if e.ids is None else e.ids
            made = reply.get("out")
            out.append(Entry("call", body, e.data, made, e.nbytes, ids=ids, merged=e.merged))
        elif e.kind == "load":
            reply = s._call_raw("LOAD", body)
            made = {t["name"]: t["handle"] for t in reply["tensors"]}
            for name, old in e.out.items():
                if name in made:
                    mapping[old] = made[name]
            out.append(Entry("load", body, out=made, nbytes=e.nbytes))
    materialize(set(live))
    spent[last] = spent.get(last, 0.0) + time.perf_counter() - t_last
    spent.pop("", None)
    lin.replay_kinds.append({k: round(v, 3) for k, v in spent.items() if v >= 0.001})
    # what the program dropped while the worker was dying: free the twins
    with s._lists_lock:
        dropped = [mapping.pop(h) for h in s._pending_free if h in mapping]
        gone = [mapping.pop(o) for o in s._pending_free_objects if o in mapping]
        s._pending_free, s._pending_free_objects, s._release = [], [], []
    if dropped or gone:
        s._call_raw("HEARTBEAT", {"free": dropped, "free_objects": gone})
        out.append(Entry("free", dropped, nbytes=32 * len(dropped)))
        out.append(Entry("free_objects", gone, nbytes=32 * len(gone)))
    return mapping, out
