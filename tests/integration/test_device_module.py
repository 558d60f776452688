"""``torch.remote_accelerator`` behaves as a CUDA device module would (issue 8 §3,
issue 15 §2, §5, §6, §8): RNG state, memory figures from the appliance, autocast with
CUDA's policy, pinned memory, save and load, and `djinn run`'s view of torch.cuda."""

from __future__ import annotations

import copy
import io
import os
import subprocess
import sys
import textwrap

import pytest
import torch

R = "remote_accelerator:0"


def _djinn_run(appliance, script) -> subprocess.CompletedProcess:
    """``djinn run script`` on ``appliance``, or on an embedded one when it is None."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    if appliance is not None:
        env["DJINN_ADDRESS"] = appliance.unix
    done = subprocess.run(
        [sys.executable, "-m", "djinn.cli.main", "run", str(script)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    return done


def test_fork_rng_restores_the_remote_generator(remote):
    torch.manual_seed(3)
    with torch.random.fork_rng(device_type="remote_accelerator"):
        inside = torch.randn(5, device=R).cpu()
    after = torch.randn(5, device=R).cpu()
    torch.manual_seed(3)
    assert torch.equal(inside, after)
    assert torch.equal(torch.randn(5), inside)  # the same stream as local eager


def test_rng_state_round_trips(remote):
    mod = torch.remote_accelerator
    state = mod.get_rng_state()
    a = torch.rand(4, device=R).cpu()
    mod.set_rng_state(state)
    assert torch.equal(torch.rand(4, device=R).cpu(), a)
    mod.manual_seed(11)
    b = torch.rand(4, device=R).cpu()
    torch.manual_seed(11)
    assert torch.equal(torch.rand(4), b)
    assert mod.initial_seed() == 11


def test_memory_figures_come_from_the_appliance(remote):
    mod = torch.remote_accelerator
    start = mod.memory_allocated()
    big = torch.ones(1 << 18, device=R) * 2  # 1 MiB, kept remotely once run
    held = mod.memory_allocated()
    assert held - start >= 1 << 20
    assert mod.max_memory_allocated() >= held
    free, total = mod.mem_get_info()
    assert 0 < free <= total
    del big
    assert mod.memory_allocated() < held


def test_autocast_follows_cudas_policy(remote):
    torch.manual_seed(0)
    x, w = torch.randn(8, 16), torch.randn(4, 16)
    rx, rw = x.to(R), w.to(R)
    with torch.autocast("remote_accelerator", dtype=torch.float16):
        y = torch.nn.functional.linear(rx, rw)  # lower precision
        s = torch.softmax(y, dim=-1)  # float32
        z = rx + 1  # untouched
    assert (y.dtype, s.dtype, z.dtype) == (torch.float16, torch.float32, torch.float32)
    want = torch.nn.functional.linear(x.half(), w.half())
    assert torch.equal(y.cpu(), want)
    torch.testing.assert_close(s.cpu(), torch.softmax(want.float(), dim=-1))
    with torch.autocast("remote_accelerator", dtype=torch.bfloat16):
        assert (rx @ rw.t()).dtype == torch.bfloat16


def test_pinned_memory_and_non_blocking_copies(remote):
    t = torch.arange(12.0).reshape(3, 4)
    pinned = t.pin_memory()
    assert pinned.is_pinned() and not t.is_pinned()
    moved = pinned.to(R, non_blocking=True)
    pinned.fill_(-1)  # the copy was complete when .to() returned
    assert torch.equal(moved.cpu(), t)


def test_save_and_load_remote_tensors(remote, tmp_path):
    t = torch.randn(3, 5)
    r = t.to(R)
    path = tmp_path / "t.pt"
    torch.save({"x": r, "p": torch.nn.Parameter(r.clone())}, path)
    back = torch.load(path)
    assert back["x"].device.type == "remote_accelerator"
    assert torch.equal(back["x"].cpu(), t)
    local = torch.load(path, map_location="cpu")
    assert local["x"].device.type == "cpu" and torch.equal(local["x"], t)
    assert isinstance(local["p"], torch.nn.Parameter)


def _tied() -> torch.nn.Module:
    torch.manual_seed(0)
    emb, head = torch.nn.Embedding(3, 2), torch.nn.Linear(2, 3, bias=False)
    head.weight = emb.weight
    return torch.nn.Sequential(emb, head)


@pytest.mark.parametrize("device", [R, "cpu"])
def test_saved_and_copied_tensors_keep_the_storage_they_share(remote, device):
    """Note [copies keep shared storage]: a view and its base, saved or deep-copied, were
    copied apart, so writing into the loaded view left the loaded base as it was; and a
    tied checkpoint's keys scaled one by one were scaled once (a review)."""
    x = torch.arange(6.0).reshape(2, 3).to(device)
    for how in ("load", "load to cpu", "deepcopy"):
        pair = {"x": x, "v": x[:, 1], "alias": x.detach()[1]}
        if how == "deepcopy":
            got = copy.deepcopy(pair)
        else:
            buf = io.BytesIO()
            torch.save(pair, buf)
            buf.seek(0)
            got = torch.load(buf, map_location="cpu" if how == "load to cpu" else None)
        want_device = "cpu" if how == "load to cpu" else x.device.type
        assert got["x"].device.type == want_device
        got["v"].fill_(-1)
        got["alias"].mul_(10)
        assert got["x"].cpu().tolist() == [[0.0, -1.0, 2.0], [30.0, -10.0, 50.0]], how
    assert x.cpu().tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]]  # the originals stay
    model = _tied().to(device)
    buf = io.BytesIO()
    torch.save(model.state_dict(), buf)
    buf.seek(0)
    state = torch.load(buf)
    for key in state:  # scaling a checkpoint key by key: the tied weight twice
        state[key].mul_(0.5)
    want = _tied().state_dict()["0.weight"] * 0.25
    assert torch.allclose(state["1.weight"].cpu(), want) and torch.allclose(
        state["0.weight"].cpu(), want
    )


