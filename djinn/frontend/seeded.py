"""Random ops on the remote device: the local generator kept in step with eager's.

Note [seeded ops]: a random op records the local CPU generator's state (the worker
restores it before running the op), then runs the op locally on scratch tensors so the
local generator advances exactly as eager PyTorch's would. Remote values then equal local
eager values under the same ``torch.manual_seed``, and so does every later random number,
remote or local.
"""

from __future__ import annotations

from collections.abc import Callable
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
    }
)


def advance_local_generator(
    func: Any, args: tuple, kwargs: dict, read: Callable[[torch.Tensor], torch.Tensor]
) -> torch.Tensor:
    """The local generator's state for ``func`` to run with, the generator then advanced
    as eager's would be (Note [seeded ops]); ``read`` gives a remote tensor's value."""
    state = torch.get_rng_state()
    by_value = func in DRAWS_BY_VALUE

    def scratch(x: Any) -> Any:
        if isinstance(x, torch.Tensor) and x.device.type == DEVICE_TYPE:
            t = torch.empty_strided(tuple(x.shape), tuple(x.stride()), dtype=x.dtype)
            if by_value:  # the generator advances by as many draws as these values take
                return t.copy_(read(x))
            # values every random op accepts (a probability, a mean, a rate), never
            # uninitialised memory: bernoulli refuses p outside [0, 1]
            return t.fill_(0.5 if t.is_floating_point() or t.is_complex() else 1)
        if isinstance(x, torch.device) and x.type == DEVICE_TYPE:
            return torch.device("cpu")
        if type(x) in (list, tuple):
            return type(x)(scratch(v) for v in x)
        return x

    func(*[scratch(v) for v in args], **{k: scratch(v) for k, v in kwargs.items()})
    return state
