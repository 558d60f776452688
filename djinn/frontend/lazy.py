"""LazyTensor: a tensor on ``remote_accelerator`` whose value is computed on the appliance.

One type, two states: a LazyTensor refers either to a *pending* output of a captured op
(``trace.Pending``) or to a value held on the appliance (``RemoteTensor``); a third,
transient state (``Uninit``) is an allocation nobody has written yet, so that ``empty`` +
``copy_`` (how ``.to()`` moves data) uploads the bytes once and allocates nothing else
remotely. Shapes, dtypes and strides come from ``meta`` inference; the client never
holds a tensor's data."""

from __future__ import annotations

from typing import Any

import torch

from djinn.errors import UnsupportedOp
from djinn.protocol import norm_stats
from djinn.runtime.remote import RemoteTensor

from . import (
    backward_errors,
    custom_ops,
    engine_started,
    failures,
    hook_errors,
    hooks,
    immediate,
    inference_views,
    local_targets,
    own_generators,
    seeded,
    serialization,
    shared_copies,
    tensor_copy,
    tensor_text,
    ties,
    uncaptured,
    writes,
)
from . import meta as meta_mod
from . import trace as trace_mod
from .device import DEVICE_TYPE
from .failures import written_args
from .immediate import _run_now, fetch, run_locally
from .meta import META, TensorSpec, spec_of
from .nodes import Uninit
from .trace import Node, Pending, bind, current, flush

_REMOTE: list[torch.device] = []  # torch.device(DEVICE_TYPE, 0), once the backend has a name


def _remote() -> torch.device:
    if not _REMOTE:
        _REMOTE.append(torch.device(DEVICE_TYPE, 0))
    return _REMOTE[0]


SMALL_UPLOAD = 64 << 10  # CPU tensors up to this size are copied into the trace inline
SMALL_KEY = 64  # CPU tensors up to this many elements key the meta cache by value
_TENSOR_DATA = torch._C.TensorBase.__dict__["data"]  # the C++ getter and setter of .data


