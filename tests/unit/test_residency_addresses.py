"""The memory manager knows storages by address, and an address is only a storage's
while that storage holds its bytes: a model swapped out (Note [swap by storage resize])
frees its weights' memory, and whatever is allocated there next is not its weights."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from djinn.appliance.models import ModelCache
from djinn.appliance.residency import MemoryManager
from djinn.appliance.vmu.device import DeviceVMU
from djinn.appliance.vmu.slabs import SlabAllocator
from djinn.appliance.vmu.tiers import TierMover

transformers = pytest.importorskip("transformers")


def _manager() -> tuple[MemoryManager, ModelCache]:
    arena = torch.empty(64 << 20, dtype=torch.uint8)
    slabs = SlabAllocator(0, arena.numel())
    vmu = DeviceVMU(256 << 20)
    store = SimpleNamespace(vmu=vmu, slabs=slabs)
    models = ModelCache(vmu["text"], ["transformers."])
    mover = TierMover(torch.device("cpu"), slabs, lambda off, n: arena[off : off + n])
    return MemoryManager(store, models, lambda: [], mover, None), models


def test_a_swapped_out_models_old_addresses_are_not_taken_for_its_weights():
    memory, models = _manager()
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=256, n_head=4, vocab_size=1000)
    entry = models.add("f" * 16, "gpt2", transformers.GPT2LMHeadModel(cfg).eval())
    sizes = [
        st.nbytes()
        for st in {
            id(p.untyped_storage()): p.untyped_storage() for p in entry.module.parameters()
        }.values()
    ]
    memory._swap_out("m:" + entry.fingerprint)
    # new storages of the same sizes: the allocator hands out the memory just freed
    fresh = [torch.empty(n, dtype=torch.uint8) for n in sizes for _ in range(2)]
    reused = [t for t in fresh if t.untyped_storage().data_ptr() in entry.storages]
    assert not reused, f"{len(reused)} new storages taken for the swapped-out weights"
    memory.prepare(SimpleNamespace(id="s"), entry, set())  # back in: its own addresses
    ptrs = {p.untyped_storage().data_ptr() for p in entry.module.parameters()}
    assert ptrs <= entry.storages
