"""Random ops on the remote device: the generator they draw from, kept in step with eager's.

Note [seeded ops]: a random op records the local CPU generator's state (the worker
restores it before running the op), then runs the op locally on scratch tensors so the
local generator advances exactly as eager PyTorch's would. Remote values then equal local
eager values under the same ``torch.manual_seed``, and so does every later random number,
remote or local. That is for a session on a CPU worker; one on a GPU worker draws from the
remote device's own generator (Note [a GPU worker's generator]).
"""

from __future__ import annotations

import contextlib
import math
import struct
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

from .device import DEVICE_TYPE

SEEDED = torch.Tag.nondeterministic_seeded
# Tagged as seeded (its schema has a dropout probability) but never drawing: the CPU kernel
# refuses any dropout but 0. Advancing the local generator for it ran the whole attention
# on scratch tensors on the client, for nothing (Note [seeded ops]).
DRAWS_NOTHING = frozenset({torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default})
# Samplers that draw until a value is accepted: how far the generator moves depends on
# their inputs' values (a Poisson rate, a gamma shape), so scratch values would leave it
# elsewhere than eager's, and every later random number with it. These read their inputs.
DRAWS_BY_VALUE = frozenset(
    {
        torch.ops.aten.poisson.default,
        torch.ops.aten._standard_gamma.default,
        torch.ops.aten.binomial.default,
        torch.ops.aten._sample_dirichlet.default,
        # one draw per element that is not positive (``F.rrelu`` in training)
        torch.ops.aten.rrelu_with_noise.default,
        torch.ops.aten.rrelu_with_noise_.default,
        torch.ops.aten.rrelu_with_noise_functional.default,
    }
)


class _Scratch:
    """A remote tensor's place in a ``Draw``: a local tensor of its layout is made for it
    at each draw, holding a value every random op accepts."""

    __slots__ = ("dtype", "shape", "stride")

    def __init__(self, x: torch.Tensor) -> None:
        self.shape, self.stride, self.dtype = tuple(x.shape), tuple(x.stride()), x.dtype

    def made(self) -> torch.Tensor:
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype, device="cpu")
        # a probability, a mean, a rate, never uninitialised memory: bernoulli refuses p
        # outside [0, 1]
        return t.fill_(0.5 if t.is_floating_point() or t.is_complex() else 1)


# Note [draws by count]: PyTorch's CPU kernels for dropout's mask (``bernoulli_``),
# ``rand``, ``uniform_``, ``randint`` and ``random_`` take a fixed count of the Mersenne
# Twister's 32-bit outputs per element, whatever the numbers drawn: one or two. Running
# such an op again on scratch tensors does more than move the generator on by that
# count: a dropout fills a float mask and multiplies it in twice. So a Draw of one of
# ``COUNTED`` learns its count: at its first ``LEARN`` draws it also moves a private
# generator, set to the start state, on by each candidate count (one or two outputs per
# element of its result, taken by an int32 ``random_``) and compares the whole states,
# the normal-sample caches included. A count that gave the op's own state every time is
# used from then on; an op that draws any other way (the Intel MKL path of ``bernoulli_``
# takes one output per call) matches none and keeps running as it is. The Twister itself
# stays: the 3.9e5 mask elements of training_step.py's encoder with dropout 0.1 (2
# layers) took 3.5-3.9 ms a step as the ops and 2.3-3.0 ms as counts, on a 2-core machine.
COUNTED = frozenset(
    {
        torch.ops.aten.native_dropout.default,
        torch.ops.aten.bernoulli_.float,
        torch.ops.aten.bernoulli.p,
        torch.ops.aten.bernoulli.default,
        torch.ops.aten.bernoulli_.Tensor,
        torch.ops.aten.uniform_.default,
        torch.ops.aten.rand.default,
        torch.ops.aten.rand_like.default,
        torch.ops.aten.random_.default,
        getattr(torch.ops.aten.random_, "from"),  # a keyword
        torch.ops.aten.random_.to,
        torch.ops.aten.randint.default,
        torch.ops.aten.randint.low,
        torch.ops.aten.randint_like.default,
        torch.ops.aten.randint_like.low_dtype,
    }
)
LEARN = 2  # draws whose count must agree, each from another start state


