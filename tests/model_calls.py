"""A model call as a decode loop sends it on the wire, for tests that drive the model path
of several sessions by hand (the transparent frontend uses one session per process)."""

from __future__ import annotations

import torch


def model_call(session, fp: str, ids: torch.Tensor, past: str | None = None, free=(), **extra):
    """One forward on the appliance: (logits fetched to the CPU, the KV cache's id).
    ``past``: the remote id of the cache to extend; ``free``: remote objects (caches)
    the session no longer needs; ``extra``: more fields of the request body."""
    from djinn.protocol.tensors import to_wire
    from djinn.runtime.remote import RemoteTensor

    desc, flat = to_wire(ids)
    kwargs: dict = {"use_cache": True}
    if past is not None:
        kwargs["past_key_values"] = {"$o": past}
    body = {"fingerprint": fp, "args": [{"$t": 0, "desc": desc}], "kwargs": kwargs}
    if free:
        body["free_objects"] = list(free)
    body.update(extra)
    fields = session.call_model(body, [flat.numpy()])["out"]["fields"]
    logits = fields["logits"]
    return RemoteTensor(session, logits["$h"], logits).cpu(), fields["past_key_values"]["$o"]


def holds_no_weight(p: torch.Tensor) -> bool:
    """A registered model's weight: meta here, whatever device it tells the program (Note
    [weights of a registered model]), and of the class that says so."""
    from djinn.frontend.registered_weights import RegisteredBuffer, RegisteredParameter

    with torch._C.DisableTorchFunctionSubclass():
        return p.is_meta and isinstance(p, (RegisteredParameter, RegisteredBuffer))


def tiny_llama(device: str) -> torch.nn.Module:
    """A one-layer Llama (rotary buffers, grouped-query attention), seeded, in eval mode."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, vocab_size=100,
    )  # fmt: skip
    torch.manual_seed(0)
    return LlamaForCausalLM(cfg).eval().to(device)
