"""Executing an op graph received over the wire (format: ``djinn.protocol.graph``).

Only ops found in ``torch.ops.aten`` / ``torch.ops.prims`` run; names are checked against
a strict pattern before any attribute lookup, and constants are decoded from tagged JSON.
Intermediates are dropped right after their last use so a long graph's stack stays as
small as eager execution's.

Note [op validation]: a node's op must be on the allowlist (``oppolicy``); its arguments
must match the op's schema (``opargs``) and pass the op's own extra checks where its
kernel trusts more than its meta kernel checks (``opchecks``); and where the op has a
meta kernel it runs on meta replicas first (``metacheck``), which checks the arguments'
consistency and says how many bytes the op would allocate, compared with what is left of
the stack segment. Only then does the real kernel run.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Callable, Generator, Iterator
from typing import Any

import torch

from djinn.errors import (
    DjinnError,
    ExecutionError,
    InvalidArgument,
    ResourceExhausted,
    UnsupportedOp,
    kernel_mark,
)
from djinn.protocol import norm_stats
from djinn.protocol.graph import MAX_DEPTH, MAX_NODES, parse_op_name
from djinn.protocol.values import decode_constant, inline_tensor

from ..vmu.device import DeviceShort, Segment
from . import index_bounds, metacheck, opargs, opchecks, oppolicy, threads, value_sizes

_OP_CACHE: dict[str, Any] = {}
# what a kernel raises for arguments it refuses: reported as EXECUTION_ERROR naming the op
OP_ERRORS = (RuntimeError, TypeError, ValueError, IndexError, KeyError)


def op_error(name: Any, i: int, exc: BaseException) -> ExecutionError:
    """A kernel's error as the request's: EXECUTION_ERROR naming the op and node, PyTorch's
    words, and for a ``torch.linalg.LinAlgError``, an ``IndexError``... its class's name,
    which the client raises it as too (Note [linear algebra errors], djinn/errors.py)."""
    return ExecutionError(f"{name} (node {i}): {kernel_mark(exc)}{exc}")


PHILOX_STATE_BYTES = 16  # a device generator's seed and offset (a CPU state is 5056 bytes)


def _digest_seed(state: bytes) -> int:
    """A seed for a generator of another algorithm than the state's, from all of it."""
    return int.from_bytes(hashlib.blake2b(state, digest_size=8).digest(), "little")


MAX_PLANS = 256  # templates whose last uses are kept (the worker keeps as many templates)
_LAST_USES: OrderedDict[str, dict[int, list[int]]] = OrderedDict()


def resolve_op(name: Any) -> Any:
    op = _OP_CACHE.get(name) if isinstance(name, str) else None
    if op is not None:
        return op
    try:
        namespace, opname, overload = parse_op_name(name)
    except ValueError as exc:
        raise UnsupportedOp(str(exc)) from None
    packet = getattr(getattr(torch.ops, namespace), opname, None)
    if packet is None or not isinstance(packet, torch._ops.OpOverloadPacket):
        raise UnsupportedOp(f"{name}: no such op in torch.ops.{namespace}")
    op = getattr(packet, overload, None)
    if not isinstance(op, torch._ops.OpOverload):
        raise UnsupportedOp(f"{name}: no overload {overload!r}")
    oppolicy.check(op)
    _OP_CACHE[name] = op
    return op


