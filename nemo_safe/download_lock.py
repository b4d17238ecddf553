# ruff: noqa: UP006, UP007, UP035  (torchvision's typing idiom: Optional, typing.Callable)
"""The lock every single flight runs on, in the form torchvision's ``datasets/utils.py`` gets it.

``ci/make_patches.py`` copies :class:`_DownloadLock` and its constants by name into
torchvision's ``utils.py`` (patch 0002 of ``patches/torchvision/``), where the MNIST
family's ``download()`` holds it. The overlay runs the same class: every
:class:`~nemo_safe.single_flight.SingleFlight` (the MNIST family, the other dataset
classes, torch.hub) is a subclass of it that keeps its protocol (waiting, leading, the
heartbeat, takeover, failure and outcome) and adds what a package can do and a library
function should not: election by ``link(2)``, locks of other writers ignored, a stuck
job told apart from a slow one by its thread's progress, SIGTERM, logging, nemo_safe's
errors. Written in torchvision's idiom (``Optional``, ``RuntimeError``, no logging).
"""

import contextlib
import json
import os
import re
import threading
import time
from collections.abc import Iterator
from typing import Any, Callable, Optional

#: A holder beats every _LOCK_BEAT s; silent for _LOCK_STALE s it is taken over; _LOCK_TIMEOUT s without progress fail.
_LOCK_BEAT, _LOCK_STALE, _LOCK_TIMEOUT = 1.0, 15.0, 30 * 60.0


class _DownloadLock:
    """Processes downloading into one folder take turns: creating ``<folder>/<name>.<n>`` (``O_EXCL``) makes the holder,
    which beats in it, then removes it (done) or writes its outcome while no newer generation exists. Waiters return
    once ``done()`` holds, raise the error of a holder seen running, or take over an ended or silent one."""

    stale_after, timeout, poll_max = _LOCK_STALE, _LOCK_TIMEOUT, 1.0
    missing_rereads = (0.01, 0.02, 0.04)  # some FUSE mounts answer ENOENT while a beat's rename replaces the lock

    def __init__(self, folder: str, name: str = ".download.lock") -> None:
        self.folder, self.name, self.token = folder, name, os.urandom(8).hex()
        self._stop, self._beating = threading.Event(), threading.Thread()

    def _path(self, generation: int) -> str:
        return os.path.join(self.folder, f"{self.name}.{generation}")

    def _generations(self) -> list[int]:
        names = os.listdir(self.folder) if os.path.isdir(self.folder) else []
        return sorted(int(n.rpartition(".")[2]) for n in names if re.fullmatch(re.escape(self.name) + r"\.\d+", n))

    def _read(self, generation: int) -> Optional[dict[str, Any]]:
        for pause in (*self.missing_rereads, 0):
            with contextlib.suppress(FileNotFoundError), open(self._path(generation), "rb") as f:
                info = json.loads(f.read() or b"{}")  # empty until its creator has written it
                return info if isinstance(info, dict) else {"state": "unreadable"}
            time.sleep(pause)
        return None

    def _create(self, generation: int) -> bool:
        os.makedirs(self.folder, exist_ok=True)
        try:
            os.close(os.open(self._path(generation), os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        except FileExistsError:
            return False
        with contextlib.suppress(OSError):  # else it stays silent and is taken over
            self._write(generation, "running", 0)
        return True

    def _write(self, generation: int, state: str, beat: int, **extra: Any) -> None:
        with open(f"{self._path(generation)}.{self.token}", "w") as f:
            json.dump({"state": state, "beat": beat, "token": self.token, **extra}, f)
        os.replace(f.name, self._path(generation))

    def _holds(self, generation: int) -> bool:
        info = self._read(generation)
        return bool(info) and info.get("token") == self.token and max(self._generations(), default=-1) == generation

    def _takes_over(self, info: dict[str, Any], silent: float, overdue: bool) -> bool:
        return silent >= self.stale_after

    def _pause(self, delay: float, info: dict[str, Any], deadline: float) -> float:
        time.sleep(delay)
        return min(2 * delay, self.poll_max)

    def _error(self, info: dict[str, Any]) -> Exception:
        if info.get("state") != "failed":
            return RuntimeError(f"No progress downloading into {self.folder} for {self.timeout:.0f} s")
        return RuntimeError(f"Downloading into {self.folder} failed: {info.get('error_type')}: {info.get('error')}")

    def _beat(self, generation: int) -> None:
        beat = 0
        while not self._stop.wait(_LOCK_BEAT):
            beat += 1
            with contextlib.suppress(OSError):  # a missed beat; the next one may get through
                if not self._holds(generation) or self._stop.is_set():
                    return
                self._write(generation, "running", beat)

    def _finish(self, generation: int, state: str, **extra: Any) -> bool:
        self._stop.set()
        self._beating.join(2 * _LOCK_BEAT)
        if not self._holds(generation):
            return False  # taken over while stalled: the new holder's outcome counts
        with contextlib.suppress(OSError):  # if this fails, the others see the beat stop
            if state != "done":
                self._write(generation, state, -1, **extra)
            for old in [g for g in self._generations() if g <= generation] if state == "done" else []:
                os.remove(self._path(old))  # the oldest first: the newest says "running" until the last
        return True

    def _wait(self, done: Callable[[], bool]) -> Optional[int]:  # None once done() holds, else the one created
        saw_running, seen_beat, seen_progress, delay = set(), None, None, 0.01
        looked = changed = time.monotonic()
        deadline = looked + self.timeout
        while not done():
            try:
                current = max(self._generations(), default=-1)
                info = self._read(current) if current >= 0 else {"state": "done"}
            except OSError:  # this process's own listing or read failed: no verdict on the holder
                info = None
            now = time.monotonic()
            if info is not None:
                beat, progress = (current, info.get("beat")), (current, info.get("progress", info.get("beat")))
                if progress != seen_progress:  # the timeout counts a standstill, not a long download
                    seen_progress, deadline = progress, now + self.timeout
                if beat != seen_beat or now - looked > max(self.stale_after / 3, 2 * self.poll_max):
                    seen_beat, changed = beat, now  # a new beat, or this process's own pause: no silence
                looked, state = now, info.get("state")
                if state == "failed" and current in saw_running:
                    raise self._error(info)
                saw_running.update([current] if state == "running" else [])
                if state in ("done", "failed", "abandoned") or self._takes_over(info, now - changed, now > deadline):
                    if self._create(current + 1):
                        return current + 1
                elif now > deadline:
                    raise self._error(info)
            elif now > deadline:
                raise self._error({})
            delay = self._pause(delay, info or {}, deadline)
        return None

    @contextlib.contextmanager
    def hold(self, done: Callable[[], bool]) -> Iterator[bool]:
        """The block runs in the holder (True); the others get False once ``done()`` holds."""
        generation = self._wait(done)
        if generation is None:
            yield False
            return
        self._stop.clear()
        self._beating = threading.Thread(target=self._beat, args=(generation,), daemon=True)
        self._beating.start()
        try:
            yield True
        except Exception as e:
            self._finish(generation, "failed", error_type=type(e).__name__, error=str(e))
            raise
        except BaseException:  # interrupted (Ctrl-C): no verdict on the download, the next process takes over
            self._finish(generation, "abandoned")
            raise
        self._finish(generation, "done")
