"""A CUDA script's own habits under ``djinn run``: ``torch.set_default_device("cuda")``,
and ``torch.tensor`` of a list of its tensors (a hunt)."""

from __future__ import annotations

import subprocess
import sys
import textwrap

from tests.integration.test_device_module import _djinn_run

SCRIPT = textwrap.dedent(
    """
    import torch
    device = "cuda" if torch.cuda.is_available() else "cpu"
    a = torch.tensor([3.0, 1.0, 2.0], device=device)
    losses = [torch.tensor(0.5, device=device) * i for i in range(3)]
    print(torch.tensor(losses).tolist(), torch.tensor(losses).device.type)
    print(torch.as_tensor([a[0], a[1]]).tolist(), torch.tensor((a.sum(), a.mean())).tolist())
    print(torch.tensor([a[0], 1.0]).tolist(), torch.tensor([[a[0]], [a[1]]]).tolist())
    print(torch.tensor(losses, device=device).cpu().tolist())
    print(a.new_tensor([a[0], a[1]]).cpu().tolist(), torch.tensor(data=[a[2]]).tolist())
    print(torch.tensor([a.argmax(), a.argmin()]).tolist())
    print(torch.tensor([a[0], 2, a.argmax()]).tolist(), torch.tensor([1.0, 2.0]).tolist())
    torch.set_default_device(device)
    t = torch.arange(6.0)
    print(t.device.type != "cpu" or device == "cpu", t.tolist(), t.sum().item())
    print(repr(t).startswith("tensor([0., 1., 2., 3., 4., 5.]"))
    with torch.device(device):
        u = torch.ones(2, 2)
    print(u.tolist(), (u @ u).tolist())
    data = torch.utils.data.TensorDataset(torch.arange(8.0, device="cpu"))
    gen = torch.Generator(device="cpu").manual_seed(0)
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True, generator=gen)
    print([b[0].tolist() for b in loader])
    """
)


def test_a_cuda_scripts_habits_give_what_the_cpu_run_gives(appliance, tmp_path):
    """``set_default_device("cuda")`` hung the first ``.tolist()`` or ``print(t)``: the
    client's receive buffer was made on the default device, the remote one, and reading
    it re-entered the connection its own read held. ``torch.tensor`` of remote 0-d
    tensors met PyTorch's untyped "len() of a 0-d tensor" (Note [tensors in a list of
    data], devicemap.py)."""
    script = tmp_path / "habits.py"
    script.write_text(SCRIPT)
    local = subprocess.run(
        [sys.executable, str(script)], capture_output=True, text=True, timeout=120
    )
    assert local.returncode == 0, local.stderr[-2000:]
    assert _djinn_run(appliance, script).stdout == local.stdout


def test_legacy_cuda_tensor_types_make_remote_tensors(appliance, tmp_path):
    """Note [legacy CUDA tensor types] (legacy_types.py): ``torch.cuda.FloatTensor`` and
    its siblings failed untyped under ``djinn run`` ("type torch.cuda.FloatTensor not
    available"; a hunt). The GAN scripts' idioms, against the same values made on the
    CPU."""
    script = tmp_path / "legacy.py"
    script.write_text(
        textwrap.dedent(
            """
            import numpy as np, torch
            assert torch.cuda.is_available()
            Tensor, LongTensor = torch.cuda.FloatTensor, torch.cuda.LongTensor
            noise = np.random.RandomState(0).normal(0, 1, (4, 3))
            valid = Tensor(4, 1).fill_(1.0)
            z = Tensor(noise)
            labels = LongTensor(np.array([1, 0, 2, 1]))
            imgs = torch.arange(12.0).reshape(4, 3)
            real = imgs.type(Tensor)
            assert valid.is_cuda and z.is_cuda and real.is_cuda and labels.dtype == torch.int64
            assert torch.equal(z.cpu(), torch.tensor(noise, dtype=torch.float32))
            assert torch.equal(real.cpu(), imgs) and valid.cpu().tolist() == [[1.0]] * 4
            assert isinstance(real, Tensor) and not isinstance(labels, Tensor)
            assert isinstance(labels, LongTensor) and not isinstance(imgs, Tensor)
            assert real.type() == "torch.cuda.FloatTensor" and imgs.type() == "torch.FloatTensor"
            half = imgs.type("torch.cuda.HalfTensor")
            assert half.is_cuda and half.dtype == torch.float16
            assert Tensor().numel() == 0 and Tensor(torch.Size([2, 2])).shape == (2, 2)
            # NumPy ints are sizes, a lone float is refused, as by PyTorch's own (a review)
            assert Tensor(np.int64(3)).shape == (3,) and Tensor(np.int64(2), 1).shape == (2, 1)
            assert Tensor(2, device="cuda").shape == (2,) and Tensor(size=(2,)).shape == (2,)
            for bad in (3.0, True):
                try:
                    Tensor(bad)
                except TypeError:
                    pass
                else:
                    raise AssertionError(bad)
            torch.set_default_tensor_type("torch.cuda.FloatTensor")
            assert torch.ones(2).is_cuda and torch.ones(2).dtype == torch.float32
            torch.set_default_tensor_type(torch.cuda.DoubleTensor)
            assert torch.ones(2).is_cuda and torch.ones(2).dtype == torch.float64
            print("ok")
            """
        )
    )
    assert _djinn_run(appliance, script).stdout.split() == ["ok"]


def test_a_forked_process_is_refused_its_parents_connection(appliance, tmp_path):
    """Note [a forked process] (djinn/runtime/channel.py): a DataLoader worker, forked,
    made remote tensors under a default device of "cuda" on its parent's socket: "reply
    to request 4, expected 6", a lost session, then a hang (a review). The child is now
    refused, typed, as CUDA refuses a forked child; the parent goes on."""
    script = tmp_path / "fork.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, torch
            from djinn.errors import UnsupportedOp
            torch.set_default_device("cuda")
            a = torch.arange(4.0)
            ds = [(torch.zeros(2, device="cpu"), i) for i in range(8)]
            try:
                for xb, yb in torch.utils.data.DataLoader(ds, batch_size=4, num_workers=1):
                    print("batch", yb.device.type)
            except UnsupportedOp as exc:
                print("refused", "forked" in str(exc))
            pid = os.fork()
            if pid == 0:
                try:
                    a.sum().item()
                    code = 1
                except UnsupportedOp:
                    code = 7
                os._exit(code)
            _, status = os.waitpid(pid, 0)
            print("child", os.WEXITSTATUS(status))
            print((a * 2).tolist(), torch.ones(2).sum().item())
            """
        )
    )
    out = _djinn_run(appliance, script).stdout.splitlines()
    assert out == ["refused True", "child 7", "[0.0, 2.0, 4.0, 6.0] 2.0"]


def test_a_forked_childs_exit_leaves_the_embedded_appliance_alone(tmp_path):
    """A forked child that exits normally runs the parent's exit handlers: the embedded
    appliance's removed the parent's socket directory (its Popen said the appliance, not
    the child's own, had exited). Only the process that started it stops it now."""
    script = tmp_path / "fork_exit.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, sys, torch
            a = torch.arange(4.0, device="cuda")
            a.sum().item()
            pid = os.fork()
            if pid == 0:
                sys.exit(0)  # a normal exit: atexit handlers run in the child
            os.waitpid(pid, 0)
            from djinn.runtime import embedded
            print(os.path.exists(embedded._embedded.socket_path), (a * 2).tolist())
            """
        )
    )
    done = _djinn_run(None, script)  # the embedded appliance: no address given
    assert done.stdout.split() == ["True", "[0.0,", "2.0,", "4.0,", "6.0]"]