class GraphRun:
    """One EXEC request: decode, run node by node, hand back kept and fetched values."""

    def __init__(
        self,
        body: dict[str, Any],
        lookup: Callable[[str], torch.Tensor],
        segments: list[memoryview],
        device: torch.device,
        stack: Segment,
    ) -> None:
        nodes = body.get("nodes")
        if not isinstance(nodes, list) or len(nodes) > MAX_NODES:
            raise InvalidArgument(f"nodes must be a list of at most {MAX_NODES} ops")
        self.nodes = nodes
        self.keep = _ref_list(body, "keep")
        self.fetch = _ref_list(body, "fetch")
        # Note [partial graphs]: with "partial", a failing node ends the run instead of
        # failing the request: the nodes before it stay done (their effects happened,
        # their values are kept and fetched), the rest never ran, and the reply says
        # which node failed and why. The client runs the independent rest again.
        self.partial = body.get("partial") is True
        self.failed: tuple[int, DjinnError] | None = None
        # Note [rerunnable graphs]: whether an op that ran wrote into a tensor (an in-place
        # or out= op). Until one has, running the request again from its first node is the
        # same as running it once, so a request short of memory may wait in the admission
        # queue and run again; after one has, it must not (a += 1 would happen twice).
        self.wrote = False
        self.lookup = lookup
        self.segments = segments
        self.device = device
        self.values: dict[int, Any] = {}
        self.stack = stack
        self._stack_refs: dict[int, list[int]] = {}  # storage ptr -> [nbytes, live values]
        self._inputs: set[int] | None = None
        # the fingerprint of the graph template this request instantiates, if any: what
        # depends only on the graph's structure is worked out once per template
        self.template: str | None = None
        # Note [graph plans]: (op, bytes, meta output) of each node, while a plan of this
        # run's template is being recorded
        self.recording: list[tuple[Any, int, Any]] | None = None
        self.casts: set[int] = set()  # nodes whose output _like_meta cast (while recording)
        self.held = self.peak_held = 0  # stack bytes this run holds; their most at once
        self.input_storages: Callable[[], list[int]] = lambda: []
        # Note [a capturing client beside its worker] (threads.py): the intra-op threads
        # its ops run with, when fewer than the worker's own
        self.threads: int | None = None

    def run(self) -> tuple[list[Any], list[Any]]:
        steps = self.steps()
        while True:
            try:
                next(steps)
            except StopIteration as stop:
                return stop.value

    def steps(self) -> Generator[None, None, tuple[list[Any], list[Any]]]:
        """``run`` one op at a time: yields after each node, so the worker's scheduler can
        run another request between two ops and resume this one later (Note [threading
        model] in scheduler.py). Closing it early gives back its stack bytes."""
        try:
            last_use = self._last_uses()
            for i, node in enumerate(self.nodes):
                if i:
                    yield  # between two ops, never after the last: a finished run replies
                if self.threads is not None:
                    threads.use(self.threads)
                try:
                    self._node(i, node, last_use)
                except DjinnError as exc:
                    if not self.partial:
                        raise
                    self.failed = (i, exc)
                    break
                finally:
                    if self.threads is not None:
                        threads.use(threads.base())
            return [self._result(r) for r in self.keep], [self._result(r) for r in self.fetch]
        finally:
            for nbytes, _refs in self._stack_refs.values():
                self.stack.release(nbytes)
            self._stack_refs.clear()

    def _result(self, ref: dict[str, Any]) -> Any:
        """A kept or fetched value; None for the output of a node that never ran."""
        if self.failed is not None and "$v" in ref and ref["$v"] >= self.failed[0]:
            return None
        return self._ref(ref, -1)

    def _node(self, i: int, node: Any, last_use: dict[int, list[int]]) -> None:
        if not isinstance(node, dict):
            raise InvalidArgument(f"node {i} is not an object")
        op = resolve_op(node.get("op"))
        if "rng" in node:
            self._seed(node["rng"])
        args = self._decode(node.get("args", []), i, 0)
        kwargs = self._decode(node.get("kwargs", {}), i, 0)
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise InvalidArgument(f"node {i}: args must be a list and kwargs an object")
        need, meta = self._check(op, args, kwargs, i)
        if self.recording is not None:  # Note [graph plans]: what the checks found
            self.recording.append((op, need, meta))
        self._call(i, op, node.get("op"), args, kwargs, meta, last_use)

    def _call(
        self,
        i: int,
        op: Any,
        name: Any,
        args: list[Any],
        kwargs: dict[str, Any],
        meta: Any,
        last_use: dict[int, list[int]],
    ) -> None:
        """The real kernel, once the node's checks passed, and what follows it: the
        dtype the client was told, the bounds of what it returned, the stack's account,
        and the intermediates this node was the last to read."""
        self.wrote = self.wrote or writes(op)
        try:
            out = op(*args, **kwargs)
        except OP_ERRORS as exc:
            raise op_error(name, i, exc) from None
        cast = finished(self.device, op, name, args, kwargs, out, meta)
        if self.recording is not None and _differs(cast, out):
            self.casts.add(i)  # Note [compiled plans]: the cast stays in the compiled run
        out = cast
        self.values[i] = out
        self._account(out, +1)
        for j in last_use.pop(i, ()):
            self._account(self.values.pop(j, None), -1)  # intermediate no longer needed

    def _check(self, op: Any, args: list[Any], kwargs: dict[str, Any], i: int) -> tuple[int, Any]:
        """Before the real kernel: arguments against the schema, then a meta run whose
        output must fit in what is left of the stack (Note [op validation]). Returns the
        bytes the op allocates and its meta output ((-1, None) when the op has no meta
        kernel)."""
        try:
            named = opargs.bind(op, args, kwargs, self.device)
            self._extra_checks(op, named)
            need, meta = metacheck.checked_run(op, args, kwargs)  # Note [meta signatures]
        except metacheck.NoMetaKernel:
            by_value = value_sizes.output_bytes(op, named)  # Note [sizes by value]
            if by_value is not None:
                self._make_room(op, by_value, i)
            return -1, None
        except (InvalidArgument, ExecutionError) as exc:
            raise type(exc)(f"node {i}: {exc.message}") from None
        self._make_room(op, need, i)
        return need, meta

    def _extra_checks(self, op: Any, named: dict[str, Any]) -> None:
        """The op's own checks (``opchecks``), and on a GPU its index guards (Note [indices
        on a GPU], index_bounds.py), on its arguments by name."""
        opchecks.check(op, named)
        if self.device.type != "cpu":
            index_bounds.check(op, named)

    def _make_room(self, op: Any, need: int, i: int) -> None:
        """``need`` bytes of stack for node ``i``, evicting what the policy gives up;
        DeviceShort (the request may wait and run again) or RESOURCE_EXHAUSTED."""
        self.peak_held = max(self.peak_held, self.held + need)  # Note [compiled plans]
        free = self.stack.vmu.make_room(need)  # Note [one device budget] (vmu/device.py)
        if need > free:
            text = (
                f"{op._schema.name} (node {i}) would allocate {need} bytes; the device "
                f"has {free} of {self.stack.capacity} free after eviction"
            )
            if self.wrote:  # Note [rerunnable graphs]: cannot wait and run again
                raise ResourceExhausted(text + " (not queued: earlier ops wrote in place)")
            raise DeviceShort(text, need - free)

    def _seed(self, k: Any) -> None:
        """Random ops carry the client generator's state so a CPU worker draws exactly the
        numbers local eager PyTorch would under the same seed; or, from a GPU worker's
        session, the device generator's seed and offset (Note [a GPU worker's generator]
        in djinn/frontend/seeded.py)."""
        if type(k) is not int or not 0 <= k < len(self.segments):
            raise InvalidArgument(f"no payload segment {k!r} for the generator state")
        if len(self.segments[k]) == PHILOX_STATE_BYTES:
            self._seed_philox(bytes(self.segments[k]))
            return
        state = torch.frombuffer(self.segments[k], dtype=torch.uint8).clone()
        try:
            if self.device.type == "cpu":
                torch.set_rng_state(state)
            else:  # CUDA's generator is another algorithm: seed it from the whole state
                torch.cuda.manual_seed(_digest_seed(state.numpy().tobytes()))
        except RuntimeError as exc:
            raise InvalidArgument(f"bad generator state: {exc}") from None

    def _seed_philox(self, raw: bytes) -> None:
        seed, offset = struct.unpack("<QQ", raw)
        if offset % 4:  # CUDA's generator refuses it; checked on every device alike
            raise InvalidArgument(f"generator offset {offset} is not a multiple of 4")
        if self.device.type == "cuda":
            gen = torch.cuda.default_generators[self.device.index or 0]
            gen.manual_seed(seed)
            gen.set_offset(offset)
        else:  # a CPU worker sent the device's state (its session was placed late)
            torch.default_generator.manual_seed(_digest_seed(raw))

    def _account(self, value: Any, delta: int) -> None:
        """Stack segment bookkeeping: storages created by this run, while referenced."""
        tensors = value if isinstance(value, (tuple, list)) else (value,)
        for t in tensors:
            if not isinstance(t, torch.Tensor):
                continue
            storage = t.untyped_storage()
            ptr, ref = storage.data_ptr(), self._stack_refs.get(storage.data_ptr())
            if ref is None:
                if delta < 0 or not storage.nbytes() or ptr in self._input_ptrs():
                    continue
                try:
                    self.stack.reserve(storage.nbytes())
                except DeviceShort as exc:  # charged after the op ran (no meta kernel)
                    if self.wrote:  # Note [rerunnable graphs]: cannot wait and run again
                        text = f"{exc.message} (not queued: earlier ops wrote in place)"
                        raise ResourceExhausted(text) from None
                    raise
                self._stack_refs[ptr] = [storage.nbytes(), 1]
                self.held += storage.nbytes()
                self.peak_held = max(self.peak_held, self.held)
            elif delta > 0 or ref[1] > 1:
                ref[1] += delta
            else:
                self.stack.release(ref[0])
                self.held -= ref[0]
                del self._stack_refs[ptr]

    def _input_ptrs(self) -> set[int]:
        if self._inputs is None:
            self._inputs = set(self.input_storages())
        return self._inputs

    def _last_uses(self) -> dict[int, list[int]]:
        """node index -> node outputs whose last reader it is (kept/fetched ones excluded);
        a graph template's, worked out once (its structure is the template's)."""
        if self.template is None:
            return self._find_last_uses()
        known = _LAST_USES.get(self.template)
        if known is None:
            known = _LAST_USES[self.template] = self._find_last_uses()
            if len(_LAST_USES) > MAX_PLANS:
                _LAST_USES.popitem(last=False)
        else:
            _LAST_USES.move_to_end(self.template)
        return dict(known)  # steps() pops from it; the lists are only read

    def _find_last_uses(self) -> dict[int, list[int]]:
        last: dict[int, int] = {}
        for i, node in enumerate(self.nodes):
            if isinstance(node, dict):
                for part in (node.get("args"), node.get("kwargs")):
                    for ref in _value_refs(part, 0, reader=i):
                        last[ref["$v"]] = i
        pinned = {r["$v"] for r in self.keep + self.fetch if "$v" in r}
        out: dict[int, list[int]] = {}
        for produced, reader in last.items():
            if produced not in pinned:
                out.setdefault(reader, []).append(produced)
        return out

    def held_for_rest(self) -> list[tuple[dict[str, Any], torch.Tensor]]:
        """After a partial failure, the values made before the failed node that a node
        after it reads, and that are not kept already: (reference, tensor) pairs.

        Note [values the rest reads]: the client runs the independent rest of a failed
        graph again (Note [partial graphs]). A value that only such a node read was held
        by nothing on the client, so it was not kept, and it went with the run: the rest
        could not compute, where eager (whose ``try`` caught the failure at once) does.
        So the reply names these too, as handles the client binds before it sends the
        rest (djinn/frontend/partial.py), and lets go once the rest ran."""
        if self.failed is None:
            return []
        at = self.failed[0]
        kept = {(r["$v"], r.get("i")) for r in self.keep if "$v" in r}
        out: list[tuple[dict[str, Any], torch.Tensor]] = []
        seen: set[tuple[Any, Any]] = set()
        for node in self._source_nodes()[at + 1 :]:
            if not isinstance(node, dict):
                continue
            # the lenient walk (Note [walking value references]): it stops where the strict
            # one would raise, which it can reach here (see the Note)
            for ref in _value_refs([node.get("args"), node.get("kwargs")], 0):
                key = (ref["$v"], ref.get("i"))
                if key in seen or key in kept or not (type(key[0]) is int and key[0] < at):
                    continue
                seen.add(key)
                clean = {"$v": key[0]} if "i" not in ref else {"$v": key[0], "i": key[1]}
                try:
                    value = self._ref(clean, -1)
                except InvalidArgument:  # released, or not an output of that node
                    continue
                if isinstance(value, torch.Tensor):
                    out.append((clean, value))
        return out

    def _source_nodes(self) -> list[Any]:
        """The request's nodes as the client sent them (a plan's keep their template's)."""
        return self.nodes

    def _ref(self, ref: dict[str, Any], at: int) -> Any:
        if "$h" in ref:
            handle = ref["$h"]
            if not isinstance(handle, str):
                raise InvalidArgument("handle must be a string")
            return self.lookup(handle)
        n = ref["$v"]
        if type(n) is not int or not (0 <= n < len(self.nodes)) or (at >= 0 and n >= at):
            raise InvalidArgument(f"reference to node {n!r} from node {at}: not an earlier node")
        if n not in self.values:
            raise InvalidArgument(f"node {n}'s value was already released")
        value = self.values[n]
        if "i" in ref:
            k = ref["i"]
            if (
                not isinstance(value, (tuple, list))
                or type(k) is not int
                or not 0 <= k < len(value)
            ):
                raise InvalidArgument(f"node {n} has no output {k!r}")
            value = value[k]
        return value

    def _decode(self, x: Any, at: int, depth: int) -> Any:
        if depth > MAX_DEPTH:
            raise InvalidArgument("constant nested too deeply")
        if isinstance(x, list):
            return [self._decode(v, at, depth + 1) for v in x]
        if not isinstance(x, dict):
            return x
        if "$h" in x or "$v" in x:
            return self._ref(x, at)
        if "$t" in x:
            return inline_tensor(x, self.segments, self.device)
        found, value = decode_constant(x, self.device)
        if found:
            return value
        return {k: self._decode(v, at, depth + 1) for k, v in x.items()}