def _advance(count: int, generator: torch.Generator | None = None) -> None:
    """Move a CPU generator (the default one) on by ``count`` 32-bit outputs of its
    Mersenne Twister: an int32 ``random_`` takes one per element, and is the cheapest per
    output of the kernels that take a fixed count (float64 ``uniform_`` took twice as
    long)."""
    if count:
        torch.empty(count, dtype=torch.int32, device="cpu").random_(generator=generator)


class Draw:
    """A random op as it advances the local generator: run again, it advances it again
    the same way (Note [replayed draws] in replay_record.py)."""

    __slots__ = ("args", "count", "func", "kwargs", "learnt")

    def __init__(self, func: Any, args: tuple, kwargs: dict) -> None:
        self.func = func
        self.args = [_placed(v) for v in args]
        self.kwargs = {k: _placed(v) for k, v in kwargs.items()}
        # Note [draws by count]: the count seen so far, and how many draws showed it
        self.count: int | None = None
        self.learnt = 0 if func in COUNTED else -1

    def again(self) -> torch.Tensor:
        """The local generator's state for the op to run with, the generator advanced."""
        state = torch.get_rng_state()
        if self.learnt >= LEARN:
            _advance(self.count)
            return state
        with one_thread():  # the scratch tensors' fill too
            args, kwargs = self._scratch()
            out = self.func(*args, **kwargs)
        if self.learnt >= 0:
            self._learn(state, out)
        return state

    def on(self, generator: torch.Generator) -> bool:
        """Move ``generator`` on as ``again()`` moves the default one, which is left alone:
        by the learnt count, else as the op draws with ``generator`` (``_drawer``). False
        where the op cannot draw from another generator."""
        if self.learnt >= LEARN:
            _advance(self.count, generator)
            return True
        draw = _drawer(self.func)
        if draw is None or self.kwargs.get("generator") is not None:
            return False
        with one_thread():
            draw(*self._scratch(), generator)
        return True

    def _scratch(self) -> tuple[list[Any], dict[str, Any]]:
        """The op's arguments, its remote tensors made as scratch CPU tensors."""
        return [_made(v) for v in self.args], {k: _made(v) for k, v in self.kwargs.items()}

    def _learn(self, start: torch.Tensor, out: Any) -> None:
        """Which count took the generator from ``start`` to where it is, tried on a
        private generator: the default one is never set back, so another thread's draws
        are not lost (drawn in between, they make no count match: the op keeps running)."""
        after = torch.get_rng_state()
        first = out[0] if isinstance(out, (tuple, list)) else out
        n = first.numel() if isinstance(first, torch.Tensor) else 0
        found = None
        with private_generator() as trial:
            for count in (2 * n, n) if n else ():
                trial.set_state(start)
                _advance(count, trial)
                if torch.equal(trial.get_state(), after):
                    found = count
                    break
        if found is None or (self.count is not None and found != self.count):
            self.learnt = -1  # it draws some other way: as it is, always
            return
        self.count, self.learnt = found, self.learnt + 1


_WITH_GENERATOR: dict[Any, Any] = {}


def _with_generator(func: Any) -> Any:
    """The op itself if it has a ``generator`` argument, else its overload that takes the
    same arguments plus one (``randn.default``: ``randn.generator``), else None."""
    if func in _WITH_GENERATOR:
        return _WITH_GENERATOR[func]
    found = None
    if any(a.name == "generator" for a in func._schema.arguments):
        found = func
    else:
        name = func._overloadname
        overload = "generator" if name == "default" else f"{name}_generator"
        if overload in func.overloadpacket.overloads():
            other = getattr(func.overloadpacket, overload)
            names = [a.name for a in other._schema.arguments if a.name != "generator"]
            if names == [a.name for a in func._schema.arguments]:  # the same call, plus it
                found = other
    _WITH_GENERATOR[func] = found
    return found


def _dropout_mask(args: list[Any], kwargs: dict[str, Any], generator: torch.Generator) -> None:
    """``native_dropout``'s draws, which it takes no generator for: its CPU kernel draws a
    mask like its input with ``bernoulli_(1 - p)``, and nothing for an empty input or
    ``train=False``."""
    x, p = args[0], args[1]
    train = args[2] if len(args) > 2 else kwargs.get("train")
    if x.numel() and train is not False:
        mask = torch.empty_like(x, memory_format=torch.contiguous_format)
        mask.bernoulli_(1.0 - p, generator=generator)


