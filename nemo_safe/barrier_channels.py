"""Where a barrier keeps its few small records: a shared directory, or the torchrun agent's key-value store.

The protocol (:mod:`nemo_safe.barrier`) needs a handful of operations on one
barrier's records: read and replace rank 0's ``state``, add and remove
arrivals, list the arrivals answering a session, and (where the attempt key
names one attempt only) claim the leader's place exclusively. Each channel
implements them with what its medium makes atomic:

* :class:`FileChannel`: ``<directory>/.nemo_safe/<label>/``; records are
  files written under a temporary name and renamed (atomic on local disks,
  NFSv3+, Lustre and GPFS); the leader claim is an ``O_EXCL`` create. Ranks
  meet only where they share that directory.
* :class:`StoreChannel`: torchrun's elastic agent serves a ``TCPStore`` at
  ``MASTER_ADDR:MASTER_PORT`` to every worker before ``init_process_group``
  (``TORCHELASTIC_USE_AGENT_STORE=True``), so ranks meet there whatever
  filesystem each node's directories are on. The store outlives worker
  restarts, so records of an earlier round stay visible: the protocol's
  sessions and nonces make them harmless. It has no exclusive create that
  can tell a dead round's leader from a live one, so it offers no leader claim.
"""

from __future__ import annotations

import errno
import json
import os
import stat
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from nemo_safe.atomic_files import listdir_if_exists, publish, read_if_exists, unlink_if_exists
from nemo_safe.errors import NemoSafeError, UnsafeBarrierPath
from nemo_safe.records import HIDDEN_DIRNAME

BARRIER_DIRNAME = HIDDEN_DIRNAME
STATE_NAME = "state"
LEADER_NAME = "leader"
ARRIVE_PREFIX = "arrive."
TAKEN_PREFIX = "taken."
_OPEN_DIR = os.O_RDONLY | getattr(os, "O_DIRECTORY", 0) | getattr(os, "O_NOFOLLOW", 0)
_OPEN_FILE = os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0)
_CREATE_EXCL = os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0)


@dataclass(frozen=True)
class Arrival:
    """One rank's answer to a session: ``arrive.<session>.<rank>.<world>.<nonce>``."""

    session: str
    rank: int
    world_size: int
    nonce: str

    @property
    def name(self) -> str:
        return f"{ARRIVE_PREFIX}{self.session}.{self.rank}.{self.world_size}.{self.nonce}"

    @classmethod
    def parse(cls, name: str) -> Arrival | None:
        parts = name.split(".")
        if len(parts) != 5 or parts[0] + "." != ARRIVE_PREFIX:
            return None
        try:
            return cls(parts[1], int(parts[2]), int(parts[3]), parts[4])
        except ValueError:
            return None


def _loads(raw: bytes | None) -> dict[str, Any] | None:
    if not raw:
        return None
    try:
        body = json.loads(raw)
    except ValueError:
        return None  # not ours: records are only ever replaced whole
    return body if isinstance(body, dict) else None


class Channel(ABC):
    """One barrier's records. ``bind`` is called once by the barrier with its label."""

    #: Identifies the medium, for the per-process count of barriers of one name.
    identity: str

    @abstractmethod
    def bind(self, label: str) -> None: ...

    @abstractmethod
    def where(self) -> str:
        """For messages: where the records are."""

    def prepare(self) -> None:  # noqa: B027 - optional: nothing to create in a store
        """Make the records' container exist (rank 0, and waiters that publish presence)."""

    def check_safe(self) -> None:  # noqa: B027 - optional
        """Raise if the container is not what it should be (a planted symlink)."""

    @abstractmethod
    def read_state(self) -> dict[str, Any] | None: ...

    @abstractmethod
    def publish_state(self, body: dict[str, Any]) -> None: ...

    def claim_leader(self, body: dict[str, Any]) -> dict[str, Any] | None:
        """Claim rank 0's place for this attempt; the other claim if someone else holds it.

        Channels without an exclusive create claim nothing and return None."""
        return None

    @abstractmethod
    def arrive(self, arrival: Arrival, body: dict[str, Any]) -> None: ...

    @abstractmethod
    def withdraw(self, arrival: Arrival) -> None: ...

    @abstractmethod
    def arrivals(self, session: str) -> list[Arrival]: ...

    @abstractmethod
    def describe(self, arrival: Arrival) -> str:
        """``host H pid P`` of the process behind an arrival, for messages."""

    def arrival_body(self, arrival: Arrival) -> dict[str, Any] | None:
        """What the process behind an arrival wrote (host, pid, start, time), or None where unknown."""
        return None

    #: Whether rank 0 removes the records once every rank took the outcome (a store ends with the job).
    needs_cleanup = False

    def shared_pollers(self, world_size: int) -> int:
        """How many waiting ranks poll the shared ``state`` (it sets their poll cap): all of them, here."""
        return world_size - 1

    def poll_cap(self, shared_cap: float) -> float:
        """The cap of a waiter's next pause (:mod:`nemo_safe.node_copy` polls its local copy more often)."""
        return shared_cap

    def finish(self) -> None:  # noqa: B027 - optional
        """A waiter is done with the records (taken, failed or given up)."""

    def replace_leader(self, body: dict[str, Any]) -> None:  # noqa: B027 - only where a claim exists
        """Take over the claim of a rank 0 that ended before this process started."""

    def mark_taken(self, session: str, rank: int, nonce: str) -> None:  # noqa: B027 - only with clean-up
        """A waiter took the outcome of ``session`` and will not read the records again."""

    def taken_ranks(self, session: str) -> set[int]:
        """The ranks that took the outcome of ``session``."""
        return set()

    def remove(self, keep_parent: bool) -> None:  # noqa: B027 - only where records are cleaned up
        """Rank 0, once every rank took the outcome: remove the records."""