def test_deep_copies_of_strided_aliases_read_their_own_values(remote):
    """Note [copies keep shared storage]: a column's copy (a strided root, no _base) left
    the gaps between its elements unwritten, and an alias of the same storage copied
    after it read them: uninitialised memory (a review)."""
    for make in (lambda t: t.detach(), lambda t: t):
        base = torch.arange(16.0).reshape(4, 4).to(R)
        with torch.inference_mode():
            a, b = make(base[:, 0]), make(base[0:2, 1])
        got = copy.deepcopy([a, b])
        assert got[0].cpu().tolist() == [0.0, 4.0, 8.0, 12.0]
        assert got[1].cpu().tolist() == [1.0, 5.0]


def test_storage_pointers_tell_shared_memory_apart_as_on_a_device(remote, tmp_path):
    """Note [remote storages]: safetensors and save_pretrained compare storage pointers;
    a remote tensor's raised ("invalid python storage") and save_pretrained crashed."""
    from safetensors.torch import load_file, save_file, save_model

    x = torch.arange(6.0).reshape(2, 3).to(R)
    other = torch.ones(3).to(R)
    ptr = x.untyped_storage().data_ptr()
    assert ptr != 0 and x.data_ptr() == ptr
    assert x[1].untyped_storage().data_ptr() == ptr == x.detach().untyped_storage().data_ptr()
    assert x[1].data_ptr() == ptr + 3 * 4  # its offset in bytes, as a device tensor's
    assert other.untyped_storage().data_ptr() not in (0, ptr)
    assert x[1].untyped_storage().nbytes() == 24
    save_file({"x": x, "other": other}, tmp_path / "t.safetensors")
    back = load_file(tmp_path / "t.safetensors")
    assert torch.equal(back["x"], torch.arange(6.0).reshape(2, 3))
    model = _tied().to(R)  # tied: saved once, as for a CUDA model
    save_model(model, tmp_path / "m.safetensors")
    saved = load_file(tmp_path / "m.safetensors")
    assert len(saved) == 1 and torch.equal(next(iter(saved.values())), _tied()[0].weight.detach())


def test_a_storage_moved_to_the_remote_device_is_refused_typed(remote, tmp_path):
    """Note [no storages on the remote device]: it killed the process (SIGSEGV)."""
    import io

    from djinn.errors import UnsupportedOp

    with pytest.raises(UnsupportedOp, match="storage cannot move"):
        torch.ones(2).untyped_storage().to(device=R)
    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    buf.seek(0)
    with pytest.raises(UnsupportedOp, match="map_location"):
        torch.load(buf, map_location=lambda s, loc: s.to(device=R))
    assert torch.ones(2).untyped_storage().to(device="cpu").nbytes() == 8
    with torch.remote_accelerator.device(0):  # the context itself is still a no-op
        assert (torch.ones(2, device=R) + 1).cpu().tolist() == [2.0, 2.0]


