"""One reader per node: a node's waiting ranks follow rank 0's ``state`` through a node-local copy.

Every waiting rank of a flat barrier polls the shared ``state`` (2 metadata calls a poll): at 4,096 ranks
that is 9,360 calls a second on the shared metadata server (docs/benchmarks.md). So on each node one
waiting rank, the *reader* (launcher local rank 0; local rank 1 on node 0, whose local rank 0 is rank 0),
polls the shared ``state`` and copies each read into ``/dev/shm/nemo_safe-<uid>/`` (tmpfs: node-local,
no server); the node's other waiting ranks poll that copy. Only the readers load the server.

The copy changes who reads the shared ``state``, never where the ranks meet: arrivals, withdrawals and
``taken`` marks still go to the shared folder, and a copy holds exactly what its reader read there. A
follower takes only copies written after it began (so by a live process of this attempt: every process
of an earlier one was gone before this one started), so following one shows it what a shared read
showed a moment earlier, after it began, and the protocol's checks (sessions, nonces, publication times)
apply unchanged. A follower that finds no such copy refreshed within its reader's few seconds (no
reader on this node yet, a private ``/dev/shm`` per container, the reader finished, failed or died,
``/dev/shm`` full or read-only) reads the shared ``state`` itself, at the flat cap: that is the flat
barrier. So a role misjudged from launcher variables costs load, never correctness, and the roles
need not agree between ranks.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import stat
import time
from collections.abc import Mapping
from typing import Any

from nemo_safe import cluster_identity
from nemo_safe.atomic_files import publish, read_if_exists, unlink_if_exists
from nemo_safe.barrier_channels import Arrival, Channel, FileChannel
from nemo_safe.errors import ConfigurationError
from nemo_safe.records import has_field_types, new_nonce
from nemo_safe.waiting import poll_cap
from nemo_safe.warn_once import warn_once

log = logging.getLogger("nemo_safe.barrier")

NODE_COPY_ENV = "NEMO_SAFE_NODE_COPY"
#: With ``auto`` (the default) barriers of this many ranks or more read through node copies: from here the
#: flat barrier's cap rises above its 50 ms floor (44 pollers x 2 calls / (0.875 x 50 ms) > 2,000 calls/s);
#: below it the flat barrier polls at the floor within the budget and a copy would only add a hop.
AUTO_FROM_RANKS = 45
COPY_ROOT = "/dev/shm"
#: A copy is followed only while its reader refreshed it within max(this, 4 x its poll cap), at most 10 s:
#: long enough for a reader's slow shared read on a loaded server, short where a reader died.
STALE_FLOOR, STALE_POLLS, STALE_MAX = 5.0, 4, 10.0
#: Copies older than this are swept by the next reader on the node (tmpfs lives until reboot).
SWEEP_AFTER = 24 * 3600.0
_ENVELOPE = {"refreshed": (int, float), "stale_after": (int, float), "state": (dict, type(None)), "final": bool}


def judge_node_copy(raw: str) -> tuple[str, str]:
    """The setting's text as ``auto``, ``on`` or ``off``, and what is wrong with it ("" when nothing): any other
    value is ``auto`` (the default): it only changes who reads the state, so it must not stop a job."""
    value = raw.strip().lower()
    if value in ("1", "on", "true", "yes"):
        return "on", ""
    if value in ("0", "off", "false", "no"):
        return "off", ""
    if value in ("", "auto"):
        return "auto", ""
    return "auto", f"not auto, 1 (on) or 0 (off); using auto (node copies from {AUTO_FROM_RANKS} ranks)"


def copies_wanted(world_size: int, env: Mapping[str, str] | None = None) -> bool:
    """``NEMO_SAFE_NODE_COPY``: ``auto`` (unset: from :data:`AUTO_FROM_RANKS` ranks), ``1``/``on``, ``0``/``off``;
    any other value is ``auto`` with one warning (:func:`judge_node_copy`)."""
    raw = (os.environ if env is None else env).get(NODE_COPY_ENV, "")
    mode, problem = judge_node_copy(raw)
    if problem:
        warn_once(log, f"env:{raw}", "nemo_safe: %s=%r is %s", NODE_COPY_ENV, raw, problem)
    if mode == "off":
        return False
    return world_size >= (2 if mode == "on" else AUTO_FROM_RANKS)


def _count(env: Mapping[str, str], name: str) -> int | None:
    try:
        value = int(env.get(name, ""))
    except ValueError:
        return None
    return value if value >= 1 else None


def node_count(env: Mapping[str, str], world_size: int) -> int | None:
    """How many nodes the launcher says the job has (it only sets the readers' poll rate), else None."""
    for name in ("SLURM_STEP_NUM_NODES", "SLURM_JOB_NUM_NODES", "SLURM_NNODES", "GROUP_WORLD_SIZE"):
        if (nodes := _count(env, name)) is not None:
            return nodes
    for name in ("LOCAL_WORLD_SIZE", "OMPI_COMM_WORLD_LOCAL_SIZE", "PMIX_LOCAL_SIZE"):
        if (per_node := _count(env, name)) is not None:
            return -(-world_size // per_node)
    return None


def copy_folder(root: str = COPY_ROOT) -> str | None:
    """``<root>/nemo_safe-<uid>/``, created 0700; None (no copies) where it is missing or anyone else could
    write it or swap it (a root writable by others without the sticky bit)."""
    folder = os.path.join(root, f"nemo_safe-{os.getuid()}")
    try:
        root_st = os.stat(root)
        if root_st.st_mode & 0o002 and not root_st.st_mode & stat.S_ISVTX:
            warn_once(log, root, "nemo_safe: %s is writable by everyone without the sticky bit; no node copies "
                       "there (barrier ranks read the shared state)", root)  # fmt: skip
            return None
        try:
            os.mkdir(folder, 0o700)
        except FileExistsError:
            pass
        st = os.lstat(folder)
    except OSError as exc:  # no /dev/shm, read-only, removed meanwhile (logind's RemoveIPC)
        log.debug("nemo_safe: no node copies in %s (%s)", folder, exc)
        return None
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        warn_once(log, folder, "nemo_safe: %s is not a private folder of this user (a symlink, another owner, or "
                   "writable by others); barrier ranks read the shared state instead. Remove it.", folder)  # fmt: skip
        return None
    return folder


def around(channel: Channel, rank: int, world_size: int, env: Mapping[str, str] | None = None) -> Channel:
    """``channel`` read through a node copy where that helps and the launcher places this rank, else itself."""
    env = os.environ if env is None else env
    # The setting is read on every rank alike (rank 0 too), so that a bad value is named once per process.
    if not copies_wanted(world_size, env) or not isinstance(channel, FileChannel) or rank == 0:
        return channel
    try:
        ident = cluster_identity.detect(env)
    except ConfigurationError:
        return channel
    if ident.launcher == "none" or ident.rank != rank or ident.world_size != world_size:
        return channel  # the launcher does not describe this barrier's ranks
    folder = copy_folder()
    if folder is None:
        return channel
    reader = ident.local_rank == (1 if ident.node_rank == 0 else 0)
    return NodeCopy(channel, folder, reader, node_count(env, world_size))


class NodeCopy(Channel):
    """A :class:`FileChannel` whose ``state`` reads go through this node's copy (see the module text)."""

    def __init__(self, shared: FileChannel, folder: str, reader: bool, nodes: int | None) -> None:
        self.shared, self.folder, self.reader, self.nodes = shared, folder, reader, nodes
        self.identity = shared.identity
        self.needs_cleanup = shared.needs_cleanup
        self.role = "reader" if reader else "follower"
        self.copy: str | None = None
        self.stale_after = STALE_FLOOR
        self.nonce = new_nonce()
        #: Copies written before this (by a reader of an earlier attempt, maybe) are never followed.
        self.since = time.time()
        #: Reads of the shared state and of the copy (benchmarks and tests report them).
        self.shared_reads = self.copy_reads = 0
        self._following = False
        self._last: dict[str, Any] | None = None
        self._final_used: float | None = None

    def bind(self, label: str) -> None:
        self.shared.bind(label)
        try:
            st = os.stat(self.shared.root)  # the same folder seen through other mounts has the same dev/ino
        except OSError:
            return  # no copies: every read goes to the shared state
        digest = hashlib.sha256(f"{st.st_dev}:{st.st_ino}:{label}".encode()).hexdigest()[:32]
        self.copy = os.path.join(self.folder, digest)

    def shared_pollers(self, world_size: int) -> int:
        """Readers poll with the cap of one reader per node; followers fall back to the flat cap."""
        if self.reader and self.nodes is not None:
            return max(1, self.nodes)
        return world_size - 1

    def poll_cap(self, shared_cap: float) -> float:
        """The cap of the next pause: the node-local one while following a live copy. A reader's copy
        counts as stale after a few of its own polls, so it notes its cap here."""
        if not self.reader:
            return min(shared_cap, poll_cap(0)) if self._following else shared_cap
        self.stale_after = min(STALE_MAX, max(STALE_FLOOR, STALE_POLLS * shared_cap))
        return shared_cap

    def read_state(self) -> dict[str, Any] | None:
        if self.reader:
            state = self.shared.read_state()
            self.shared_reads += 1
            self._last = state
            self._write(final=False)
            return state
        envelope = self._live_copy()
        self._following = envelope is not None
        if envelope is None:
            self.shared_reads += 1
            return self.shared.read_state()
        self.copy_reads += 1
        if envelope.get("final"):
            self._final_used = envelope["refreshed"]  # its reader is gone: take it once, then read shared
        return envelope["state"]

    def finish(self) -> None:
        """The reader stops: mark its copy final, so that followers take it once and then read the shared state."""
        if self.reader and self.copy is not None:
            self._write(final=True)

    def _write(self, final: bool) -> None:
        """Never raises: a copy that cannot be written goes stale, and the followers read the shared state."""
        if self.copy is None:
            return
        body = {"refreshed": time.time(), "stale_after": self.stale_after, "state": self._last, "final": final,
                "reader": {"pid": os.getpid(), "nonce": self.nonce}}  # fmt: skip
        try:
            publish(self.folder, os.path.basename(self.copy), json.dumps(body).encode())
        except OSError as exc:  # /dev/shm full, read-only or gone
            warn_once(log, f"write:{self.folder}", "nemo_safe: cannot write the node copy %s (%s); this node's "
                       "ranks read the shared state", self.copy, exc)  # fmt: skip
            try:
                os.unlink(self.copy)
            except OSError:
                pass
            self.copy = None
            return
        if self.shared_reads == 1 and not final:
            self._sweep()

    def _sweep(self) -> None:
        """Remove copies (and temporaries of killed readers) untouched for a day: tmpfs keeps them until reboot."""
        now = time.time()
        try:
            with os.scandir(self.folder) as entries:
                for entry in entries:
                    if entry.is_file(follow_symlinks=False) and now - entry.stat().st_mtime > SWEEP_AFTER:
                        unlink_if_exists(entry.path)
        except OSError:
            pass  # the next reader on this node sweeps

    def _live_copy(self) -> dict[str, Any] | None:
        """The copy, if a reader refreshed it recently and it is not a final one already taken."""
        if self.copy is None:
            return None
        try:
            raw = read_if_exists(self.copy)
            envelope = json.loads(raw) if raw else None
        except (OSError, ValueError):
            return None
        if not has_field_types(envelope, _ENVELOPE, required=("refreshed", "stale_after", "state")):
            return None
        if envelope["refreshed"] < self.since:
            return None  # maybe an earlier attempt's reader: only a shared read can tell, so read shared
        age = time.time() - envelope["refreshed"]
        if not -1.0 <= age < min(STALE_MAX, envelope["stale_after"]):
            return None
        if envelope.get("final") and envelope["refreshed"] == self._final_used:
            return None
        return envelope

    # Everything else is the shared folder's.
    def where(self) -> str:
        return self.shared.where()

    def prepare(self) -> None:
        self.shared.prepare()

    def check_safe(self) -> None:
        self.shared.check_safe()

    def publish_state(self, body: dict[str, Any]) -> None:
        self.shared.publish_state(body)

    def claim_leader(self, body: dict[str, Any]) -> dict[str, Any] | None:
        return self.shared.claim_leader(body)

    def arrive(self, arrival: Arrival, body: dict[str, Any]) -> None:
        self.shared.arrive(arrival, body)

    def withdraw(self, arrival: Arrival) -> None:
        self.shared.withdraw(arrival)

    def arrivals(self, session: str) -> list[Arrival]:
        return self.shared.arrivals(session)

    def describe(self, arrival: Arrival) -> str:
        return self.shared.describe(arrival)

    def arrival_body(self, arrival: Arrival) -> dict[str, Any] | None:
        return self.shared.arrival_body(arrival)

    def replace_leader(self, body: dict[str, Any]) -> None:
        self.shared.replace_leader(body)

    def mark_taken(self, session: str, rank: int, nonce: str) -> None:
        self.shared.mark_taken(session, rank, nonce)

    def taken_ranks(self, session: str) -> set[int]:
        return self.shared.taken_ranks(session)

    def remove(self, keep_parent: bool) -> None:
        self.shared.remove(keep_parent)
