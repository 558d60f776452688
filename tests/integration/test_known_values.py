"""Note [values the client knows] (djinn/frontend/known.py): a value read of a small integer
tensor made from uploads the client keeps a copy of is computed on the client, with
eager's value; inside ``djinn.replayable`` it becomes a check each replay makes again, so
a model whose Python branches on its attention mask replays."""

from __future__ import annotations

import copy

import pytest
import torch

import djinn
from djinn.frontend import trace
from djinn.frontend.session import default_session
from djinn.protocol.frames import Kind


def _execs() -> int:
    return default_session().channel.sent_by_kind[Kind.EXEC]


def _bert():
    from transformers import BertConfig, BertModel

    torch.manual_seed(0)
    cfg = BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, max_position_embeddings=64,
    )  # fmt: skip
    return BertModel(cfg).eval()


def _replayable_bert(remote):
    """A BERT and its copy on ``remote`` (moved in training mode so it stays on the graph
    path, then eval), whose last hidden state is a replayable function of ids and mask."""
    local = _bert()
    model = copy.deepcopy(local).train().to(remote).eval()
    encode = djinn.replayable(lambda i, a: model(input_ids=i, attention_mask=a).last_hidden_state)
    return local, encode


def test_bert_given_an_attention_mask_replays_padded_and_unpadded_batches_with_eagers_bits(
    remote,
):
    local, encode = _replayable_bert(remote)
    padded = torch.ones(2, 12, dtype=torch.long)
    padded[1, 7:] = 0
    full = torch.ones(2, 12, dtype=torch.long)
    with torch.no_grad():
        for step in range(12):
            ids = torch.randint(0, 100, (2, 12))
            mask = full if step % 3 == 2 else padded
            want = local(input_ids=ids, attention_mask=mask).last_hidden_state
            got = encode(ids.to(remote), mask.to(remote)).cpu()
            assert torch.equal(got, want), step
    stats = encode.stats()
    # each kind of batch records twice (`after`), then replays: 8 padded calls, 4 full
    assert stats["replays"] == 8, stats
    assert stats["recordings"] == 4, stats
    assert stats["plain"] == {}, stats
    assert stats["keys"] == 2, stats


def test_a_read_of_an_uploaded_masks_value_sends_nothing_of_its_own(remote):
    mask = torch.tensor([[1, 1, 0], [1, 1, 1]])
    rmask = mask.to(remote)
    trace.flush(trace.current())  # the put's reply: nothing else is waited for below
    before = _execs()
    assert bool(rmask[:, -2:].bool().all()) is False
    assert int((rmask == 0).sum()) == 1
    assert rmask.sum().item() == 5
    assert _execs() == before, "a read of a known value sent a graph"
    # ops the client cannot compute go where the read is, and are waited for, as before
    x = torch.randn(2, 3)
    y = x.to(remote) * 2
    assert bool((rmask == 1).any()) is True
    assert not trace.current().nodes
    assert _execs() > before
    assert torch.equal(y.cpu(), x * 2)


def test_an_error_of_the_ops_before_a_read_is_the_reads_as_before(remote):
    """A review's case: sent without waiting, a singular inv's check raised later, on
    another thread that landed it, or never."""
    from djinn.errors import DjinnError

    counts = torch.tensor([1, 2, 3]).to(remote)
    torch.linalg.inv(torch.zeros(2, 2).to(remote))  # eager raises here
    with pytest.raises(DjinnError, match="_linalg_check_errors"):
        int(counts.sum())
    assert torch.equal((counts * 2).cpu(), torch.tensor([2, 4, 6]))


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(lambda t: t.fill_(1), id="in place"),
        pytest.param(lambda t: t[1].fill_(1), id="through a view"),
        pytest.param(lambda t: t.view(-1)[5:].zero_().add_(1), id="through a view of a view"),
        pytest.param(lambda t: t.copy_(torch.ones(2, 3, dtype=torch.long)), id="copied into"),
    ],
)
@pytest.mark.parametrize("inference", [False, True], ids=["", "inference mode"])
def test_a_value_the_client_kept_is_dropped_by_a_write(remote, write, inference):
    with torch.inference_mode(inference):  # its tensors have no _base nor version
        mask = torch.tensor([[1, 1, 0], [1, 0, 0]])
        rmask = mask.to(remote)
        assert bool(rmask.all()) is False  # known, and read from the copy
        write(rmask)
        write(mask)
        assert bool(rmask.all()) is bool(mask.all())
        trace.flush(trace.current())
        assert bool(rmask.all()) is bool(mask.all())  # once the write ran too
        assert torch.equal(rmask.cpu(), mask)


def test_a_replay_that_writes_into_its_argument_drops_the_value_kept(remote):
    def add_one(t):
        t.add_(1)

    bump = djinn.replayable(add_one)
    for step in range(5):  # two recordings, then replays
        counts = torch.full((4,), step)
        rcounts = counts.to(remote)  # known: uploaded from a CPU tensor
        bump(rcounts)
        assert int(rcounts.sum()) == 4 * (step + 1), step
    assert bump.stats()["replays"] == 3, bump.stats()