class LazyTensor(torch.Tensor):
    @staticmethod
    def __new__(
        cls, spec: TensorSpec, ref: Any, requires_grad: bool = False, dynamic: bool = False
    ) -> LazyTensor:
        # Note [resizable outputs]: factories such as arange and eye allocate empty(0) and
        # let an out= kernel resize it. A wrapper's sizes are fixed at creation, so those
        # empties are made with sizes answered from Python (`_dyn`), which a resize updates.
        t = torch.Tensor._make_wrapper_subclass(
            cls,
            spec.shape,
            strides=spec.stride,
            storage_offset=spec.offset,
            dtype=spec.dtype,
            device=_remote(),
            requires_grad=requires_grad,
            dispatch_sizes_strides_policy="sizes" if dynamic else None,
        )
        t._dyn = spec if dynamic else None
        if spec.bits:  # Note [conjugate and negative views] (meta.py)
            meta_mod.set_bits(t, spec.bits)
        bind(t, ref)
        return t

    __torch_function__ = torch._C._disabled_torch_function_impl

    # what the tensor stands for: a Pending output, a RemoteTensor, an Uninit allocation or
    # a Failed value, held in a cell of its own (Note [bindings], nodes.py)
    @property
    def _ref(self) -> Any:
        return self.__dict__["_b"].ref

    @_ref.setter
    def _ref(self, ref: Any) -> None:
        bind(self, ref)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        try:
            return dispatch(func, args, kwargs or {})
        except Exception as exc:
            if torch._C._current_graph_task_id() == -1:
                raise
            # Note [errors in backward] (backward_errors.py)
            return backward_errors.failed_outputs(func, args, kwargs or {}, exc, LazyTensor)

    # Note [set data]: ``t.data = other`` (and ``Module._apply``: ``model.half()`` after a
    # move sets each parameter's ``.data``) copies the C++ tensor's metadata over (dtype,
    # sizes, strides) but knows nothing of the Python reference to the value, so ``t``
    # claimed the new dtype and shape and computed with the old value. The reference
    # follows the metadata here.
    @property
    def data(self) -> torch.Tensor:
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, new: torch.Tensor) -> None:
        if isinstance(new, LazyTensor) and new._dyn is not None:
            new = new.detach()  # sizes held in C++, where the copy takes them from
        _TENSOR_DATA.__set__(self, new)
        if isinstance(new, LazyTensor):
            if isinstance(new._ref, Uninit):  # one allocation for both, as _detach does
                ref_for_node(new, current())
            if self._dyn is not None:  # its sizes are still answered from Python
                self._dyn = spec_of(new)
            bind(self, new._ref, writes.shared_storage(new))

    __tensor_flatten__ = ties.SeenByApply("__tensor_flatten__")
    __tensor_unflatten__ = ties.SeenByApply("__tensor_unflatten__")

    # -- reading values: these materialise -------------------------------------------------
    def __repr__(self, *, tensor_contents: Any = None) -> str:
        return tensor_text.remote_repr(self, fetch(self))

    def tolist(self) -> Any:
        return fetch(self).tolist()

    def numpy(self, *, force: bool = False) -> Any:
        return fetch(self).numpy(force=force)

    def __array__(self, dtype: Any = None) -> Any:
        arr = fetch(self).numpy()
        return arr if dtype is None else arr.astype(dtype)

    def __format__(self, spec: str) -> str:
        if self.dim() == 0:
            return format(self.item(), spec)
        return object.__format__(self, spec)  # eager's: str(self), or a TypeError for a spec

    # Indexing with Python lists makes PyTorch build an index tensor on *this* tensor's
    # device through a path that asserts for Python backends: build it on the CPU instead
    # (it is then uploaded like any local tensor mixed into remote code).
    def __getitem__(self, index: Any) -> Any:
        return super().__getitem__(_local_index(index))

    def __setitem__(self, index: Any, value: Any) -> None:
        super().__setitem__(_local_index(index), value)

    # Note [remote storages] (shared_copies.py): what libraries that tell shared memory
    # apart ask (safetensors, save_pretrained); storage() keeps PyTorch's own
    def untyped_storage(self) -> Any:
        return shared_copies.RemoteStorage(self)

    def _typed_storage(self) -> Any:
        untyped = torch._C.TensorBase.untyped_storage(self)
        return torch.TypedStorage(wrap_storage=untyped, dtype=self.dtype, _internal=True)

    def data_ptr(self) -> int:
        return shared_copies.data_ptr(self)

    def __deepcopy__(self, memo: dict) -> LazyTensor:
        return tensor_copy.deep_copy(self, memo)

    def __copy__(self) -> LazyTensor:
        return tensor_copy.shallow_copy(self)

    # Note [errors in hooks during backward] (hook_errors.py): Python autograd calls on
    # its device thread must not raise there, and ``backward()`` raises what it did
    def register_hook(self, hook: Any) -> Any:
        return super().register_hook(hook_errors.tensor_hook(hook))

    def register_post_accumulate_grad_hook(self, hook: Any) -> Any:
        return super().register_post_accumulate_grad_hook(hook_errors.accumulated_hook(hook))

    def backward(self, *args: Any, **kwargs: Any) -> None:
        # Note [an engine started before Djinn] (engine_started.py)
        hook_errors.backward_raising(
            lambda: engine_started.backward(lambda: torch.Tensor.backward(self, *args, **kwargs))
        )

    def __reduce_ex__(self, proto: Any) -> Any:
        # as a CUDA tensor pickles: its bytes, fetched, with its device recorded
        # (serialization.py says how torch.load brings it back)
        if getattr(self, "_is_param", False):  # a Parameter stays one
            data = LazyTensor(spec_of(self), self._ref)
            return torch._utils._rebuild_parameter, (data, self.requires_grad, {})
        # Note [copies keep shared storage]: a view of its storage's bytes, fetched once
        data = shared_copies.saved_bytes(self, fetch)
        data = fetch(self).detach() if data is None else data
        rebuild = torch._utils._rebuild_device_tensor_from_cpu_tensor
        return rebuild, (data, self.dtype, serialization.saved_device(self), self.requires_grad)


local_targets.REMOTE_CLASSES = (LazyTensor,)


def _local_index(index: Any) -> Any:
    if isinstance(index, list):
        return torch.tensor(index, device="cpu")
    if isinstance(index, tuple):
        return tuple(torch.tensor(i, device="cpu") if isinstance(i, list) else i for i in index)
    return index


