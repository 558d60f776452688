"""`djinn run`: an unmodified CUDA script runs on the appliance with the same numbers."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import run_together

SCRIPT = textwrap.dedent("""
    import sys
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.ReLU(), torch.nn.Flatten(),
                              torch.nn.Linear(4 * 6 * 6, 5))
    net = net.cuda() if device == "cuda" else net
    x = torch.randn(2, 3, 8, 8).to(device)
    w = torch.randn(5, 3, device=torch.device(device))
    out = net(x) @ w
    print("sum %.6f" % out.sum().item())
    print("values", [round(v, 5) for v in out.flatten().tolist()])
    print("argmax", out.argmax(dim=1).tolist())
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    loss = out.pow(2).mean()
    loss.backward()
    opt.step()
    print("after step %.6f" % (net(x) @ w).sum().item())
    print("argv", sys.argv[1:])
    sys.exit(int(sys.argv[1]))
""")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    env.update(extra)
    return env


def _djinn_run(appliance, script: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "djinn.cli.main", "run", str(script)],
        env=_env(DJINN_ADDRESS=appliance.unix),
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.fixture
def scripts(tmp_path: Path) -> tuple[Path, Path]:
    cuda = tmp_path / "train_cuda.py"
    cuda.write_text(SCRIPT)
    cpu = tmp_path / "train_cpu.py"
    cpu.write_text(SCRIPT.replace('"cuda" if torch.cuda.is_available() else "cpu"', '"cpu"'))
    return cuda, cpu


def test_unmodified_cuda_script_prints_the_same_numbers_as_local_cpu(appliance, scripts):
    cuda, cpu = scripts
    remote, local = run_together(
        dict(
            args=[sys.executable, "-m", "djinn.cli.main", "run", str(cuda), "7", "--some-flag"],
            env=_env(DJINN_ADDRESS=appliance.unix),
            capture_output=True,
            text=True,
            timeout=120,
        ),
        dict(
            args=[sys.executable, str(cpu), "7", "--some-flag"],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        ),
    )
    assert local.returncode == 7
    assert remote.returncode == 7, remote.stderr  # exit code passed through
    assert remote.stdout == local.stdout  # same numbers, same argv
    assert "argv ['7', '--some-flag']" in remote.stdout


def test_script_really_ran_on_the_appliance(appliance, tmp_path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        textwrap.dedent("""
        import torch
        x = torch.ones(3).cuda()
        print(x.device.type, torch.cuda.is_available(), torch.device("cuda", 0))
        print(type(x).__name__)
    """)
    )
    out = _djinn_run(appliance, probe)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == [
        "remote_accelerator",
        "True",
        "remote_accelerator:0",
        "LazyTensor",
    ]


def test_model_cuda_of_a_transformers_model_takes_the_model_path(appliance, tmp_path):
    """``model.cuda()`` and ``model.to("cuda")`` reach the model path through PyTorch's own
    ``Module`` methods (Note [module to]); the logits are local CPU's."""
    probe = tmp_path / "gpt2_cuda.py"
    probe.write_text(
        textwrap.dedent("""
        import torch
        from transformers import GPT2Config, GPT2LMHeadModel
        torch.manual_seed(0)
        cfg = GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=100)
        models = [GPT2LMHeadModel(cfg).eval() for _ in range(2)]
        local = [m(torch.tensor([[1, 2, 3]])).logits for m in models]
        moved = [models[0].cuda(), models[1].to("cuda")]
        for m, want in zip(moved, local):
            got = m(torch.tensor([[1, 2, 3]]).cuda()).logits.cpu()
            print(m._djinn.info["uploaded"], (got - want).abs().max().item() <= 1e-5)
    """)
    )
    out = _djinn_run(appliance, probe)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["True", "True", "True", "True"]