def _drawer(func: Any) -> Callable[[list[Any], dict[str, Any], torch.Generator], None] | None:
    """How ``func`` draws from a given generator: by ``_with_generator``, else, for
    dropout, ``_dropout_mask``; None for an op with neither (attention and recurrent
    kernels with dropout, ``randint_like.low_dtype``)."""
    op = _with_generator(func)
    if op is not None:
        return lambda args, kwargs, gen: op(*args, **{**kwargs, "generator": gen})
    return _dropout_mask if func is torch.ops.aten.native_dropout.default else None


# Note [scratch draws on one thread]: a scratch dropout of a training step's activations
# is big enough for OpenMP to split it, and the client's idle OpenMP threads then spin
# (for as long as the runtime's default) on the cores the worker runs the step on: with
# dropout 0.1, followed_steps.py's client spent 15-16 ms of CPU a step, for 3 ms of
# draws. PyTorch's CPU generator gives the same numbers at any thread count (a kernel
# takes its seed, or draws serially), so the draws run on the calling thread alone.
# Only with OpenMP, whose thread count may change at any time; the native backend warns.
_OPENMP = "OpenMP" in torch.__config__.parallel_info()


@contextlib.contextmanager
def one_thread() -> Iterator[None]:
    threads = torch.get_num_threads()
    if threads == 1 or not _OPENMP:
        yield
        return
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)


def _scratch_args(x: Any, tensor: Callable[[torch.Tensor], Any]) -> Any:
    """``x`` with each remote tensor in it as ``tensor(t)`` and the remote device as the
    CPU: an argument of a random op run locally."""
    if isinstance(x, torch.Tensor) and x.device.type == DEVICE_TYPE:
        return tensor(x)
    if isinstance(x, torch.device) and x.type == DEVICE_TYPE:
        return torch.device("cpu")
    if type(x) in (list, tuple):
        return type(x)(_scratch_args(v, tensor) for v in x)
    return x


def _placed(x: Any) -> Any:
    return _scratch_args(x, _Scratch)


def _made(x: Any) -> Any:
    if type(x) is _Scratch:
        return x.made()
    if type(x) in (list, tuple):
        return type(x)(_made(v) for v in x)
    return x


PRIVATE: set[int] = set()  # Djinn's own trial generators, alive while in use


@contextlib.contextmanager
def private_generator() -> Iterator[torch.Generator]:
    """A private CPU generator (``OwnGenerators`` does not count its draws)."""
    trial = torch._C.Generator()
    PRIVATE.add(id(trial))
    try:
        yield trial
    finally:
        PRIVATE.discard(id(trial))


def advance_generator(
    func: Any,
    args: tuple,
    kwargs: dict,
    read: Callable[[torch.Tensor], torch.Tensor],
    specs: tuple = (),
) -> tuple[torch.Tensor, Any]:
    """The generator state for ``func`` to run with, the generator then advanced as
    eager's would be (Note [seeded ops]); ``read`` gives a remote tensor's value, ``specs``
    the outputs' specs where known. And the ``Draw`` that advances it so again, but for
    an op that draws by its inputs' values (``DRAWS_BY_VALUE``) on the CPU generator,
    which reads them. On a GPU worker's session, the remote device's generator's (Note
    [a GPU worker's generator]): a ``DeviceDraw``. An op given a generator of the
    program's own: own_generators.py."""
    if draws_on_device():
        device_draw = DeviceDraw(_philox_increment(args, kwargs, specs))
        return device_draw.again(), device_draw
    if func not in DRAWS_BY_VALUE:
        draw = Draw(func, args, kwargs)
        return draw.again(), draw
    state = torch.get_rng_state()
    by_value(func, args, kwargs, read)
    return state, None


def by_value(
    func: Any, args: tuple, kwargs: dict, read: Callable[[torch.Tensor], torch.Tensor]
) -> None:
    """Run ``func`` locally on copies of its remote tensors' values: the generator it
    draws from advances as those values say."""

    def copied(t: torch.Tensor) -> torch.Tensor:
        shape, stride = tuple(t.shape), tuple(t.stride())
        if torch._debug_has_internal_overlap(torch.empty_strided(shape, stride, device="meta")):
            # an expanded rate: no copy can be written in its layout (copy_ refuses); the
            # values go in the same order whatever the layout
            return read(t).clone()
        return torch.empty_strided(shape, stride, dtype=t.dtype, device="cpu").copy_(read(t))

    args = tuple(_scratch_args(v, copied) for v in args)
    func(*args, **{k: _scratch_args(v, copied) for k, v in kwargs.items()})


