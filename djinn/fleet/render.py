"""The fleet document as an operator reads it: `djinn status --fleet` and `djinn top
--fleet` share these rows. Pure functions of the document (no ray)."""

from __future__ import annotations

from typing import Any

from djinn.cli.status import human_bytes

APPLIANCE_HEADERS = [
    "appliance",
    "node",
    "endpoint",
    "state",
    "workers",
    "sessions",
    "queued",
    "free",
    "capacity",
    "models",
    "placed",
    "report",
]


def _age(value: Any) -> str:
    return "-" if value is None else f"{float(value):.1f}s ago"


def state_text(a: dict[str, Any]) -> str:
    state = a.get("state", "?")
    if state == "up":
        return "up"
    why = f" ({a['why']})" if a.get("why") else ""
    return f"{state} {float(a.get('for_s', 0)):.0f}s{why}"


def models_text(a: dict[str, Any]) -> str:
    models = a.get("models", [])
    if not models:
        return "-"
    return ", ".join(f"{m.get('name') or '?'}:{m['fingerprint'][:8]}" for m in models)


def appliance_row(a: dict[str, Any]) -> list[str]:
    return [
        a.get("id", "?"),
        f"{a.get('node_ip', '')} {str(a.get('node_id', ''))[:8]}".strip(),
        a.get("endpoint", "") or "-",
        state_text(a),
        f"{a.get('workers_up', 0)}/{a.get('workers', 0)}",
        str(a.get("sessions", 0)),
        str(a.get("queued", 0)),
        human_bytes(a.get("free_bytes", 0)),
        human_bytes(a.get("capacity_bytes", 0)),
        models_text(a),
        str(a.get("placed", 0)),
        _age(a.get("report_age_s")),
    ]


def model_copies(doc: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per model in the fleet: where its copies are and what they weigh."""
    by_fp: dict[str, dict[str, Any]] = {}
    for a in doc.get("appliances", []):
        if a.get("state") != "up":
            continue
        for m in a.get("models", []):
            row = by_fp.setdefault(
                m["fingerprint"],
                {"fingerprint": m["fingerprint"], "name": m.get("name", ""), "bytes": 0},
            )
            row.setdefault("appliances", []).append(a["id"])
            row["bytes"] += int(m.get("bytes", 0))
    return sorted(by_fp.values(), key=lambda r: r["fingerprint"])


def render_fleet(doc: dict[str, Any]) -> str:
    from djinn.cli.status import _table

    f = doc.get("fleet", {})
    lines = [
        f"fleet: {f.get('live', 0)}/{f.get('appliances', 0)} appliances up, placement "
        f"{f.get('placement', '?')}, {f.get('placements', 0)} sessions placed, free "
        f"{human_bytes(f.get('free_bytes', 0))}, weights {human_bytes(f.get('weight_bytes', 0))}",
        "",
        "Appliances",
    ]
    lines += _table(APPLIANCE_HEADERS, [appliance_row(a) for a in doc.get("appliances", [])])
    lines += ["", "Models"]
    lines += _table(
        ["model", "name", "copies", "appliances", "bytes"],
        [
            [
                m["fingerprint"],
                m["name"],
                len(m["appliances"]),
                " ".join(m["appliances"]),
                human_bytes(m["bytes"]),
            ]
            for m in model_copies(doc)
        ],
    )
    return "\n".join(lines)
