"""``nn.RNN``, ``nn.LSTM``, ``nn.GRU`` and their cells on the remote device: the CPU's
algorithm, op for op.

Note [recurrent layers]: ``aten::lstm``, ``gru``, ``rnn_tanh``, ``rnn_relu`` (over a padded
sequence, ``.input``, or a packed one, ``.data``) and the ``lstm_cell`` / ``gru_cell`` ops
are composite: their C++ body picks an algorithm by device. A CPU projects the whole
sequence's inputs at once, then runs each step as a cell of ``linear``, ``sigmoid``,
``tanh``. CUDA runs cuDNN, and any other device the fused cells ``_thnn_fused_lstm_cell``
/ ``_thnn_fused_gru_cell``, which only CUDA implements: on the remote device every
``nn.LSTM``, ``nn.GRU`` and ``GRUCell`` failed with UNSUPPORTED_OP, and ``nn.RNN`` with
``batch_first`` on the in-place ``transpose_`` of its output.

So the remote device runs the CPU's body, written here from ``aten/src/ATen/native/
RNN.cpp`` (``FullLayer``, ``PackedLayer`` and their reversed and bidirectional forms,
``apply_layer_stack``, the cells) with the same ops in the same order: on a CPU worker
the outputs and gradients are local eager's to the bit. It is registered on the autograd
key, above the composite's own body, so autograd records the ops it runs; under
``torch.inference_mode()``, which skips that key, the capture's dispatch takes it as a
special op instead. The one place it differs: eager writes ``batch_first`` outputs with
``transpose_``; here the output is ``transpose``'s view, with the same sizes and strides.
(``torch._decomp`` has decompositions of these ops, but they drop the dropout between
layers, and project a packed sequence's inputs step by step.)
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Sequence
from typing import Any

import torch
import torch.nn.functional as F

from . import lazy

_aten = torch.ops.aten
Tensor = torch.Tensor
Hidden = Any  # a Tensor, or (h, c) for an LSTM


class _Params:
    """One layer and direction's weights (RNN.cpp ``CellParams``)."""

    __slots__ = ("b_hh", "b_ih", "w_hh", "w_hr", "w_ih")

    def __init__(self, group: Sequence[Tensor], has_biases: bool, has_projections: bool):
        self.w_ih, self.w_hh = group[0], group[1]
        self.b_ih = group[2] if has_biases else None
        self.b_hh = group[3] if has_biases else None
        self.w_hr = group[-1] if has_projections else None

    def linear_ih(self, x: Tensor) -> Tensor:
        return F.linear(x, self.w_ih, self.b_ih)

    def linear_hh(self, h: Tensor) -> Tensor:
        return F.linear(h, self.w_hh, self.b_hh)


def _gather(params: Sequence[Tensor], has_biases: bool, has_projections: bool) -> list[_Params]:
    size = 2 + 2 * has_biases + has_projections
    if len(params) % size:
        raise RuntimeError(f"got an incorrect number of RNN parameters: {len(params)}")
    return [
        _Params(params[i : i + size], has_biases, has_projections)
        for i in range(0, len(params), size)
    ]


# -- cells: (step input, hidden, params, whether the input is already projected) -----------
# RNN.cpp's CPU cells, with their in-place ops: a gate is a view of the projected gates
# (strided), and on an AVX2 CPU an elementwise kernel over strided operands rounds
# otherwise than over contiguous ones (no FMA). Out-of-place gates made GRU's gradients
# differ from eager's by 3e-8 on such a machine (sigmoid_backward of a contiguous output).
def _simple(nonlinearity: Callable[[Tensor], Tensor]) -> Callable[..., Tensor]:
    def cell(x: Tensor, h: Tensor, p: _Params, projected: bool) -> Tensor:
        return nonlinearity(p.linear_hh(h).add_(x if projected else p.linear_ih(x)))

    return cell


