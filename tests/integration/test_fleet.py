"""A fleet on a real local Ray cluster (issue 13): a head and two worker nodes on this
machine, each offering the djinn_appliance resource, so the directory runs three
appliances with one CPU worker each. One cluster serves the whole module (starting it
and its appliances is most of the cost); the tests that change its shape run last, in
file order: a node joins, then a node is killed."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import ray  # the test extra installs it (= the [fleet] extra): these tests never skip
import torch

from djinn.errors import ApplianceLost, SessionLost
from tests.conftest import TOKEN

pytestmark = pytest.mark.timeout(300)

NODE = {"num_cpus": 1, "object_store_memory": 80 << 20, "resources": {"djinn_appliance": 1}}
# Ray declares a node dead after this many missed health checks (default: 5 of 3 s)
FAST_HEALTH = {"health_check_period_ms": 500, "health_check_failure_threshold": 3}
APPLIANCE_SETTINGS = {
    "token": TOKEN,
    "arena_bytes": "64MiB",
    "cpu_worker_memory": "512MiB",
    "prewarm": False,
    "drain_timeout": 1.0,
    "heartbeat_interval": 1.0,
    "fleet_appliance_host": "127.0.0.1",
    "fleet_report_interval": 0.25,
    "log_level": "info",
}


class Fleet:
    def __init__(self, tmp: Path) -> None:
        from ray.cluster_utils import Cluster

        from djinn import config as config_mod
        from djinn.fleet import cluster as fc

        toml = tmp / "djinn.toml"
        toml.write_text(
            "\n".join(
                f"{k} = {str(v).lower() if isinstance(v, bool) else repr(v)}"
                for k, v in APPLIANCE_SETTINGS.items()
            ).replace("'", '"')
            + "\n"
        )
        self.cfg = config_mod.load(toml, env={})
        self.cluster = Cluster(
            initialize_head=True,
            head_node_args={**NODE, "_system_config": FAST_HEALTH},
        )
        self.nodes = [self.cluster.add_node(**NODE) for _ in range(2)]
        ray.init(address=self.cluster.address, namespace="djinn", log_to_driver=False)
        self.directory = fc.start_directory(self.cfg.to_dict(), TOKEN, detached=False)
        fc.wait_live(self.directory, 3, timeout=180)
        self.address = f"fleet://{self.cluster.address}"

    def doc(self) -> dict:
        return ray.get(self.directory.snapshot.remote())

    def appliance(self, appliance_id: str) -> dict:
        return next(a for a in self.doc()["appliances"] if a["id"] == appliance_id)

    def client(self):
        from djinn.fleet.client import FleetClient

        return FleetClient(self.address, token=TOKEN)

    def wait(self, predicate, timeout: float = 30.0, what: str = ""):
        deadline = time.monotonic() + timeout
        while True:
            doc = self.doc()
            value = predicate(doc)
            if value:
                return value
            if time.monotonic() > deadline:
                raise AssertionError(f"not within {timeout}s: {what}\n{doc}")
            time.sleep(0.1)

    def close(self) -> None:
        from djinn.fleet import cluster as fc

        try:
            fc.stop_directory(self.directory)
        finally:
            ray.shutdown()
            self.cluster.shutdown()
            # a node killed without grace left its appliance's arena; the next `djinn
            # serve` on this host would sweep it, and no later test starts one here
            from appliance.vmu.arena import sweep_stale

            sweep_stale()


@pytest.fixture(scope="module")
def fleet(tmp_path_factory):
    f = Fleet(tmp_path_factory.mktemp("fleet"))
    yield f
    f.close()


def tiny_gpt2(seed: int):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    cfg = GPT2Config(n_layer=1, n_embd=32, n_head=2, n_positions=64, vocab_size=64)
    cfg.bos_token_id = cfg.eos_token_id = 0
    return GPT2LMHeadModel(cfg).eval()


def resident(doc: dict, fingerprint: str) -> list[str]:
    return [
        a["id"]
        for a in doc["appliances"]
        if a["state"] == "up" and any(m["fingerprint"] == fingerprint[:12] for m in a["models"])
    ]


def register(session, model) -> dict:
    from djinn.frontend import remote_module

    return remote_module.register(model, session)


def test_three_appliances_report_to_the_directory(fleet):
    doc = fleet.doc()
    up = [a for a in doc["appliances"] if a["state"] == "up"]
    assert len(up) == 3 and len({a["node_id"] for a in up}) == 3
    assert all(a["endpoint"].startswith("tcp://127.0.0.1:") for a in up)
    assert all(a["workers_up"] == 1 and a["capacity_bytes"] == 512 << 20 for a in up)


def test_tensors_go_straight_to_the_placed_appliance(fleet):
    with fleet.client() as client, client.session() as s:
        assert s.appliance is None  # Note [lazy placement]: nothing asked yet
        x = torch.randn(1000, 300)  # over inline_max: a bulk payload over TCP
        r = s.put(x)
        assert s.appliance in {a["id"] for a in fleet.doc()["appliances"]}
        assert torch.equal(r.cpu(), x)
        assert s.channel.address.scheme == "tcp"


def test_sessions_registering_a_resident_model_join_its_only_copy(fleet):
    model = tiny_gpt2(1)
    with fleet.client() as client:
        first = client.session()
        info = register(first, model)
        assert info["uploaded"]
        fleet.wait(lambda d: resident(d, info["fingerprint"]), what="the model resident")
        others = [client.session() for _ in range(3)]
        for s in others:
            again = register(s, model)
            assert s.appliance == first.appliance
            assert not again["uploaded"]  # attached by fingerprint: no second upload
        assert resident(fleet.doc(), info["fingerprint"]) == [first.appliance]
        for s in [first, *others]:
            s.close()


def test_new_models_spread_over_the_fleet_one_copy_each(fleet):
    models = [tiny_gpt2(seed) for seed in (11, 12, 13)]
    with fleet.client() as client:
        sessions = [client.session() for _ in models]
        fps = [register(s, m)["fingerprint"] for s, m in zip(sessions, models, strict=True)]
        # placed back to back, before any report shows them (Note [pending placements])
        assert len({s.appliance for s in sessions}) == 3
        doc = fleet.wait(lambda d: all(resident(d, fp) for fp in fps) and d)
        assert [len(resident(doc, fp)) for fp in fps] == [1, 1, 1]
        for s in sessions:
            s.close()


def test_round_robin_copies_a_model_onto_every_appliance(fleet):
    model = tiny_gpt2(21)
    ray.get(fleet.directory.set_placement.remote("round_robin"))
    try:
        with fleet.client() as client:
            sessions = [client.session() for _ in range(3)]
            infos = [register(s, model) for s in sessions]
            assert len({s.appliance for s in sessions}) == 3
            assert all(i["uploaded"] for i in infos)
            fp = infos[0]["fingerprint"]
            fleet.wait(lambda d: len(resident(d, fp)) == 3, what="three copies")
            for s in sessions:
                s.close()
    finally:
        ray.get(fleet.directory.set_placement.remote("semantic"))


def test_transparent_model_to_remote_joins_the_resident_copy(fleet, monkeypatch):
    """`model.to("remote_accelerator")` with address = fleet://: the default session is
    placed by the model's fingerprint (Note [lazy placement]), so it lands where another
    client already holds those weights, and the model runs there."""
    from djinn.frontend import session as default

    monkeypatch.setenv("DJINN_ADDRESS", fleet.address)
    monkeypatch.setenv("DJINN_TOKEN", TOKEN)
    default.reset()
    model = tiny_gpt2(31)
    with fleet.client() as client, client.session() as holder:
        fp = register(holder, tiny_gpt2(31))["fingerprint"]
        fleet.wait(lambda d: resident(d, fp), what="the model resident")
        try:
            ids = torch.tensor([[1, 2, 3, 4]])
            with torch.no_grad():
                expected = model(ids).logits
                remote = model.to("remote_accelerator:0")
                got = remote(ids).logits.cpu()
            torch.testing.assert_close(got, expected)
            s = default.default_session()
            assert type(s).__name__ == "FleetSession"
            assert s.appliance == holder.appliance
            assert resident(fleet.doc(), fp) == [holder.appliance]
        finally:
            default.reset()


def test_top_fleet_reads_the_live_directory(fleet):
    import asyncio

    from djinn.tui.fleet import DirectorySource, FleetTop
    from djinn.tui.widgets.table import SortableTable

    app = FleetTop(DirectorySource(fleet.address, TOKEN), refresh=3600)

    async def main() -> None:
        async with app.run_test(size=(160, 40)) as pilot:
            deadline = time.monotonic() + 30
            while app.polls < 1 and time.monotonic() < deadline:
                await pilot.pause(0.1)
            ids = {a["id"] for a in fleet.doc()["appliances"] if a["state"] == "up"}
            rows = set(app.query_one("#appliances", SortableTable).row_keys())
            assert ids <= rows and "appliances up" in app.status_text

    asyncio.run(main())


def test_status_fleet_shows_every_appliance(fleet):
    out = subprocess.run(
        [sys.executable, "-m", "djinn.cli.main", "status", "--fleet", "--address", fleet.address],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    assert "3/3 appliances up" in out.stdout
    for a in fleet.doc()["appliances"]:
        assert a["id"] in out.stdout and a["endpoint"] in out.stdout


def test_a_joining_node_grows_the_fleet_without_restart(fleet):
    before = {a["id"] for a in fleet.doc()["appliances"]}
    node = fleet.cluster.add_node(**NODE)
    fleet.nodes.append(node)
    doc = fleet.wait(
        lambda d: (
            sum(a["state"] == "up" and bool(a.get("workers_up")) for a in d["appliances"]) == 4
            and d
        ),
        timeout=120,
        what="a fourth appliance",
    )
    (new,) = {a["id"] for a in doc["appliances"]} - before
    assert before <= {a["id"] for a in doc["appliances"] if a["state"] == "up"}
    with fleet.client() as client, client.session(appliance=new) as s:
        x = torch.arange(12.0)
        assert torch.equal(s.put(x).cpu(), x)
        assert s.appliance == new


def test_a_killed_node_fails_its_sessions_with_one_typed_error_or_replays_them(fleet):
    victim_node = fleet.nodes[-1]
    victim = next(
        a["id"]
        for a in fleet.doc()["appliances"]
        if a["state"] == "up" and a["node_id"] == victim_node.node_id
    )
    model = tiny_gpt2(41)
    with fleet.client() as client:
        doomed = client.session(appliance=victim)
        kept = doomed.put(torch.arange(5.0))
        # Note [fleet recovery]: a recovering session is placed again and replayed
        rebuilt = client.session(appliance=victim, recover=True)
        fp = register(rebuilt, model)["fingerprint"]
        held = rebuilt.put(torch.arange(7.0))
        survivor = client.session()
        survivor_tensor = survivor.put(torch.ones(3))
        if survivor.appliance == victim:
            pytest.fail("placement picked the appliance pinned for the kill")
        fleet.cluster.remove_node(victim_node, allow_graceful=False)
        fleet.nodes.remove(victim_node)
        row = fleet.wait(
            lambda d: next(
                (a for a in d["appliances"] if a["id"] == victim and a["state"] == "dead"), None
            ),
            what="the directory marks the appliance dead",
        )
        assert "node" in row["why"]
        with pytest.raises(ApplianceLost) as lost:
            kept.cpu()
        assert isinstance(lost.value, SessionLost) and victim in lost.value.message
        with pytest.raises(ApplianceLost):  # the same error every time, never a hang
            doomed.put(torch.zeros(2))
        assert not doomed.usable
        assert torch.equal(held.cpu(), torch.arange(7.0))  # replayed elsewhere
        assert rebuilt.usable and rebuilt.appliance not in (None, victim)
        assert rebuilt.recovery_stats()["recoveries"] == 1
        fleet.wait(lambda d: rebuilt.appliance in resident(d, fp), what="the model re-registered")
        # the rest of the fleet is untouched, and new sessions avoid the dead appliance
        assert torch.equal(survivor_tensor.cpu(), torch.ones(3))
        for _ in range(3):
            with client.session() as s:
                s.put(torch.zeros(1))
                assert s.appliance != victim
