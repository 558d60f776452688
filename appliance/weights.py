"""Loading model weights from the appliance's own disk (ghost loading).

Only ``*.safetensors`` files in a directory under an allowlisted root (``model_roots``)
are read: safetensors holds raw tensors and a JSON header, nothing executable. The
directory is resolved (``..`` and symlinks followed) *before* it is compared with the
roots, so neither can reach outside them. Sizes are checked against the room the device
budget has (after eviction) before a byte is loaded.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable
from pathlib import Path

import torch

from djinn.errors import InvalidArgument, NotFound, ResourceExhausted


def resolve(path: object, roots: list[str]) -> Path:
    if not isinstance(path, str) or not path or "\x00" in path:
        raise InvalidArgument("path must be a non-empty string")
    if not roots:
        raise InvalidArgument("this appliance allows no model directory (set model_roots)")
    real = Path(os.path.realpath(os.path.expanduser(path)))
    for root in roots:
        base = Path(os.path.realpath(os.path.expanduser(root)))
        if real == base or base in real.parents:
            break
    else:
        raise InvalidArgument(f"{path} is outside the appliance's model_roots")
    if not real.is_dir():
        raise NotFound(f"no model directory {path}")
    return real


def safetensors_files(directory: Path) -> list[Path]:
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        raise NotFound(f"no *.safetensors file in {directory}")
    for f in files:  # a symlinked file must not point outside the directory either
        if Path(os.path.realpath(f)).parent != directory:
            raise InvalidArgument(f"{f.name} links outside {directory}")
    return files


_hashes: dict[tuple, str] = {}


def content_hash(directory: Path) -> str:
    """Hash of the weight files' bytes (cached per file size and mtime): ghost-loaded
    models are fingerprinted by what they contain, not by where they lie."""
    files = safetensors_files(directory)
    key = tuple((str(f), f.stat().st_size, f.stat().st_mtime_ns) for f in files)
    digest = _hashes.get(key)
    if digest is None:
        h = hashlib.blake2b(digest_size=20)
        for f in files:
            with open(f, "rb") as fh:
                while chunk := fh.read(8 << 20):
                    h.update(chunk)
        digest = _hashes[key] = h.hexdigest()
    return digest


def tensor_names(directory: Path) -> list[str]:
    """Names in the files, read from the safetensors headers alone."""
    from safetensors import safe_open

    names: list[str] = []
    for f in safetensors_files(directory):
        with safe_open(str(f), framework="pt") as handle:
            names.extend(handle.keys())
    return sorted(names)


def load(
    directory: Path, device: torch.device, room: int | Callable[[int], int]
) -> dict[str, torch.Tensor]:
    """The files' tensors on ``device``; ``room`` is the bytes free for them, or a
    function making room for ``n`` bytes and returning what is free (the device VMU's)."""
    from safetensors.torch import load_file

    files = safetensors_files(directory)
    total = sum(f.stat().st_size for f in files)
    if callable(room):
        room = room(total)
    if total > room:
        raise ResourceExhausted(
            f"weights of {total >> 20} MiB do not fit the {room >> 20} MiB free for them"
        )
    tensors: dict[str, torch.Tensor] = {}
    for f in files:
        tensors.update(load_file(str(f), device=str(device)))
    return tensors