def test_script_error_shows_the_scripts_traceback_not_djinns(appliance, tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "import torch\n\ndef f():\n    raise ValueError('broken input')\n\n"
        "x = torch.ones(2).cuda()\nf()\n"
    )
    out = subprocess.run(
        [sys.executable, "-m", "djinn.cli.main", "run", str(bad)],
        env=_env(DJINN_ADDRESS=appliance.unix),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 1
    assert "ValueError: broken input" in out.stderr
    assert 'bad.py", line 7, in <module>' in out.stderr
    assert "djinn/cli" not in out.stderr and "runpy" not in out.stderr


def test_missing_script_is_a_clear_error(tmp_path):
    out = subprocess.run(
        [sys.executable, "-m", "djinn.cli.main", "run", str(tmp_path / "nope.py")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 2 and "no such script" in out.stderr


def test_with_no_appliance_configured_an_embedded_one_serves_and_stops(tmp_path, scripts):
    cuda, cpu = scripts
    env = _env(DJINN_SOCKET_PATH=str(tmp_path / "none.sock"), DJINN_ARENA_BYTES="64MiB")
    remote, local = run_together(
        dict(
            args=[sys.executable, "-m", "djinn.cli.main", "run", str(cuda), "0"],
            env=env,
            cwd=tmp_path,
            capture_output=True,
            text=True,
            timeout=180,
        ),
        dict(
            args=[sys.executable, str(cpu), "0"],
            env=_env(),
            capture_output=True,
            text=True,
            timeout=120,
        ),
    )
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout


def test_factories_asked_for_pinned_memory_work_as_on_cuda(appliance, tmp_path):
    """A CUDA script's pinned host tensors (safetensors' load_file(device="cuda"), peft's
    adapter loading, a hand-made staging buffer) raised NotImplementedError: PyTorch asks
    the backend's C++ hooks for the pinned allocator (a review)."""
    from safetensors.torch import save_file

    weights = {"w": torch.arange(12, dtype=torch.float32).reshape(3, 4)}
    save_file(weights, str(tmp_path / "w.safetensors"))
    script = tmp_path / "pinned.py"
    script.write_text(
        textwrap.dedent(f"""
        import torch
        from safetensors.torch import load_file
        staging = torch.empty(8, pin_memory=True)
        print("pinned", staging.is_pinned(), torch.zeros(2, pin_memory=True).is_pinned())
        w = load_file({str(tmp_path / "w.safetensors")!r}, device="cuda")["w"]
        print("loaded", w.device.type, w.is_cuda, w.sum().item())
        """)
    )
    done = _djinn_run(appliance, script)
    assert done.returncode == 0, done.stderr
    assert "pinned True True" in done.stdout
    assert "loaded remote_accelerator True 66.0" in done.stdout


def test_threads_the_script_starts_map_cuda_too(appliance, tmp_path):
    """Note [mapped threads]: the map is a per-thread mode; a thread of the script's own
    (a plain one, a pool's, a subclass with its own ``run``) raised "Torch not compiled
    with CUDA enabled" at its first ``device="cuda"`` (a review)."""
    script = tmp_path / "threads.py"
    script.write_text(
        textwrap.dedent("""
        import concurrent.futures, threading, torch
        out = {}
        def work(k):
            out[k] = (torch.arange(3.0, device="cuda") * k).device.type
        t = threading.Thread(target=work, args=(1,))
        t.start(); t.join()
        with concurrent.futures.ThreadPoolExecutor(2) as pool:
            list(pool.map(work, [2, 3]))
        class Worker(threading.Thread):
            def run(self):
                work(4)
        t = Worker()
        t.start(); t.join()
        print(sorted(out.items()))
        """)
    )
    done = _djinn_run(appliance, script)
    assert done.returncode == 0, done.stderr
    kinds = [(k, "remote_accelerator") for k in (1, 2, 3, 4)]
    assert str(kinds) in done.stdout


def test_a_thread_left_running_when_the_script_ends_keeps_the_map(appliance, tmp_path):
    """The interpreter joins such a thread after ``djinn run``'s script body returned; the
    map came off first, and the thread found ``cuda`` unmapped mid-way (a review)."""
    script = tmp_path / "late.py"
    script.write_text(
        textwrap.dedent("""
        import threading, time, torch
        def work():
            time.sleep(0.3)
            x = torch.ones(2, device="cuda") * 3
            print("late", torch.cuda.is_available(), x.device.type, x.sum().item(), flush=True)
        threading.Thread(target=work).start()  # not joined
        """)
    )
    done = _djinn_run(appliance, script)
    assert done.returncode == 0, done.stderr
    assert "late True remote_accelerator 6.0" in done.stdout
