"""One process of tests/test_atomic_faults.py: an extraction, a download, an MNIST download, a
barrier, or a deleter, run for real. Prints one JSON line (``status`` ok or error) and exits 0.

``--as-pid P`` makes the work run with pid P (run it in a fresh pid namespace: ``unshare -pf
--mount-proc``), so that its temporaries carry a pid that is dead in the root namespace.
``--user UID:GID:GROUPS`` drops root after the imports (the interpreter lives under /root,
which other users cannot read), ``--umask`` sets the umask, ``--go FILE`` waits for FILE first.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time


def _become_pid(pid: int) -> None:
    """In a fresh pid namespace: fork so that the child has ``pid``; the parent exits with its status."""
    if os.getpid() == pid:
        return
    with open("/proc/sys/kernel/ns_last_pid", "w") as fh:
        fh.write(str(pid - 1))
    child = os.fork()
    if child == 0:
        if os.getpid() != pid:
            os._exit(97)
        return
    _, status = os.waitpid(child, 0)
    os._exit(os.waitstatus_to_exitcode(status))


def _drop_privileges(user: str, umask: int | None) -> None:
    uid, gid, groups = user.split(":")
    os.setgroups([int(g) for g in groups.split(",") if g])
    os.setgid(int(gid))
    os.setuid(int(uid))
    if umask is not None:
        os.umask(umask)


def _wait_for(path: str, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} did not appear")
        time.sleep(0.01)


def _deleter(dest: str, after: int) -> dict:
    """Wait for an extraction folder in ``dest`` (the destination's parent) holding ``after`` entries, then
    remove it once."""
    import shutil

    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for name in os.listdir(dest):
            path = os.path.join(dest, name)
            if name.startswith(".tmp.") and os.path.isdir(path):
                count = sum(len(d) + len(f) for _, d, f in os.walk(path))
                if count >= after:
                    began = time.time()  # the extraction may fail mid-rmtree, before it ends
                    shutil.rmtree(path, ignore_errors=True)
                    return {"removed": path, "entries": count, "began": began}
        time.sleep(0.005)
    raise TimeoutError(f"no extraction folder with {after} entries appeared in {dest}")


def _barrier(directory: str, name: str, work: float, world: int, hold: str | None = None) -> dict:
    """rank_zero_first with launcher variables from the caller; rank 0 reports the barrier folders it sees,
    then works ``work`` seconds and, with ``hold``, until that path exists."""
    import stat

    from nemo_safe import rank_zero_first

    seen = {}
    with rank_zero_first(directory, world, name, timeout=120) as barrier:
        if barrier is not None and barrier.rank == 0:
            for top, dirs, _ in os.walk(os.path.join(directory, ".nemo_safe")):
                for d in [top, *(os.path.join(top, n) for n in dirs)]:
                    st = os.stat(d)
                    seen[os.path.relpath(d, directory)] = [stat.S_IMODE(st.st_mode), st.st_gid]
            time.sleep(work)
            if hold:
                _wait_for(hold)
    return {"barrier_dirs": seen}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("action", choices=["extract", "download", "mnist", "barrier", "delete-staging"])
    p.add_argument("args", nargs="*")
    p.add_argument("--as-pid", type=int)
    p.add_argument("--user")
    p.add_argument("--umask", type=lambda s: int(s, 8))
    p.add_argument("--go")
    p.add_argument("--md5")
    p.add_argument("--resources")
    p.add_argument("--world", type=int, default=2)
    p.add_argument("--work", type=float, default=0.0)
    p.add_argument("--hold")
    p.add_argument("--after", type=int, default=1)
    args = p.parse_args()
    if args.as_pid:
        _become_pid(args.as_pid)
    result: dict = {"pid": os.getpid(), "status": "ok"}
    try:
        # Everything is imported before privileges are dropped or the go signal waited for.
        import encodings.hex_codec  # MNIST reads its headers with it
        import encodings.idna  # noqa: F401  (urllib encodes host names with it)
        import gzip  # noqa: F401

        from torchvision.datasets import utils

        import nemo_safe
        import nemo_safe.barrier  # noqa: F401
        from nemo_safe_tools import download_race

        if args.user:
            _drop_privileges(args.user, args.umask)
        elif args.umask is not None:
            os.umask(args.umask)
        if args.go:
            _wait_for(args.go)
        result["started"] = time.time()
        if args.action == "extract":
            utils.extract_archive(args.args[0], args.args[1])
        elif args.action == "download":
            url, directory = args.args
            utils.download_url(url, directory, md5=args.md5)
        elif args.action == "mnist":
            root, mirror = args.args
            result.update(download_race.build("MNIST", root, mirror, json.loads(args.resources)))
        elif args.action == "barrier":
            result.update(_barrier(args.args[0], args.args[1], args.work, args.world, args.hold))
        else:
            result.update(_deleter(args.args[0], args.after))
    except Exception as exc:
        result.update(status="error", error_type=type(exc).__name__, error=str(exc)[:3000])
        result["oserror"] = isinstance(exc, OSError)
    result["ended"] = time.time()
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
