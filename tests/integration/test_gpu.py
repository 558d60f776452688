"""CUDA paths: per-GPU workers, the page-locked arena, device VMU. Skipped without CUDA."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch

from tests.conftest import wait_for

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

        def worker_stats():  # workers push stats at most every 0.1 s: poll, never read once
            doc = client.stats()
            dev = next(d for d in doc["vmu"]["devices"] if d["worker"] == s.worker)
            w = next(w for w in doc["workers"] if w["id"] == s.worker)
            return (dev, w) if dev["data"]["used"] >= ts[0].nbytes else None

        dev, w = wait_for(worker_stats)
        # Note [device memory figures]: the worker's CUDA allocator holds at least what the
        # VMU charged, and the card's figures agree with this process's view of it
        figures = w["device_memory"]
        assert figures["allocated"] >= dev["data"]["used"]
        free, total = torch.cuda.mem_get_info(0)
        assert figures["total"] == total and abs(figures["free"] - free) <= 0.01 * total
        # NVML's view of the same card: its total counts what the driver keeps back
        # (150,754,820,096 against CUDA's 150,109,880,320 bytes on an H200)
        assert total <= w["gpu_memory_total"] <= 1.01 * total
        assert 0 < w["gpu_memory_used"] <= total


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


PINNED = textwrap.dedent(
    """
    import sys
    import torch
    if sys.argv[1] == "djinn":
        import djinn  # noqa: F401
    from torch.utils.data import DataLoader, TensorDataset

    x = torch.randn(1000)
    p = x.pin_memory()
    (batch,) = next(iter(DataLoader(TensorDataset(torch.randn(8, 3)), batch_size=4,
                                    pin_memory=True)))
    print(p.is_pinned(), x.is_pinned(), batch.is_pinned(),
          torch.equal(p.cuda(non_blocking=True).cpu(), x))
    """
)


def test_pin_memory_on_a_cuda_host_is_unchanged_by_import_djinn():
    """Note [pinned memory beside CUDA]: PyTorch asks the accelerator which allocator pins,
    and prefers a registered PrivateUse1 device: without the fix, pin_memory() raised."""
    got = {}
    for mode in ("plain", "djinn"):
        proc = subprocess.run(
            [sys.executable, "-c", PINNED, mode], capture_output=True, text=True, timeout=120
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        got[mode] = proc.stdout.split()
    assert got["djinn"] == got["plain"] == ["True", "False", "True", "True"]


def test_an_index_out_of_range_on_a_gpu_worker_fails_alone(gpu_appliance, monkeypatch):
    """Note [indices on a GPU]: refused before the kernel, whose device-side assert would
    lose the worker's CUDA context for every session on it (seen on an H200)."""
    import djinn  # noqa: F401
    from djinn.errors import DjinnError
    from djinn.frontend import session

    monkeypatch.setenv("DJINN_ADDRESS", gpu_appliance.unix)
    session.reset()
    r = "remote_accelerator:0"
    x = torch.arange(16.0).reshape(4, 4).to(r)
    with pytest.raises(DjinnError, match="out of bounds"):
        torch.nn.functional.embedding(torch.tensor([7], device=r), x).cpu()
    with pytest.raises(DjinnError, match="out of bounds"):
        x.gather(0, torch.full((1, 4), 9, device=r)).cpu()
    assert torch.equal((x * 2).cpu(), torch.arange(16.0).reshape(4, 4) * 2)
    assert gpu_appliance.stats()["workers"][0]["restarts"] == 0
    session.reset()


def test_a_replayed_forward_runs_as_a_cuda_graph(gpu_appliance, monkeypatch):
    """Note [CUDA graphs for plans]: a forward replayed by djinn.replayable is captured once
    its plan is compiled, then replayed as one CUDA graph: the results of local CUDA eager
    for every new input (each a new upload, copied into the graph's buffer), a bad token id
    refused before the replay, and the worker never restarted."""
    import djinn
    from djinn.errors import DjinnError
    from djinn.frontend import session

    monkeypatch.setenv("DJINN_ADDRESS", gpu_appliance.unix)
    session.reset()
    r = "remote_accelerator:0"
    torch.manual_seed(0)
    local = torch.nn.Sequential(
        torch.nn.Embedding(100, 32), torch.nn.Linear(32, 64), torch.nn.GELU(),
        torch.nn.LayerNorm(64), torch.nn.Linear(64, 100),
    )  # fmt: skip
    remote = __import__("copy").deepcopy(local).to(r).eval()  # training mode: the graph path
    local = local.cuda().eval()

    def stats() -> dict:
        return gpu_appliance.stats()["scheduler"][0]["cuda_graphs"]

    before = stats()
    forward = djinn.replayable(lambda ids: remote(ids))
    with torch.no_grad():
        # interpreted twice, recorded, planned, then compiled and captured; the next call's
        # new ids are elsewhere: captured again, with the ids copied in; then replays
        for k in range(12):
            # one row of ids: with a batch, Linear's output would be a view of its addmm,
            # and djinn.replayable runs a function that keeps such a tensor plainly
            ids = torch.randint(0, 100, (32,), generator=torch.Generator().manual_seed(k))
            got = forward(ids.to(r)).cpu()
            want = local(ids.cuda()).cpu()
            assert (got - want).abs().max().item() <= 1e-5, k
            # the same kernels as the same forward captured op by op, so the same bits
            assert torch.equal(got, remote(ids.to(r)).cpu()), k
        # the worker's stats reach the supervisor every STATS_PUSH_S
        assert forward.stats()["replays"] == 10, forward.stats()
        after = wait_for(lambda: (s := stats())["replays"] >= before["replays"] + 3 and s)
        assert after["captured"] > before["captured"], after
        assert after["failed"] == before["failed"], after
        with pytest.raises(DjinnError, match="out of bounds"):
            forward(torch.full((32,), 100).to(r)).cpu()
        ids = torch.randint(0, 100, (32,))
        assert (forward(ids.to(r)).cpu() - local(ids.cuda()).cpu()).abs().max().item() <= 1e-5
    assert gpu_appliance.stats()["workers"][0]["restarts"] == 0
    session.reset()


