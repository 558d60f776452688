"""The model path on the client: register a module once, then call it by fingerprint.

``model.eval().to("remote_accelerator:0")`` on a transformers model registers it: the
fingerprint (class, config, weights) is offered to the appliance, which either already
holds the model (another session or client uploaded it: nothing is sent) or asks for the
weights, uploaded once through the data plane. The local copy's parameters then move to
the meta device (no client memory), and the module's class is swapped for a subclass
whose ``__call__`` and allowlisted methods (``generate``) run on the appliance.

Calls send the fingerprint, the inputs (handles for values already remote) and the
semantic hints of ``djinn.analyze``. Results come back as skeletons: the same structure,
tensors as LazyTensors bound to handles, other objects (a ``DynamicCache``) as
``RemoteObject``s that can be passed back, so a KV cache never crosses the wire.
"""

from __future__ import annotations

import copy
import importlib
import itertools
import json
import logging
import sys
import threading
import time
import warnings
import weakref
from typing import Any

import torch

from djinn.errors import InvalidArgument, UnsupportedOp
from djinn.protocol.fingerprint import same_bytes_key
from djinn.protocol.tensors import to_wire
from djinn.protocol.values import NOT_A_CONSTANT, encode
from djinn.runtime.remote import RemoteTensor

from . import (
    call_settings,
    generate_args,
    local_caches,
    model_changes,
    model_leaves,
    model_twin,
    no_autograd,
    registered_weights,
    seeded,
    ties,
)
from .device import DEVICE_TYPE
from .remote_objects import RemoteObject

log = logging.getLogger("djinn.frontend.model")
UPLOAD_CHUNK = 256 << 20  # bytes per put while uploading weights (progress granularity)
PROGRESS_MIN = 256 << 20  # show upload progress for models at least this big
_local = threading.local()


def wants_model_path(module: torch.nn.Module) -> bool:
    """Inference-mode transformers models take the model path; everything else (training,
    plain nn.Modules, a model with hooks, which the appliance would not run) keeps the
    graph path."""
    if module.training or getattr(module, "_djinn", None) is not None:
        return False
    if model_changes.hooked(module):
        return False
    config = getattr(module, "config", None)
    if not hasattr(config, "to_dict") or not any(
        c.__name__ == "PreTrainedModel" and c.__module__.startswith("transformers.")
        for c in type(module).__mro__
    ):
        return False
    if _partly_moved(module):  # its move already goes the graph path (decided below)
        return False
    differs = model_twin.difference(module)  # Note [the model the appliance builds]
    if differs is not None:
        warnings.warn(
            f"djinn: {type(module).__name__} takes the graph path, not the model path, "
            "which builds a model from its class, config and weights: "
            f"{differs} (Note [the model the appliance builds])",
            RuntimeWarning,
            stacklevel=ties._callers_level(),
        )
        return False
    return True


def _partly_moved(module: torch.nn.Module) -> bool:
    """Whether a tensor of ``module`` is on the remote device already: its move converts
    the rest one by one, and a model with remote tensors cannot be registered."""
    tensors = itertools.chain(module.parameters(), module.buffers())
    return any(t.device.type == DEVICE_TYPE for t in tensors)