def _value_refs(x: Any, depth: int, reader: int | None = None) -> Iterator[dict[str, Any]]:
    """The references to earlier nodes' values (``{"$v": n}`` objects) in node arguments.

    Note [walking value references]: the one walk of ``_find_last_uses`` and of
    ``held_for_rest``. They differ only where arguments are malformed, and each keeps its
    own answer there:

    - Given ``reader`` (the node whose arguments ``x`` are), the walk is strict, as
      ``_find_last_uses`` validates a request before any op runs: nesting past MAX_DEPTH
      is INVALID_ARGUMENT naming the node, and only a ``"$v"`` that is an int makes a
      reference (an object with another ``"$v"`` is looked into like any object).
    - Without it (``held_for_rest``), nesting past MAX_DEPTH is looked no deeper into,
      and every object with a ``"$v"`` is yielded, not looked into (the caller skips
      those that are not an int). This walk does not rely on the strict one having
      passed: it walks ``[args, kwargs]``, one level deeper than the strict walk counts,
      and a plan's run walks its template's nodes, where each float is a ``{"$s": k}``
      object one level deeper still; so it can pass MAX_DEPTH where the strict walk did
      not, and raising there would lose every value the rest reads, not the deep ones.
    """
    if depth > MAX_DEPTH:
        if reader is None:
            return
        raise InvalidArgument(f"node {reader}: arguments nested too deeply")
    if isinstance(x, dict):
        if "$v" in x and (reader is None or isinstance(x["$v"], int)):
            yield x
        else:
            for v in x.values():
                yield from _value_refs(v, depth + 1, reader)
    elif isinstance(x, list):
        for v in x:
            yield from _value_refs(v, depth + 1, reader)