def test_a_replayed_training_step_runs_as_a_cuda_graph(gpu_appliance, tmp_path, monkeypatch):
    """Note [a graph that writes its inputs]: an SGD step (momentum) replayed by
    djinn.replayable writes its weights and momentum buffers; its plan is captured as a
    CUDA graph whose warm-up writes copies, so each call applies the step once: every loss
    and parameter is bit for bit the same loop's on an appliance without CUDA graphs (the
    same kernels; this process cannot train on its local GPU, pytorch#161129)."""
    import djinn
    from djinn.frontend import session
    from tests.conftest import start_appliance

    r = "remote_accelerator:0"

    def train(address: str) -> tuple[list[torch.Tensor], list[torch.Tensor], dict]:
        monkeypatch.setenv("DJINN_ADDRESS", address)
        session.reset()
        torch.manual_seed(0)
        model = torch.nn.Sequential(
            torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 1)
        ).to(r)
        opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)

        def step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
            opt.zero_grad()
            loss = torch.nn.functional.mse_loss(model(x), y)
            loss.backward()
            opt.step()
            return loss.detach()

        run = djinn.replayable(step)
        gen = torch.Generator().manual_seed(1)
        losses = []
        for _ in range(12):
            x, y = torch.randn(8, 16, generator=gen), torch.randn(8, 1, generator=gen)
            losses.append(run(x.to(r), y.to(r)).cpu())
        params = [p.detach().cpu() for p in model.parameters()]
        stats = run.stats()
        session.reset()
        return losses, params, stats

    def graphs() -> dict:
        return gpu_appliance.stats()["scheduler"][0]["cuda_graphs"]

    before = graphs()
    losses, params, stats = train(gpu_appliance.unix)
    assert stats["replays"] >= 8, stats
    after = wait_for(lambda: (s := graphs())["replays"] >= before["replays"] + 5 and s)
    assert after["captured"] > before["captured"] and after["failed"] == before["failed"], after
    plain = start_appliance(tmp_path, gpus="auto", arena_bytes="1GiB", cuda_graphs=False)
    try:
        want_losses, want_params, _ = train(plain.unix)
        assert plain.stats()["scheduler"][0]["cuda_graphs"]["replays"] == 0
    finally:
        plain.stop()
    for k, (got, want) in enumerate(zip(losses, want_losses, strict=True)):
        assert torch.equal(got, want), f"loss {k}: {got} != {want}"
    for got, want in zip(params, want_params, strict=True):
        assert torch.equal(got, want), (got - want).abs().max()
    assert gpu_appliance.stats()["workers"][0]["restarts"] == 0


def test_a_step_with_dropout_replays_on_a_gpu_worker_as_it_runs_captured(
    gpu_appliance, monkeypatch
):
    """Note [replayed draws] with a GPU worker's generator (Note [a GPU worker's generator]):
    a replay sends, for each random op, the device generator's seed and offset as the
    captured op did, and the worker sets CUDA's generator to them, so a replayed step with
    dropout draws the masks the same step draws captured op by op: the same losses and
    parameters, bit for bit. The local CPU generator is left where the model's
    initialisation left it, as CUDA eager leaves it. The default Adam's steps are followed
    (ahead of the forward and backward on a GPU worker, Note [steps followed while the
    graph runs])."""
    from djinn.frontend import session
    from tests.dropout_training import initialised_cpu_generator, train_with_dropout

    monkeypatch.setenv("DJINN_ADDRESS", gpu_appliance.unix)
    session.reset()
    r = "remote_accelerator:0"
    losses, params, stats = train_with_dropout(r, True, 10)
    cpu_after, device_after = torch.get_rng_state(), torch.remote_accelerator.get_rng_state()
    # the first call runs as it is: Adam makes its state (zeros_like) and keeps it
    assert stats["replays"] == 7 and stats["recordings"] == 2, stats
    want_losses, want_params, _ = train_with_dropout(r, False, 10)
    assert torch.equal(torch.remote_accelerator.get_rng_state(), device_after)
    assert torch.equal(cpu_after, initialised_cpu_generator())
    for k, (got, want) in enumerate(zip(losses, want_losses, strict=True)):
        assert torch.equal(got, want), f"loss {k}: {got} != {want}"
    for got, want in zip(params, want_params, strict=True):
        assert torch.equal(got, want), (got - want).abs().max()
    assert gpu_appliance.stats()["workers"][0]["restarts"] == 0
    session.reset()
