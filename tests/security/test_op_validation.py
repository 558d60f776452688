"""Issue 17 §2 (and §6's single huge op, §7's plain-string devices and sparse ops):
no EXEC node may crash the worker, whatever its arguments.

Each repro from the issue is sent to a live appliance by one session while a bystander
session holds a tensor on the same worker. Each must come back as a typed error, and
the bystander's tensor must still read back intact afterwards.
"""

from __future__ import annotations

import pytest
import torch

from djinn.errors import DjinnError
from djinn.protocol.tensors import to_wire


def _t(k: int, t: torch.Tensor) -> dict:
    return {"$t": k, "desc": to_wire(t)[0]}


X = torch.randn(2, 64, 4)
C = torch.randn(4, 4, dtype=torch.complex64)
G, S = torch.randn(1, 4, 3), torch.randn(1, 4, 8)
G16 = torch.randn(1, 4, 16)
# (name, node without its handle, inline tensors, the codes that are a right answer)
CASES = [
    ("to.prim_dtype", "aten::to.prim_dtype", ["H", None, True, True], [], "UNSUPPORTED_OP"),
    ("to.dtype max", "aten::to.dtype", ["H", 2147483647], [], "UNSUPPORTED_OP"),
    ("to.device", "aten::to.device", ["H", "meta", {"$dtype": "float32"}], [], "UNSUPPORTED_OP"),
    (
        "batch norm, one running_mean for 64 channels",
        "aten::_native_batch_norm_legit.default",
        [_t(0, X), None, None, _t(1, torch.zeros(1)), _t(2, torch.ones(1)), False, 0.1, 1e-5],
        [X, torch.zeros(1), torch.ones(1)],
        "INVALID_ARGUMENT",
    ),
    (
        "fft normalization 7",
        "aten::_fft_c2r.default",
        [_t(0, C), [1], 7, 6],
        [C],
        "INVALID_ARGUMENT",
    ),
    (
        "reflection pad backward, a pad as wide as the input",  # a negative pad crops
        "aten::reflection_pad1d_backward.default",
        [_t(0, G16), _t(1, S), [8, 0]],
        [G16, S],
        "INVALID_ARGUMENT",
    ),
    ("dtype as a bare enum value", "aten::_to_copy.default", ["H"], [], None),
    (
        "sparse, unchecked indices",
        "aten::sparse_coo_tensor.indices_size",
        [_t(0, torch.tensor([[9]])), _t(1, torch.ones(1)), [2]],
        [torch.tensor([[9]]), torch.ones(1)],
        "UNSUPPORTED_OP",
    ),
    ("device as a plain string", "aten::zeros.default", [[4]], [], "INVALID_ARGUMENT"),
    (
        "4 GiB of zeros on a small stack",
        "aten::zeros.default",
        [[1 << 15, 1 << 15]],
        [],
        "RESOURCE_EXHAUSTED",
    ),
    (
        "list too long for int[2]",
        "aten::max_pool2d_with_indices.default",
        ["H4", [2, 2, 2]],
        [],
        "INVALID_ARGUMENT",
    ),
]
# max pooling's backward adds at the positions its indices name: out of the input, a
# write outside its allocation (each of these killed the worker with SIGSEGV)
P2, P3 = torch.randn(1, 1, 4, 4), torch.randn(1, 1, 4, 4, 4)
G2, G3 = torch.ones(1, 1, 2, 2), torch.ones(1, 1, 2, 2, 2)
I2, I3 = torch.full((1, 1, 2, 2), 10**9), torch.full((1, 1, 2, 2, 2), -5)
CASES += [
    (
        "max pool backward, an index past the input",
        "aten::max_pool2d_with_indices_backward.default",
        [_t(0, G2), _t(1, P2), [2, 2], [2, 2], [0, 0], [1, 1], False, _t(2, I2)],
        [G2, P2, I2],
        "INVALID_ARGUMENT",
    ),
    (
        "adaptive max pool backward, an index past the input",
        "aten::adaptive_max_pool2d_backward.default",
        [_t(0, G2), _t(1, P2), _t(2, I2)],
        [G2, P2, I2],
        "INVALID_ARGUMENT",
    ),
    (
        "3-d max pool backward, a negative index",
        "aten::max_pool3d_with_indices_backward.default",
        [_t(0, G3), _t(1, P3), [2, 2, 2], [2, 2, 2], [0] * 3, [1] * 3, False, _t(2, I3)],
        [G3, P3, I3],
        "INVALID_ARGUMENT",
    ),
    (
        "adaptive 3-d max pool backward, a negative index",
        "aten::adaptive_max_pool3d_backward.default",
        [_t(0, G3), _t(1, P3), _t(2, I3)],
        [G3, P3, I3],
        "INVALID_ARGUMENT",
    ),
    (
        "adaptive average pool backward over an empty input (found by the op fuzz)",
        "aten::_adaptive_avg_pool2d_backward.default",
        [_t(0, torch.ones(3, 3, 2, 3)), _t(1, torch.ones(0, 3, 0, 0))],
        [torch.ones(3, 3, 2, 3), torch.ones(0, 3, 0, 0)],
        "INVALID_ARGUMENT",
    ),
    (
        "embedding backward, counts by an index past the weight",
        "aten::embedding_backward.default",
        [_t(0, torch.ones(2, 2)), _t(1, torch.tensor([10**9, 1])), 3, -1, True, False],
        [torch.ones(2, 2), torch.tensor([10**9, 1])],
        "UNSUPPORTED_OP",
    ),
]
# batch norm's backward reads the saved statistics in training and the running ones in
# evaluation, each through its data pointer (eval's empty saved statistics are allowed)
B, BG, ONE, EMPTY = torch.randn(2, 3, 4), torch.ones(2, 3, 4), torch.ones(3), torch.ones(0)
MASK = [True, True, True]
CASES += [
    (
        "batch norm backward in training, empty saved statistics",
        "aten::native_batch_norm_backward.default",
        [_t(0, BG), _t(1, B), None, None, None, _t(2, EMPTY), _t(3, EMPTY), True, 1e-5, MASK],
        [BG, B, EMPTY, EMPTY],
        "INVALID_ARGUMENT",
    ),
    (
        "batch norm backward in evaluation, no running statistics",
        "aten::native_batch_norm_backward.default",
        [_t(0, BG), _t(1, B), None, None, None, _t(2, EMPTY), _t(3, EMPTY), False, 1e-5, MASK],
        [BG, B, EMPTY, EMPTY],
        "INVALID_ARGUMENT",
    ),
]
# nll_loss's backward without reduction writes grad_input[i][target[i]] unchecked (a
# SIGSEGV in local PyTorch too); pdist's backward reads a gradient per pair of rows
N2, T_FAR, T4 = torch.randn(2, 3), torch.tensor([0, 10**9]), torch.full((1, 2, 2), 10**9)
N4, W1 = torch.randn(1, 3, 2, 2), torch.tensor(1.0)
CASES += [
    (
        "nll loss backward, no reduction, a target past the classes",
        "aten::nll_loss_backward.default",
        [_t(0, torch.ones(2)), _t(1, N2), _t(2, T_FAR), None, 0, -100, _t(3, W1)],
        [torch.ones(2), N2, T_FAR, W1],
        "INVALID_ARGUMENT",
    ),
    (
        "2-d nll loss backward, no reduction, a target past the classes",
        "aten::nll_loss2d_backward.default",
        [_t(0, torch.ones(1, 2, 2)), _t(1, N4), _t(2, T4), None, 0, -100, _t(3, W1)],
        [torch.ones(1, 2, 2), N4, T4, W1],
        "INVALID_ARGUMENT",
    ),
    (
        "pdist backward, a gradient shorter than the pairs",
        "aten::_pdist_backward.default",
        [_t(0, torch.ones(1)), _t(1, torch.randn(5, 3)), 2.0, _t(2, torch.ones(1))],
        [torch.ones(1), torch.randn(5, 3), torch.ones(1)],
        "INVALID_ARGUMENT",
    ),
]
# CTC indexes log_probs by its targets and reads log_alpha by the forward's shapes;
# segment_reduce reads between offsets it does not check (each found by reading kernels)
LP, CT, Z3 = torch.randn(5, 1, 4).log_softmax(2), torch.tensor([[1, 2]]), torch.zeros(1, 1, 1)
ONE1 = torch.ones(1)
LP3, CT3, G3 = torch.randn(5, 3, 4).log_softmax(2), torch.tensor([[1, 2]] * 3), torch.ones(3)
LA3 = torch.zeros(3, 5, 5)  # the forward's log_alpha: (batch, time, 2 * longest + 1)
T5, T2 = torch.tensor(5), torch.tensor(2)
TG3D, LA3D = torch.ones(3, 1, 1000, dtype=torch.long), torch.zeros(3, 5, 2001)
CASES += [
    (
        "ctc loss, a target past the classes",
        "aten::_ctc_loss.default",
        [_t(0, LP), _t(1, torch.tensor([[10**9, 2]])), [5], [2], 0, False],
        [LP, torch.tensor([[10**9, 2]])],
        "INVALID_ARGUMENT",
    ),
    (
        "ctc loss backward, a log_alpha shorter than the forward's",
        "aten::_ctc_loss_backward.default",
        [_t(0, ONE1), _t(1, LP), _t(2, CT), [5], [2], _t(3, ONE1), _t(4, Z3), 0, False],
        [ONE1, LP, CT, ONE1, Z3],
        "INVALID_ARGUMENT",
    ),
    (  # a review: the kernel reads one length per batch element, unchecked
        "ctc loss backward, one length for a batch of 3",
        "aten::_ctc_loss_backward.default",
        [_t(0, G3), _t(1, LP3), _t(2, CT3), [5], [2], _t(3, G3), _t(4, LA3), 0, False],
        [G3, LP3, CT3, G3, LA3],
        "INVALID_ARGUMENT",
    ),
    (
        "ctc loss backward, 0-d lengths for a batch of 3",
        "aten::_ctc_loss_backward.Tensor",
        [_t(0, G3), _t(1, LP3), _t(2, CT3), _t(5, T5), _t(6, T2), _t(3, G3), _t(4, LA3), 0, False],
        [G3, LP3, CT3, G3, LA3, T5, T2],
        "INVALID_ARGUMENT",
    ),
    (  # a review: the backward indexes log_probs by blank, unchecked
        "ctc loss backward, blank past the classes",
        "aten::_ctc_loss_backward.default",
        [_t(0, G3), _t(1, LP3), _t(2, CT3), [5] * 3, [2] * 3, _t(3, G3), _t(4, LA3), 10**8, False],
        [G3, LP3, CT3, G3, LA3],
        "INVALID_ARGUMENT",
    ),
    (  # a review: targets that are not 1-d are read by their first two strides
        "ctc loss backward, 3-d targets",
        "aten::_ctc_loss_backward.default",
        [_t(0, G3), _t(1, LP3), _t(2, TG3D), [5] * 3, [1000] * 3, _t(3, G3), _t(4, LA3D), 0, False],
        [G3, LP3, TG3D, G3, LA3D],
        "INVALID_ARGUMENT",
    ),
    (
        "ctc loss, an input length past log_probs' steps",
        "aten::_ctc_loss.default",
        [_t(0, LP3), _t(1, CT3), [5, 5, 9], [2, 2, 2], 0, False],
        [LP3, CT3],
        "INVALID_ARGUMENT",
    ),
    (
        "segment reduce, offsets past the data",
        "aten::segment_reduce.default",
        [_t(0, torch.randn(4)), "sum"],
        [torch.randn(4), torch.tensor([0, 10**6])],
        "INVALID_ARGUMENT",
    ),
]
# weight_norm's kernels read one g and one saved norm per slice of v, by pointer
V43 = torch.randn(4, 3)
CASES += [
    (
        "weight norm, a g shorter than v's rows",
        "aten::_weight_norm_interface.default",
        [_t(0, V43), _t(1, ONE1), 0],
        [V43, ONE1],
        "INVALID_ARGUMENT",
    ),
    (
        "weight norm backward, saved norms shorter than v's rows",
        "aten::_weight_norm_interface_backward.default",
        [_t(0, V43), _t(1, V43), _t(2, torch.ones(4, 1)), _t(3, ONE1), 0],
        [V43, V43, torch.ones(4, 1), ONE1],
        "INVALID_ARGUMENT",
    ),
]
# _cdist_backward reads grad and cdist by pointer, one value per pair of rows
X53, X43 = torch.randn(5, 3), torch.randn(4, 3)
CASES += [
    (
        "cdist backward, a gradient of one value for 5 x 4 distances",
        "aten::_cdist_backward.default",
        [_t(0, ONE1), _t(1, X53), _t(2, X43), 1.0, _t(3, torch.ones(5, 4))],
        [ONE1, X53, X43, torch.ones(5, 4)],
        "INVALID_ARGUMENT",
    ),
]
# the functional _foreach_copy walks src by self's length unchecked (found by the op fuzz)
CASES += [
    (
        "foreach copy, a source list longer than the targets",
        "aten::_foreach_copy.default",
        [[], [_t(0, ONE1)]],
        [ONE1],
        "INVALID_ARGUMENT",
    ),
]
CASES.append(  # the meta check ran it on the CPU, for real (found by the op fuzz)
    (
        "16 GiB randperm, device None",
        "aten::randperm.default",
        [2**31 - 1],
        [],
        "RESOURCE_EXHAUSTED",
    )
)
# Note [sizes by value]: outputs as long as a value of the input (found before allowing
# bincount and repeat_interleave: the CPU kernels trust the values they size by)
BIG = torch.tensor([2**63 - 1])  # bincount's max + 1 wrapped: a write past minlength
HUGE = torch.tensor([2**40])  # 8 TiB allocated before anything was charged
WRAPS = torch.tensor([2**62, 2**62, 2**62, 2**62, 1])  # a running sum that wraps int64
CASES += [
    (
        "bincount, a wrapping max",
        "aten::bincount.default",
        [_t(0, BIG)],
        [BIG],
        "RESOURCE_EXHAUSTED",
    ),
    ("bincount, 8 TiB", "aten::bincount.default", [_t(0, HUGE)], [HUGE], "RESOURCE_EXHAUSTED"),
    (
        "bincount, minlength 2**50",
        "aten::bincount.default",
        [_t(0, torch.tensor([1])), None, 2**50],
        [torch.tensor([1])],
        "RESOURCE_EXHAUSTED",
    ),
    (
        "repeat_interleave, 8 TiB",
        "aten::repeat_interleave.Tensor",
        [_t(0, HUGE)],
        [HUGE],
        "RESOURCE_EXHAUSTED",
    ),
    (
        "repeat_interleave, a wrapping sum",
        "aten::repeat_interleave.Tensor",
        [_t(0, WRAPS)],
        [WRAPS],
        "RESOURCE_EXHAUSTED",
    ),
    (
        "repeat_interleave, output_size below the sum",
        "aten::repeat_interleave.Tensor",
        [_t(0, torch.tensor([3, 3]))],
        [torch.tensor([3, 3])],
        "INVALID_ARGUMENT",
    ),
    (
        "repeat_interleave, output_size above the sum",
        "aten::repeat_interleave.self_Tensor",
        [_t(0, torch.ones(2)), _t(1, torch.tensor([3, 3]))],
        [torch.ones(2), torch.tensor([3, 3])],
        "INVALID_ARGUMENT",
    ),
    (
        "repeat_interleave, a wrapping sum given as output_size",
        "aten::repeat_interleave.Tensor",
        [_t(0, WRAPS)],
        [WRAPS],
        "INVALID_ARGUMENT",
    ),
    (
        "repeat_interleave, an out= tensor the kernel would grow",
        "aten::repeat_interleave.Tensor_out",
        [_t(0, torch.tensor([3, 3]))],
        [torch.tensor([3, 3]), torch.zeros(1, dtype=torch.long)],
        "INVALID_ARGUMENT",
    ),
    (
        "repeat_interleave, a negative repeat",
        "aten::repeat_interleave.Tensor",
        [_t(0, torch.tensor([-2, 5]))],
        [torch.tensor([-2, 5])],
        "EXECUTION_ERROR",
    ),
]
KWARGS = {
    "repeat_interleave, output_size below the sum": {"output_size": 2},
    "repeat_interleave, output_size above the sum": {"output_size": 60_000},
    "repeat_interleave, a wrapping sum given as output_size": {"output_size": 1},
    "repeat_interleave, an out= tensor the kernel would grow": {
        "out": _t(1, torch.zeros(1, dtype=torch.long))
    },
    "segment reduce, offsets past the data": {"offsets": _t(1, torch.tensor([0, 10**6]))},
    "16 GiB randperm, device None": {"dtype": {"$dtype": "float64"}, "device": None},
    "dtype as a bare enum value": {"dtype": 2147483647},
    "device as a plain string": {"device": "cuda:7"},
}


