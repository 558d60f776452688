"""A request refused for device memory says what holds it, by kind (a review: a session
told to "free handles or KV caches" while the memory was another session's model, in use
by its call, could not tell)."""

from __future__ import annotations

import pytest

from appliance.vmu.device import DeviceShort, DeviceVMU


def test_a_short_device_says_what_is_in_use_by_kind():
    vmu = DeviceVMU(1000)
    vmu.charge(vmu["text"], 700)  # a model's weights, which nothing can evict here
    vmu.charge(vmu["data"], 200)
    with pytest.raises(DeviceShort) as short:
        vmu.charge(vmu["stack"], 300)
    assert short.value.short == 200
    assert "in use: weights 700, session data 200;" in short.value.message
    assert "weights of models other calls are running" in short.value.message
