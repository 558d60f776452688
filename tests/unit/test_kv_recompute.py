"""Note [kv recompute] (appliance/recompute.py): which calls leave a cache recomputable,
how the worker chooses between swapping and recomputing it, and a cache dropped and
rebuilt from its tokens continuing a greedy decode as if nothing happened."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from djinn.appliance.recompute import KvRecompute, Record
from djinn.appliance.store import _tensors_in
from djinn.appliance.vmu.tiers import movable

transformers = pytest.importorskip("transformers")


def _gpt2():
    torch.manual_seed(0)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _session() -> SimpleNamespace:
    return SimpleNamespace(id="s1", objects={}, object_ids={})


def _call(kv: KvRecompute, s, model, ids, cache=None, method="forward", **extra):
    """A model call as the worker makes it: run, give the output cache an id, note it."""
    kwargs = {"use_cache": True, **extra}
    if cache is not None:
        kwargs["past_key_values"] = cache
    with torch.no_grad():
        out = model(ids, **kwargs)
    pkv = out.past_key_values
    if id(pkv) not in s.object_ids:
        oid = f"o{len(s.objects)}"
        s.objects[oid], s.object_ids[id(pkv)] = pkv, oid
    kv.note_call(s, "fp", method, [ids], kwargs, out, 0.01)
    return out, s.object_ids[id(pkv)]


def _storages(cache) -> list:
    seen, out = set(), []
    for t in _tensors_in(cache):
        st = t.untyped_storage()
        if st.data_ptr() not in seen and movable(st):
            seen.add(st.data_ptr())
            out.append(st)
    return out


def test_a_cache_dropped_and_rebuilt_from_its_tokens_continues_the_greedy_decode():
    model, kv, s = _gpt2(), KvRecompute("always"), _session()
    prompt = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(1))
    out, oid = _call(kv, s, model, prompt)
    tokens = []
    for step in range(6):
        nxt = out.logits[:, -1:].argmax(-1)
        tokens.append(int(nxt))
        cache = s.objects[oid]
        if step % 2 == 0:  # evicted every other step
            storages = _storages(cache)
            rec = kv.recomputable(s, oid, storages)
            assert rec is not None and rec.tokens == 40 + step
            assert kv.choose(rec, 1 << 20, 1e9, can_swap=True)
            freed = kv.drop((s.id, oid), storages)
            assert freed > 0 and all(st.nbytes() == 0 for st in storages)
            kv.rebuild((s.id, oid), cache, model)
            assert (s.id, oid) not in kv.dropped
        out, same = _call(kv, s, model, nxt, cache=cache)
        assert same == oid  # the client's id for its cache never changes
    with torch.no_grad():
        want = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert tokens == want[0, 40:].tolist()
    # and the last step's logits equal an undisturbed run's to float rounding
    with torch.no_grad():
        ref = model(torch.cat([prompt, want[:, 40:46]], 1)).logits[:, -1]
    assert (out.logits[:, -1] - ref).abs().max().item() <= 1e-5


def test_calls_a_prefill_would_not_repeat_leave_no_record():
    model, kv, s = _gpt2(), KvRecompute(), _session()
    ids = torch.tensor([[1, 2, 3, 4]])
    _, masked = _call(kv, s, model, ids, attention_mask=torch.ones_like(ids))
    assert (s.id, masked) not in kv.records  # a mask the record would not reproduce
    _, oid = _call(kv, s, model, ids)
    assert kv.records[(s.id, oid)].tokens == 4
    _call(kv, s, model, torch.tensor([[5]]), cache=s.objects[oid], position_ids=torch.tensor([[9]]))
    assert (s.id, oid) not in kv.records  # extended in a way it cannot replay
    _call(kv, s, model, torch.tensor([[6]]), cache=s.objects[oid])
    assert (s.id, oid) not in kv.records  # and it stays unrecorded: always swapped
    kv.forget(s.id)
    assert not kv.records and not kv.dropped


def test_the_cost_model_recomputes_only_when_the_prefill_is_cheaper_than_the_copy_back():
    kv = KvRecompute("auto")
    rec = Record("fp", [torch.zeros(1, 512, dtype=torch.long)], 512, 1)
    nbytes = 40 << 20  # 40 MiB of keys and values
    assert not kv.choose(rec, nbytes, 10e9, can_swap=True)  # no prefill measured yet
    kv.s_per_token["fp"] = 2e-3  # a CPU: 1 s to prefill 512 tokens, 4 ms to copy back
    assert not kv.choose(rec, nbytes, 10e9, can_swap=True)
    kv.s_per_token["fp"] = 1e-6  # a GPU: 0.5 ms to prefill, 1.6 ms over PCIe at 25 GB/s
    assert kv.choose(rec, nbytes, 25e9, can_swap=True)
    kv.s_per_token["fp"] = 2e-3
    assert kv.choose(rec, nbytes, 10e9, can_swap=False)  # no room on the host: recompute
    assert not KvRecompute("never").choose(rec, nbytes, 1.0, can_swap=False)
    assert KvRecompute("always").choose(rec, nbytes, 1e12, can_swap=True)
    assert not KvRecompute("always").choose(None, nbytes, 1e12, can_swap=True)  # no tokens


def test_a_cache_another_object_views_is_never_dropped():
    model, kv, s = _gpt2(), KvRecompute("always"), _session()
    _, oid = _call(kv, s, model, torch.tensor([[1, 2, 3]]))
    s.objects["alias"] = list(_tensors_in(s.objects[oid]))[:1]  # a view of its storage
    assert kv.recomputable(s, oid, _storages(s.objects[oid])) is None


def test_the_memory_manager_drops_a_cache_the_host_tier_has_no_room_for_and_rebuilds_it():
    """The wiring (residency.py): under 'auto', a victim cache that cannot be swapped
    (an 8 KiB arena) is dropped, not refused, and rebuilt before the call that names it."""
    from djinn.appliance.models import ModelCache
    from djinn.appliance.residency import MemoryManager
    from djinn.appliance.store import TensorStore
    from djinn.appliance.vmu.device import DeviceVMU
    from djinn.appliance.vmu.tiers import TierMover
    from djinn.plugins.memory_policies import LruPolicy

    arena = torch.empty(8 << 10, dtype=torch.uint8)
    store = TensorStore(SimpleNamespace(size=0), 0, arena.numel(), DeviceVMU(256 << 20))
    models = ModelCache(store.vmu["text"], ["transformers."])
    s = SimpleNamespace(
        id="s1",
        objects={},
        object_ids={},
        storages={},
        handles={},
        phase="llm_decode",
        data_bytes=0,
        object_bytes=0,
    )
    mover = TierMover(torch.device("cpu"), store.slabs, lambda off, n: arena[off : off + n])
    memory = MemoryManager(store, models, lambda: [s], mover, LruPolicy())
    model = _gpt2()
    entry = models.add("f" * 16, "gpt2", model)
    prompt = torch.randint(0, 100, (1, 40), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        out = model(prompt, use_cache=True)
    oid = "c1"
    s.objects[oid], s.object_ids[id(out.past_key_values)] = out.past_key_values, oid
    memory.kv.note_call(s, entry.fingerprint, "forward", [prompt], {"use_cache": True}, out, 0.1)
    held = store.charge_objects(s)
    assert held > arena.numel()  # it cannot go to the host

    memory._swap_out(f"o:{s.id}:{oid}")
    assert (s.id, oid) in memory.kv.dropped and store.charge_objects(s) == 0
    assert memory.total.evictions == 1 and memory.total.swaps_out == 0

    memory.prepare(s, entry, {oid})  # the next call's working set: rebuilt
    memory.finish(s)
    assert memory.total.recomputes == 1 and store.charge_objects(s) == held
    nxt = out.logits[:, -1:].argmax(-1)
    with torch.no_grad():
        got = model(nxt, past_key_values=s.objects[oid], use_cache=True).logits
        want = model(torch.cat([prompt, nxt], 1)).logits[:, -1:]
    assert (got - want).abs().max().item() <= 1e-5
