"""Issue 12 §4, the capability interlock: with fallback = "local" a program whose
appliance cannot be reached runs on this machine (an embedded appliance), with one
warning; by default it gets UNAVAILABLE saying how to start or reach one."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

from tests.conftest import run_together

PROBE = textwrap.dedent("""
    import torch, djinn
    x = torch.arange(6.0, device="remote_accelerator:0").reshape(2, 3)
    print((x * 2 + 1).sum(dim=1).cpu().tolist())
""")
CUDA_SCRIPT = textwrap.dedent("""
    import torch
    torch.manual_seed(0)
    net = torch.nn.Linear(4, 3).cuda()
    print([round(v, 5) for v in net(torch.ones(2, 4).cuda()).sum(dim=0).tolist()])
""")


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    env.update(DJINN_ADDRESS="unix:///nonexistent/djinn.sock", **extra)
    return env


def _python_call(code: str, **env: str) -> dict:
    return dict(
        args=[sys.executable, "-c", code],
        env=_env(**env),
        capture_output=True,
        text=True,
        timeout=180,
    )


def _python(code: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(**_python_call(code, **env))


def test_local_fallback_runs_the_remote_device_here_with_one_warning(tmp_path):
    out = _python(PROBE, DJINN_FALLBACK="local")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split("\n")[0] == "[9.0, 27.0]"
    warnings = [line for line in out.stderr.splitlines() if "cannot be reached" in line]
    assert len(warnings) == 1 and "fallback = local" in warnings[0]


def test_local_fallback_under_djinn_run_prints_the_numbers_of_a_cpu_run(tmp_path):
    script = tmp_path / "train_cuda.py"
    script.write_text(CUDA_SCRIPT)
    remote, local = run_together(
        dict(
            args=[sys.executable, "-m", "djinn.cli.main", "run", str(script)],
            env=_env(DJINN_FALLBACK="local"),
            capture_output=True,
            text=True,
            timeout=180,
        ),
        _python_call(CUDA_SCRIPT.replace(".cuda()", "")),
    )
    assert remote.returncode == 0, remote.stderr
    assert remote.stdout == local.stdout


def test_by_default_an_unreachable_appliance_is_one_clear_error():
    out = _python(PROBE)
    assert out.returncode != 0
    last = out.stderr.strip().splitlines()[-1]
    assert "UNAVAILABLE" in last and "djinn serve" in last and 'fallback = "local"' in last
