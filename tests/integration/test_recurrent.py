"""Note [recurrent layers] (djinn/frontend/recurrent.py): ``nn.RNN``, ``nn.LSTM``,
``nn.GRU`` and their cells run on the remote device with local eager's numbers: outputs,
final states and gradients. They failed with UNSUPPORTED_OP (CUDA's fused cells) or on
an in-place ``transpose_``."""

from __future__ import annotations

import pytest
import torch
from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

R = "remote_accelerator:0"

LAYERS = {
    "rnn_tanh": lambda **kw: torch.nn.RNN(5, 7, **kw),
    "rnn_relu": lambda **kw: torch.nn.RNN(5, 7, nonlinearity="relu", **kw),
    "gru": lambda **kw: torch.nn.GRU(5, 7, **kw),
    "lstm": lambda **kw: torch.nn.LSTM(5, 7, **kw),
    "lstm_proj": lambda **kw: torch.nn.LSTM(5, 7, proj_size=3, **kw),
}
SHAPES = {
    "one_layer": {},
    "two_layers_batch_first": {"num_layers": 2, "batch_first": True},
    "bidirectional_dropout": {"num_layers": 3, "bidirectional": True, "dropout": 0.5},
}


def _exact_or_lstm(kind: str, got: torch.Tensor, want: torch.Tensor) -> None:
    """GRU and RNN: to the bit. LSTM: eager on a CPU runs float32 LSTMs through oneDNN,
    whose sums round differently from the CPU's own algorithm, which the remote device runs
    (the two differ by ~1e-7); within the float32 parity bar."""
    assert got.shape == want.shape and got.stride() == want.stride()
    if kind.startswith("lstm"):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    else:
        assert torch.equal(got, want), (got - want).abs().max()


def _run(kind: str, shape: dict, device: str) -> list[torch.Tensor]:
    torch.manual_seed(0)
    layer = LAYERS[kind](**shape).to(device)
    x = torch.randn(3, 4, 5).to(device).requires_grad_()
    out, hidden = layer(x)
    hiddens = list(hidden) if isinstance(hidden, tuple) else [hidden]
    (out.sum() + sum(h.pow(2).sum() for h in hiddens)).backward()
    grads = [x.grad] + [p.grad for p in layer.parameters()]
    return [t.detach().cpu() for t in [out, *hiddens, *grads]]


@pytest.mark.parametrize("shape", sorted(SHAPES))
@pytest.mark.parametrize("kind", sorted(LAYERS))
def test_a_recurrent_layer_trains_with_local_eagers_numbers(remote, kind, shape):
    got, want = _run(kind, SHAPES[shape], R), _run(kind, SHAPES[shape], "cpu")
    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        _exact_or_lstm(kind, g, w)


@pytest.mark.parametrize("kind", ["gru", "lstm", "rnn_tanh"])
def test_a_packed_sequence_runs_both_directions_as_local_eager(remote, kind):
    def run(device: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        layer = LAYERS[kind](num_layers=2, bidirectional=True, batch_first=True).to(device)
        x = torch.randn(4, 6, 5).to(device).requires_grad_()
        lengths = torch.tensor([3, 6, 1, 4])  # unsorted: the packing sorts them
        packed = pack_padded_sequence(x, lengths, batch_first=True, enforce_sorted=False)
        out, hidden = layer(packed)
        padded, _ = pad_packed_sequence(out, batch_first=True)
        hiddens = list(hidden) if isinstance(hidden, tuple) else [hidden]
        (padded.pow(2).sum() + sum(h.sum() for h in hiddens)).backward()
        return [t.detach().cpu() for t in [padded, *hiddens, x.grad, *layer.parameters()]]

    for g, w in zip(run(R), run("cpu"), strict=True):
        _exact_or_lstm(kind, g, w)


@pytest.mark.parametrize("cell", ["RNNCell", "GRUCell", "LSTMCell"])
def test_a_cell_stepped_by_the_program_matches_local_eager(remote, cell):
    def run(device: str) -> list[torch.Tensor]:
        torch.manual_seed(0)
        step = getattr(torch.nn, cell)(5, 7).to(device)
        xs = torch.randn(4, 2, 5).to(device)
        state = None
        outs = []
        for x in xs:
            state = step(x, state)
            outs.append(state[0] if isinstance(state, tuple) else state)
        torch.stack(outs).sum().backward()
        return [t.detach().cpu() for t in [*outs, *(p.grad for p in step.parameters())]]

    for g, w in zip(run(R), run("cpu"), strict=True):
        assert torch.equal(g, w)


def test_under_inference_mode_the_layers_run_as_local_eager(remote):
    torch.manual_seed(0)
    gru = torch.nn.GRU(5, 7, num_layers=2, bidirectional=True)
    x = torch.randn(3, 4, 5)
    want = gru(x)
    gru.to(R)
    with torch.inference_mode():
        got = gru(x.to(R))
    for g, w in zip(got, want, strict=True):
        assert torch.equal(g.cpu(), w.detach())


def test_cell_and_device_mismatches_get_eagers_errors(remote):
    w_ih, w_hh = torch.randn(21, 5).to(R), torch.randn(21, 7).to(R)
    with pytest.raises(RuntimeError, match="input has inconsistent input_size: got 6 expected 5"):
        torch.gru_cell(torch.randn(2, 6).to(R), torch.randn(2, 7).to(R), w_ih, w_hh)
    with pytest.raises(RuntimeError, match="doesn't match hidden0 batch size 3"):
        torch.gru_cell(torch.randn(2, 5).to(R), torch.randn(3, 7).to(R), w_ih, w_hh)
    lstm = torch.nn.LSTM(5, 7).to(R)
    cpu_state = (torch.zeros(1, 4, 7), torch.zeros(1, 4, 7))
    with pytest.raises(RuntimeError, match="Input and hidden tensors are not at the same device"):
        lstm(torch.randn(3, 4, 5).to(R), cpu_state)
    with pytest.raises(RuntimeError, match="must be sorted in decreasing order"):
        pack_padded_sequence(torch.randn(3, 4, 5).to(R), torch.tensor([2, 3, 1, 1]))
