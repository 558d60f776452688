"""Random ops given a generator of the program's own (Note [explicit generators]).

Note [explicit generators]: a random op given a generator of the program's own
(``torch.randn(..., generator=g, device=remote)``; diffusers' pipelines and samplers pass
one for reproducible noise) draws from that generator in eager PyTorch, and moves it on,
not the default one. A generator object cannot travel, and need not: on a CPU worker the
op is sent without it, with ``g``'s state as its seeded state (Note [seeded ops] in
seeded.py); the worker's default CPU generator, set to that state, draws what ``g`` would
(both are the same Mersenne Twister: the state is all there is to it). ``g`` is moved on
by the op again on scratch tensors with ``generator=g``, as the default generator is for
an op without one; the default generator is left alone, as in eager. Only a CPU generator
can be so: a CUDA generator (a client with a GPU of its own) is refused, and so is any
generator on a GPU worker's session, whose ops draw from the device's generator (Note [a
GPU worker's generator]). Under ``djinn run``, ``torch.Generator("cuda")`` makes a CPU
generator (mapped_generator.py): the numbers are the local CPU's under the same seed, as
every other random op's there. A replayable function that draws from one, on the
appliance or locally (``OwnGenerators`` watches its recordings), runs as it is at every
call: a replay makes only its remote random ops' draws, and the generator a call passes
may be another object each time.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from djinn.errors import UnsupportedOp

from . import seeded
from .seeded import (
    DRAWS_BY_VALUE,
    PRIVATE,
    SEEDED,
    Draw,
    by_value,
    draws_on_device,
    one_thread,
)


def taken(func: Any, args: tuple, kwargs: dict) -> tuple[Any, tuple, dict]:
    """The generator the program gave ``func`` (None if none), and its arguments with
    None in its place: it is never sent. Where the schema
    has it positional (``poisson``, ``binomial``), it comes positional."""
    found = kwargs.get("generator")
    if found is not None:
        kwargs = {**kwargs, "generator": None}  # some schemas need it named
    else:  # every captured op comes here: a dict lookup for the many that take none
        at = _position(func)
        if at is not None and at < len(args) and args[at] is not None:
            found, args = args[at], (*args[:at], None, *args[at + 1 :])
    if found is not None and SEEDED not in func.tags:
        raise UnsupportedOp(f"{func.name()}: cannot send a generator to the appliance")
    return found, args, kwargs


class OwnGenerators(TorchFunctionMode):
    """While a replayable call records: whether it gives any torch function, local or
    remote, a generator of the program's own (Note [explicit generators]). A local draw
    from one (``torch.rand(1, generator=g) < p`` steering the call) never reaches the
    capture, and ``drawn_alone`` sees the default generator only: such calls were
    replayed with the branch of their recording, ``g`` never moved (a review)."""

    def __init__(self) -> None:
        super().__init__()
        self.seen = False

    def __torch_function__(
        self, func: Any, types: Any, args: tuple = (), kwargs: Any = None
    ) -> Any:
        kwargs = kwargs or {}
        if not self.seen:
            given = kwargs.get("generator")
            if given is None:
                given = next((a for a in args if isinstance(a, torch._C.Generator)), None)
            self.seen = (
                given is not None
                and given is not torch.default_generator
                and (id(given) not in PRIVATE)
            )
        return func(*args, **kwargs)


_POSITIONS: dict[Any, int | None] = {}


def _position(func: Any) -> int | None:
    """Where ``func``'s schema takes a generator positionally (``poisson``, ``binomial``);
    None where it takes none, or by keyword only."""
    if func not in _POSITIONS:
        _POSITIONS[func] = next(
            (
                i
                for i, arg in enumerate(func._schema.arguments)
                if arg.name == "generator" and not arg.kwarg_only
            ),
            None,
        )
    return _POSITIONS[func]


def _given(func: Any, args: Any, kwargs: dict, generator: torch.Generator) -> tuple:
    """``func``'s arguments with ``generator`` where ``taken`` took it from."""
    at = _position(func)
    if at is not None and at < len(args):
        return (*args[:at], generator, *args[at + 1 :]), kwargs
    return tuple(args), {**kwargs, "generator": generator}


class OwnDraw:
    """A random op given a CPU generator of the program's (Note [explicit generators])."""

    __slots__ = ("draw", "generator")

    def __init__(self, func: Any, args: tuple, kwargs: dict, generator: torch.Generator) -> None:
        self.draw = Draw(func, args, kwargs)
        self.generator = generator

    def again(self) -> torch.Tensor:
        """The generator's state for the op to run with, the generator then advanced."""
        state = self.generator.get_state()
        with one_thread():
            func = self.draw.func
            args, kwargs = _given(func, *self.draw._scratch(), self.generator)
            func(*args, **kwargs)
        return state

    def on(self, _default: torch.Generator) -> bool:
        return True  # it moves the default generator by nothing (``drawn_alone``)


def advance(
    func: Any,
    args: tuple,
    kwargs: dict,
    read: Callable[[torch.Tensor], torch.Tensor],
    generator: Any,
) -> tuple[torch.Tensor, Any]:
    name = func.name()
    if not isinstance(generator, torch.Generator) or generator.device.type != "cpu":
        where = getattr(generator, "device", type(generator).__name__)
        raise UnsupportedOp(
            f"{name}: cannot draw for the appliance from a generator on {where}; a CPU "
            "generator (torch.Generator()) can (Note [explicit generators])"
        )
    if draws_on_device():
        raise UnsupportedOp(
            f"{name}: a GPU worker's session draws from the remote device's own generator "
            "(torch.manual_seed seeds it); it cannot take generator= (Note [explicit "
            "generators])"
        )
    if func in DRAWS_BY_VALUE:
        state = generator.get_state()
        by_value(func, *_given(func, args, kwargs, generator), read)
        return state, None
    draw = OwnDraw(func, args, kwargs, generator)
    return draw.again(), draw


def draw_for(
    func: Any,
    args: tuple,
    kwargs: dict,
    read: Callable[[torch.Tensor], torch.Tensor],
    specs: tuple,
    generator: Any,
) -> tuple:
    """A random op's generator state, its generator advanced: the program's own
    (``advance``), else the default one's or the device's (Note [seeded ops])."""
    if generator is not None:
        return advance(func, args, kwargs, read, generator)
    return seeded.advance_generator(func, args, kwargs, read, specs)
