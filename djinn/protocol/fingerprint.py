"""Model fingerprints: one definition, computed by the client and *verified* by the
appliance before it caches a model (a client cannot name someone else's model and
substitute its own weights).

The digest covers the class path, the exact config JSON the client sends, every tensor's
name, dtype, shape and bytes, and — for ghost loading — the weight files' content hash
and how model names map onto checkpoint names.

Note [fingerprint pieces]: a tensor's bytes enter the digest as the blake2b digests of
their 32 MiB pieces, not as one stream, so that the pieces are hashed on several threads
at once (hashlib lets go of the GIL while it hashes): GPT-2 small's fingerprint took
0.82 s on one thread. A tensor that shares its bytes with one listed before it (tied
weights: one tensor under two names) is hashed once and its digests listed again: the
fingerprint is a function of names, dtypes, shapes and bytes only, whether or not two
names share a storage (a cast model's tied weights do not). Both sides compute the same
function (the appliance over what it received), so the format is theirs alone.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor

import torch

from .tensors import dtype_name


def same_bytes_key(t: torch.Tensor) -> tuple:
    """Equal for two tensors that are the same bytes (tied weights under two names)."""
    return (t.device, t.data_ptr(), t.dtype, tuple(t.shape), tuple(t.stride()))


def model_fingerprint(
    class_path: str,
    config_json: str,
    tensors: Iterable[tuple[str, torch.Tensor]] = (),
    *,
    content_hash: str = "",
    name_map: dict[str, str] | None = None,
) -> str:
    h = hashlib.blake2b(digest_size=20)
    h.update(class_path.encode())
    h.update(b"\0")
    h.update(config_json.encode())
    if content_hash:
        h.update(b"\0files:" + content_hash.encode())
    for model_name, file_name in sorted((name_map or {}).items()):
        h.update(f"\0map:{model_name}={file_name}".encode())
    items = sorted(tensors, key=lambda item: item[0])
    first: dict[tuple, tuple[int, int]] = {}  # bytes already listed -> their pieces
    pieces: list[memoryview] = []
    layout: list[tuple[str, int, int]] = []  # per tensor: its header and its pieces
    for name, t in items:
        header = f"\0{name}:{dtype_name(t.dtype)}:{list(t.shape)}"
        key = same_bytes_key(t)
        if t.numel() and key in first:
            layout.append((header, *first[key]))  # hashed once, listed again
            continue
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        raw = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else memoryview(b"")
        start = len(pieces)
        pieces.extend(raw[i : i + PIECE] for i in range(0, len(raw), PIECE))
        first[key] = (start, len(pieces))
        layout.append((header, start, len(pieces)))
    digests = _digests(pieces)
    for header, start, end in layout:
        h.update(header.encode())
        for d in digests[start:end]:
            h.update(d)
    return h.hexdigest()


PIECE = 32 << 20
THREADS = min(4, os.cpu_count() or 1)


def _digests(pieces: list[memoryview]) -> list[bytes]:
    def one(piece: memoryview) -> bytes:
        return hashlib.blake2b(piece, digest_size=20).digest()

    if THREADS < 2 or sum(len(p) for p in pieces) < 2 * PIECE:
        return [one(p) for p in pieces]
    with ThreadPoolExecutor(THREADS, thread_name_prefix="djinn-fingerprint") as pool:
        return list(pool.map(one, pieces))