class FileChannel(Channel):
    """Records as files in ``<directory>/.nemo_safe/<label>/``."""

    needs_cleanup = True

    def __init__(self, directory: str | os.PathLike[str]) -> None:
        self.root = os.path.abspath(os.fspath(directory))
        self.identity = self.root
        self.parent = os.path.join(self.root, BARRIER_DIRNAME)
        self.path = self.parent

    def bind(self, label: str) -> None:
        self.path = os.path.join(self.parent, label)

    def where(self) -> str:
        return self.path

    def _check_real_dir(self, path: str, missing_ok: bool = False) -> None:
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            if missing_ok:
                return
            raise
        if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
            kind = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise UnsafeBarrierPath(
                f"{path} is {kind}; nemo_safe refuses to use it as a barrier directory. "
                "Remove it (someone or something planted it there) and restart the job."
            )

    def check_safe(self) -> None:
        self._check_real_dir(self.parent, missing_ok=True)

    def prepare(self) -> None:
        for _ in range(100):
            try:
                for path in (self.parent, self.path):
                    try:
                        os.mkdir(path)  # mode 0o777 & ~umask, like upstream's os.makedirs
                    except FileExistsError:
                        self._check_real_dir(path)
                return
            except FileNotFoundError:
                # Another barrier's rank 0 removed the empty parent just now: retry.
                if not os.path.isdir(self.root):
                    raise NemoSafeError(
                        f"barrier in {self.path}: the directory {self.root} does not exist; "
                        "create it before the barrier"
                    ) from None
            except OSError as exc:  # read-only, permission denied, disk full, quota
                raise NemoSafeError(
                    f"barrier in {self.path}: cannot create the barrier directory ({exc}); make {self.root} "
                    "writable for this job. The other ranks will time out saying rank 0 never started."
                ) from exc
        raise NemoSafeError(f"barrier in {self.path}: could not create the barrier directory")

    def read_state(self) -> dict[str, Any] | None:
        """Re-open the directory (NFS revalidates its cached lookups), then read ``state``."""
        try:
            dir_fd = os.open(self.path, _OPEN_DIR)
        except FileNotFoundError:
            return None
        except OSError as exc:
            if os.path.islink(self.path):
                self._check_real_dir(self.path)
            raise NemoSafeError(f"barrier in {self.path}: cannot open the directory: {exc}") from exc
        try:
            try:
                fd = os.open(STATE_NAME, _OPEN_FILE, dir_fd=dir_fd)
                with os.fdopen(fd, "rb") as f:
                    raw = f.read()
            except FileNotFoundError:
                return None
            except OSError as exc:
                if exc.errno != errno.ESTALE:
                    raise
                return None  # rank 0 replaced it between our open and read (NFS): read again next poll
        finally:
            os.close(dir_fd)
        return _loads(raw)

    def publish_state(self, body: dict[str, Any]) -> None:
        publish(self.path, STATE_NAME, json.dumps(body).encode())

    def claim_leader(self, body: dict[str, Any]) -> dict[str, Any] | None:
        path = os.path.join(self.path, LEADER_NAME)
        data = json.dumps(body).encode()
        try:
            fd = os.open(path, _CREATE_EXCL, 0o644)
        except FileExistsError:
            other = _loads(read_if_exists(path)) or {}
            # NFS may answer a retransmitted exclusive create with EEXIST: our own claim is no conflict.
            return None if other.get("nonce") == body.get("nonce") else other
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        return None

    def arrive(self, arrival: Arrival, body: dict[str, Any]) -> None:
        self._check_real_dir(self.parent)
        publish(self.path, arrival.name, json.dumps(body).encode())

    def withdraw(self, arrival: Arrival) -> None:
        unlink_if_exists(os.path.join(self.path, arrival.name))

    def arrivals(self, session: str) -> list[Arrival]:
        names = listdir_if_exists(self.path) or []
        parsed = [Arrival.parse(name) for name in names]
        return [a for a in parsed if a is not None and a.session == session]

    def describe(self, arrival: Arrival) -> str:
        body = self.arrival_body(arrival) or {}
        return f"host {body.get('host', 'unknown')} pid {body.get('pid', 'unknown')}"

    def arrival_body(self, arrival: Arrival) -> dict[str, Any] | None:
        return _loads(read_if_exists(os.path.join(self.path, arrival.name)))

    def replace_leader(self, body: dict[str, Any]) -> None:
        publish(self.path, LEADER_NAME, json.dumps(body).encode())

    def mark_taken(self, session: str, rank: int, nonce: str) -> None:
        publish(self.path, f"{TAKEN_PREFIX}{session}.{rank}.{nonce}", b"")

    def taken_ranks(self, session: str) -> set[int]:
        names = listdir_if_exists(self.path) or []
        parts = (n.split(".") for n in names if n.startswith(f"{TAKEN_PREFIX}{session}."))
        return {int(p[2]) for p in parts if len(p) == 4 and p[2].isdigit()}

    def remove(self, keep_parent: bool) -> None:
        """Every rank took the outcome, so nobody reads these records again: remove them all."""
        try:
            for name in os.listdir(self.path):
                unlink_if_exists(os.path.join(self.path, name))
            os.rmdir(self.path)
            if not keep_parent:
                os.rmdir(self.parent)
        except OSError:
            pass  # not empty (another barrier, or leftovers of an earlier attempt): not ours


