"""Typed errors with stable codes that cross the wire.

Every error the appliance reports travels as an ERROR frame carrying ``code`` and
``message``; the client turns it back into the same exception class here. Codes are part
of the protocol: never rename one, only add.
"""

from __future__ import annotations

import builtins
import re


class DjinnError(Exception):
    """Base class. ``code`` is the stable wire code."""

    code = "INTERNAL"

    def __init__(self, message: str = "") -> None:
        super().__init__(message or self.__class__.__doc__ or self.code)
        self.message = message or (self.__class__.__doc__ or self.code).strip()

    def __str__(self) -> str:
        return f"[{self.code}] {self.message}"


class InternalError(DjinnError):
    """The appliance hit a bug; the request failed but the appliance keeps serving."""

    code = "INTERNAL"


class ProtocolError(DjinnError):
    """A frame broke the wire protocol (bad magic, bad lengths, malformed body...)."""

    code = "PROTOCOL_ERROR"


class VersionMismatch(ProtocolError):
    """Client and appliance speak different protocol versions; upgrade the older side."""

    code = "VERSION_MISMATCH"


class FrameTooLarge(ProtocolError):
    """A frame declared more bytes than the protocol allows at this stage."""

    code = "FRAME_TOO_LARGE"


class AuthFailed(DjinnError):
    """Authentication failed: wrong or missing token, or a peer with another uid."""

    code = "AUTH_FAILED"


class SessionExpired(DjinnError):
    """The session's lease ran out (no heartbeat in time); its handles were freed."""

    code = "SESSION_EXPIRED"


class SessionEnded(DjinnError):
    """An operator ended the session (djinn top, KILL_SESSION); its handles were freed.
    The message says who and when. Open a new session."""

    code = "SESSION_ENDED"


class SessionLost(DjinnError):
    """The session's worker died; its handles are gone. Open a new session."""

    code = "SESSION_LOST"


class ApplianceLost(SessionLost):
    """The fleet appliance holding the session is gone (its node died or cannot be
    reached); its tensors and KV caches are lost. New sessions go to the live appliances.
    A kind of SESSION_LOST, so code that handles that handles this too."""

    code = "APPLIANCE_LOST"


class RecoveryFailed(SessionLost):
    """(client side) a recovering session could not be rebuilt after its worker was lost;
    the message names the original fault (``fault`` holds it) and why recovery gave up."""

    code = "RECOVERY_FAILED"
    fault: DjinnError | None = None


class WorkerLost(DjinnError):
    """The worker running this request died before answering."""

    code = "WORKER_LOST"


class NotFound(DjinnError):
    """No such handle (or object) in this session."""

    code = "NOT_FOUND"


class ResourceExhausted(DjinnError):
    """Not enough memory (arena or device segment) for this request."""

    code = "RESOURCE_EXHAUSTED"


class QuotaExceeded(ResourceExhausted):
    """This session would hold more device or host memory than its quota
    (session_device_max, session_host_max); other sessions are unaffected."""

    code = "QUOTA_EXCEEDED"


class InvalidArgument(DjinnError):
    """A well-formed request with a value the appliance cannot accept."""

    code = "INVALID_ARGUMENT"


class UnsupportedOp(DjinnError):
    """An op that cannot be captured or executed (only torch.ops.aten / prims run)."""

    code = "UNSUPPORTED_OP"


class ExecutionError(DjinnError, RuntimeError):
    """An op raised while executing on the appliance (the message carries PyTorch's).

    Also a ``RuntimeError``, what PyTorch raises for the same op locally: a program that
    catches eager's error (``except RuntimeError``) catches it here too, where it comes
    at the read rather than at the call (ops run lazily)."""

    code = "EXECUTION_ERROR"


class BehindFailed(DjinnError):
    """A graph sent behind another request of its session (its ``after``) that failed: it
    was not run (Note [replays sent ahead]). A client sends it again, or fails it with the
    first one's error; a program never sees this code."""

    code = "BEHIND_FAILED"


class Interrupted(DjinnError):
    """(Client side) a result never read: the program was interrupted twice while it
    waited (Note [interrupted waits]); the appliance may have run the request."""

    code = "INTERRUPTED"


class Unavailable(DjinnError):
    """The appliance cannot be reached or has no worker ready."""

    code = "UNAVAILABLE"


class ConfigError(DjinnError):
    """A setting has a value Djinn cannot use."""

    code = "CONFIG_ERROR"


_BY_CODE: dict[str, type[DjinnError]] = {}


def _register(cls: type[DjinnError]) -> None:
    for sub in cls.__subclasses__():
        _BY_CODE.setdefault(sub.code, sub)
        _register(sub)


_register(DjinnError)