# Note [a GPU worker's generator]: keeping the local CPU generator in step with CPU
# eager's (Note [seeded ops]) runs every random op again on the client, on scratch
# tensors: one 64-bit draw of the Mersenne Twister per element of a dropout, serially.
# On a GPU appliance that made the client the bottleneck: on an H100, a replayed
# training step of training_step.py's encoder with dropout 0.1 took 21.0 ms against
# local CUDA eager's 6.1 ms, the client spending 10.2 ms of CPU a step, 56% of it in
# those draws; GPT-2 small trained at 512 tokens would draw some 4e8 numbers a step on
# the client. And on a GPU they buy nothing: a GPU worker cannot draw CPU eager's
# numbers. CUDA eager does not touch the CPU generator for a random op on the GPU: it
# takes the GPU's own Philox generator, a seed and an offset that each op moves on by
# what it may draw. So does Djinn's remote device on a GPU worker: random ops send a
# (seed, offset) of the device's generator, the client moves the offset on by a bound
# on what the op draws (``_philox_increment``), in O(1), and the worker sets its CUDA
# generator to it before the op. The local CPU generator is left alone, as by CUDA
# eager; ``torch.manual_seed`` seeds the device's generator (PyTorch calls the device
# module's ``manual_seed_all``); ``fork_rng`` and activation checkpointing save and
# restore it through the device module. The numbers are the GPU's, fresh at every op and
# the same under the same seed, but not CUDA eager's own (its offsets come from its
# kernels' launch shapes). A session whose worker is not known at the op (a fleet
# session not placed yet) keeps the CPU generator's way.
_U64 = (1 << 64) - 1
DEVICE_STATE_BYTES = 16  # a seed and an offset, little-endian uint64s (a CPU state: 5056)


def _uint64(seed: int) -> int:
    """A seed as ``torch.manual_seed`` takes it: a negative one as its two's complement
    (what ``torch.initial_seed()`` then says)."""
    seed = int(seed)
    if not -(1 << 63) <= seed <= _U64:
        raise RuntimeError(f"Overflow when unpacking long long: seed {seed}")
    return seed & _U64


class _DeviceGenerator:
    """The remote device's Philox generator, kept on the client: a seed and an offset."""

    __slots__ = ("lock", "offset", "seed")

    def __init__(self) -> None:
        self.lock = threading.Lock()
        # a torch.manual_seed before ``import djinn`` did not reach the device module: its
        # seed is the CPU generator's initial seed (CUDA's default in a fresh process)
        self.seed, self.offset = torch.initial_seed() & _U64, 0

    def take(self, increment: int) -> torch.Tensor:
        """The state for an op that may draw ``increment`` numbers; the offset moved on."""
        with self.lock:
            state = _packed(self.seed, self.offset)
            self.offset = (self.offset + increment) & _U64
        return state

    def state(self) -> torch.Tensor:
        with self.lock:
            return _packed(self.seed, self.offset)

    def set_state(self, state: torch.Tensor) -> None:
        if (
            not isinstance(state, torch.Tensor)
            or state.dtype != torch.uint8
            or state.numel() != DEVICE_STATE_BYTES
        ):
            raise RuntimeError("the remote device's generator state is 16 bytes (uint8)")
        seed, offset = _unpacked(state)
        if offset % 4:
            raise RuntimeError(f"the generator offset must be a multiple of 4, not {offset}")
        with self.lock:
            self.seed, self.offset = seed, offset

    def manual_seed(self, seed: int) -> None:
        with self.lock:
            self.seed, self.offset = _uint64(seed), 0


DEVICE_GENERATOR = _DeviceGenerator()


def _packed(seed: int, offset: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(struct.pack("<QQ", seed, offset)), dtype=torch.uint8)


def _unpacked(state: torch.Tensor) -> tuple[int, int]:
    return struct.unpack("<QQ", state.contiguous().numpy().tobytes())


class DeviceDraw:
    """A random op as it moves the device generator's offset on: again, it moves it again."""

    __slots__ = ("increment",)

    def __init__(self, increment: int) -> None:
        self.increment = increment

    def again(self) -> torch.Tensor:
        return DEVICE_GENERATOR.take(self.increment)


def draws_on_device() -> bool:
    """Whether this thread's random ops draw from the device's generator: the default
    session's worker is a GPU's (Note [a GPU worker's generator])."""
    from .session import current_device_type

    return current_device_type(start=True) not in (None, "cpu")