def test_a_mask_moved_while_the_trace_holds_ops_is_known_once_sent(remote):
    local, encode = _replayable_bert(remote)
    mask = torch.ones(1, 8, dtype=torch.long)
    mask[0, 6:] = 0
    with torch.no_grad():
        for step in range(5):
            ids = torch.randint(0, 100, (1, 8))
            pending = encode(ids.to(remote), mask.to(remote)).sum()  # left in the trace
            rmask = mask.to(remote)  # moved inline in the pending graph
            assert trace.current().nodes, "the mask was expected to go inside a graph"
            got = encode(ids.to(remote), rmask)
            want = local(input_ids=ids, attention_mask=mask).last_hidden_state
            assert torch.equal(got.cpu(), want), step
            assert torch.allclose(pending.cpu(), want.sum())
    assert encode.stats()["plain"] == {}, encode.stats()
    assert encode.stats()["replays"] >= 6, encode.stats()


def test_a_value_read_of_a_tensor_the_call_was_not_given_runs_it_as_it_is(remote):
    flags = torch.tensor([1, 1, 0]).to(remote)  # read by name, not passed

    def fn(x):
        return x * 2 if bool(flags.all()) else x * 3

    f = djinn.replayable(fn)
    x = torch.randn(3)
    for _ in range(4):
        assert torch.equal(f(x.to(remote)).cpu(), x * 3)
    assert f.stats()["replays"] == 0
    assert f.stats()["plain"] == {"it read a value of a tensor it was not given": 4}, f.stats()


def test_reads_that_the_client_cannot_compute_wait_for_the_appliance(remote):
    ints = torch.tensor([3, 1, 2, 1]).to(remote)
    floats = torch.tensor([0.5, 1.5]).to(remote)
    reads = [
        lambda: int(ints.argsort(stable=True)[0]) == 1,  # a sort: ties may order otherwise
        lambda: float(floats.sum()) == 2.0,  # floating point
        lambda: bool((ints * 1.5 > 2).any()),  # a float on the way
    ]
    for read in reads:
        trace.flush(trace.current())
        before = _execs()
        assert read()
        assert _execs() > before, "a read the client cannot compute was not sent"


def test_bert_fine_tuned_with_padded_batches_replays_with_eagers_parameters(remote):
    """Its head makes a loss module at each call, and its mask helper reads the mask."""
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    cfg = BertConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64,
        vocab_size=100, max_position_embeddings=64, num_labels=2,
    )  # fmt: skip
    local = BertForSequenceClassification(cfg).train()  # dropout on: replayed draws
    model = copy.deepcopy(local).to(remote)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (local, model)]

    def step(m, opt, ids, mask, labels):
        loss = m(input_ids=ids, attention_mask=mask, labels=labels).loss
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss.detach()

    run = djinn.replayable(lambda *batch: step(model, opts[1], *batch))
    mask = torch.ones(4, 12, dtype=torch.long)
    mask[1, 8:] = 0
    mask[3, 4:] = 0
    gen = torch.Generator().manual_seed(1)
    for _ in range(6):
        ids = torch.randint(0, 100, (4, 12), generator=gen)
        labels = torch.randint(0, 2, (4,), generator=gen)
        state = torch.random.get_rng_state()
        want = step(local, opts[0], ids, mask, labels)
        torch.random.set_rng_state(state)  # the same dropout draws
        got = run(ids.to(remote), mask.to(remote), labels.to(remote))
        assert torch.equal(got.cpu(), want)
    assert run.stats()["replays"] == 4, run.stats()
    for a, b in zip(local.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b.cpu())


@pytest.mark.parametrize(
    "write",
    [
        pytest.param(lambda b: b[0].fill_(False), id="through a view"),
        pytest.param(lambda b: b.view(-1)[:2].zero_(), id="through a view of a view"),
        pytest.param(lambda b: b.logical_not_(), id="in place"),
    ],
)
def test_a_write_not_sent_into_a_value_on_the_way_is_seen(remote, write):
    mask = torch.ones(2, 3, dtype=torch.long)
    on_the_way = mask.to(remote).bool()  # not sent: computed on the client if read
    local = mask.bool()
    write(on_the_way)
    write(local)
    assert bool(on_the_way.all()) is bool(local.all()) is False
    assert int(on_the_way.sum()) == int(local.sum())


def test_gpt2_given_a_left_padded_mask_replays_with_eagers_bits(remote):
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)
    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=100, n_positions=64)
    local = GPT2LMHeadModel(cfg).eval()
    model = copy.deepcopy(local).train().to(remote).eval()
    logits = djinn.replayable(lambda i, a: model(input_ids=i, attention_mask=a).logits)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[0, :3] = 0  # left padding, as generation pads
    with torch.no_grad():
        for _ in range(5):
            ids = torch.randint(0, 100, (2, 12))
            want = local(input_ids=ids, attention_mask=mask).logits
            assert torch.equal(logits(ids.to(remote), mask.to(remote)).cpu(), want)
    assert logits.stats()["replays"] == 3, logits.stats()


