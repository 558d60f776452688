"""Note [fused attention]: the appliance runs the CPU flash-attention kernel only on
arguments that kernel can read safely (it checks none of them itself)."""

from __future__ import annotations

import pytest
import torch

from djinn.appliance.executor.graph import GraphRun
from djinn.appliance.vmu.device import DeviceVMU
from djinn.errors import InvalidArgument

OP = "aten::_scaled_dot_product_flash_attention_for_cpu.default"


def run_node(op: str, args: list, kwargs: dict, handles: dict[str, torch.Tensor]):
    """The first output of one node run by the worker's graph executor, every check
    included, on ``handles``."""
    node = {"op": op, "args": args, "kwargs": kwargs}
    g = GraphRun(
        {"nodes": [node], "fetch": [{"$v": 0, "i": 0}]},
        handles.__getitem__,
        [],
        torch.device("cpu"),
        DeviceVMU(1 << 30)["stack"],
    )
    return g.run()[1][0]


def run(handles: dict[str, torch.Tensor], **kwargs):
    return run_node(OP, [{"$h": "q"}, {"$h": "k"}, {"$h": "v"}], kwargs, handles)


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
        {"k": (2, 3, 8, 16), "v": (2, 3, 8, 16)},  # heads that do not divide the query's
        {"k": (2, 4, 8, 8), "v": (2, 4, 8, 8)},  # another head size
        {"v": (2, 4, 4, 16)},  # key and value of other lengths
        {"q": (2, 4, 0, 16)},  # empty
        {"q": (4, 8, 16), "k": (4, 8, 16), "v": (4, 8, 16)},  # 3-D
    ],
)
def test_shapes_the_kernel_would_read_past_are_refused(shapes):
    with pytest.raises(InvalidArgument):
        run(qkv(**shapes))


def test_grouped_query_heads_give_eagers_attention():
    """Fewer key heads that divide the query's (grouped-query attention): the kernel reads
    one key head per group, as eager's ``enable_gqa=True`` has it do."""
    h = qkv(k=(2, 2, 8, 16), v=(2, 2, 8, 16))
    got = run(h, is_causal=True)
    want = torch.nn.functional.scaled_dot_product_attention(
        h["q"], h["k"], h["v"], is_causal=True, enable_gqa=True
    )
    assert torch.equal(got, want)


def test_a_query_whose_dimensions_overlap_is_refused():
    """Its output (empty_like(query)) would have gaps the kernel never writes: the bytes
    the allocator held before, another session's perhaps (found by review)."""
    overlapping = torch.zeros(40).as_strided((4, 8, 1, 32), (0, 1, 0, 1))
    with pytest.raises(InvalidArgument, match="overlap"):
        run({"q": overlapping, "k": torch.zeros(4, 8, 1, 32), "v": torch.zeros(4, 8, 1, 32)})


@pytest.mark.parametrize(
    "mask",
    [
        torch.zeros(8, 8),
        torch.zeros(2, 1, 8, 1),
        torch.zeros(1, 4, 1, 8),
        torch.zeros(8, 8).t(),  # read row by row from each row's start: within its bytes
        torch.zeros(2, 1, 1, 8).expand(2, 4, 8, 8),
    ],
    ids=["2-d", "per batch, one key", "per head", "transposed", "expanded"],
)
def test_a_mask_of_the_shapes_eager_sends_gives_its_attention(mask):
    h = qkv()
    mask = mask + torch.randn(mask.shape, generator=torch.Generator().manual_seed(1))
    got = run({**h, "m": mask}, attn_mask={"$h": "m"})
    want = torch.nn.functional.scaled_dot_product_attention(h["q"], h["k"], h["v"], mask)
    assert torch.equal(got, want)


@pytest.mark.parametrize(
    "mask",
    [
        torch.zeros(4, 8, 8),  # 3-D
        torch.zeros(8),  # 1-D
        torch.zeros(3, 1, 8, 8),  # 3 batches for 2
        torch.zeros(2, 3, 8, 8),  # 3 heads for 4
        torch.zeros(9, 8),  # 9 query rows for 8
        torch.zeros(8, 7),  # 7 keys for 8
        torch.zeros(8, 8, dtype=torch.float64),  # not the query's dtype
        torch.zeros(8, 8, dtype=torch.bool),  # the kernel would add it as 0 and 1
    ],
    ids=["3-d", "1-d", "batches", "heads", "rows", "keys", "dtype", "bool"],
)
def test_a_mask_the_kernel_would_misread_is_refused(mask):
    with pytest.raises(InvalidArgument, match="attn_mask"):
        run({**qkv(), "m": mask}, attn_mask={"$h": "m"})


def test_a_strided_last_dimension_dropout_or_mixed_dtypes_are_refused():
    h = qkv()
    with pytest.raises(InvalidArgument, match="contiguous"):
        run({**h, "k": torch.randn(2, 4, 16, 8).transpose(2, 3)})
    with pytest.raises(InvalidArgument, match="dropout"):
        run(h, dropout_p=0.5)
    with pytest.raises(InvalidArgument, match="dtype"):
        run({**h, "v": h["v"].double()})


BACKWARD = "aten::_scaled_dot_product_flash_attention_for_cpu_backward.default"


def run_backward(h: dict[str, torch.Tensor]):
    names = ("grad_out", "q", "k", "v", "out", "lse")
    return run_node(BACKWARD, [{"$h": n} for n in names] + [0.0, False], {}, h)


def forward_state():
    h = {n: t.requires_grad_() for n, t in qkv().items()}
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(h["q"], h["k"], h["v"])
    grad = torch.randn_like(out)
    (out * grad).sum().backward()
    state = {n: t.detach() for n, t in h.items()}
    state.update(out=out.detach(), lse=lse.detach(), grad_out=grad)
    return state, h["q"].grad


def test_the_backward_on_well_formed_arguments_gives_autograds_gradient():
    state, want = forward_state()
    assert torch.equal(run_backward(state), want)


@pytest.mark.parametrize(
    "bad",
    [
        {"lse": torch.zeros(2, 4, 4)},  # fewer rows than the query
        {"lse": torch.zeros(2, 4, 8, dtype=torch.float64)},  # not the accumulation dtype
        {"out": torch.zeros(2, 4, 4, 16)},  # out shorter than the query
        {"grad_out": torch.zeros(1, 4, 8, 16)},  # grad_out of another batch
        {"out": torch.zeros(2, 4, 16, 8).transpose(2, 3)},  # out strided last
        {"k": torch.zeros(2, 2, 8, 16)},  # key with fewer heads
    ],
)
def test_a_backward_that_would_read_past_its_tensors_is_refused(bad):
    state, _ = forward_state()
    with pytest.raises(InvalidArgument):
        run_backward({**state, **bad})