def _returns(name: str) -> int:
    packet, _, overload = name.removeprefix("aten::").partition(".")
    return len(getattr(getattr(torch.ops.aten, packet), overload or "default")._schema.returns)


def test_crafted_exec_nodes_get_typed_errors_and_spare_the_bystander(fresh_appliance):
    app = fresh_appliance(cpu_workers=1, cpu_worker_memory="1GiB")
    wrong = []
    with app.connect("unix") as by_client, by_client.session() as bystander:
        kept = torch.arange(1000.0)
        held = bystander.put(kept)
        with app.connect("unix") as client, client.session() as s:
            r3, r4 = s.put(torch.ones(3)), s.put(torch.ones(1, 1, 4, 4))  # held: not freed
            h, h4 = r3.handle, r4.handle
            for name, op, args, inline, code in CASES:
                args = [{"$h": h} if a == "H" else {"$h": h4} if a == "H4" else a for a in args]
                node = {"op": op, "args": args, "kwargs": KWARGS.get(name, {})}
                # an op of several outputs is fetched by index: fetching the tuple itself
                # is refused before the op runs, which passed such a case vacuously
                many = _returns(op) > 1
                try:
                    s.execute(
                        [node], fetch=[{"$v": 0, "i": 0} if many else {"$v": 0}], inline=inline
                    )
                except DjinnError as exc:
                    accepted = (code,) if code else ("INVALID_ARGUMENT", "UNSUPPORTED_OP")
                    if exc.code not in accepted:
                        wrong.append(f"{name}: {exc.code} {exc.message[:100]}")
                else:
                    wrong.append(f"{name}: ran")
        assert torch.equal(held.cpu(), kept)  # the worker survived every case
    assert wrong == []


