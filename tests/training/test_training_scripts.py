"""Issue 15's acceptance: ordinary CUDA training scripts run unchanged under `djinn run`
and end where the same scripts end on the local CPU: every loss and every final
parameter within 1e-5 (the scripts save them with torch.save, itself under test)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

import djinn  # noqa: F401 - torch.load of the scripts' remote tensors needs the device
from tests.conftest import run_together

HERE = Path(__file__).parent
SCRIPTS = ["cnn_amp", "transformer_checkpoint", "dataloader_pinned", "optimizers", "resume"]


def _call(script: str, out: Path, remote_address: str | None) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DJINN_")}
    if remote_address:
        env["DJINN_ADDRESS"] = remote_address
        cmd = [sys.executable, "-m", "djinn.cli.main", "run", str(HERE / f"{script}.py"), str(out)]
    else:
        cmd = [sys.executable, str(HERE / f"{script}.py"), str(out)]
    return dict(args=cmd, env=env, capture_output=True, text=True, timeout=300)


@pytest.mark.parametrize("script", SCRIPTS)
def test_script_under_djinn_run_matches_local_cpu(appliance, tmp_path, script):
    outs = [tmp_path / "local.pt", tmp_path / "remote.pt"]
    # the local run and the remote one share nothing: both at once
    for done in run_together(_call(script, outs[0], None), _call(script, outs[1], appliance.unix)):
        assert done.returncode == 0, done.stderr[-3000:]
    local, remote = (torch.load(out) for out in outs)  # written just now by our own script
    torch.testing.assert_close(
        torch.tensor(remote["losses"]), torch.tensor(local["losses"]), rtol=1e-5, atol=1e-5
    )
    assert sorted(remote["params"]) == sorted(local["params"])
    for name, want in local["params"].items():
        got = remote["params"][name]
        assert got.device.type == "remote_accelerator", name  # saved with its device
        torch.testing.assert_close(got.cpu(), want, rtol=1e-5, atol=1e-5, msg=name)
