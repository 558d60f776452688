"""Making a warm standby (Note [warm standby] in lineage.py): a session of its own on
another worker of the appliance, holding the recovering session's registered models, so
that a recovery finds them cached there."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

import torch

from djinn.errors import DjinnError

from .journal import Entry, remap, strings_in

if TYPE_CHECKING:
    from .session import Session

log = logging.getLogger("djinn.runtime.lineage")

STANDBY_TRIES = 240  # 0.5 s apart: how long a standby waits for another worker


def make_standby(owner: Session, entries: list[Entry]) -> Session | None:
    """A session on a worker other than ``owner``'s with the models that ``entries`` (its
    journal) registered, uploaded again from the journal's puts where the other worker
    does not hold them; None when there is no other worker within the tries, when the
    owner closed meanwhile, or when a registration failed."""
    from .session import Session

    standby = None
    for _ in range(STANDBY_TRIES):  # a replacement may take a while to be ready
        if owner._closed.is_set():
            return None
        try:
            standby = Session(owner.client, avoid=owner.worker)
        except DjinnError:
            standby = None
        if standby is not None and standby.worker != owner.worker:
            break
        if standby is not None:
            standby.close()
            standby = None
        time.sleep(0.5)
    if standby is None:
        return None
    try:
        puts: dict[str, torch.Tensor] = {}
        cached: dict[str, bool] = {}
        for e in entries:
            if e.kind == "put":
                puts.update((h, t) for h, (t, _) in zip(e.out, e.data, strict=True))
            elif e.kind == "register":
                fp = e.body.get("fingerprint")
                if "state" not in e.body and "path" not in e.body:
                    cached[fp] = bool(standby.register_model(e.body).get("cached"))
                    continue
                if cached.get(fp):
                    continue
                names = [h for h in strings_in(e.body, set()) if h in puts]
                remotes = standby._put_many([puts[h] for h in names])
                for r in remotes:
                    r._finalizer.detach()  # the appliance takes them over
                mapping = {h: r.handle for h, r in zip(names, remotes, strict=True)}
                standby.register_model(remap(e.body, mapping))
    except DjinnError as exc:
        log.info("no warm standby: %s", exc)
        standby.close()
        return None
    return standby
