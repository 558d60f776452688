"""`djinn run script.py [args...]`: an unmodified script, with its GPU work on the appliance.

The script runs as ``__main__`` with its own argv; its exit code is ours. With no
``DJINN_ADDRESS`` or configured address an embedded appliance serves it and stops with it.
A failure in the script prints the script's traceback, without Djinn's frames.
"""

from __future__ import annotations

import os
import runpy
import sys
import traceback
from types import TracebackType

_OURS = (os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "runpy.py", "<frozen runpy>")


def _user_frames(tb: TracebackType | None) -> TracebackType | None:
    """Skip the leading frames that belong to Djinn or runpy: start at the script."""
    while (tb is not None and tb.tb_frame.f_code.co_filename.startswith(_OURS[0])) or (
        tb is not None and tb.tb_frame.f_code.co_filename.endswith(_OURS[1:])
    ):
        tb = tb.tb_next
    return tb


def run_script(script: str, args: list[str], device_map: str) -> int:
    if not os.path.isfile(script):
        print(f"djinn run: no such script: {script}", file=sys.stderr)
        return 2
    mode = None
    if device_map:
        source, _, target = device_map.partition("=")
        if target and target != "remote_accelerator":
            print(f"djinn run: can only map to remote_accelerator, not {target!r}", file=sys.stderr)
            return 2
        from djinn.frontend import devicemap

        mode = devicemap.install(source or "cuda")
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as exc:
        code = exc.code
        if code is None:
            return 0
        if isinstance(code, int):
            return code
        print(code, file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BaseException as exc:  # the script's own error: show it as Python would
        traceback.print_exception(type(exc), exc, _user_frames(exc.__traceback__))
        return 1
    finally:
        sys.stdout.flush()
        if mode is not None:
            from djinn.frontend import devicemap

            if not _script_threads_left():  # Note [mapped threads]: theirs until they end
                devicemap.uninstall(mode)
    return 0


def _script_threads_left() -> bool:
    """Whether threads the script started are still running (not daemons, not Djinn's):
    the interpreter joins them at its exit, after this returns. The map stays on for them:
    taken off, a thread still at work found ``cuda`` unmapped mid-way (a review). Joining
    them here instead would hang on a thread pool the script left open, which only the
    interpreter's exit shuts down."""
    import threading

    return any(
        t is not threading.current_thread() and not t.daemon and not t.name.startswith("djinn-")
        for t in threading.enumerate()
    )