def _lstm(x: Tensor, hidden: tuple[Tensor, Tensor], p: _Params, projected: bool) -> Any:
    hx, cx = hidden
    gates = p.linear_hh(hx).add_(x if projected else p.linear_ih(x))
    chunked = gates.unsafe_chunk(4, 1)
    ingate, forgetgate = chunked[0].sigmoid_(), chunked[1].sigmoid_()
    cellgate, outgate = chunked[2].tanh_(), chunked[3].sigmoid_()
    cy = (forgetgate * cx).add_(ingate * cellgate)
    hy = outgate * cy.tanh()
    if p.w_hr is not None:
        hy = torch.matmul(hy, p.w_hr.t())
    return hy, cy


def _gru(x: Tensor, h: Tensor, p: _Params, projected: bool) -> Tensor:
    igates = (x if projected else p.linear_ih(x)).unsafe_chunk(3, 1)
    hgates = p.linear_hh(h).unsafe_chunk(3, 1)
    reset_gate = hgates[0].add_(igates[0]).sigmoid_()
    input_gate = hgates[1].add_(igates[1]).sigmoid_()
    new_gate = igates[2].add(hgates[2].mul_(reset_gate)).tanh_()
    return (h - new_gate).mul_(input_gate).add_(new_gate)


# -- hidden states: a tensor, or an LSTM's (h, c) --------------------------------------------
def _output(hidden: Hidden) -> Tensor:
    return hidden[0] if isinstance(hidden, tuple) else hidden


def _slice(hidden: Hidden, start: int, end: int) -> Hidden:
    if isinstance(hidden, tuple):
        return tuple(h.narrow(0, start, end - start) for h in hidden)
    return hidden.narrow(0, start, end - start)


def _concat(hiddens: list[Hidden]) -> Hidden:
    if isinstance(hiddens[0], tuple):
        return tuple(torch.cat(parts, 0) for parts in zip(*hiddens, strict=True))
    return torch.cat(hiddens, 0)


# -- layers: one direction over the whole sequence -----------------------------------------
def _full(cell: Callable, x: Tensor, hidden: Hidden, p: _Params, reverse: bool) -> Any:
    steps = p.linear_ih(x).unbind(0)
    outputs = []
    for step in reversed(steps) if reverse else steps:
        hidden = cell(step, hidden, p, True)
        outputs.append(_output(hidden))
    if reverse:
        outputs.reverse()
    return torch.stack(outputs, 0), hidden


def _packed(cell: Callable, data: Tensor, sizes: list[int], hidden: Hidden, p: _Params) -> Any:
    projected = p.linear_ih(data)
    outputs, finals, offset, last = [], [], 0, sizes[0]
    for size in sizes:
        step = projected.narrow(0, offset, size)
        offset += size
        if last > size:  # sequences that ended: their final state is set aside
            finals.append(_slice(hidden, size, last))
            hidden = _slice(hidden, 0, size)
        last = size
        hidden = cell(step, hidden, p, True)
        outputs.append(_output(hidden))
    finals.append(hidden)
    finals.reverse()
    return torch.cat(outputs, 0), _concat(finals)


def _packed_reversed(
    cell: Callable, data: Tensor, sizes: list[int], initial: Hidden, p: _Params
) -> Any:
    projected = p.linear_ih(data)
    outputs, offset, last = [], data.size(0), sizes[-1]
    hidden = _slice(initial, 0, last)
    for size in reversed(sizes):
        if size > last:  # sequences that start here join with their initial state
            hidden = _concat([hidden, _slice(initial, last, size)])
        step = projected.narrow(0, offset - size, size)
        offset -= size
        last = size
        hidden = cell(step, hidden, p, True)
        outputs.append(_output(hidden))
    outputs.reverse()
    return torch.cat(outputs, 0), hidden