def _state(module: torch.nn.Module, dtype: torch.dtype | None = None) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, as ``module.to(dtype=dtype)`` would leave them."""
    state = dict(module.named_parameters(remove_duplicate=False))
    state.update(module.named_buffers(remove_duplicate=False))
    if dtype is not None:  # Module.to casts floating and complex tensors only
        state = {
            k: v.to(dtype) if v.is_floating_point() or v.is_complex() else v
            for k, v in state.items()
        }
    return {k: v.detach() for k, v in state.items()}


def _class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def fingerprint(module: torch.nn.Module, state: dict[str, torch.Tensor] | None = None) -> str:
    """Architecture (class + config) and every weight byte: identical models share it
    (the appliance recomputes it from what it receives before caching anything)."""
    from djinn.protocol.fingerprint import model_fingerprint

    return model_fingerprint(
        _class_path(type(module)), _config_json(module), (state or _state(module)).items()
    )


def _config_json(module: torch.nn.Module) -> str:
    # json, not orjson: configs have int keys (id2label) and the odd non-JSON value
    return json.dumps(model_twin.config_dict(module), sort_keys=True, default=str)


def _upload(session: Any, state: dict[str, torch.Tensor]) -> dict[str, str]:
    """Put every tensor (bulk through the arena), with a progress line for big models.
    Tied weights (one tensor under two names) travel once; both names get its handle."""
    unique: dict[tuple, str] = {}
    aliases: dict[str, str] = {}
    for name, t in state.items():
        first = unique.setdefault(same_bytes_key(t), name)
        if first != name:
            aliases[name] = first
    state = {n: t for n, t in state.items() if n not in aliases}
    total = sum(t.numel() * t.element_size() for t in state.values())
    show = total >= PROGRESS_MIN and sys.stderr.isatty()
    handles: dict[str, str] = {}
    batch: list[tuple[str, torch.Tensor]] = []
    done, started = 0, time.perf_counter()

    def flush() -> None:
        nonlocal done
        remotes = session.put_many([t for _, t in batch])
        for (name, t), r in zip(batch, remotes, strict=True):
            r._finalizer.detach()  # the appliance hands these to the model
            handles[name] = r.handle
            done += t.numel() * t.element_size()
        batch.clear()
        if show:
            rate = done / max(time.perf_counter() - started, 1e-9) / 1e6
            print(
                f"\rdjinn: uploading weights {done >> 20}/{total >> 20} MiB ({rate:.0f} MB/s)",
                end="",
                file=sys.stderr,
                flush=True,
            )

    pending = 0
    for name, t in state.items():
        batch.append((name, t))
        pending += t.numel() * t.element_size()
        if pending >= UPLOAD_CHUNK:
            flush()
            pending = 0
    if batch:
        flush()
    if show:
        print(file=sys.stderr)
    for name, first in aliases.items():
        handles[name] = handles[first]
    return handles


def register(
    module: torch.nn.Module, session: Any, dtype: torch.dtype | None = None
) -> dict[str, Any]:
    """Offer ``module`` (cast to ``dtype``) to the appliance by fingerprint; upload the
    weights only if asked."""
    state = _state(module, dtype)
    fp = fingerprint(module, state)
    body = {
        "fingerprint": fp,
        "class": _class_path(type(module)),
        "config_json": _config_json(module),
        "name": type(module).__name__,
    }
    reply = session.register_model(body)
    uploaded = False
    if not reply["cached"]:
        # the appliance takes the uploaded handles over (or drops them if it refuses)
        handles = _upload(session, state)
        reply = session.register_model({**body, "state": handles})
        uploaded = True
    log.info(
        "registered %s (%s): %s",
        body["name"],
        fp[:12],
        "uploaded" if uploaded else "already on the appliance",
    )
    return {"fingerprint": fp, "uploaded": uploaded, **reply}


class _RemoteBinding:
    def __init__(self, fingerprint: str, session: Any, device: torch.device, info: dict):
        self.fingerprint = fingerprint
        self.session = session
        self.device = device
        self.info = info
        self.modules: tuple = ()  # Note [a registered model changed]
        self.dtypes: dict[str, torch.dtype] = {}
        self.weights: tuple = ()  # taken at the first call
        self.buffers: tuple | None = None  # taken at the first call
        self.attributes: tuple | None = None  # each submodule's plain settings
        self.plain_keys: dict[int, tuple[str, ...]] | None = None  # their names, by module
        self.seen: list = []  # _glance's answer when nothing had changed
        self.lock = threading.Lock()  # the local module's check and analysis (call)
        self.told_no_grad = False  # Note [no autograd on the model path]
        self.told_weights = False  # Note [weights of a registered model]
        self.owned = False  # its meta weights given their class (RemoteModelMixin._own)
        self.config: dict[str, Any] | None = None  # as registered
        self.settings: dict[str, Any] = {}  # its config's CALL_SETTINGS, as registered

    def __deepcopy__(self, memo: dict) -> _RemoteBinding:
        """A deep copy of a registered model is another local handle on the same
        registered model (its weights are the appliance's, one copy for all): the same
        fingerprint and session, and the copy's own modules and parameters recorded at its
        first call, as a weightless model's are (Note [a registered model changed]). A
        session holds no mmap a copy could take (it raised "cannot pickle 'mmap.mmap'")."""
        twin = _RemoteBinding(self.fingerprint, self.session, self.device, dict(self.info))
        twin.dtypes = dict(self.dtypes)
        twin.config = copy.deepcopy(self.config, memo)
        twin.settings = dict(self.settings)
        return twin


class RemoteModelMixin(registered_weights.WeightsOwner):
    """Mixed into a registered module's class: calls run on the appliance (and its meta
    weights are the program's to use: Note [weights of a registered model])."""

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if getattr(_local, "tracing", False):  # djinn.analyze tracing on meta: stay local
            return super().__call__(*args, **kwargs)
        return call(self, "forward", args, kwargs)

    def generate(self, *args: Any, **kwargs: Any) -> Any:
        """``generate()`` on the appliance; a ``generation_config=`` and a ``streamer`` are
        taken here (Note [generation objects])."""
        streamer = generate_args.take_streamer(self, kwargs)
        out = call(self, "generate", args, kwargs)
        if streamer is not None:
            generate_args.stream(self, streamer, args, kwargs, out)
        return out

    @property
    def device(self) -> torch.device:
        """The remote device, where its calls run: its local parameters are meta tensors,
        and transformers' ``model.device`` (the first parameter's) said ``meta``, so the
        usual ``inputs.to(model.device)`` sent meta tensors (a review). While the call's
        own analysis runs the local module on meta, meta."""
        if getattr(_local, "tracing", False):
            return torch.device("meta")
        return self._djinn.device

    def to(self, *args: Any, **kwargs: Any) -> Any:
        device, dtype, _, _ = torch._C._nn._parse_to(*args, **kwargs)
        tensors = itertools.chain(self.parameters(), self.buffers())  # what Module.to casts
        floats = {t.dtype for t in tensors if t.is_floating_point() or t.is_complex()}
        if (device is None or model_leaves.on_appliance(device)) and (
            dtype is None or {dtype} >= floats
        ):
            return self  # where and what it is already: stays on the model path
        return super().to(*args, **kwargs)  # through _apply, below

    def cuda(self, device: Any = None) -> Any:
        return self if model_leaves.on_appliance(torch.device("cuda")) else super().cuda(device)

    def _apply(self, fn: Any, recurse: bool = True) -> Any:
        """A move back (``.cpu()``), a cast (``.half()``) or any conversion of the weights
        needs them here: taken off the model path first (Note [a registered model
        trains]), then converted as any remote module's are."""
        if model_leaves.converts_nothing(
            self, fn
        ):  # .float() of a float32 model, .cuda() under djinn run
            return self
        _leave(self)
        return self._apply(fn, recurse)  # the plain class's, now

    def load_state_dict(self, state_dict: Any, strict: bool = True, assign: bool = False) -> Any:
        """Loading weights into a registered model (a checkpoint resumed by ``Trainer``,
        fine-tuned weights) wrote into meta tensors, a no-op, and the next call was refused
        (a review): it takes its weights into the session first, then loads (Note [a
        registered model trains])."""
        _leave(self)
        return self.load_state_dict(state_dict, strict=strict, assign=assign)

    def share_memory(self) -> Any:
        return self  # its tensors are on the appliance: a no-op, as for CUDA tensors


def _leave(
    module: torch.nn.Module, binding: _RemoteBinding | None = None, given: dict | None = None
) -> None:
    """Off the model path, with the registered weights copied into the session (Note [a
    registered model trains]). Once: a thread that waited on the lock while another took
    the model off finds it off (a review: an untyped AttributeError)."""
    binding = binding or module.__dict__.get("_djinn")
    if binding is None:
        return
    # after a use of its weights under way on another thread (registered_weights.lock_of),
    # so that a write it made is kept
    with registered_weights.lock_of(module), binding.lock, registered_weights.meta_answers():
        if module.__dict__.get("_djinn") is not binding:
            return
        with torch.inference_mode(False):  # the weights outlive the program's mode
            model_leaves.take_weights(module, binding, _decode, given)
        module.__class__ = registered_weights.plain_class(type(module))
        del module.__dict__["_djinn"]


def _leave_for_use(module: torch.nn.Module, given: dict[str, torch.Tensor]) -> None:
    """Off the model path for a use of a weight (Note [weights of a registered model]),
    saying so once; ``given``: the session's copies of weights the use wrote."""
    binding = module.__dict__.get("_djinn")
    if binding is not None:
        registered_weights.say_taken(module, binding)
        _leave(module, binding, given)


registered_weights.connect(
    _leave_for_use, lambda m, names: model_leaves.weights_of(m._djinn, names, _decode)
)


_classes: dict[type, type] = {}


def _remote_class(cls: type) -> type:
    remote = _classes.get(cls)
    if remote is None:
        remote = _classes[cls] = type(
            cls.__name__,
            (RemoteModelMixin, cls),
            {"__module__": cls.__module__, "__qualname__": cls.__qualname__},
        )
    return remote


def adopt(module: torch.nn.Module, device: torch.device, dtype: torch.dtype | None) -> None:
    """Register ``module`` and make its calls run on the appliance (Note [module to] in
    factories.py: its tensors are being moved to ``meta`` by the ``Module.to`` under way)."""
    from .session import default_session

    session = default_session()
    info = register(module, session, dtype)
    binding = _RemoteBinding(info["fingerprint"], session, device, info)
    binding.dtypes = model_changes.dtypes_of(module, dtype)  # Note [a registered model changed]
    binding.config = copy.deepcopy(model_changes.config_snapshot(module))
    binding.settings = model_changes.call_settings(module)
    module._djinn = binding
    module.__class__ = _remote_class(type(module))
    binding.modules = model_changes.registered_modules(module)
    binding.attributes = model_changes.attributes_of(module)
    binding.plain_keys = model_changes.plain_keys(module)


# -- calls --------------------------------------------------------------------------------
def _encode(x: Any, inline: list[torch.Tensor], name: str = "it") -> Any:
    from .lazy import LazyTensor

    def leaf(v: Any) -> Any:
        if isinstance(v, LazyTensor):
            return {"$h": _handle_of(v).handle}
        if isinstance(v, torch.Tensor):
            if v.device.type != "cpu":
                raise UnsupportedOp(f"cannot send a {v.device} tensor to the appliance")
            inline.append(v.detach())
            return {"$t": len(inline) - 1, "desc": to_wire(v.detach())[0]}
        if isinstance(v, RemoteObject):
            return {"$o": v.oid}
        bound = local_caches.remote_of(v)  # Note [a cache the program made]
        if bound is not None:
            return {"$o": bound.oid}
        if isinstance(v, RemoteTensor):
            return {"$h": v.handle}
        return NOT_A_CONSTANT

    try:
        return encode(x, leaf, tuples=True)
    except UnsupportedOp as exc:
        raise InvalidArgument(f"cannot pass {name} to a remote model: {exc.message}") from None


def _handle_of(x: Any) -> RemoteTensor:
    """A LazyTensor's value on the appliance: run whatever is pending first (program
    order: a pending in-place op on it must happen before the model reads it)."""
    from . import trace
    from .lazy import ref_for_node

    tr = trace.current()
    ref_for_node(x, tr)
    trace.flush(tr)
    ref = x._ref
    if not isinstance(ref, RemoteTensor):
        raise InvalidArgument("tensor has no value on the appliance")
    return ref


def _decode(x: Any, session: Any) -> Any:
    from .lazy import LazyTensor
    from .meta import TensorSpec

    if isinstance(x, list):
        return [_decode(v, session) for v in x]
    if not isinstance(x, dict):
        return x
    if "$h" in x:
        remote = RemoteTensor(session, x["$h"], x)
        return LazyTensor(
            TensorSpec(remote.dtype, tuple(remote.shape), remote.strides, 0, None), remote
        )
    if "$o" in x:
        # One RemoteObject per remote id: a cache updated in place comes back with the
        # same id, and an older wrapper's finalizer must not free it under the newer one.
        with session.objects_lock:
            known = session.__dict__.setdefault("_remote_objects", weakref.WeakValueDictionary())
            obj = known.get(x["$o"])
            if obj is None:
                obj = known[x["$o"]] = RemoteObject(session, x["$o"], x.get("class", "object"))
        return obj
    if "$tuple" in x:
        return tuple(_decode(v, session) for v in x["$tuple"])
    if "$mo" in x:
        cls = _model_output_class(x["$mo"])
        return cls(**{k: _decode(v, session) for k, v in x["fields"].items()})
    return {k: _decode(v, session) for k, v in x.items()}


def _model_output_class(path: str) -> type:
    if not isinstance(path, str) or not path.startswith("transformers."):
        raise InvalidArgument(f"unexpected output class {path!r}")
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


def _hints(module: torch.nn.Module, args: tuple, kwargs: dict) -> dict[str, Any] | None:
    from djinn.semantics.analyze import analyze

    # the analysis runs the local module on meta tensors, and a forward may write its
    # config (BertForSequenceClassification sets ``problem_type`` at its first call with
    # labels), or a module its settings and buffers (a dynamic RoPE's cached length and
    # inv_freq): put back as they were, or the next call would find the model changed
    config = getattr(module, "config", None)
    saved = dict(vars(config)) if config is not None else None
    settings = [(m, model_changes.plain_settings(m), dict(m._buffers)) for m in module.modules()]
    _local.tracing = True
    try:
        return analyze(module, *args, **kwargs).hints()
    except Exception as exc:  # hints help placement; a call never fails for want of them
        log.debug("no semantic hints for %s: %s", type(module).__name__, exc)
        return None
    finally:
        _local.tracing = False
        if saved is not None:  # put back whole: a value's == may be elementwise (numpy)
            vars(config).clear()
            vars(config).update(saved)
        for m, plain, buffers in settings:
            m.__dict__.update(plain)
            if m._buffers.keys() != buffers.keys() or any(
                m._buffers[k] is not b for k, b in buffers.items()
            ):
                m._buffers.clear()
                m._buffers.update(buffers)


def _checked(
    module: torch.nn.Module, binding: Any, method: str, args: tuple, kwargs: dict
) -> tuple[str | None, dict[str, Any] | None]:
    """What changed in ``module`` (Note [a registered model changed]), and a forward's
    semantic hints when nothing did."""
    what = model_changes.changed(module, binding)
    if what is not None or method != "forward":
        return what, None
    return None, _hints(module, args, kwargs)


def call(module: torch.nn.Module, method: str, args: tuple, kwargs: dict) -> Any:
    binding: _RemoteBinding = module._djinn
    module._own()
    if method == "forward" and torch.is_grad_enabled() and no_autograd.wants_grad(args, kwargs):
        no_autograd.say_leaving(module)  # Note [no autograd on the model path]
        _leave(module, binding)
        return module(*args, **kwargs)
    # the analysis below runs the local module on meta values and would fill the
    # program's empty cache with them: it sees the call as sent. A call that leaves the
    # model path runs with the program's own arguments (a review: its cache stayed
    # empty, and the next step ran without the prompt)
    sent, made = local_caches.stand_in(module, method, kwargs)
    # one thread at a time looks at the local module: the call's analysis swaps its
    # parameters for meta twins while it runs, and another thread's check (or analysis)
    # took those for the program's change, and later calls were refused for good (a
    # review: three threads calling one model)
    with binding.lock, registered_weights.meta_answers():
        gone = module.__dict__.get("_djinn") is not binding  # another thread took it off
        if not gone:
            what, hints = _checked(module, binding, method, args, sent)
            gone = what is not None and model_leaves.put_in_training(module, binding)
    if gone:  # Note [a registered model trains]: the graph path from now on
        _leave(module, binding)
        return getattr(module, "__call__" if method == "forward" else method)(*args, **kwargs)
    if what is not None:
        raise UnsupportedOp(
            f"{type(module).__name__} runs on the appliance as it was registered when it "
            f"moved (the model path); since then, {what}. Make such changes before the "
            "move, or move it in training mode (model.train().to(...)) to run it op by op "
            "on the graph path, which follows them (Note [a registered model changed])"
        )
    kwargs = sent
    if method == "forward":
        kwargs = call_settings.with_call_settings(module, binding.settings, kwargs)
    if method == "generate":
        kwargs = generate_args.generate_kwargs(module, binding.settings, kwargs)
    inline: list[torch.Tensor] = []
    body = {
        "fingerprint": binding.fingerprint,
        "method": method,
        "args": [_encode(a, inline, f"argument {i}") for i, a in enumerate(args)],
        "kwargs": {k: _encode(v, inline, k) for k, v in kwargs.items()},
    }
    if hints:
        body["hints"] = hints
    autocast = call_settings.autocast_dtype()  # Note [a model call under autocast]
    if autocast is not None:
        body["autocast"] = autocast
    from djinn.protocol.tensors import to_wire

    segments = [memoryview(to_wire(t)[1].numpy()) for t in inline]
    if method == "generate":  # it may sample: Note [a sampled model call]
        body["generator"] = len(segments)
        segments.append(seeded.call_generator(binding.session))
    reply = binding.session.call_model(body, segments)
    if "generator" in reply:
        seeded.after_call(reply["generator"])
    out = _decode(reply["out"], binding.session)
    _note_lengths(binding.session, reply.get("lengths"))
    # Note [a cache the program made]
    out = local_caches.bind(made, out) if made is not None else local_caches.rebound(out)
    if method == "forward" and torch.is_grad_enabled() and not binding.told_no_grad:
        no_autograd.say_no_grad(module, binding)
    return out


def _note_lengths(session: Any, lengths: Any) -> None:
    """The cache lengths a call reported (Note [cache lengths]), on their RemoteObjects."""
    if not isinstance(lengths, dict) or not lengths:
        return
    with session.objects_lock:
        known = session.__dict__.get("_remote_objects") or {}
        for oid, n in lengths.items():
            obj = known.get(oid)
            if obj is not None and type(n) is int:
                obj.seq_length = n
