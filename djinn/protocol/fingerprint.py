"""Model fingerprints: one definition, computed by the client and *verified* by the
appliance before it caches a model (a client cannot name someone else's model and
substitute its own weights).

The digest covers the class path, the exact config JSON the client sends, every tensor's
name, dtype, shape and bytes, and — for ghost loading — the weight files' content hash
and how model names map onto checkpoint names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable

import torch

from .tensors import dtype_name


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
    for name, t in sorted(tensors, key=lambda item: item[0]):
        h.update(f"\0{name}:{dtype_name(t.dtype)}:{list(t.shape)}".encode())
        flat = t.detach().to("cpu").contiguous().reshape(-1)
        if flat.numel():
            h.update(memoryview(flat.view(torch.uint8).numpy()))
    return h.hexdigest()