# -- capture -------------------------------------------------------------------------------
class _Args:
    """One pass over an op's arguments: refs for the node, a cache key, meta inputs."""

    __slots__ = ("by_value", "flat", "key", "trace")

    def __init__(self, trace: trace_mod.Trace, by_value: bool = True) -> None:
        self.trace = trace
        self.by_value = by_value  # Note [pointwise keys]
        self.flat: list[Any] = []  # tensor inputs in traversal order (original objects)
        self.key: list[Any] | None = []

    def ref(self, x: Any) -> Any:
        kind = type(x)
        if kind is list and x and type(x[0]) is LazyTensor:
            return self._lazy_list(x)
        if isinstance(x, LazyTensor):
            self.flat.append(x)
            if self.key is not None:
                self.key.append(
                    ("L", x.dtype, x.shape, x.stride(), x.storage_offset(), x.is_conj(), x.is_neg())
                )
            trace = self.trace
            ref = ref_for_node(x, trace)
            if trace.reads is not None or trace.recorders:
                self._noted(x, ref)
            return ref
        if isinstance(x, torch.Tensor):
            if x.device.type == "meta":
                raise UnsupportedOp(
                    "cannot mix a meta tensor into remote computation: a model registered "
                    "on the appliance (the model path) keeps only meta tensors here, so its "
                    "parts (its encoder, its embeddings) cannot run on their own; call the "
                    "whole model, or move it in training mode (model.train().to(...), then "
                    ".eval()) to run its parts op by op on the graph path"
                )
            if x.device.type != "cpu":
                raise UnsupportedOp(f"cannot mix a {x.device} tensor into remote computation")
            if x.layout != torch.strided:
                raise UnsupportedOp(f"{x.layout} tensors cannot be sent to the appliance yet")
            self.flat.append(x)
            if self.trace.reads is not None:
                self.trace.read(("cpu", id(x)), x)
            if self.key is not None:
                # Small local tensors can steer output shapes (tensor_split indices): their
                # values are part of the signature. Large ones never do in practice.
                small = self.by_value and x.numel() <= SMALL_KEY
                values = tuple(x.reshape(-1).tolist()) if small else None
                meta = (x.dtype, tuple(x.shape), tuple(x.stride()), x.storage_offset())
                self.key.append(("C", meta, values))
            return snapshot(x)
        if isinstance(x, (list, tuple)):
            if self.key is not None:
                self.key.append(("(", len(x)))
            return [self.ref(v) for v in x]
        if self.key is not None:
            if not self.by_value and type(x) in meta_mod.SCALAR_KINDS:
                self.key.append((type(x),))
                return x
            try:
                hash(x)
                self.key.append((type(x), x))
            except TypeError:
                self.key = None
        return x

    def _lazy_list(self, xs: list[Any]) -> list[Any]:
        """``ref`` over a list of remote tensors (the ``_foreach_*`` ops' lists: an
        optimizer's step passes each of its parameters, gradients and states). One loop
        with what every element needs looked up once: capturing an ``Adam(foreach=True)``
        step cost 3-4x a bare wrapper's dispatch, most of it ``ref`` per element."""
        if any(type(x) is not LazyTensor for x in xs):
            if self.key is not None:
                self.key.append(("(", len(xs)))
            return [self.ref(x) for x in xs]
        flat, key, trace = self.flat, self.key, self.trace
        flat.extend(xs)
        if key is not None:
            # no conjugate or negative bits here (Note [conjugate and negative views]): a
            # list op's outputs never have them, and its meta inputs do (spec_tuple)
            key.append(("(", len(xs)))
            key.extend([("L", x.dtype, x.shape, x.stride(), x.storage_offset()) for x in xs])
        refs = [ref_for_node(x, trace) for x in xs]
        if trace.reads is not None or trace.recorders:
            for x, ref in zip(xs, refs, strict=True):
                self._noted(x, ref)
        return refs

    def _noted(self, x: LazyTensor, ref: Any) -> None:
        """What a recording (``djinn.replayable``) and a ``djinn.capture()`` block learn
        of a remote tensor an op reads."""
        if self.trace.reads is not None and isinstance(ref, RemoteTensor):
            self.trace.read(ref.handle, x)
        if self.trace.recorders and getattr(x, "_is_param", False):
            from djinn.graph.builder import WEIGHTS

            if isinstance(ref, RemoteTensor):
                WEIGHTS.add(ref)