def has_extra_checks(op: Any, device: torch.device) -> bool:
    """Whether ``op`` has checks beyond its schema and meta kernel (``opchecks``; on a
    GPU, index guards): those read values, so a plan runs them every time."""
    return opchecks.has_check(op) or (device.type != "cpu" and index_bounds.has_guard(op))


def finished(
    device: torch.device,
    op: Any,
    name: Any,
    args: list[Any],
    kwargs: dict[str, Any],
    out: Any,
    meta: Any,
) -> Any:
    """What follows a kernel: the dtype the client was told (Note [meta dtypes], Note
    [statistics dtypes]) and the bounds of what it returned."""
    if device.type == "cpu" and op in norm_stats.OPS:
        meta = _cpu_statistics(op, args, kwargs, meta)
    out = _like_meta(out, meta, op)
    oppolicy.check_bounds(out, name)
    return out


def _cpu_statistics(op: Any, args: list[Any], kwargs: dict[str, Any], meta: Any) -> Any:
    """Note [statistics dtypes] (djinn/protocol/norm_stats.py): a half-precision
    normalization's saved statistics keep the CPU kernel's dtype, as the client was told."""
    dtype = norm_stats.cpu_dtype(op, args, kwargs)
    if dtype is None or not isinstance(meta, (tuple, list)):
        return meta
    return tuple(
        torch.empty_like(m, dtype=dtype) if i in norm_stats.STATISTICS else m
        for i, m in enumerate(meta)
    )


