"""Random programs of views and writes, run on the CPU and on the appliance, every tensor
compared as it is read and at the end (a differential fuzz, seeded).

A lazy device must keep eager's aliasing: a write into a tensor shows in every view of
it taken before or after, through any route (``out=``, ``.data``, a mask, an index, a
view of a view), and a read between writes sees exactly the writes before it. This
fuzz found a view that read its base's bytes from before a failed write, and lost every
write after it (Note [a failed write's views]). A program stops at an op eager refuses at
the call: Djinn learns of those when the graph runs (Note [failed values]).
"""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest
import torch

from djinn.errors import DjinnError

R = "remote_accelerator:0"
Pool = list[torch.Tensor]
Op = Callable[[Pool], "torch.Tensor | None"]

PROGRAMS = 120
STEPS = 25


def _bases(seed: int) -> Pool:
    g = torch.Generator().manual_seed(seed)
    # the third is a copy of a slice: its own storage, as the others
    return [torch.randn(4, 4, generator=g), torch.randn(4, 4, generator=g),
            torch.randn(3, 4, 4, generator=g)[1].clone()]  # fmt: skip


def _views(i: int, shape: tuple[int, ...], rng: random.Random) -> list[Op]:
    ops: list[Op] = [lambda p: p[i].detach(), lambda p: p[i].view(-1),
                     lambda p: p[i].reshape(-1), lambda p: p[i].unsqueeze(0)]  # fmt: skip
    if shape and shape[0] > 0:
        k, a = rng.randrange(shape[0]), rng.randrange(shape[0])
        b = rng.randrange(a, shape[0] + 1)
        ops += [lambda p: p[i][k], lambda p: p[i][a:b], lambda p: p[i][::2],
                lambda p: p[i].chunk(2)[-1], lambda p: p[i].narrow(0, 0, 1)]  # fmt: skip
    if len(shape) >= 2:
        ops += [lambda p: p[i].t(), lambda p: p[i][:, 1:], lambda p: p[i].movedim(0, -1)]
        if shape[1] > 0:
            ops.append(lambda p: p[i].unbind(1)[0])
        if shape[0] == shape[1]:
            ops.append(lambda p: p[i].diagonal())
    return ops


def _writes(
    i: int, j: int, shape: tuple[int, ...], c: float, rng: random.Random
) -> list[tuple[Op, int]]:
    """Each write, with the index of the tensor it writes into."""

    def none(_: object) -> None:
        return None

    ops: list[Op] = [
        lambda p: none(p[i].add_(c)), lambda p: none(p[i].mul_(c)),
        lambda p: none(p[i].fill_(c)), lambda p: none(p[i].zero_()),
        lambda p: none(p[i].clamp_(-1, 1)), lambda p: none(p[i].add_(p[j])),
        lambda p: none(p[i].copy_(p[j])), lambda p: none(p[i].mul_(p[j])),
        lambda p: none(p[i].__setitem__(Ellipsis, p[j])),
        lambda p: none(p[i].addcmul_(p[j], p[j], value=c)),
        lambda p: none(p[i].masked_fill_(p[j] > 0, c)),
        lambda p: none(p[i].sub_(p[j].sum())), lambda p: none(p[i].lerp_(p[j], 0.3)),
        lambda p: none(p[i].data.add_(c)),
        lambda p: none(torch.add(p[j] if p[j].shape == p[i].shape else p[i], c, out=p[i])),
        lambda p: none(p[i].__setitem__(p[i] > 0, c)),
        lambda p: none(p[i].unsqueeze_(0)), lambda p: none(p[i].squeeze_()),
    ]  # fmt: skip
    if shape and shape[0] > 0:
        k = rng.randrange(shape[0])
        idx = [rng.randrange(shape[0]) for _ in range(3)]
        ops += [
            lambda p: none(p[i].__setitem__(k, c)), lambda p: none(p[i][k].add_(c)),
            lambda p: none(p[i].index_add_(0, torch.tensor(idx, device=p[i].device),
                                           p[i][idx].mul(c))),
            lambda p: none(p[i].index_put_((torch.tensor(idx, device=p[i].device),),
                                           torch.ones((), device=p[i].device), accumulate=True)),
        ]  # fmt: skip
    if len(shape) == 2:
        ops += [lambda p: none(p[i].t_()), lambda p: none(p[i][:, 0].mul_(2)),
                lambda p: none(p[i].tril_()), lambda p: none(p[i].diagonal().fill_(c))]  # fmt: skip
    item = (lambda p: none(p[j].add_(p[i].reshape(-1)[0].item() if p[i].numel() else 0.0)), j)
    return [(op, i) for op in ops] + [item]