def ref_for_node(x: LazyTensor, trace: trace_mod.Trace) -> Any:
    if trace.follower is not None:  # a value read (fetch, repr) while steps are followed
        trace.follower.abort("its steps read a value")  # Note [followed steps]
    cell = x.__dict__["_b"]
    storage = cell.storage  # a view, or viewed: a write into any of them counts
    if storage is not None:
        if storage.failed is not None:  # Note [a failed write's views] (failures.py)
            raise trace_mod.reported(storage.failed)
        writes.mark_read(storage, trace)  # Note [reads another thread captured]
        if storage.writer is not None:
            writes.writes_sent(storage, trace)
    ref = cell.ref
    kind = type(ref)
    # the common cases first, without the checks below (an optimizer step's lists make
    # them most of a capture): a live handle no other thread has a write into pending,
    # or an output of this trace's node not yet sent
    if kind is RemoteTensor:
        if ref.reader is not trace:
            writes.mark_read(ref, trace)
        writer = ref.writer
        if ref.failed is None and (writer is None or writer.trace is trace):
            return ref
    elif kind is Pending:
        node = ref.node
        if (
            node.trace is trace
            and not node.executed
            and node.failed is None
            and node.inflight is None
        ):
            return ref
    if isinstance(ref, failures.Failed):
        raise trace_mod.reported(ref.error)
    if isinstance(ref, Uninit):
        node = Node(
            torch.ops.aten.empty_strided.default,
            [list(ref.spec.shape), list(ref.spec.stride)],
            {"dtype": ref.spec.dtype, "device": _remote()},
            trace,
            1,
        )
        ref = Pending(node, 0)
        with trace.lock:  # Note [a node and its outputs] (trace.py)
            trace.add(node)
            bind(x, ref)
    elif isinstance(ref, Pending) and not ref.node.executed and ref.node.trace is not trace:
        if ref.node.inflight is None:  # captured by another thread: send it now, and go on
            flush(ref.node.trace, wait=False)  # Note [asynchronous flushes] (inflight.py)
        ref = x._ref
    elif isinstance(ref, RemoteTensor):
        writes.writes_sent(ref, trace)  # Note [writes another thread captured]
    out = trace_mod.resolved(ref)
    writes.mark_taken(x, out, trace)  # Note [reads another thread captured]
    return out


def snapshot(t: torch.Tensor) -> Any:
    """A CPU tensor used by remote code: copy it now (eager semantics: later changes to
    it must not leak into the captured op). Large ones are uploaded once."""
    t = t.detach()
    if t.numel() * t.element_size() <= SMALL_UPLOAD:
        return t.clone()
    return upload(t)


def upload(t: torch.Tensor) -> Any:
    """A CPU tensor moved to the appliance whole (``x.to(remote)``) while its thread
    captures nothing: put, and not waited for (Note [puts sent without waiting]). A
    small one is put too, rather than sent inside the next graph: a replay that takes it
    as an argument then needs no graph run before it, and waited for, to learn its
    handle. It is put as a private copy, which the journal may keep (Note [lineage
    journal]) whatever the program does to ``t``."""
    from .session import default_session

    t = t.detach()
    small = t.numel() * t.element_size() <= SMALL_UPLOAD
    with torch._C._DisableFuncTorch():  # Note [buffers under torch.func] (trace.py)
        return default_session().put(t.clone() if small else t, wait=False)


