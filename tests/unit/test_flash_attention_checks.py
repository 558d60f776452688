"""Note [fused attention]: the appliance runs the CPU flash-attention kernel only on
arguments that kernel can read safely (it checks none of them itself)."""

from __future__ import annotations

import pytest
import torch

from djinn.appliance.executor.graph import GraphRun
from djinn.appliance.vmu.device import DeviceVMU
from djinn.errors import InvalidArgument

OP = "aten::_scaled_dot_product_flash_attention_for_cpu.default"


def run(handles: dict[str, torch.Tensor], **kwargs):
    node = {"op": OP, "args": [{"$h": "q"}, {"$h": "k"}, {"$h": "v"}], "kwargs": kwargs}
    g = GraphRun(
        {"nodes": [node], "fetch": [{"$v": 0, "i": 0}]},
        handles.__getitem__,
        [],
        torch.device("cpu"),
        DeviceVMU(1 << 30)["stack"],
    )
    return g.run()[1][0]


def qkv(q=(2, 4, 8, 16), k=(2, 4, 8, 16), v=(2, 4, 8, 16), dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return {n: torch.randn(s, generator=g, dtype=dtype) for n, s in (("q", q), ("k", k), ("v", v))}


def test_well_formed_arguments_give_local_eagers_attention():
    h = qkv(k=(2, 4, 5, 16), v=(2, 4, 5, 16))
    got = run(h, is_causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(h["q"], h["k"], h["v"], is_causal=True)
    assert torch.equal(got, want)  # the kernel local eager picks on a CPU


@pytest.mark.parametrize(
    "shapes",
    [
        {"k": (1, 4, 8, 16), "v": (1, 4, 8, 16)},  # fewer batches than the query
        {"k": (2, 2, 8, 16), "v": (2, 2, 8, 16)},  # fewer heads
        {"k": (2, 4, 8, 8), "v": (2, 4, 8, 8)},  # another head size
        {"v": (2, 4, 4, 16)},  # key and value of other lengths
        {"q": (2, 4, 0, 16)},  # empty
        {"q": (4, 8, 16), "k": (4, 8, 16), "v": (4, 8, 16)},  # 3-D
    ],
)
def test_shapes_the_kernel_would_read_past_are_refused(shapes):
    with pytest.raises(InvalidArgument):
        run(qkv(**shapes))


def test_a_strided_last_dimension_a_mask_dropout_or_mixed_dtypes_are_refused():
    h = qkv()
    with pytest.raises(InvalidArgument, match="contiguous"):
        run({**h, "k": torch.randn(2, 4, 16, 8).transpose(2, 3)})
    with pytest.raises(InvalidArgument, match="attn_mask"):
        node_mask = {"$h": "m"}
        run({**h, "m": torch.zeros(8, 8)}, attn_mask=node_mask)
    with pytest.raises(InvalidArgument, match="dropout"):
        run(h, dropout_p=0.5)
    with pytest.raises(InvalidArgument, match="dtype"):
        run({**h, "v": h["v"].double()})
