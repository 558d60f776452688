"""Error codes are stable and rebuild the right exception type across the wire."""

from __future__ import annotations

from djinn import errors


def test_every_code_rebuilds_its_own_class():
    for code in errors.all_codes():
        exc = errors.error_from_wire(code, "why")
        assert exc.code == code
        assert "why" in str(exc)


def test_design_codes_exist():
    for code in (
        "AUTH_FAILED",
        "SESSION_EXPIRED",
        "NOT_FOUND",
        "RESOURCE_EXHAUSTED",
        "WORKER_LOST",
        "PROTOCOL_ERROR",
        "UNSUPPORTED_OP",
        "SESSION_LOST",
    ):
        assert code in errors.all_codes()


def test_unknown_code_stays_a_djinn_error_with_that_code():
    exc = errors.error_from_wire("FUTURE_CODE", "from a newer appliance")
    assert isinstance(exc, errors.DjinnError) and exc.code == "FUTURE_CODE"


def test_version_mismatch_is_a_protocol_error():
    assert issubclass(errors.VersionMismatch, errors.ProtocolError)