def dispatch(func: Any, args: tuple, kwargs: dict) -> Any:
    if ties.PENDING_HOOKS:
        ties.move_hooks()  # Note [hooks through a swap]
    # Note [a failed value overwritten] (failures.py); copy_ is a special op
    if func in failures.OVERWRITES and failures.failed_targets(args):
        return failures.healed(args, lambda: dispatch(func, args, kwargs))
    if func in uncaptured.SIZE_QUERIES:
        return uncaptured.size_query(func, args, kwargs)
    special = SPECIAL.get(func)
    if special is not None:
        if trace_mod.FOLLOWING:
            trace_mod.stop_following(f"its steps called {func}, which is not followed")
        return special(func, args, kwargs)
    if uncaptured.composite(func):
        return func.decompose(*args, **kwargs)
    kw_device = kwargs.get("device")
    if isinstance(kw_device, torch.device) and kw_device.type == "cpu":
        if trace_mod.FOLLOWING:
            trace_mod.stop_following(f"its steps called {func}, which is not followed")
        return SPECIAL_TO_CPU.get(func, run_locally)(func, args, kwargs)
    own_body = custom_ops.body(func)  # raises for an op the appliance cannot run
    if own_body is not None:  # Note [custom ops]
        return own_body(*args, **kwargs)
    if written_args(func) and (done := local_targets.run(func, args, kwargs)) is not None:
        return done
    return capture(func, args, kwargs)


def streamed(trace: trace_mod.Trace, func: Any = None, args: tuple = ()) -> trace_mod.Trace:
    """``trace``, its ops sent first if it holds a part's worth (Note [streamed graphs]);
    called before ``func`` is captured, when every earlier op's outputs are bound. Never
    between a linalg op and its check right after it: the check fails what it checks
    only while that is a node of its own graph (``failures.checked_nodes``); sent apart,
    a singular ``linalg.inv`` read nan after its error, where eager never made it."""
    full = trace.chunk_ops and len(trace.nodes) >= trace.chunk_ops
    if full and (func is not failures.CHECK or not _reads_last_node(trace, args)):
        trace_mod.stream(trace)
    return trace


def _reads_last_node(trace: trace_mod.Trace, args: tuple) -> bool:
    last = trace.nodes[-1]
    for x in args:
        ref = x._ref if type(x) is LazyTensor else None
        if isinstance(ref, Pending) and ref.node is last:
            return True
    return False


def capture(func: Any, args: tuple, kwargs: dict) -> Any:
    trace = streamed(current(), func, args)
    if trace.follower is not None:  # Note [followed steps]
        out = trace.follower.op(func, args, kwargs)
        if out is not trace_mod.MISSED:
            return out
    generator, args, kwargs = own_generators.taken(func, args, kwargs)
    a = _Args(trace, meta_mod.values_matter(func))
    ref_args = [a.ref(v) for v in args]
    ref_kwargs = {}
    for k, v in kwargs.items():
        if a.key is not None:
            a.key.append(k)  # keyword names are part of the signature
        ref_kwargs[k] = a.ref(v)
    host = meta_mod.host_args(func)
    if host:
        for i in host:
            if i < len(args) and _is_host_tensor(args[i]) and _is_host_tensor(ref_args[i]):
                ref_args[i] = trace_mod.HostTensor(ref_args[i])
    key = (func, tuple(a.key)) if a.key is not None else None
    flat = a.flat

    def build():
        metas = [
            t if host and _is_host_tensor(t) else meta_mod.meta_tensor(*meta_mod.spec_tuple(t))
            for t in flat
        ]
        it = iter(metas)

        def sub(x: Any) -> Any:
            if isinstance(x, torch.Tensor):
                return next(it)
            if isinstance(x, torch.device):
                return META
            if type(x) in (list, tuple):
                return type(x)(sub(v) for v in x)
            return x

        return [sub(v) for v in args], {k: sub(v) for k, v in kwargs.items()}, metas

    try:
        spec = meta_mod.infer(func, key, build)
    except meta_mod.DataDependent:
        rng = None
        if seeded.SEEDED in func.tags:  # Note [seeded ops]
            rng, _draw = own_generators.draw_for(func, args, kwargs, fetch, (), generator)
        return _run_now(func, trace, ref_args, ref_kwargs, rng, args, kwargs)
    # any other error (a shape mismatch...) propagates as the same RuntimeError eager raises
    if func in norm_stats.OPS:
        spec = meta_mod.cpu_statistics(func, spec, args, kwargs)
    specs = spec if isinstance(spec, (tuple, list)) else (spec,)
    tensor_pos = [i for i, s in enumerate(specs) if isinstance(s, TensorSpec)]
    if not tensor_pos:
        if not _mutates(func) and func._schema.returns:
            return spec  # a metadata-only answer (is_same_size, sizes...)
        # Note [effects without outputs]: `_foreach_add_(list, 1.0)` returns nothing and
        # mutates its inputs; `_linalg_check_errors(info)` returns nothing and raises if
        # `linalg.inv` met a singular matrix. Both are recorded like any op (program order
        # keeps every later read correct); dropping one is a silent wrong number.
        node = Node(func, ref_args, ref_kwargs, trace, 0)
        node.module = hooks.module_path()
        writes.record_writes(node, func, args, kwargs)
        trace.add(node)
        return spec
    for s in specs:  # refuse before recording: a refused op must leave nothing behind
        if isinstance(s, TensorSpec):
            _check_alias(s, flat, func)
    node = Node(func, ref_args, ref_kwargs, trace, len(specs), multi=specs is spec)
    node.specs = specs
    node.module = hooks.module_path()
    writes.record_writes(node, func, args, kwargs)
    if seeded.SEEDED in func.tags and func not in seeded.DRAWS_NOTHING:
        node.rng, node.draw = own_generators.draw_for(func, args, kwargs, fetch, specs, generator)
    outs: list[Any] = []
    with trace.lock:  # Note [a node and its outputs] (trace.py)
        trace.add(node)
        with inference_views.view_mode(func, args):
            for i, s in enumerate(specs):
                outs.append(_output(s, flat, node, i) if isinstance(s, TensorSpec) else s)
    if func.is_view and isinstance(args[0], LazyTensor):  # Note [writes another thread...]
        storage = writes.shared_storage(args[0])
        for out in outs:
            if isinstance(out, LazyTensor):
                out.__dict__["_b"].storage = storage
    if isinstance(spec, TensorSpec):
        return outs[0]
    return type(spec)(outs) if type(spec) in (tuple, list) else tuple(outs)


