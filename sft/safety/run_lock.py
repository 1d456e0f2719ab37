"""One run per output directory: `<output_dir>/.run.lock` names the process that holds it.

Two runs writing checkpoints into one directory destroy each other's resume state, and a training process left
behind by a killed launcher keeps writing. The main process creates the lock with O_EXCL before it changes
anything in the directory and removes it when it ends. A lock whose process is gone (same host, and no live
process with that pid and start time) is stale: it is taken over, with a message. A lock held by a live process,
or by another host (which cannot be checked from here), stops the new run with what to do. A lock held by another
rank of this same launch (both think they are rank 0: started without a distributed backend) says that, not
"another run".
"""

from __future__ import annotations

import atexit
import json
import os
import socket
import time
from pathlib import Path

from sft.errors import ConfigError, RunLockedError
from sft.machine import CPU_BACKEND_ADVICE, Launch, launch as this_launch, process_start_ticks
from sft.safety.run_dir import LOCK_NAME, TRAINED_ON


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # someone else's live process
    now = process_start_ticks(pid)
    return start is None or now is None or now == start


def _me() -> dict:
    return {"pid": os.getpid(), "host": socket.gethostname(), "start": process_start_ticks(os.getpid()),
            "since": time.strftime("%Y-%m-%d %H:%M:%S")}


class RunLock:
    def __init__(self, output_dir: str | Path, command: str = "", launch: Launch | None = None):
        """`launch`: this process's (the environment's unless given): under a launcher the lock records the
        launcher's pid, which the ranks of one launch share."""
        self.path = Path(output_dir) / LOCK_NAME
        self.command = command
        self.held = False
        self.created: list[Path] = []  # the directories acquire() made, deepest first (removed again if left empty)
        launch = launch or this_launch()
        self.launch = {"launcher": os.getppid(), "rank": launch.rank} if launch.launched else {}

    def acquire(self) -> str | None:
        """Take the lock; -> a message when a stale lock was taken over. Raises RunLockedError if held, and
        ConfigError where the directory cannot be created or written (read-only, a file, no permission, full)."""
        self.created = [p for p in (self.path.parent, *self.path.parent.parents) if not p.exists()]
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            return self._take()
        except OSError as e:
            blocker = next((p for p in (self.path.parent, *self.path.parent.parents) if p.exists()), None)
            why = (f"{blocker} is a file, not a directory" if blocker and not blocker.is_dir()
                   else f"{e.strerror or e}: {e.filename or self.path.parent}")
            raise ConfigError(f"--output_dir {self.path.parent}: cannot write there ({why}); nothing was trained. "
                              f"Give an --output_dir you can write to.") from None

    def _take(self) -> str | None:
        note = None
        for _ in range(3):
            if self._create():
                self.held = True
                atexit.register(self.release)
                return note
            holder = self._read()
            if holder is None:  # being written right now, or unreadable: look again
                time.sleep(0.2)
                continue
            same_host = holder.get("host") == socket.gethostname()
            if not same_host or _alive(int(holder.get("pid", -1)), holder.get("start")):
                if same_host and self.launch and holder.get("launcher") == self.launch["launcher"]:
                    raise RunLockedError(self._same_launch_message(holder))
                raise RunLockedError(self._held_message(holder, same_host))
            try:  # one taker wins the rename; a second one finds the lock gone and retries its own create
                os.rename(self.path, self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}"))
                os.unlink(self.path.with_name(f"{LOCK_NAME}.stale-{os.getpid()}"))
            except FileNotFoundError:
                pass
            note = (f"Took over the lock of a run that is no longer running (pid {holder.get('pid')} on "
                    f"{holder.get('host')}, since {holder.get('since')}).")
        raise RunLockedError(f"cannot take the lock {self.path}: it keeps changing or cannot be read. If no run "
                             f"uses {self.path.parent}, delete {self.path} and try again.")

    def _create(self) -> bool:
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            json.dump({**_me(), **self.launch, "command": self.command}, f)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _read(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except (OSError, ValueError):
            return None

    def _held_message(self, holder: dict, same_host: bool) -> str:
        who = f"pid {holder.get('pid')} on {holder.get('host')}, since {holder.get('since')}"
        command = f": `{holder['command']}`" if holder.get("command") else ""
        if same_host:
            todo = "Wait for it to finish, stop it (kill " + str(holder.get("pid")) + "), or give another --output_dir."
        else:
            todo = (f"Wait for it, or give another --output_dir. If no run is active on {holder.get('host')}, "
                    f"delete {self.path}.")
        return f"--output_dir {self.path.parent} is in use by another run ({who}){command}. {todo}"

    def _same_launch_message(self, holder: dict) -> str:
        return (f"--output_dir {self.path.parent} is held by rank {holder.get('rank')} of this same launch (pid "
                f"{holder.get('pid')}), not by another run: its processes do not agree which of them is rank 0, "
                f"which happens when they start without a distributed backend. {CPU_BACKEND_ADVICE}")

    def release(self) -> None:
        """Remove the lock if it is still ours (idempotent; also at exit)."""
        if not self.held:
            return
        self.held = False
        holder = self._read() or {}
        if holder.get("pid") == os.getpid() and holder.get("host") == socket.gethostname():
            self.path.unlink(missing_ok=True)
            if self.created:
                self._remove_unused_directories()

    def _remove_unused_directories(self) -> None:
        """The directories this run created (output/<model>/<method>/<time> and the folders above it), when it
        stopped before writing anything but its record."""
        root = self.path.parent
        try:
            if [p.name for p in root.iterdir()] == [TRAINED_ON]:
                (root / TRAINED_ON).unlink()
            for made in self.created:
                made.rmdir()  # only if empty: stops at the first that holds something
        except OSError:
            pass
