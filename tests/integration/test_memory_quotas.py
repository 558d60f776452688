"""Per-session quotas (issue 9 §4): a session over its device or host quota gets
QUOTA_EXCEEDED (a RESOURCE_EXHAUSTED), and other sessions keep working."""

from __future__ import annotations

import pytest
import torch

MIB = 1 << 20


def test_a_session_over_its_device_quota_is_refused_and_others_are_not(fresh_appliance):
    from djinn.errors import QuotaExceeded, ResourceExhausted

    app = fresh_appliance(session_device_max="2MiB", inline_max_bytes="4MiB")
    big = torch.ones(MIB // 4 * 3)  # 3 MiB, sent inline: lives on the device, not the arena
    with app.connect("tcp") as client, client.session() as greedy, client.session() as fair:
        kept = greedy.put(torch.ones(MIB // 4))  # 1 MiB: within the quota
        with pytest.raises(QuotaExceeded, match="session_device_max") as info:
            greedy.put(big[: MIB // 2])  # 2 MiB more: over it
        assert isinstance(info.value, ResourceExhausted)  # old clients still catch it
        assert torch.equal(fair.put(torch.ones(MIB // 4)).cpu(), torch.ones(MIB // 4))
        assert torch.equal(kept.cpu(), torch.ones(MIB // 4))  # nothing was lost


def test_a_session_over_its_host_quota_is_refused(fresh_appliance):
    from djinn.errors import QuotaExceeded

    app = fresh_appliance(session_host_max="2MiB")
    with app.connect() as client, client.session() as s, client.session() as other:
        with pytest.raises(QuotaExceeded, match="session_host_max"):
            s.put(torch.ones(MIB))  # 4 MiB through the arena
        assert other.put(torch.ones(MIB // 8)).cpu().sum().item() == MIB // 8


def test_tensors_staged_for_an_upload_count_against_the_quota_once_it_is_over(fresh_appliance):
    """Tensors PUT while uploading a model's weights wait in the arena uncharged (Note
    [staged uploads]); kept after the upload was given up and used as ordinary tensors,
    they are charged like any other, so they cannot hold the session past its quota."""
    import json

    from djinn.errors import QuotaExceeded

    app = fresh_appliance(session_device_max="2MiB")
    config = json.dumps({"model_type": "gpt2", "n_layer": 1, "n_embd": 64, "n_head": 4})
    body = {
        "fingerprint": "f" * 32,
        "class": "transformers.GPT2LMHeadModel",
        "config_json": config,
    }
    with app.connect() as client, client.session() as s:
        assert s.register_model(body)["cached"] is False  # this session uploads it now
        staged = s.put(torch.ones(MIB))  # 4 MiB, "weights": uncharged while uploading
        with pytest.raises(QuotaExceeded, match="session_device_max"):
            s.execute([{"op": "aten::sum.default", "args": [staged.ref()]}], fetch=[{"$v": 0}])
        s.free([staged.handle])  # freeing it is always allowed
        small = s.put(torch.ones(4))
        _, (total,) = s.execute(
            [{"op": "aten::sum.default", "args": [small.ref()]}], fetch=[{"$v": 0}]
        )
        assert total.item() == 4


def test_a_tenants_sessions_together_are_held_to_the_tenant_quota(fresh_appliance):
    """Note [tenant quotas]: two TCP sessions from one address are one tenant
    (host:127.0.0.1): together over tenant_device_max, the second is refused; a session
    of another tenant (this Unix user) is not."""
    from djinn.errors import QuotaExceeded

    app = fresh_appliance(tenant_device_max="2MiB", inline_max_bytes="4MiB")
    half = torch.ones(MIB // 16 * 5)  # 1.25 MiB, inline: device memory
    with app.connect("tcp") as tcp, tcp.session() as a, tcp.session() as b:
        kept = a.put(half)
        with pytest.raises(QuotaExceeded, match="tenant_device_max"):
            b.put(half)  # alone it fits a session; with a's, not the tenant
        with app.connect() as unix, unix.session() as other:
            assert torch.equal(other.put(half).cpu(), half)  # another tenant
        b.put(torch.ones(16))  # what fits the tenant still goes in
        assert torch.equal(kept.cpu(), half)


def test_a_tenants_sessions_together_are_held_to_the_tenant_host_quota(fresh_appliance):
    """Two sessions of one Unix user: their arena slabs count together against
    tenant_host_max."""
    from djinn.errors import QuotaExceeded

    app = fresh_appliance(tenant_host_max="6MiB")
    with app.connect() as client, client.session() as a, client.session() as b:
        kept = a.put(torch.ones(MIB))  # 4 MiB through the arena
        with pytest.raises(QuotaExceeded, match="tenant_host_max"):
            b.put(torch.ones(MIB))  # 4 MiB more for the same tenant
        assert torch.equal(kept.cpu(), torch.ones(MIB))


def test_a_partial_failure_holds_what_the_rest_reads_within_the_quota_only(fresh_appliance):
    """The appliance's Note [values the rest reads]: a graph that fails part way keeps,
    for the nodes after the failure, the values they read; a session that cannot hold one
    more within its quota gets none kept, the failure reported as before (its client then
    fails that work saying it read a dropped value), and nothing is left charged."""
    app = fresh_appliance(session_device_max="2MiB", inline_max_bytes="4MiB")
    nodes = [
        {"op": "aten::mul.Tensor", "args": [None, 2.0]},
        {"op": "aten::index.Tensor", "args": [None, [None]]},
        {"op": "aten::add.Tensor", "args": [{"$v": 0}, 1.0]},
    ]
    with app.connect("tcp") as client, client.session() as s:
        bad = s.put(torch.tensor([10**6]))
        for n, held in ((4, 1), (MIB // 8 * 3, 0)):  # 16 bytes; 1.5 MiB, twice over 2 MiB
            x = s.put(torch.ones(n))
            nodes[0]["args"][0] = nodes[1]["args"][0] = x.ref()
            nodes[1]["args"][1][0] = bad.ref()
            kept, _, failure = s.run_graph(nodes, keep=[{"$v": 2}])
            assert failure["node"] == 1 and kept == [None]
            assert len(failure.get("held", [])) == held
            if held:
                ref, t = failure["held"][0]
                assert ref == {"$v": 0} and torch.equal(t.cpu(), torch.full((n,), 2.0))
            del x
        # nothing the refused hold made stays charged: 1.5 MiB fits again
        assert s.put(torch.ones(MIB // 8 * 3)).cpu().sum().item() == MIB // 8 * 3
