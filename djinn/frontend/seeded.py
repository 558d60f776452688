"""Random ops on the remote device: the local generator kept in step with eager's.

Note [seeded ops]: a random op records the local CPU generator's state (the worker
restores it before running the op), then runs the op locally on scratch tensors so the
local generator advances exactly as eager PyTorch's would. Remote values then equal local
eager values under the same ``torch.manual_seed``, and so does every later random number,
remote or local.
"""

from __future__ import annotations

import contextlib
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
        t = torch.empty_strided(self.shape, self.stride, dtype=self.dtype)
        # a probability, a mean, a rate, never uninitialised memory: bernoulli refuses p
        # outside [0, 1]
        return t.fill_(0.5 if t.is_floating_point() or t.is_complex() else 1)


class Draw:
    """A random op as it advances the local generator: run again, it advances it again
    the same way (Note [replayed draws] in replay_record.py)."""

    __slots__ = ("args", "func", "kwargs")

    def __init__(self, func: Any, args: tuple, kwargs: dict) -> None:
        self.func = func
        self.args = [_placed(v) for v in args]
        self.kwargs = {k: _placed(v) for k, v in kwargs.items()}

    def again(self) -> torch.Tensor:
        """The local generator's state for the op to run with, the generator advanced."""
        state = torch.get_rng_state()
        with _one_thread():  # the scratch tensors' fill too
            args = [_made(v) for v in self.args]
            self.func(*args, **{k: _made(v) for k, v in self.kwargs.items()})
        return state


# Note [scratch draws on one thread]: a scratch dropout of a training step's activations
# is big enough for OpenMP to split it, and the client's idle OpenMP threads then spin
# (for as long as the runtime's default) on the cores the worker runs the step on: with
# dropout 0.1, followed_steps.py's client spent 15-16 ms of CPU a step, for 3 ms of
# draws. PyTorch's CPU generator gives the same numbers at any thread count (a kernel
# takes its seed, or draws serially), so the draws run on the calling thread alone.
# Only with OpenMP, whose thread count may change at any time; the native backend warns.
_OPENMP = "OpenMP" in torch.__config__.parallel_info()


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
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


def advance_local_generator(
    func: Any, args: tuple, kwargs: dict, read: Callable[[torch.Tensor], torch.Tensor]
) -> tuple[torch.Tensor, Draw | None]:
    """The local generator's state for ``func`` to run with, the generator then advanced
    as eager's would be (Note [seeded ops]); ``read`` gives a remote tensor's value. And
    the ``Draw`` that advances it so again, but for an op that draws by its inputs'
    values (``DRAWS_BY_VALUE``), which reads them."""
    if func not in DRAWS_BY_VALUE:
        draw = Draw(func, args, kwargs)
        return draw.again(), draw
    state = torch.get_rng_state()

    def copied(t: torch.Tensor) -> torch.Tensor:  # the generator advances as these values say
        return torch.empty_strided(tuple(t.shape), tuple(t.stride()), dtype=t.dtype).copy_(read(t))

    args = tuple(_scratch_args(v, copied) for v in args)
    func(*args, **{k: _scratch_args(v, copied) for k, v in kwargs.items()})
    return state, None
