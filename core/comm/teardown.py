"""Ending the process group polyaccel created, on every way out of the process.

A world group that :func:`polyaccel.comm.init_distributed` created (not one the application made
and polyaccel adopted) is destroyed exactly once, whichever comes first:

- an explicit :func:`polyaccel.comm.destroy` (which also takes back what is armed here);
- interpreter exit (``atexit``): a normal end, ``sys.exit``, an uncaught exception, an uncaught
  ``KeyboardInterrupt``;
- ``SIGTERM`` (what ``torchrun`` sends the other ranks when one fails): the group is destroyed,
  then the default action is taken again, so the process still dies by ``SIGTERM``.

A process whose group is never destroyed leaves its teardown to the C++ destructors at interpreter
shutdown, after Python's own state is gone; that is where a rank can abort while its peers exit.

``SIGINT`` keeps its meaning: it raises ``KeyboardInterrupt`` in the main thread (the group still
works, so an ``except KeyboardInterrupt`` may still save), and the group is destroyed at exit. An
uncaught ``KeyboardInterrupt`` prints one line instead of a traceback, and a second Ctrl-C while the
process is already exiting ends it at once with one line, never a traceback from an exit hook.

Nothing here raises: a teardown that fails is one line on stderr. Signal handlers are installed only
from the main thread and only over the default ones (an application's own handlers are left alone).
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import threading
import time

import torch.distributed as dist

#: seconds a signal-driven teardown may take before the process exits without it
SIGNAL_TEARDOWN_S = 10.0

_lock = threading.RLock()
_group = None  # the world group polyaccel created, while it is alive
_atexit_registered = False
_exiting = False
_installed: dict[int, object] = {}  # signal number -> the handler ours replaced
_previous_excepthook = None  # the hook ours wraps


def _say(message: str) -> None:
    try:
        sys.stderr.write(f"polyaccel: rank {os.environ.get('RANK', '0')}: {message}\n")
        sys.stderr.flush()
    except Exception:  # noqa: BLE001, S110 - stderr may be closed at exit; nothing else to tell it with
        pass


def arm() -> None:
    """Take ownership of the current world group (just created by polyaccel): destroy it on every exit path."""
    global _group, _atexit_registered
    with _lock:
        _group = _default_group()
        if not _atexit_registered:
            atexit.register(_at_exit)
            _atexit_registered = True
        if threading.current_thread() is threading.main_thread():
            _install(signal.SIGTERM, signal.SIG_DFL, _on_sigterm)
            _install(signal.SIGINT, signal.default_int_handler, _on_sigint)
            _install_excepthook()


def disarm() -> None:
    """Forget the owned group and put back the handlers ours replaced (when they are still ours)."""
    global _group
    with _lock:
        _group = None
        _restore_signals()
        _restore_excepthook()


def release_signals() -> None:
    """Leave SIGTERM and SIGINT to a framework that handles them itself (Lightning stops its loop on SIGTERM);
    the group is still destroyed at exit."""
    with _lock:
        _restore_signals()


def _restore_signals() -> None:
    if threading.current_thread() is not threading.main_thread():
        return
    for signum, previous in list(_installed.items()):
        try:
            if signal.getsignal(signum) in (_on_sigterm, _on_sigint):
                signal.signal(signum, previous)
        except (ValueError, OSError):
            pass
        del _installed[signum]


def _default_group():
    if not (dist.is_available() and dist.is_initialized()):
        return None
    try:
        return dist.distributed_c10d._get_default_group()
    except Exception:  # noqa: BLE001
        return None


def _install(signum: int, default, handler) -> None:
    try:
        current = signal.getsignal(signum)
    except (ValueError, OSError):
        return
    if current is handler or current is not default:
        return  # ours already, or the application's own: left alone
    signal.signal(signum, handler)
    _installed[signum] = current


def teardown(reason: str) -> bool:
    """Destroy the owned group if it is still the live world group; never raises. True when one was destroyed."""
    global _group
    with _lock:
        group, _group = _group, None
        if group is None:
            return False
        try:
            if _default_group() is not group:
                return False  # already destroyed (by the application, say), or replaced by its own
            dist.destroy_process_group()
            return True
        except BaseException as exc:  # noqa: BLE001 - an exit path must not raise
            _say(f"destroying the process group ({reason}) failed: {type(exc).__name__}: {exc}")
            return False
        finally:
            _end_session()


def _end_session() -> None:
    try:
        from ..runtime import current
        from . import dispatch

        current().comm.end()
        dispatch.install(None)
    except BaseException:  # noqa: BLE001, S110 - best effort on the way out
        pass


def _at_exit() -> None:
    global _exiting
    _exiting = True
    try:
        teardown("at exit")
    except BaseException as exc:  # noqa: BLE001 - a second Ctrl-C lands in _on_sigint, but never raise here
        _say(f"teardown at exit failed: {type(exc).__name__}: {exc}")


def _on_sigterm(signum, frame) -> None:
    """Destroy the group, then die by the same signal with its default action (the exit status says SIGTERM)."""
    global _exiting
    _exiting = True
    watchdog = threading.Timer(SIGNAL_TEARDOWN_S, _force_exit, args=(signum, "the teardown did not finish"))
    watchdog.daemon = True
    watchdog.start()
    if teardown(signal.Signals(signum).name):
        _say(f"{signal.Signals(signum).name}: process group destroyed, exiting")
    watchdog.cancel()
    _reraise_default(signum)


def _on_sigint(signum, frame) -> None:
    """Ctrl-C: ``KeyboardInterrupt`` as always; a second one while exiting ends the process with one line."""
    if _exiting:
        _force_exit(signum, "interrupted again while exiting")
    raise KeyboardInterrupt


def _force_exit(signum: int, why: str) -> None:
    _say(f"{why}; exiting now")
    if threading.current_thread() is threading.main_thread():
        _reraise_default(signum)
    os._exit(128 + signum)


def _reraise_default(signum: int) -> None:
    """Die by ``signum`` with its default action (the exit status names the signal)."""
    try:
        signal.signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)
        time.sleep(1.0)  # the default action is asynchronous to another thread's delivery
    finally:
        os._exit(128 + signum)


def _install_excepthook() -> None:
    """An uncaught ``KeyboardInterrupt`` prints one line (where it stopped), not a traceback per rank.

    Every other exception goes to the hook that was in force; the interpreter still ends by SIGINT."""
    global _previous_excepthook
    if sys.excepthook is _excepthook:
        return
    _previous_excepthook = sys.excepthook
    sys.excepthook = _excepthook


def _restore_excepthook() -> None:
    global _previous_excepthook
    if sys.excepthook is _excepthook and _previous_excepthook is not None:
        sys.excepthook = _previous_excepthook
    _previous_excepthook = None


def _excepthook(exc_type, exc, tb) -> None:
    if not (isinstance(exc_type, type) and issubclass(exc_type, KeyboardInterrupt)):
        (_previous_excepthook or sys.__excepthook__)(exc_type, exc, tb)
        return
    where = ""
    here = os.path.abspath(__file__)
    while tb is not None:
        code = tb.tb_frame.f_code
        if os.path.abspath(code.co_filename) != here:
            where = f" in {code.co_name} ({os.path.basename(code.co_filename)}:{tb.tb_lineno})"
        tb = tb.tb_next
    _say(f"interrupted (KeyboardInterrupt){where}; exiting")