@pytest.mark.parametrize("device", ["meta", "cuda:7", "cpu"])
def test_device_arguments_must_be_tagged(fresh_appliance, device):
    """A plain string bypassed the $device mapping (§7): now it is refused, and the
    tagged form still lands on the worker's device."""
    app = fresh_appliance(cpu_workers=1)
    with app.connect("unix") as client, client.session() as s:
        with pytest.raises(DjinnError) as info:
            s.execute([{"op": "aten::zeros.default", "args": [[2]], "kwargs": {"device": device}}])
        assert info.value.code == "INVALID_ARGUMENT"
        _, (out,) = s.execute(
            [
                {
                    "op": "aten::zeros.default",
                    "args": [[2]],
                    "kwargs": {"device": {"$device": device}},
                }
            ],
            fetch=[{"$v": 0}],
        )
        assert out.tolist() == [0.0, 0.0]


def test_a_stride_0_rrelu_noise_is_refused_and_spares_the_bystander(fresh_appliance):
    """rrelu's kernel writes its noise as if contiguous: an expanded one-float noise had it
    write a million floats past its storage, and the worker died (found by review)."""
    app = fresh_appliance(cpu_workers=1)
    x, one, n = torch.ones(1 << 20), torch.zeros(1), 1 << 20
    with app.connect("unix") as by_client, by_client.session() as bystander:
        held = bystander.put(torch.arange(10.0))
        with app.connect("unix") as client, client.session() as s:
            for op in ("aten::rrelu_with_noise_.default", "aten::rrelu_with_noise.default"):
                nodes = [
                    {"op": "aten::expand.default", "args": [_t(1, one), [n]]},
                    {"op": op, "args": [_t(0, x), {"$v": 0}, 0.1, 0.3, True]},
                ]
                with pytest.raises(DjinnError) as err:
                    s.execute(nodes, fetch=[{"$v": 1}], inline=[x, one])
                assert err.value.code == "INVALID_ARGUMENT"
        assert torch.equal(held.cpu(), torch.arange(10.0))