def _new(i: int, j: int, shape: tuple[int, ...], c: float) -> list[Op]:
    ops: list[Op] = [
        lambda p: p[i] + p[j], lambda p: p[i] * c, lambda p: p[i].clone(),
        lambda p: p[i].contiguous(), lambda p: torch.where(p[j] > 0, p[i], c),
        lambda p: torch.cat([p[i].reshape(-1), p[i].reshape(-1)]),
        lambda p: p[i].double().half().float(),
        lambda p: p[i].unsqueeze(0).expand(2, *p[i].shape).clone(),
    ]  # fmt: skip
    if len(shape) == 2:
        ops.append(lambda p: p[i] @ p[i].t())
    return ops


def _program(seed: int) -> tuple[list[tuple[str, Op | int, int]], Pool]:
    """The steps: ("op", fn, the tensor it writes or -1), ("read", k, -1) and ("drop", k,
    -1), drawn against a CPU run (for the shapes), which is returned too: a program ends
    at an op eager refuses at the call."""
    rng = random.Random(seed)
    cpu = _bases(seed)
    steps: list[tuple[str, Op | int, int]] = []
    for _ in range(STEPS):
        i, j = rng.randrange(len(cpu)), rng.randrange(len(cpu))
        shape, c = tuple(cpu[i].shape), round(rng.uniform(-2, 2), 3)
        family = rng.choice((_views, _writes, _writes, _new))
        target = -1
        if family is _views:
            op = rng.choice(_views(i, shape, rng))
        elif family is _writes:
            op, target = rng.choice(_writes(i, j, shape, c, rng))
        else:
            op = rng.choice(_new(i, j, shape, c))
        steps.append(("op", op, target))
        try:
            out = op(cpu)
        except (RuntimeError, IndexError):
            break
        if out is not None:
            cpu.append(out)
        if rng.random() < 0.3:
            steps.append(("read", rng.randrange(len(cpu)), -1))
        if len(cpu) > 12:
            k = rng.randrange(3, len(cpu))
            del cpu[k]
            steps.append(("drop", k, -1))
    return steps, cpu


def _same(got: torch.Tensor, want: torch.Tensor, where: str) -> None:
    assert got.shape == want.shape, where
    torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5, equal_nan=True, msg=where)


def _shares(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


@pytest.mark.parametrize("chunk", range(4))
def test_random_programs_of_views_and_writes_match_eager(remote, chunk):
    """At the end every tensor reads as eager's, but, after a write eager refused at the
    call (the program's last op) and the appliance only when it ran, those sharing the
    written bytes: they raise its error (Note [a failed write's views])."""
    per = PROGRAMS // 4
    refused = 0
    for seed in range(chunk * per, (chunk + 1) * per):
        steps, _ = _program(seed)
        cpu, rem = _bases(seed), [t.to(R) for t in _bases(seed)]
        poisoned: torch.Tensor | None = None
        for n, (kind, what, target) in enumerate(steps):
            where = f"seed {seed}, step {n}"
            if kind == "drop":
                del cpu[what], rem[what]
            elif kind == "read":
                _same(rem[what], cpu[what], where)
            else:
                try:
                    want = what(cpu)
                except (RuntimeError, IndexError):
                    refused += 1
                    try:
                        what(rem)
                    except (RuntimeError, IndexError):
                        break  # refused at the call here too: nothing was captured
                    poisoned = cpu[target] if target >= 0 else None
                    break
                got = what(rem)
                assert (got is None) == (want is None), where
                if want is not None:
                    cpu.append(want)
                    rem.append(got)
        for k, (got, want) in enumerate(zip(rem, cpu, strict=True)):
            where = f"seed {seed}, end, tensor {k}"
            if poisoned is not None and _shares(want, poisoned):
                with pytest.raises(DjinnError):
                    got.cpu()
            else:
                _same(got, want, where)
    assert refused > 0  # the programs meet writes eager refuses
