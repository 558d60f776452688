"""Two clients registering the same model at once upload it once (issue 16 §5):
the second waits for the first upload, by fingerprint, and then shares it."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.conftest import wait_for

transformers = pytest.importorskip("transformers")


def _model(seed: int):
    torch.manual_seed(seed)
    cfg = transformers.GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=1000)
    return transformers.GPT2LMHeadModel(cfg).eval()


def _body(model) -> dict:
    from djinn.frontend import remote_module

    return {
        "fingerprint": remote_module.fingerprint(model),
        "class": remote_module._class_path(type(model)),
        "config_json": remote_module._config_json(model),
        "name": "shared",
    }


def _register_in_thread(session, body: dict) -> tuple[threading.Thread, dict]:
    got: dict = {}
    t = threading.Thread(target=lambda: got.update(session.register_model(body)), daemon=True)
    t.start()
    return t, got


def test_a_second_registration_waits_for_the_first_upload_and_shares_it(appliance):
    from djinn.frontend import remote_module
    from djinn.protocol.tensors import to_wire

    model = _model(21)
    body = _body(model)
    fp = body["fingerprint"][:12]
    with appliance.connect() as a, a.session() as first, a.session() as second:
        assert first.register_model(body)["cached"] is False  # first is the uploader
        waiter, got = _register_in_thread(second, body)
        # parked: the second is neither answered nor told to upload while the first uploads
        handles = remote_module._upload(first, remote_module._state(model))
        assert not got
        done = first.register_model({**body, "state": handles})
        assert done["cached"] is True
        waiter.join(30)
        assert got["cached"] is True and got["sessions"] == 2  # shared, never uploaded
        listed = wait_for(lambda: [m for m in a.stats()["models"] if m["fingerprint"] == fp])
        assert len(listed) == 1 and listed[0]["sessions"] == 2  # one copy
        # and it runs for the second session
        desc, flat = to_wire(torch.tensor([[1, 2, 3]]))
        call = {"fingerprint": body["fingerprint"], "args": [{"$t": 0, "desc": desc}]}
        assert "out" in second.call_model(call, [flat.numpy()])


def test_a_waiter_uploads_itself_when_the_uploader_gives_up(appliance):
    model = _model(22)
    body = _body(model)
    with appliance.connect() as a, a.session() as second:
        first = a.session()
        assert first.register_model(body)["cached"] is False
        waiter, got = _register_in_thread(second, body)
        first.close()  # the uploader leaves without uploading
        waiter.join(30)
        assert got == {"cached": False}  # now it is the uploader
    wait_for(lambda: not any(m["name"] == "shared" for m in appliance.stats()["models"]))
