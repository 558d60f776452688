"""CUDA paths: per-GPU workers, the page-locked arena, device VMU. Skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def gpu_appliance(tmp_path_factory):
    from tests.conftest import start_appliance

    app = start_appliance(tmp_path_factory.mktemp("gpu"), gpus="auto", arena_bytes="2GiB")
    yield app
    app.stop()


def test_one_worker_per_gpu_with_a_pinned_arena(gpu_appliance):
    st = gpu_appliance.stats()
    assert len(st["workers"]) == torch.cuda.device_count()
    assert all("cuda" in w["device"] for w in st["workers"])
    assert st["vmu"]["host_arena"]["pinned"] is True
    for dev in st["vmu"]["devices"]:
        assert dev["data"]["capacity"] > 0 and dev["text"]["capacity"] > 0


@pytest.mark.parametrize("via", ["unix", "tcp"])
def test_round_trip_through_device_memory(gpu_appliance, via):
    ts = [torch.randn(1024, 1024), torch.randn(64, 64).bfloat16().t(), torch.arange(10)]
    with gpu_appliance.connect(via) as client, client.session() as s:
        remotes = s.put_many(ts)
        for t, back in zip(ts, s.get_many(remotes), strict=True):
            assert torch.equal(t, back)
        data = next(d for d in client.stats()["vmu"]["devices"] if d["worker"] == s.worker)
        assert data["data"]["used"] >= ts[0].nbytes


def test_graph_executes_on_the_gpu_with_eager_parity(gpu_appliance):
    a, b = torch.randn(256, 256), torch.randn(256, 256)
    with gpu_appliance.connect() as client, client.session() as s:
        ra, rb = s.put_many([a, b])
        _, (out,) = s.execute(
            [{"op": "aten::mm.default", "args": [ra.ref(), rb.ref()]}], fetch=[{"$v": 0}]
        )
    expected = (a.cuda() @ b.cuda()).cpu()
    torch.testing.assert_close(out, expected, rtol=0, atol=0)


def test_random_ops_on_a_gpu_worker_draw_fresh_numbers(gpu_appliance, monkeypatch):
    import djinn  # noqa: F401
    from djinn.frontend import session

    monkeypatch.setenv("DJINN_ADDRESS", gpu_appliance.unix)
    session.reset()
    a = torch.randn(1000, device="remote_accelerator:0").cpu()
    b = torch.randn(1000, device="remote_accelerator:0").cpu()
    assert not torch.equal(a, b)
    session.reset()