def test_a_replay_writing_into_its_argument_through_a_view_drops_the_value_kept(remote):
    """A review's case: the guard of the next call read the value from before the write."""

    def step(x, state):
        y = x * 2 if bool(state[0] < 4) else x * 3
        state[0] += 1  # through a view (select) of the argument
        return y

    f = djinn.replayable(step)
    x = torch.ones(2)
    for _ in range(4):
        state = torch.tensor([3, 0])
        rstate = state.to(remote)  # uploaded afresh: known
        for _call in range(2):
            want = step(x, state)
            assert torch.equal(f(x.to(remote), rstate).cpu(), want)
        assert int(rstate.sum()) == int(state.sum())
    assert f.stats()["replays"] > 0, f.stats()


def test_a_value_read_that_changes_at_every_call_stops_recording(remote):
    from djinn.frontend.replayable import MAX_READ_SETS, VARIED

    f = djinn.replayable(lambda x, mask: x.sum() / int(mask.sum()))
    x = torch.randn(4)
    for n in range(1, 13):
        mask = torch.zeros(16, dtype=torch.long)
        mask[:n] = 1
        assert torch.equal(f(x.to(remote), mask.to(remote)).cpu(), x.sum() / n)
    stats = f.stats()
    assert stats["recordings"] == 1 + MAX_READ_SETS, stats
    assert stats["plain"] == {VARIED: 12 - 1 - MAX_READ_SETS}, stats


@pytest.mark.parametrize(
    "derive",
    [
        pytest.param(lambda m, r: m.to(r)[:, :10], id="a slice of an upload"),
        pytest.param(lambda m, r: m[:, :10].bool().to(r).long(), id="cast after the upload"),
        pytest.param(
            lambda m, r: (m[:, :10].to(r) > 0).to(torch.long), id="compared after the upload"
        ),
    ],
)
def test_a_mask_derived_from_an_upload_outside_the_call_replays(remote, derive):
    """The first review of stop 46's variants: the flush before a recording (or before a
    replay's checks) sent the ops that made the argument, and its handle had no copy, so
    the model's mask read ran the call as it is at every call."""
    local, encode = _replayable_bert(remote)
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 7:] = 0
    with torch.no_grad():
        for step in range(6):
            ids = torch.randint(0, 100, (2, 10))
            want = local(input_ids=ids, attention_mask=mask[:, :10]).last_hidden_state
            got = encode(ids.to(remote), derive(mask, remote)).cpu()
            assert torch.equal(got, want), step
    stats = encode.stats()
    assert stats["plain"] == {}, stats
    assert stats["replays"] == 4, stats


def test_a_derived_mask_written_before_the_call_is_not_taken_for_its_upload(remote):
    f = djinn.replayable(lambda x, m: x * 2 if bool(m.all()) else x * 3)
    x = torch.randn(3)
    for step in range(6):
        m = torch.ones(3, dtype=torch.long).to(remote)[:2]
        if step % 2:
            m[0] = 0  # pending, into the value the call is given
        want = x * 3 if step % 2 else x * 2
        assert torch.equal(f(x.to(remote), m).cpu(), want), step
    assert f.stats()["replays"] > 0, f.stats()


def test_a_write_by_another_thread_before_the_flush_is_not_lost(remote, monkeypatch):
    """A review's race: the value of an argument made from an upload (``u.long()``) was
    computed before the flush that sends it; another thread's write into the upload, sent
    in between, went first, so the appliance's value had the write in it and the
    client's copy (a cast shares no storage mark with the upload) did not: the replays
    took the wrong branch. Now the write sends the op captured before it first (Note
    [reads another thread captured]), as eager ran it, and a value computed before any
    write since is not kept."""
    import threading

    u = torch.ones(4, dtype=torch.int32).to(remote)
    flush, main, hit = trace.flush, threading.get_ident(), []

    def write_between(tr, *args, **kwargs):
        if threading.get_ident() == main and armed and not hit:
            hit.append(1)

            def other():
                u[0] = 0
                u.cpu()  # sent now

            worker = threading.Thread(target=other)
            worker.start()
            worker.join()
        return flush(tr, *args, **kwargs)

    monkeypatch.setattr(trace, "flush", write_between)
    f = djinn.replayable(lambda x, m: x + m.sum() if bool(m.all()) else x - 100)
    x = torch.zeros(2)
    armed = False
    rx = x.to(remote)
    flush(trace.current())
    t = u.long()  # pending: the call's flush sends it
    armed = True
    got = f(rx, t).cpu().tolist()
    assert hit == [1], "the other thread did not write in the window"
    assert t.cpu().tolist() == [1, 1, 1, 1]  # eager's: captured before the write
    assert got == [4.0, 4.0]
    assert bool(t.all()) is True and t.sum().item() == 4
    assert u.cpu().tolist() == [0, 1, 1, 1]
    for _ in range(3):
        assert f(x.to(remote), t).cpu().tolist() == [4.0, 4.0]
