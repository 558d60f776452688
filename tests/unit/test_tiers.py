"""Moving storages between device and host tiers (issue 9 §2, Note [swap by storage
resize]): what comes back is bit-equal, and tensors viewing a storage keep viewing it."""

from __future__ import annotations

import pytest
import torch

from djinn.appliance.store import _tensors_in
from djinn.appliance.vmu.slabs import SlabAllocator
from djinn.appliance.vmu.tiers import TierMover, movable

transformers = pytest.importorskip("transformers")
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _mover(device: str, size: int = 64 << 20) -> tuple[TierMover, SlabAllocator]:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    arena = torch.empty(size, dtype=torch.uint8)
    if device == "cuda":
        arena = arena.pin_memory()  # the appliance page-locks its arena the same way
    slabs = SlabAllocator(0, size)
    return TierMover(torch.device(device), slabs, lambda off, n: arena[off : off + n]), slabs


def _gpt2(device: str):
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100)
    return transformers.GPT2LMHeadModel(cfg).eval().to(device)


def _storages(tensors) -> list:
    seen, out = set(), []
    for t in tensors:
        st = t.untyped_storage()
        if st.data_ptr() not in seen and movable(st):
            seen.add(st.data_ptr())
            out.append(st)
    return out


@pytest.mark.parametrize("device", DEVICES)
def test_swapped_out_and_restored_weights_and_kv_cache_are_bit_equal(device):
    mover, slabs = _mover(device)
    model = _gpt2(device)
    ids = torch.tensor([[1, 2, 3, 4, 5]], device=device)
    with torch.no_grad():
        first = model(ids, use_cache=True)
    cache = first.past_key_values
    params = {n: p.detach().clone() for n, p in model.named_parameters()}
    kv = [t.clone() for t in _tensors_in(cache)]
    weights = _storages([*model.parameters(), *model.buffers()])
    kv_storages = _storages(_tensors_in(cache))
    total = sum(st.nbytes() for st in weights + kv_storages)

    copies = mover.out(weights) + mover.out(kv_storages)
    assert all(st.nbytes() == 0 for st in weights + kv_storages)  # device memory freed
    assert slabs.used >= total
    mover.back(copies)
    assert slabs.used == 0  # host copies freed

    for n, p in model.named_parameters():
        assert torch.equal(p, params[n]), n
    assert all(torch.equal(a, b) for a, b in zip(_tensors_in(cache), kv, strict=True))
    # still tied, still usable: the next decode step equals one on an untouched copy
    assert model.lm_head.weight.data_ptr() == model.transformer.wte.weight.data_ptr()
    nxt = first.logits[:, -1:].argmax(-1)
    with torch.no_grad():
        step = model(nxt, past_key_values=cache, use_cache=True).logits
        fresh = _gpt2(device)
        want = fresh(torch.cat([ids, nxt], 1)).logits[:, -1:]
    assert torch.allclose(step, want, atol=1e-5)


def test_a_full_host_tier_refuses_a_swap_and_leaves_the_device_untouched():
    from djinn.errors import ResourceExhausted

    mover, slabs = _mover("cpu", size=64 << 10)
    big = [torch.randn(64 << 10).untyped_storage(), torch.randn(4).untyped_storage()]
    before = [bytes(st) for st in big]
    with pytest.raises(ResourceExhausted):
        mover.out(big)
    assert slabs.used == 0 and [bytes(st) for st in big] == before
