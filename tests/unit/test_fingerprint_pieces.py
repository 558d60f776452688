"""Note [fingerprint pieces]: the model fingerprint hashes bytes in pieces on several
threads, yet stays a function of names, dtypes, shapes and bytes alone."""

from __future__ import annotations

import torch

from djinn.protocol import fingerprint as fpmod
from djinn.protocol.fingerprint import PIECE, model_fingerprint


def _fp(tensors) -> str:
    return model_fingerprint("pkg.Model", '{"n": 1}', tensors)


def test_tied_and_untied_copies_of_the_same_bytes_agree():
    w = torch.randn(64, 8)
    tied = [("a.weight", w), ("b.weight", w)]
    untied = [("a.weight", w), ("b.weight", w.clone())]
    assert _fp(tied) == _fp(untied)
    assert _fp(tied) != _fp([("a.weight", w), ("b.weight", w + 1)])


def test_every_piece_counts_and_threads_do_not_change_the_digest(monkeypatch):
    big = torch.zeros(PIECE * 2 + 100, dtype=torch.uint8)  # three pieces: hashed in parallel
    base = _fp([("w", big), ("v", torch.ones(3))])
    for where in (0, PIECE + 5, 2 * PIECE + 99):
        changed = big.clone()
        changed[where] = 1
        assert _fp([("w", changed), ("v", torch.ones(3))]) != base, where
    monkeypatch.setattr(fpmod, "THREADS", 1)
    assert _fp([("v", torch.ones(3)), ("w", big)]) == base  # one thread, another order


def test_names_dtypes_and_shapes_count():
    x = torch.arange(6, dtype=torch.float32)
    base = _fp([("x", x)])
    assert _fp([("y", x)]) != base
    assert _fp([("x", x.view(2, 3))]) != base
    assert _fp([("x", x.view(torch.int32))]) != base
    assert _fp([("x", x), ("e", torch.empty(0))]) != base
