"""Fleet placement policies (djinn.placement) and the pure parts of the fleet: addresses,
the appliance summary, the fleet document's rendering. No Ray here."""

from __future__ import annotations

import pytest

from djinn.errors import ConfigError
from djinn.fleet.address import is_fleet_address, parse_fleet_address
from djinn.fleet.render import model_copies, render_fleet
from djinn.fleet.summary import summarize
from djinn.plugins.placement import RoundRobinPlacement, SemanticPlacement
from djinn.semantics.placement import ApplianceFacts, PlacementPolicy, PlacementView
from djinn.semantics.registry import Registry

GIB = 1 << 30


def app(id: str, free: int = 8 * GIB, sessions: int = 0, models=(), pending=(), **kw):
    return ApplianceFacts(
        id=id,
        capacity_bytes=8 * GIB,
        free_bytes=free,
        sessions=sessions,
        queued=0,
        models=frozenset(m for m, _ in models),
        model_bytes=tuple(models),
        pending_models=frozenset(pending),
        **kw,
    )


def view(*apps, model=None, size=0, sequence=0):
    return PlacementView(tuple(apps), model, size, sequence)


SEM = SemanticPlacement()


def test_a_model_goes_where_it_is_resident_even_onto_a_busier_appliance():
    apps = [app("a"), app("b", free=2 * GIB, sessions=5, models=[("m1", GIB)]), app("c")]
    assert SEM.choose(view(*apps, model="m1", size=GIB)) == "b"


def test_a_model_placed_moments_ago_counts_as_resident():
    apps = [app("a"), app("b", pending=["m1"]), app("c")]
    assert SEM.choose(view(*apps, model="m1")) == "b"


def test_among_holders_the_least_loaded_per_worker_wins():
    apps = [
        app("a", sessions=4, models=[("m1", GIB)], workers=2),
        app("b", sessions=3, models=[("m1", GIB)]),
    ]
    assert SEM.choose(view(*apps, model="m1")) == "a"


def test_a_new_model_goes_where_most_memory_is_free():
    apps = [app("a", free=2 * GIB), app("b", free=6 * GIB), app("c", free=4 * GIB)]
    assert SEM.choose(view(*apps, model="new")) == "b"


def test_new_models_spread_once_pending_ones_are_counted():
    # three appliances with the same free memory; one already got a model a moment ago
    apps = [app("a", pending=["m1"], models=[("m0", GIB)]), app("b"), app("c")]
    first = SEM.choose(view(*apps, model="m2"))
    assert first in ("b", "c")


def test_a_new_model_avoids_an_appliance_it_does_not_fit():
    apps = [app("a", free=GIB // 2, sessions=0), app("b", free=3 * GIB, sessions=9)]
    assert SEM.choose(view(*apps, model="new", size=2 * GIB)) == "b"


def test_a_session_without_a_model_goes_to_the_least_loaded():
    apps = [app("a", sessions=3), app("b", sessions=1), app("c", sessions=2)]
    assert SEM.choose(view(*apps)) == "b"


def test_round_robin_takes_appliances_in_turn_whatever_they_hold():
    rr = RoundRobinPlacement()
    apps = [app("c"), app("a", models=[("m1", GIB)]), app("b")]
    picks = [rr.choose(view(*apps, model="m1", sequence=i)) for i in range(4)]
    assert picks == ["a", "b", "c", "a"]


def test_builtin_policies_load_through_their_entry_points():
    reg = Registry()
    for name in ("semantic", "round_robin"):
        policy = reg.placement(name)
        assert isinstance(policy, PlacementPolicy) and policy.name == name
    assert reg.placement("nope") is None


@pytest.mark.parametrize(
    ("text", "ray_address"),
    [
        ("fleet://", "auto"),
        ("fleet://auto", "auto"),
        ("fleet://10.0.0.1:6379", "10.0.0.1:6379"),
        ("ray://head:10001", "ray://head:10001"),
    ],
)
def test_fleet_addresses(text, ray_address):
    assert is_fleet_address(text)
    assert parse_fleet_address(text).ray_address == ray_address


@pytest.mark.parametrize("text", ["ray://", "fleet://head", "fleet://h:1/x", "ray://h:port"])
def test_bad_fleet_addresses_are_one_line_errors(text):
    with pytest.raises(ConfigError):
        parse_fleet_address(text)


def test_not_fleet_addresses():
    assert not is_fleet_address("tcp://h:1")
    assert not is_fleet_address("")


STATS = {
    "appliance": {"uptime_s": 3.0},
    "workers": [
        {"id": 0, "device": "cpu:0", "alive": True, "ready": True},
        {"id": 1, "device": "cpu:1", "alive": False, "ready": False},
    ],
    "sessions": [{"id": "s1"}, {"id": "s2"}],
    "vmu": {"devices": [{"capacity": 1000, "used": 300}, {"capacity": 1000, "used": 100}]},
    "models": [
        {"fingerprint": "abcdef012345", "name": "GPT2LMHeadModel", "bytes": 200, "sessions": 1},
        {"fingerprint": "abcdef012345", "name": "GPT2LMHeadModel", "bytes": 200, "sessions": 1},
    ],
    "scheduler": [{"queued": 2}, {"queued": 1}],
    "latency": {"all": {"count": 7, "p50_s": 0.001, "p99_s": 0.01}},
}


def test_summary_keeps_what_placement_and_operators_need():
    s = summarize(STATS)
    assert (s["capacity_bytes"], s["used_bytes"], s["free_bytes"]) == (2000, 400, 1600)
    assert (s["workers"], s["workers_up"], s["sessions"], s["queued"]) == (2, 1, 2, 3)
    # one model on two workers of one appliance: two copies, both weigh
    assert s["models"] == [
        {"fingerprint": "abcdef012345", "name": "GPT2LMHeadModel", "bytes": 400, "sessions": 2}
    ]


def test_fleet_rendering_counts_copies_of_each_model():
    row = {"id": "a1", "state": "up", **summarize(STATS)}
    doc = {
        "fleet": {"live": 2, "appliances": 3, "placement": "semantic"},
        "appliances": [
            row,
            {**row, "id": "b2"},
            {"id": "c3", "state": "dead", "why": "node died", "for_s": 4},
        ],
    }
    copies = model_copies(doc)
    assert [(m["fingerprint"], m["appliances"]) for m in copies] == [("abcdef012345", ["a1", "b2"])]
    text = render_fleet(doc)
    assert "dead 4s (node died)" in text and "2/3 appliances up" in text