def _like_meta(out: Any, meta: Any, op: Any = None) -> Any:
    """Note [meta dtypes]: the client knows a value's dtype from the op's meta kernel. A
    CPU kernel sometimes answers in another one (``native_layer_norm`` of float16 gives
    float16 statistics on the CPU, float32 on meta and CUDA): the value is cast to what
    the client was told, so a tensor's bytes always match its dtype.

    Note [meta strides]: and its strides, for the output of an ``op`` that makes a new
    tensor (not a view, not a write). A kernel may lay its output out otherwise than
    the meta kernel the client asked: the CPU convolution answered a channels-last input
    channels-last where meta said contiguous (the client now predicts it: Note
    [convolution layouts] in djinn/frontend/meta.py), ``linalg.svd``'s ``Vh`` is
    column-major on the CPU. The client, told otherwise, decided views and ``contiguous()``
    on its strides, and the worker read other elements: the group norm after such a
    convolution refused its input (a review: diffusers' UNet2DModel in eval mode). The
    value is copied into the layout the client was told."""
    if isinstance(out, torch.Tensor):
        if not isinstance(meta, torch.Tensor):
            return out
        if op is not None and out.stride() != meta.stride() and _fresh(op, out, meta):
            # one copy, cast too where the dtype differs
            return torch.empty_strided(
                meta.shape, meta.stride(), dtype=meta.dtype, device=out.device
            ).copy_(out)
        return out.to(meta.dtype) if out.dtype != meta.dtype else out
    if isinstance(out, (tuple, list)) and isinstance(meta, (tuple, list)) and len(out) == len(meta):
        return type(out)([_like_meta(o, m, op) for o, m in zip(out, meta, strict=True)])
    return out


