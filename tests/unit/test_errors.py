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


def _raised(error: BaseException) -> BaseException:
    try:
        raise error
    except BaseException as exc:
        return exc


class NeedsTwo(Exception):
    def __init__(self, a, b):
        super().__init__(f"{a}/{b}")


def test_a_kept_copy_has_the_type_code_attributes_and_cause_but_no_traceback():
    """Note [raising a kept error]: what a failed value keeps holds no frame (nor does
    its cause), and a cause that is not Djinn's says where it was raised, as a note."""
    from djinn.errors import copy_of

    cause = _raised(ValueError("from a hook"))
    error = errors.error_from_wire("SOME_NEW_CODE", "boom")
    error._djinn_failed_value = True
    error.__cause__ = cause
    error.add_note("a note")
    error = _raised(error)
    kept = copy_of(error)
    assert type(kept) is type(error) and kept is not error
    assert (str(kept), kept.code, kept.message) == (str(error), "SOME_NEW_CODE", "boom")
    assert kept._djinn_failed_value
    assert kept.__traceback__ is None and kept.__cause__.__traceback__ is None
    assert type(kept.__cause__) is ValueError and str(kept.__cause__) == "from a hook"
    assert "_raised" in kept.__cause__.__notes__[-1]  # the hook's error: where it rose
    assert kept.__notes__ == ["a note"]
    kept.add_note("another")
    assert error.__notes__ == ["a note"]
    # raised again, the copy gathers frames; the kept one does not
    assert _raised(copy_of(kept)).__traceback__ is not None and kept.__traceback__ is None
    # a type that cannot be rebuilt from its args is copied all the same
    odd = copy_of(_raised(NeedsTwo(1, 2)))
    assert type(odd) is NeedsTwo and str(odd) == "1/2" and odd.__traceback__ is None
