"""Stopping cleanly: Ctrl-C, SIGTERM, and a launcher that died.

Checkpoints are safe to interrupt at any moment (sft/safety/checkpoints.py: a checkpoint counts only once its marker is
written), so a stop needs no cooperation from the training loop: Ctrl-C raises KeyboardInterrupt where the
process is, SIGTERM is made to do the same, and `train.py` turns either into one message: the step reached, the
newest complete checkpoint and the command that resumes it.

A worker whose launcher was killed (kill -9 of `accelerate launch`) would otherwise go on training and writing
checkpoints with no one to stop it: under a launcher each worker asks the kernel for SIGTERM when its parent
exits (Linux's PR_SET_PDEATHSIG), and elsewhere a watcher thread notices the parent change.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from sft.machine import launch

PR_SET_PDEATHSIG = 1
SIGTERM_MARK = "SIGTERM"  # the KeyboardInterrupt argument that tells SIGTERM from Ctrl-C
# A SIGTERM this soon after a Ctrl-C is the launcher passing that Ctrl-C on (accelerate's launcher sends it within
# milliseconds), not a stop of its own.
LAUNCHER_FOLLOWS_CTRL_C_S = 10.0
_ctrl_c_at: float | None = None  # when this process last got Ctrl-C (SIGINT)


def one_line_if_stopped_while_importing() -> Callable[[], None]:
    """Ctrl-C in the seconds train.py spends importing torch and transformers, before main() catches it itself: one
    `error:` line instead of the importer's traceback (Python still exits as stopped by SIGINT). -> the call that
    gives Python its own hook back once the imports are done."""
    previous = sys.excepthook

    def hook(kind, value, traceback):
        if not issubclass(kind, KeyboardInterrupt):
            return previous(kind, value, traceback)
        if launch().rank == 0:
            print("error: stopped (Ctrl-C) while loading the libraries, before anything was read or written; run the "
                  "command again to train.", file=sys.stderr, flush=True)

    sys.excepthook = hook
    return lambda: setattr(sys, "excepthook", previous)


def _ctrl_c(signum, frame):
    global _ctrl_c_at
    _ctrl_c_at = time.monotonic()
    raise KeyboardInterrupt


def _raise_interrupt(signum, frame):
    """SIGTERM. A terminal's Ctrl-C reaches the whole foreground process group: `accelerate launch` (or
    `deepseek-sft train`) and its worker both get SIGINT, and the launcher then stops the worker with SIGTERM while
    the worker is already stopping: that stop is still the user's Ctrl-C."""
    if _ctrl_c_at is not None and time.monotonic() - _ctrl_c_at < LAUNCHER_FOLLOWS_CTRL_C_S:
        raise KeyboardInterrupt
    raise KeyboardInterrupt(SIGTERM_MARK)


def stop_on_sigterm() -> None:
    """SIGTERM (a launcher stopping its workers, a scheduler, `kill`) stops like Ctrl-C: KeyboardInterrupt, which
    no library's `except Exception` swallows. Ctrl-C raises it as Python's own handler does, and is remembered so
    that a launcher's SIGTERM right after it keeps its name."""
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # (a process started with it ignored keeps that)
        signal.signal(signal.SIGINT, _ctrl_c)
    signal.signal(signal.SIGTERM, _raise_interrupt)


_launcher_pid: int | None = None  # our parent under a launcher (end_with_launcher), to tell that it died


def end_with_launcher() -> None:
    """Under a launcher: receive SIGTERM when the launcher process exits, however it died."""
    global _launcher_pid
    if not launch().launched:
        return
    parent = _launcher_pid = os.getppid()
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGTERM, 0, 0, 0) == 0:
            if os.getppid() != parent or parent == 1:  # it died before the request took effect
                os.kill(os.getpid(), signal.SIGTERM)
            return
    except (OSError, AttributeError):
        pass
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True, name="launcher-watch").start()


def _watch_parent(parent: int, every_s: float = 2.0) -> None:
    while os.getppid() == parent:
        time.sleep(every_s)
    os.kill(os.getpid(), signal.SIGTERM)


def signal_name(interrupt: KeyboardInterrupt) -> str:
    return "SIGTERM" if interrupt.args == (SIGTERM_MARK,) else "Ctrl-C"


def exit_code(interrupt: KeyboardInterrupt) -> int:
    return 128 + (signal.SIGTERM if interrupt.args == (SIGTERM_MARK,) else signal.SIGINT)


def ignore_further_interrupts() -> None:
    """While the stop is reported and the lock released, a second Ctrl-C must not print a traceback."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def leave_now(code: int) -> None:
    """Exit without waiting for other ranks (they may be inside a collective that will never complete) or for
    the interpreter's teardown."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (BrokenPipeError, OSError):  # the launcher that read it is gone (tell_user)
            pass
    os._exit(code)


def launcher_gone(wait_s: float = 0.0) -> bool:
    """The launcher that started this worker has exited (the worker was handed to another parent). `wait_s`: how
    long to give a launcher that is dying: when its main thread is killed first, the kernel sends our SIGTERM and
    hands us to one of its other threads (the same pid) until the last one is gone, a few milliseconds."""
    deadline = time.monotonic() + wait_s
    while _launcher_pid is not None and os.getppid() == _launcher_pid:
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.02)
    return _launcher_pid is not None


def tell_user(message: str, sigterm: bool = False) -> None:
    """The stop message, on stderr; and on stdout too where stderr may not reach the user. accelerate 1.16's
    launcher tees a worker's stderr through a pipe that dies with it (kill -9 of `accelerate launch`: its reader
    thread can even take the message in and die before passing it on), while the worker's stdout is the launcher's
    own terminal or file, inherited: there the message still reaches the user. A launcher that stops its workers
    itself (SIGTERM or Ctrl-C to it) stays alive meanwhile and passes stderr on: the message is said once."""
    streams = [sys.stderr, sys.stdout] if launcher_gone(wait_s=1.0 if sigterm else 0.0) else [sys.stderr]
    for stream in streams:
        try:
            print(message, file=stream, flush=True)
        except (BrokenPipeError, OSError):  # a pipe without its reader: say it on stdout instead
            if sys.stdout not in streams:
                streams.append(sys.stdout)