def _is_host_tensor(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and not isinstance(x, LazyTensor) and x.device.type == "cpu"


def _mutates(func: Any) -> bool:
    """Whether ``func`` writes to an argument (its schema marks it ``Tensor(a!)``)."""
    return bool(written_args(func))


def _check_alias(s: TensorSpec, flat: list[Any], func: Any) -> None:
    """An in-place op that would change a remote tensor's shape cannot be mirrored (a
    wrapper's sizes are fixed): refused before anything is recorded."""
    target = flat[s.alias] if s.alias is not None else None
    if (
        isinstance(target, LazyTensor)
        and (tuple(target.shape), tuple(target.stride())) != (s.shape, s.stride)
        and target._dyn is None
    ):
        raise UnsupportedOp(
            f"{func._schema.name}.{func._overloadname} changes the shape of a remote tensor "
            "in place; use the out-of-place op"
        )


def _output(s: TensorSpec, flat: list[Any], node: Node, i: int) -> Any:
    if s.alias is not None:
        target = flat[s.alias]
        if isinstance(target, LazyTensor):
            if (tuple(target.shape), tuple(target.stride())) == (s.shape, s.stride):
                return target  # in-place op or out=: the same tensor, mutated remotely
            target._dyn = TensorSpec(s.dtype, s.shape, s.stride, s.offset, None, s.bits)
            return target  # Note [resizable outputs] (_check_alias refused the rest)
    spec = TensorSpec(s.dtype, s.shape, s.stride, s.offset, None, s.bits)
    return LazyTensor(spec, Pending(node, i))


# filled by special_ops: the ops capture does not record as they come, and those of them
# whose result lives on the CPU
SPECIAL: dict[Any, Any] = {}
SPECIAL_TO_CPU: dict[Any, Any] = {}


def take_as_special(kernels: dict[str, Any]) -> None:
    """Kernels registered on the autograd key (``name`` or ``name.overload`` of ``aten``),
    taken as special ops too: ``torch.inference_mode()`` skips that key."""
    for name, kernel in kernels.items():
        packet, _, overload = name.partition(".")
        op = getattr(getattr(torch.ops.aten, packet), overload or "default")
        SPECIAL[op] = lambda func, args, kwargs, k=kernel: k(*args, **kwargs)


immediate.attach(LazyTensor, ref_for_node)