def _stack(
    layer: Callable,
    x: Tensor,
    hiddens: list[Hidden],
    params: list[_Params],
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
) -> tuple[Tensor, list[Hidden]]:
    """RNN.cpp ``apply_layer_stack``: each layer (both directions, their outputs joined on
    the last dimension), dropout between layers in training."""
    finals: list[Hidden] = []
    for i in range(num_layers):
        if bidirectional:
            fw, fw_hidden = layer(x, hiddens[2 * i], params[2 * i], False)
            bw, bw_hidden = layer(x, hiddens[2 * i + 1], params[2 * i + 1], True)
            x = torch.cat([fw, bw], fw.dim() - 1)
            finals += [fw_hidden, bw_hidden]
        else:
            x, hidden = layer(x, hiddens[i], params[i], False)
            finals.append(hidden)
        if dropout != 0 and train and i < num_layers - 1:
            x = torch.dropout(x, dropout, True)
    return x, finals


def _check_devices(x: Tensor, params: Sequence[Tensor], hiddens: Sequence[Tensor]) -> None:
    for name, tensors in (("hidden", hiddens), ("parameter", params)):
        for t in tensors:
            if t.device != x.device:
                raise RuntimeError(
                    f"Input and {name} tensors are not at the same device, found input "
                    f"tensor at {x.device} and {name} tensor at {t.device}"
                )


# -- the ops ----------------------------------------------------------------------------------
def _run(
    cell: Callable,
    x: Tensor,
    hx: Sequence[Tensor],
    flat: Sequence[Tensor],
    has_biases: bool,
    num_layers: int,
    dropout: float,
    train: bool,
    bidirectional: bool,
    batch_first: bool,
    sizes: Tensor | None,
) -> tuple[Tensor, list[Hidden]]:
    _check_devices(x, flat, hx)
    lstm = cell is _lstm
    params = _gather(flat, has_biases, lstm and hx[0].size(2) != hx[1].size(2))
    hiddens = list(zip(hx[0].unbind(0), hx[1].unbind(0), strict=True)) if lstm else hx[0].unbind(0)
    if sizes is None:
        x = x.transpose(0, 1) if batch_first else x

        def layer(inp: Tensor, hidden: Hidden, p: _Params, reverse: bool) -> Any:
            return _full(cell, inp, hidden, p, reverse)
    else:
        steps = sizes.tolist()

        def layer(inp: Tensor, hidden: Hidden, p: _Params, reverse: bool) -> Any:
            run = _packed_reversed if reverse else _packed
            return run(cell, inp, steps, hidden, p)

    out, finals = _stack(layer, x, hiddens, params, num_layers, dropout, train, bidirectional)
    if sizes is None and batch_first:
        out = out.transpose(0, 1)
    return out, finals


def _ops(cell: Callable) -> tuple[Callable, Callable]:
    """The op over a padded sequence (``.input``) and over a packed one (``.data``)."""
    lstm = cell is _lstm

    def states(hx: Any) -> Sequence[Tensor]:
        if lstm:
            _two_hidden_states(hx, "lstm")
        return hx if lstm else [hx]

    def finish(out: Tensor, finals: list[Hidden]) -> tuple[Tensor, ...]:
        if lstm:
            return out, torch.stack([h for h, _ in finals]), torch.stack([c for _, c in finals])
        return out, torch.stack(finals)

    def padded(x, hx, flat, has_biases, num_layers, dropout, train, bidirectional, batch_first):
        return finish(*_run(
            cell, x, states(hx), flat, has_biases, num_layers, dropout, train, bidirectional,
            batch_first, None,
        ))  # fmt: skip

    def packed(data, sizes, hx, flat, has_biases, num_layers, dropout, train, bidirectional):
        return finish(*_run(
            cell, data, states(hx), flat, has_biases, num_layers, dropout, train, bidirectional,
            False, sizes,
        ))  # fmt: skip

    return padded, packed


def _two_hidden_states(hx: Sequence[Tensor], op: str) -> None:
    if len(hx) != 2:
        raise RuntimeError(f"{op} expects two hidden states")


def _check_cell(x: Tensor, hx: Tensor, w_ih: Tensor, w_hh: Tensor, label: int) -> None:
    """RNN.cpp ``check_rnn_cell_forward_input`` / ``_hidden``, in eager's words."""
    if x.size(1) != w_ih.size(1):
        raise RuntimeError(
            f"input has inconsistent input_size: got {x.size(1)} expected {w_ih.size(1)}"
        )
    if x.size(0) != hx.size(0):
        raise RuntimeError(
            f"Input batch size {x.size(0)} doesn't match hidden{label} batch size {hx.size(0)}"
        )
    if hx.size(1) != w_hh.size(1):
        raise RuntimeError(
            f"hidden{label} has inconsistent hidden_size: got {hx.size(1)}, expected {w_hh.size(1)}"
        )


