"""`djinn top` shows the memory tiers (issue 9 §5): per session and per model the bytes
on the device and on the host and the swaps, per worker the policy and admission queue."""

from __future__ import annotations

from djinn.tui.widgets.rows import (
    MODEL_COLUMNS,
    SESSION_COLUMNS,
    WORKER_COLUMNS,
    model_rows,
    session_rows,
    worker_rows,
)

MIB = 1 << 20

DOC = {
    "workers": [{"id": 0, "device": "cpu:0", "alive": True, "sessions": 1}],
    "memory": [{"worker": 0, "policy": "semantic", "admission": {"waiting": 2, "oldest_s": 1.5}}],
    "sessions": [
        {
            "id": "s1",
            "worker": 0,
            "bytes": 3 * MIB,
            "host_bytes": 4 * MIB,
            "swaps_in": 2,
            "swaps_out": 3,
        }
    ],
    "models": [
        {
            "name": "GPT2LMHeadModel",
            "fingerprint": "abc",
            "bytes": 20 * MIB,
            "host_bytes": 20 * MIB,
            "swaps_in": 5,
            "swaps_out": 6,
            "evictions": 6,
            "sessions": 12,
        }
    ],
}


def _cells(rows, columns, key):
    return {c.key: str(cell) for c, cell in zip(columns, rows[key], strict=True)}


def test_sessions_models_and_workers_show_tiers_swaps_and_the_queue():
    s = _cells(session_rows(DOC), SESSION_COLUMNS, "s1")
    assert s["host"] == "4.0 MiB" and s["swaps"] == "2/3"
    m = _cells(model_rows(DOC), MODEL_COLUMNS, "abc")
    assert m["host"] == "20.0 MiB" and m["swaps"] == "5/6" and m["evictions"] == "6"
    w = _cells(worker_rows(DOC), WORKER_COLUMNS, "0")
    assert w["memory"] == "semantic, 2 waiting (1.5s)"


def test_caches_recomputed_instead_of_swapped_show_beside_the_swaps():
    doc = {**DOC, "sessions": [{**DOC["sessions"][0], "recomputes": 4}]}
    assert _cells(session_rows(doc), SESSION_COLUMNS, "s1")["swaps"] == "2/3 +4 rec"


def test_an_appliance_without_memory_figures_shows_dashes():
    old = {k: v for k, v in DOC.items() if k != "memory"}
    old["sessions"] = [{"id": "s1", "bytes": 1}]
    assert _cells(session_rows(old), SESSION_COLUMNS, "s1")["swaps"] == "-"
    assert _cells(worker_rows(old), WORKER_COLUMNS, "0")["memory"] == "-"