# Note [linear algebra errors]: PyTorch raises ``torch.linalg.LinAlgError`` (a singular
# matrix, one not positive-definite), and programs catch it by that name (``except
# LinAlgError:`` add jitter, try again). Raised by the appliance's kernel, it came back an
# ExecutionError, which that ``except`` let through. The worker names it in the message
# (``LINALG_MARK``, after the op and node), and the client raises ``LinAlgExecutionError``:
# an ExecutionError and a LinAlgError both. So for the built-in errors a kernel raises
# where eager's program catches them by name: an index out of range is eager's
# ``IndexError`` (``x[idx]``, an embedding; a review: ``except IndexError`` missed it),
# and ``ValueError`` and ``TypeError`` alike (``KERNEL_ERRORS``). The classes are made at
# first use, so this module imports no torch.
LINALG_MARK = "torch.linalg.LinAlgError: "
KERNEL_ERRORS = ("IndexError", "ValueError", "TypeError")
# ... after a graph's op and node, or a registered model's call (``(model call)``: a
# generate() argument transformers refuses with a ValueError came back an ExecutionError,
# which ``except ValueError`` let through: a review)
_MARKED = re.compile(
    rf"\((?:node \d+|model call)\): (torch\.linalg\.LinAlgError|{'|'.join(KERNEL_ERRORS)}): "
)
_kernel_classes: dict[str, type] = {}


def kernel_mark(exc: BaseException) -> str:
    """What the worker writes before a kernel's error, naming a class the client raises
    it as too ("" for the rest)."""
    import torch

    if isinstance(exc, torch.linalg.LinAlgError):
        return LINALG_MARK
    name = type(exc).__name__
    return f"{name}: " if name in KERNEL_ERRORS and type(exc).__module__ == "builtins" else ""


def _kernel_error(kind: str) -> type:
    cls = _kernel_classes.get(kind)
    if cls is None:
        if kind == "torch.linalg.LinAlgError":
            import torch

            name, base = "LinAlgExecutionError", torch.linalg.LinAlgError
        else:
            name, base = f"{kind.removesuffix('Error')}ExecutionError", getattr(builtins, kind)
        cls = type(
            name,
            (ExecutionError, base),
            {
                "__doc__": f"A kernel's {kind} on the appliance (Note [linear algebra errors]).",
                "__module__": __name__,
            },
        )
        globals()[name] = cls
        _kernel_classes[kind] = cls
    return cls


def error_from_wire(code: str, message: str) -> DjinnError:
    """Rebuild the typed exception for a wire ``code`` (unknown codes stay DjinnError)."""
    cls = _BY_CODE.get(code)
    if cls is ExecutionError:
        marked = _MARKED.search(message)
        if marked is not None:
            return _kernel_error(marked.group(1))(message)
    if cls is None:
        err = DjinnError(message)
        err.code = code
        return err
    return cls(message)


def all_codes() -> list[str]:
    return sorted(_BY_CODE)


def copy_of(error: BaseException, _depth: int = 0) -> BaseException:
    """A copy of ``error`` without its traceback: the one to keep on a failed value, and
    the one to raise where a kept error is reported again.

    Note [raising a kept error]: a traceback holds the frame each raise passed through,
    and a frame holds the frames that called it (``f_back``, once it returns) with all
    their locals: the program's model and optimizer. Their lazy tensors are held by C++
    too (the autograd graph, a gradient's accumulator), which makes them roots Python's
    collector does not look through. A failure kept on a value, with a traceback, and
    raised again at every read of it, so made a cycle error -> frames -> tensor -> failed
    value -> error that was never freed, nor the appliance's handles behind it (a loop
    whose forward failed left 12). So a kept error has no traceback, a cause kept with it
    neither, and each report raises a copy, which goes when the program lets it go. A
    cause that is not Djinn's (a hook's own error) keeps where it was raised as a note."""
    import copy
    import traceback

    try:
        fresh = copy.copy(error)  # its type, args and attributes (a code, a failed value)
    except Exception:  # a type that cannot be rebuilt from its args
        try:
            fresh = BaseException.__new__(type(error), *error.args)
            fresh.__dict__.update(getattr(error, "__dict__", {}))
        except Exception:
            return error
    cause = error.__cause__
    fresh.__cause__ = copy_of(cause, _depth + 1) if cause is not None and _depth < 8 else None
    fresh.__suppress_context__ = error.__suppress_context__
    notes = list(getattr(error, "__notes__", ()))
    if error.__traceback__ is not None and not isinstance(error, DjinnError):
        where = "".join(traceback.format_tb(error.__traceback__)).rstrip()
        notes.append(f"{type(error).__name__} was raised here:\n{where}")
    if notes:
        fresh.__notes__ = notes  # type: ignore[attr-defined]
    return fresh.with_traceback(None)