def _lstm_cell(x, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    _two_hidden_states(hx, "lstm_cell")
    _check_cell(x, hx[0], w_ih, w_hh, 0)
    _check_cell(x, hx[1], w_ih, w_hh, 1)
    return _lstm(x, (hx[0], hx[1]), _Params((w_ih, w_hh, b_ih, b_hh), True, False), False)


def _gru_cell(x, hx, w_ih, w_hh, b_ih=None, b_hh=None):
    _check_cell(x, hx, w_ih, w_hh, 0)
    return _gru(x, hx, _Params((w_ih, w_hh, b_ih, b_hh), True, False), False)


_rnn_tanh, _rnn_tanh_packed = _ops(_simple(torch.tanh))
_rnn_relu, _rnn_relu_packed = _ops(_simple(torch.relu))
_gru_padded, _gru_packed = _ops(_gru)
_lstm_padded, _lstm_packed = _ops(_lstm)

KERNELS: dict[str, Callable] = {
    "lstm.input": _lstm_padded,
    "lstm.data": _lstm_packed,
    "gru.input": _gru_padded,
    "gru.data": _gru_packed,
    "rnn_tanh.input": _rnn_tanh,
    "rnn_tanh.data": _rnn_tanh_packed,
    "rnn_relu.input": _rnn_relu,
    "rnn_relu.data": _rnn_relu_packed,
    "lstm_cell": _lstm_cell,
    "gru_cell": _gru_cell,
}


def _pack_padded_sequence(func: Any, args: tuple, kwargs: dict) -> Any:
    """``pack_padded_sequence``'s kernel (PackedSequence.cpp), which only the CPU has: the
    lengths are a CPU tensor the program gave, so the packing is planned here, from them,
    and the rows are gathered on the appliance. Autograd keeps the op's own derivative."""
    x, lengths, batch_first = (*args, *kwargs.values())
    if x.numel() == 0:
        raise RuntimeError("Cannot pack empty tensors.")
    x = x.transpose(0, 1) if batch_first else x
    if lengths.device.type != "cpu" or lengths.dim() != 1 or lengths.dtype != torch.int64:
        raise RuntimeError(
            f"'lengths' argument should be a 1D CPU int64 tensor, but got {lengths.dim()}D "
            f"{lengths.device.type} {lengths.dtype} tensor"
        )
    batch = x.size(1)
    if lengths.size(0) != batch:
        raise RuntimeError(
            f"Expected `len(lengths)` to be equal to batch_size, but got {lengths.size(0)} "
            f"(batch_size={batch})"
        )
    ls = lengths.tolist()
    if ls[-1] <= 0:
        raise RuntimeError(
            "Length of all samples has to be greater than 0, but found an element in "
            "'lengths' that is <= 0"
        )
    if any(a < b for a, b in itertools.pairwise(ls)):
        raise RuntimeError(
            "`lengths` array must be sorted in decreasing order when `enforce_sorted` is "
            "True. You can pass `enforce_sorted=False` to pack_padded_sequence and/or "
            "pack_sequence to sidestep this requirement if you do not need ONNX "
            "exportability."
        )
    steps, sizes, previous = [], [], 0
    for i, length in enumerate(reversed(ls)):
        if length > previous:
            current = batch - i
            step = x[previous:length, :current].contiguous()
            steps.append(step.view(-1, *x.shape[2:]))
            sizes += [current] * (length - previous)
            previous = length
    return torch.cat(steps), torch.tensor(sizes, dtype=torch.int64, device="cpu")


lazy.take_as_special(KERNELS)  # Note [recurrent layers]: under inference_mode
lazy.SPECIAL[_aten._pack_padded_sequence.default] = _pack_padded_sequence