def test_a_storage_made_on_the_remote_device_is_refused_typed(remote):
    """Note [no storages on the remote device] (storages.py): it killed the process
    (SIGSEGV), whichever storage class made it; other devices' storages are PyTorch's."""
    import warnings

    from djinn.errors import UnsupportedOp

    for device in (R, torch.device(R)):
        with pytest.raises(UnsupportedOp, match="storage cannot be made"):
            torch.UntypedStorage(16, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # TypedStorage is deprecated
        with pytest.raises(UnsupportedOp, match="storage cannot be made"):
            torch.TypedStorage(4, device=R, dtype=torch.float32)
        assert torch.TypedStorage([1.0, 2.0]).tolist() == [1.0, 2.0]
    assert torch.UntypedStorage(8).nbytes() == 8
    assert torch.UntypedStorage([1, 2, 3]).tolist() == [1, 2, 3]
    assert torch.UntypedStorage(4, device="cpu").device == torch.device("cpu")
    assert torch.ones(3, device=R).untyped_storage().nbytes() == 12  # a tensor's: as before


def test_djinn_run_refuses_a_cuda_storage_typed(appliance, tmp_path):
    """Under ``djinn run`` the program has CUDA: a storage made on it is the remote
    device's, refused typed (a review: PyTorch's untyped "not compiled with CUDA")."""
    script = tmp_path / "storage.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            from djinn.errors import UnsupportedOp
            for device in ("cuda", "cuda:0", torch.device("cuda")):
                try:
                    torch.UntypedStorage(4, device=device)
                except UnsupportedOp:
                    print("refused")
            print(torch.UntypedStorage(4, device="cpu").nbytes())
            """
        )
    )
    assert _djinn_run(appliance, script).stdout.split() == ["refused"] * 3 + ["4"]


def test_djinn_run_answers_torch_cuda_for_the_appliance(appliance, tmp_path):
    script = tmp_path / "probe.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            x = torch.randn(256, 256).cuda()
            y = (x @ x).sum()
            y.item()
            with torch.autocast("cuda"):
                h = x @ x
            print(x.is_cuda, torch.cuda.is_available(), torch.cuda.device_count())
            print(torch.cuda.memory_allocated() >= 256 * 256 * 4, h.dtype)
            """
        )
    )
    done = _djinn_run(appliance, script)
    assert done.stdout.split() == ["True", "True", "1", "True", "torch.float16"]


def test_djinn_run_supports_what_cuda_scripts_also_touch(appliance, tmp_path):
    """Events for timing, streams, device properties and contexts, NVTX ranges, memory
    statistics."""
    script = tmp_path / "isms.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch
            torch.cuda.set_device(0)
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            x = torch.randn(64, 64, device="cuda")
            with torch.cuda.device(0), torch.cuda.stream(torch.cuda.current_stream()):
                torch.cuda.nvtx.range_push("step")
                start.record()
                y = (x @ x).relu()
                end.record()
                torch.cuda.nvtx.range_pop()
            torch.cuda.synchronize()
            props = torch.cuda.get_device_properties(0)
            state = torch.cuda.get_rng_state()
            print(start.elapsed_time(end) >= 0, props.total_memory > 0, state.numel() > 0)
            print(round(y.sum().item(), 3) == round((x.cpu() @ x.cpu()).relu().sum().item(), 3))
            # memory_summary() read keys memory_stats() lacked: KeyError (a review)
            summary, stats = torch.cuda.memory_summary(), torch.cuda.memory_stats()
            print("Allocated memory" in summary, stats["allocated_bytes.all.current"] > 0)
            # by torch.cuda.random's own names, as Trainer's checkpoints save it
            torch.cuda.random.set_rng_state_all(torch.cuda.random.get_rng_state_all())
            print(torch.cuda.random.get_rng_state().numel() > 0)
            """
        )
    )
    done = _djinn_run(appliance, script)
    assert done.stdout.split() == ["True"] * 7, done.stdout + done.stderr


def test_a_checkpoint_written_under_djinn_run_loads_as_a_cuda_one(appliance, tmp_path):
    """Note [checkpoints name the mapped device] (serialization.py): it recorded
    ``remote_accelerator:0``, which plain PyTorch cannot parse, and ``map_location={"cuda:0":
    "cpu"}`` matched nothing (a hunt)."""
    ckpt = tmp_path / "ck.pt"
    script = tmp_path / "save.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import torch
            torch.manual_seed(0)
            m = torch.nn.Linear(3, 2).cuda()
            torch.save({{"model": m.state_dict(), "t": torch.arange(4.0).cuda()}}, {str(ckpt)!r})
            back = torch.load({str(ckpt)!r})  # onto the appliance again, as "cuda"
            print(back["t"].is_cuda, back["model"]["weight"].is_cuda, back["t"].tolist())
            """
        )
    )
    assert _djinn_run(appliance, script).stdout.split() == [
        "True",
        "True",
        "[0.0,",
        "1.0,",
        "2.0,",
        "3.0]",
    ]
    # plain PyTorch, in a process without Djinn: a CUDA checkpoint's behaviour
    probe = textwrap.dedent(
        f"""
        import torch
        for where in ("cpu", {{"cuda:0": "cpu"}}):
            d = torch.load({str(ckpt)!r}, map_location=where)
            assert d["t"].device.type == "cpu" and d["t"].tolist() == [0.0, 1.0, 2.0, 3.0]
            assert d["model"]["weight"].shape == (2, 3)
        try:
            torch.load({str(ckpt)!r})
        except Exception as exc:  # no CUDA here: what a CUDA checkpoint says
            print("cuda" in str(exc).lower())
        else:
            print(torch.cuda.is_available())
        """
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    done = subprocess.run(
        [sys.executable, "-c", probe], env=env, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["True"]
