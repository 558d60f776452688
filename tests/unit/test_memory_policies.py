"""The built-in memory policies order victims as Note [semantic eviction] says, and are
found through the djinn.memory_policies entry points like a third party's would be."""

from __future__ import annotations

from djinn.plugins.memory_policies import LruPolicy, SemanticPolicy
from djinn.semantics.memory import KV_CACHE, WEIGHTS, MemoryPolicy, MemoryView, UnitFacts
from djinn.semantics.registry import default_registry, list_plugins

MB = 1 << 20


def _view(*units: UnitFacts) -> MemoryView:
    return MemoryView(
        need=MB, device_capacity=100 * MB, device_used=100 * MB, host_free=100 * MB, units=units
    )


def _kv(key: str, idle: float, think: float = 1.0, gap: float = 0.005) -> UnitFacts:
    return UnitFacts(key, KV_CACHE, 4 * MB, 1, idle, "llm_decode", idle, think, gap)


def test_both_policies_are_registered_plugins():
    names = {p.name for p in list_plugins() if p.group == "memory_policies"}
    assert {"semantic", "lru"} <= names
    for name in ("semantic", "lru"):
        policy = default_registry().memory_policy(name)
        assert isinstance(policy, MemoryPolicy) and policy.name == name
    assert default_registry().memory_policy("off") is None


def test_semantic_evicts_the_cache_whose_session_comes_back_last():
    # both sessions think for ~1 s between bursts; "early" paused 0.9 s ago (back soon),
    # "late" 0.2 s ago (0.8 s to go); "busy" is mid-burst; "gone" overstayed its pause
    early, late = _kv("early", idle=0.9), _kv("late", idle=0.2)
    busy, gone = _kv("busy", idle=0.005), _kv("gone", idle=5.0)
    order = SemanticPolicy().victims(_view(busy, early, late, gone))
    assert order == ["gone", "late", "early", "busy"]
    # LRU takes the one that paused first: the session about to come back
    assert LruPolicy().victims(_view(busy, early, late, gone)) == ["gone", "early", "late", "busy"]


def test_semantic_keeps_the_most_shared_weights_and_mid_burst_caches():
    shared = UnitFacts("shared", WEIGHTS, 50 * MB, sessions=8, idle_s=3.0)
    private = UnitFacts("private", WEIGHTS, 50 * MB, sessions=1, idle_s=0.5)
    busy = _kv("busy", idle=0.005)
    order = SemanticPolicy().victims(_view(busy, shared, private))
    assert order == ["private", "shared", "busy"]
    assert LruPolicy().victims(_view(busy, shared, private))[0] == "shared"


def test_semantic_evicts_the_decode_loop_whose_turn_comes_last():
    # three sessions mid-burst take turns on the worker: "just_ran" had its step a
    # moment ago, so its next one is the furthest away; LRU evicts "next_up" instead
    just_ran, next_up = _kv("just_ran", idle=0.002), _kv("next_up", idle=0.008)
    view = _view(next_up, just_ran)
    assert SemanticPolicy().victims(view)[0] == "just_ran"
    assert LruPolicy().victims(view)[0] == "next_up"