def _fresh(op: Any, out: torch.Tensor, meta: torch.Tensor) -> bool:
    """Whether ``out``, whose strides are not ``meta``'s, is a new tensor of ``op`` (not
    a view, not a write) laid out otherwise than ``meta`` says: a dimension of one
    element, or an empty tensor, may have any stride; another shape is not this check's
    to say (the client's shape is checked elsewhere)."""
    if op.is_view or op._schema.is_mutable or out.shape != meta.shape or out.numel() <= 1:
        return False
    return any(
        n > 1 and a != b for n, a, b in zip(out.shape, out.stride(), meta.stride(), strict=True)
    )


def _differs(cast: Any, out: Any) -> bool:
    """Whether ``_like_meta`` gave other tensors than the kernel's."""
    if isinstance(out, (tuple, list)) and isinstance(cast, (tuple, list)):
        return any(c is not o for c, o in zip(cast, out, strict=True))
    return cast is not out


def _ref_list(body: dict[str, Any], key: str) -> list[dict[str, Any]]:
    refs = body.get(key, [])
    if not isinstance(refs, list) or not all(
        isinstance(r, dict)
        and (type(r.get("$v")) is int or isinstance(r.get("$h"), str))
        and ("i" not in r or type(r["i"]) is int)
        for r in refs
    ):
        raise InvalidArgument(f"{key} must be a list of {{'$v': n}} / {{'$h': id}} references")
    return refs


_WRITES: dict[Any, bool] = {}


def writes(op: Any) -> bool:
    """Whether ``op`` writes into one of its arguments (``Tensor(a!)`` in its schema)."""
    known = _WRITES.get(op)
    if known is None:
        known = _WRITES[op] = any(
            a.alias_info is not None and a.alias_info.is_write for a in op._schema.arguments
        )
    return known