PHILOX_FLOOR = 64  # the samplers' fixed offsets: binomial 42, poisson 20, gamma 10


def _philox_increment(args: tuple, kwargs: dict, specs: tuple) -> int:
    """A bound on the numbers a random op draws per CUDA thread, which is what its Philox
    offset must move by: four per element of what it reads and makes (an elementwise
    kernel's offset is four per element a thread takes, at most; dropout's, multinomial's
    the same; randperm's about five per element of its output, which counts its size
    argument too), plus the fixed offsets of the samplers that draw until they accept
    (``PHILOX_FLOOR``); a multiple of 4, as CUDA's generator requires. Elements are
    bounded by memory, so the 64-bit offset does not wrap in any real program."""
    count = 0
    for x in (*args, *kwargs.values(), *specs):
        count += _elements(x)
    return 4 * count + PHILOX_FLOOR


def _elements(x: Any) -> int:
    """The elements of a tensor, an output's spec, or a size. Not an integer's value: a
    ``randint`` bound of 2**62 counted so wrapped the offset round to where it was (a
    review), and what a count or a size makes is counted as the output it makes."""
    if isinstance(x, torch.Tensor):
        return x.numel()
    if hasattr(x, "shape") and hasattr(x, "dtype"):  # a TensorSpec
        return math.prod(int(d) for d in x.shape)
    if isinstance(x, (list, tuple)):  # torch.Size too
        if x and all(type(v) is int for v in x):  # a size: its tensor's elements
            return math.prod(max(v, 0) for v in x)
        return sum(_elements(v) for v in x)
    return 0


def call_generator(session: Any) -> bytes:
    """The generator state a model call on ``session``'s worker draws from, as eager's
    call would (Note [a sampled model call] in appliance/call_generator.py): the CPU
    generator's for a CPU worker, the device generator's seed and offset for a GPU's."""
    if str(session.device).partition(":")[0] in ("", "cpu"):
        return torch.get_rng_state().numpy().tobytes()
    return DEVICE_GENERATOR.state().numpy().tobytes()


def after_call(state: bytes) -> None:
    """Take the generator state a model call left (``call_generator``'s kind)."""
    tensor = torch.frombuffer(bytearray(state), dtype=torch.uint8)
    if len(state) == DEVICE_STATE_BYTES:
        DEVICE_GENERATOR.set_state(tensor)
    else:
        torch.set_rng_state(tensor)


def generators() -> tuple[torch.Tensor, torch.Tensor]:
    """The states of both generators a random op may advance (a recording checks them)."""
    return torch.get_rng_state(), DEVICE_GENERATOR.state()


def drawn_alone(entry: tuple[torch.Tensor, torch.Tensor],
                left: tuple[torch.Tensor, torch.Tensor], draws: list[Any]) -> bool:  # fmt: skip
    """Whether a call left the generators (``generators()``) where its random ops'
    ``draws`` alone take them from ``entry`` (Note [replayed draws]). A replay runs only
    those: a seed the call sets, a state it restores (``fork_rng``), a draw it makes
    locally (LayerDrop's ``torch.rand([]) < p``) would not happen, and every later number
    would be another (a review found such calls replayed off eager from their third call).

    The device's generator is checked by arithmetic: setting it back to draw again would
    hand another thread's op offsets already given (a review saw one so with a switch
    interval of a microsecond). The CPU generator's by drawing again from ``entry`` on a
    private generator (``Draw.on``: a learnt count, or the op given that generator), so
    that another thread's draws meanwhile are not lost. Only where a draw cannot move a
    generator other than the default one (no learnt count and no ``_drawer``: attention
    or a recurrent kernel with dropout) is the default one set back to ``entry``
    and drawn from, then left where the call left it: a draw of another thread inside
    that window would be lost."""
    seed, offset = _unpacked(entry[1])
    counted = sum(d.increment for d in draws if type(d) is DeviceDraw)
    if not torch.equal(_packed(seed, (offset + counted) & _U64), left[1]):
        return False
    local = [d for d in draws if type(d) is not DeviceDraw]
    if not local:
        return torch.equal(entry[0], left[0])
    with private_generator() as trial:
        trial.set_state(entry[0])
        if all(draw.on(trial) for draw in local):
            return torch.equal(trial.get_state(), left[0])
    torch.set_rng_state(entry[0])
    try:
        for draw in local:
            draw.again()
        return torch.equal(torch.get_rng_state(), left[0])
    finally:
        torch.set_rng_state(left[0])