class StoreChannel(Channel):
    """Records as keys ``nemo_safe/<label>/...`` of a ``torch.distributed.TCPStore``.

    The store cannot list keys, so arrivals are numbered: a waiter takes the
    next number of its session with ``add`` and then sets that numbered key.
    """

    def __init__(self, host: str, port: int, connect_timeout: float = 30.0, op_timeout: float = 30.0) -> None:
        from torch.distributed import TCPStore  # torch is already imported wherever this is used

        self.host, self.port = host, port
        self.identity = f"tcp://{host}:{port}"
        self._store = _connect(
            lambda: TCPStore(
                host, port, is_master=False, timeout=timedelta(seconds=connect_timeout), wait_for_workers=False
            ),  # fmt: skip
            f"{host}:{port}",
            connect_timeout,
        )
        self._store.set_timeout(timedelta(seconds=op_timeout))
        self._prefix = "nemo_safe/"
        self._bodies: dict[str, dict[str, Any]] = {}
        self._seen: dict[str, int] = {}  # session -> arrivals read so far

    def bind(self, label: str) -> None:
        self._prefix = f"nemo_safe/{label}/"

    def where(self) -> str:
        return f"the torchrun agent's store {self.host}:{self.port} under {self._prefix}"

    def _get(self, key: str) -> dict[str, Any] | None:
        full = self._prefix + key
        if not self._store.check([full]):
            return None
        return _loads(self._store.get(full))

    def read_state(self) -> dict[str, Any] | None:
        return self._get(STATE_NAME)

    def publish_state(self, body: dict[str, Any]) -> None:
        self._store.set(self._prefix + STATE_NAME, json.dumps(body))

    def arrive(self, arrival: Arrival, body: dict[str, Any]) -> None:
        number = self._store.add(f"{self._prefix}count.{arrival.session}", 1)
        self._store.set(f"{self._prefix}{arrival.session}.{number}", json.dumps({**body, "name": arrival.name}))

    def withdraw(self, arrival: Arrival) -> None:
        pass  # numbered keys stay; they answer a session nobody will read again

    def arrivals(self, session: str) -> list[Arrival]:
        count = self._store.add(f"{self._prefix}count.{session}", 0)
        seen = self._seen.get(session, 0)
        while seen < count:
            body = self._get(f"{session}.{seen + 1}")
            if body is None:
                break  # numbered but not yet set: read it next time
            self._bodies[str(body.get("name"))] = body
            seen += 1
        self._seen[session] = seen
        parsed = (Arrival.parse(name) for name in self._bodies)
        return [a for a in parsed if a is not None and a.session == session]

    def describe(self, arrival: Arrival) -> str:
        body = self._bodies.get(arrival.name, {})
        return f"host {body.get('host', 'unknown')} pid {body.get('pid', 'unknown')}"

    def arrival_body(self, arrival: Arrival) -> dict[str, Any] | None:
        return self._bodies.get(arrival.name)


def _connect(make: Callable[[], Any], where: str, timeout: float) -> Any:
    """``make()`` (a TCPStore client) within ``timeout`` seconds, else raise. The client's own timeout does
    not bound its handshake: against a port that accepts but is no store (torch 2.14) it waits forever.
    It releases the GIL while it waits, so a daemon thread bounds it; one stuck there ends with the process."""
    box: dict[str, Any] = {}

    def connect() -> None:
        try:
            box["store"] = make()
        except BaseException as exc:
            box["error"] = exc

    thread = threading.Thread(target=connect, daemon=True, name=f"nemo_safe-store-connect-{where}")
    thread.start()
    thread.join(timeout)
    if "store" in box:
        return box["store"]
    if "error" in box:
        raise box["error"]
    raise NemoSafeError(f"{where} accepted a connection but did not answer as a TCPStore within {timeout:.0f} s")


def agent_store_address(env: dict[str, str] | os._Environ[str]) -> tuple[str, int] | None:
    """``(MASTER_ADDR, MASTER_PORT)`` when torchrun's agent serves its store there to the workers."""
    if env.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return None
    host, port = env.get("MASTER_ADDR"), env.get("MASTER_PORT", "")
    if not host or not port.isdigit():
        return None
    return host, int(port)