def test_backward_calls_as_autograd_makes_them_are_accepted(fresh_appliance):
    """Refused once by these checks (found by a module sweep): evaluation-mode batch norm's
    backward gets empty saved statistics (frozen-BN fine-tuning), and a pooling backward
    gets the forward's omitted stride, ``[]`` (``F.max_pool2d(x, 2)``)."""
    indices = torch.zeros_like(I2)
    calls = [
        (
            torch.ops.aten.native_batch_norm_backward.default,
            [BG, B, ONE, ONE, ONE, EMPTY, EMPTY, False, 1e-5, MASK],
        ),
        (
            torch.ops.aten.max_pool2d_with_indices_backward.default,
            [G2, P2, [2, 2], [], [0, 0], [1, 1], False, indices],
        ),
    ]
    app = fresh_appliance(cpu_workers=1)
    with app.connect("unix") as client, client.session() as s:
        for op, args in calls:
            inline, wire = [], []
            for a in args:
                if isinstance(a, torch.Tensor):
                    inline.append(a)
                    a = _t(len(inline) - 1, a)
                wire.append(a)
            name = f"{op._schema.name}.{op._overloadname}"
            nodes = [{"op": name, "args": wire}]
            ref = {"$v": 0, "i": 0} if len(op._schema.returns) > 1 else {"$v": 0}
            _, fetched = s.execute(nodes, fetch=[ref], inline=inline)
            want = op(*args)
            assert torch.equal(fetched[0], want[0] if isinstance(want, tuple) else want)
