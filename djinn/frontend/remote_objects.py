"""Objects a model call left on the appliance (a KV cache), as the client holds them."""

from __future__ import annotations

import weakref
from typing import Any

from djinn.errors import UnsupportedOp


class RemoteObject:
    """An object that lives in a session on the appliance (a KV cache...)."""

    __slots__ = ("__weakref__", "_finalizer", "bound", "cls", "oid", "seq_length", "session")

    def __init__(self, session: Any, oid: str, cls: str) -> None:
        self.session, self.oid, self.cls = session, oid, cls
        self.seq_length: int | None = None  # a KV cache's, as the last call left it
        # the program's own cache object bound to it (a weak reference; Note [a cache the
        # program made] in local_caches.py)
        self.bound: Any = None
        self._finalizer = weakref.finalize(self, session._free_object_later, oid)

    def get_seq_length(self, layer_idx: int = 0) -> int:
        """A KV cache's length, as the last model call that grew it said (Note [cache
        lengths] in appliance/model_handlers.py): no request is made."""
        if self.seq_length is None or layer_idx != 0:
            return self.__getattr__("get_seq_length")
        return self.seq_length

    def rebind(self, oid: str) -> None:
        """Refer to ``oid``, this object's twin rebuilt after its worker was lost
        (Note [lineage journal] in djinn/runtime/lineage.py)."""
        self._finalizer.detach()
        self.oid = oid
        self._finalizer = weakref.finalize(self, self.session._free_object_later, oid)

    def __repr__(self) -> str:
        return f"RemoteObject({self.cls.rsplit('.', 1)[-1]}, id={self.oid[:8]}…)"

    def __deepcopy__(self, memo: dict) -> Any:
        # copy.deepcopy found the session's connection inside and raised an untyped
        # "cannot pickle 'mmap.mmap' object" (a review: transformers' recipe for reusing
        # a prompt's cache copies it)
        kind = self.cls.rsplit(".", 1)[-1]
        raise UnsupportedOp(
            f"a {kind} kept on the appliance cannot be copied (copy.deepcopy, pickle): it "
            "lives in the session there and has no value here. To reuse a prompt's cache "
            "for several continuations, run the prompt again for each one"
        )

    def __reduce_ex__(self, protocol: Any) -> Any:
        return self.__deepcopy__({})

    def __getattr__(self, name: str) -> Any:
        # only for names it lacks (its slots are found first): a decode loop asking a
        # kept cache for ``get_seq_length()`` met "'RemoteObject' object has no attribute"
        if name.startswith("__"):
            raise AttributeError(name)  # the protocols copy and pickle probe for
        kind = self.cls.rsplit(".", 1)[-1]
        raise AttributeError(
            f"{kind}.{name}: this {kind} stays on the appliance (a RemoteObject) and runs "
            "no method here; pass it back to the model (past_key_values=...) while that "
            "runs on the model path (called in training mode, it has left it: Note [a "
            "registered model trains]), or keep "
            "what you need of it yourself (the length of a KV cache is the number of "
            "tokens the model has been given)"
        )
