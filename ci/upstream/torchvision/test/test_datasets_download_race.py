"""Concurrent ``download=True`` from several processes sharing one root must give every process the right data.

Distributed training scripts (the PyTorch FSDP tutorial, for instance) build ``MNIST(root, download=True)`` on every
rank. ``download_url`` streams each file straight into its final path with ``open(fpath, "wb")`` and only then checks
its md5. When several processes download into the same root, every later ``open(..., "wb")`` truncates the file an
earlier process is still writing: the earlier process keeps writing at its own offset, so the file gets a hole of zero
bytes, and if the earlier process finishes before the later one has rewritten that part, its md5 check fails with "File
not found or corrupted." (or, with other timings, a process extracts or loads a file another process is rewriting).

The test makes the failure deterministic instead of timing-dependent. A loopback HTTP server (127.0.0.1 only) serves
synthetic files in the MNIST format, throttled so that the largest one (train images) takes ``DOWNLOAD_SECONDS`` to
download. Four real ``torchrun`` ranks line up after their imports, then rank ``i`` starts ``i * SKEW`` seconds later,
with ``DOWNLOAD_SECONDS / 2 < SKEW < DOWNLOAD_SECONDS``. Rank 1 therefore opens (truncates) the train-images file when
rank 0 is 75% through downloading it, and rank 0 finishes when rank 1 has rewritten only the first 25%: the half of
the file in between was written by nobody, and rank 0's md5 check fails, by construction and on every run. Later
ranks fail or not depending on how their starts fall against the file becoming whole again (the same bytes, rewritten
by the next rank), or load a raw file another rank is rewriting; the test does not depend on which. The arithmetic
only assumes that a rank can read 5 MB/s from the loopback, so the throttle, not the machine, sets the speed.

A correct implementation downloads each file once per root (the other processes wait for it and then use it) and
leaves no temporary files behind. No timing is asserted; the subprocess timeout only guards against hangs.

The file is also the rank program: ``torchrun`` runs it as a script (see ``_member``).
"""

import argparse
import gzip
import hashlib
import http.server
import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

NPROCS = 4
#: Time the largest file (train images) takes to be served.
DOWNLOAD_SECONDS = 2.0
#: Start delay between consecutive ranks; strictly between DOWNLOAD_SECONDS / 2 and DOWNLOAD_SECONDS.
SKEW = 1.5
#: Hang guard only.
TIMEOUT = 600
#: How long a rank waits for the others at the start gate.
GATE_TIMEOUT = 300

MNIST_FILES = (
    "train-images-idx3-ubyte.gz",
    "train-labels-idx1-ubyte.gz",
    "t10k-images-idx3-ubyte.gz",
    "t10k-labels-idx1-ubyte.gz",
)
LAUNCHER_VARIABLES = (
    "RANK",
    "WORLD_SIZE",
    "LOCAL_RANK",
    "LOCAL_WORLD_SIZE",
    "GROUP_RANK",
    "MASTER_ADDR",
    "MASTER_PORT",
)


def _idx(dims, payload):
    return bytes([0, 0, 0x08, len(dims)]) + b"".join(d.to_bytes(4, "big") for d in dims) + payload


def synthetic_mnist(train=12000, test=2000, seed=0):
    """Deterministic gz files with MNIST's names and format; random pixels, so the images barely compress."""
    rng = random.Random(seed)

    def images(n):
        return _idx((n, 28, 28), rng.randbytes(n * 28 * 28))

    def labels(n):
        return _idx((n,), bytes(rng.randrange(10) for _ in range(n)))

    raw = [images(train), labels(train), images(test), labels(test)]
    return {name: gzip.compress(data, compresslevel=1, mtime=0) for name, data in zip(MNIST_FILES, raw, strict=True)}


class Mirror:
    """A throttled HTTP server on 127.0.0.1 serving ``files`` from memory.

    Counts, per file, the responses whose body was sent completely. torchvision's redirect probe (a GET with a
    ``Method: HEAD`` header whose response is dropped after the headers) is counted apart, as ``probes``.
    """

    CHUNK = 64 * 1024

    def __init__(self, files, seconds):
        self.files = files
        self.rate = max(len(body) for body in files.values()) / seconds  # bytes per second, per response
        self.complete = {name: 0 for name in files}
        self.probes = {name: 0 for name in files}
        self._lock = threading.Lock()
        self._server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self):
        return f"http://127.0.0.1:{self._server.server_address[1]}/"

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc_info):
        self._server.shutdown()
        self._server.server_close()  # joins the request threads, so the counts are final

    def _handler(self):
        mirror = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format, *args):
                pass

            def do_GET(self):
                name = self.path.lstrip("/")
                if name not in mirror.files:
                    self.send_error(404)
                    return
                probe = self.headers.get("Method") == "HEAD"
                body = mirror.files[name]
                self.send_response(200)
                self.send_header("Content-Type", "application/octet-stream")
                self.send_header("Content-Length", str(len(body)))
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                started = time.monotonic()
                sent = 0
                try:
                    while sent < len(body):
                        ahead = sent / mirror.rate - (time.monotonic() - started)
                        if ahead > 0:
                            time.sleep(ahead)
                        piece = body[sent : sent + mirror.CHUNK]
                        self.wfile.write(piece)
                        sent += len(piece)
                    self.wfile.flush()
                except (BrokenPipeError, ConnectionResetError):
                    return  # the redirect probe hung up
                with mirror._lock:
                    (mirror.probes if probe else mirror.complete)[name] += 1

        return Handler


def _run_torchrun(args, cwd):
    """``torchrun --standalone`` running this file as the rank program; kills the whole process group on a hang."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES and not k.startswith("TORCHELASTIC_")}
    env.update(PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(NPROCS)]
    cmd += [os.path.abspath(__file__), *args]
    proc = subprocess.Popen(
        cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    try:
        output, _ = proc.communicate(timeout=TIMEOUT)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        output, _ = proc.communicate()
        pytest.fail(f"torchrun did not finish within {TIMEOUT} s:\n{output[-5000:]}")
    return proc.returncode, output


@pytest.mark.skipif(sys.platform == "win32", reason="uses POSIX process groups to clean up after a hang")
def test_mnist_download_from_concurrent_processes(tmp_path):
    files = synthetic_mnist()
    resources = [(name, hashlib.md5(files[name], usedforsecurity=False).hexdigest()) for name in MNIST_FILES]
    images = gzip.decompress(files["train-images-idx3-ubyte.gz"])
    labels = gzip.decompress(files["train-labels-idx1-ubyte.gz"])
    expected = {
        "data_sha256": hashlib.sha256(images[16:]).hexdigest(),
        "targets_sha256": hashlib.sha256(labels[8:]).hexdigest(),
    }

    root, results, side = tmp_path / "root", tmp_path / "results", tmp_path / "side"
    for directory in (root, results, side):
        directory.mkdir()
    with Mirror(files, DOWNLOAD_SECONDS) as mirror:
        member_args = [
            "--root", str(root), "--results", str(results), "--side", str(side), "--url", mirror.url,
            "--resources", json.dumps(resources), "--skew", str(SKEW), "--world-size", str(NPROCS),
        ]  # fmt: skip
        returncode, output = _run_torchrun(member_args, cwd=tmp_path)
    assert returncode == 0, output[-5000:]

    outcomes = {rank: json.loads((results / f"{rank}.json").read_text()) for rank in range(NPROCS)}
    failed = {rank: f"{o['error_type']}: {o['error']}" for rank, o in outcomes.items() if o["status"] != "ok"}
    assert not failed, f"ranks failed: {failed}; complete downloads per file: {mirror.complete}"
    wrong = [rank for rank, o in outcomes.items() if {k: o[k] for k in expected} != expected]
    assert not wrong, f"ranks loaded wrong data: {wrong}"
    assert mirror.complete == {name: 1 for name in MNIST_FILES}, "each file must be downloaded exactly once"

    raw = root / "MNIST" / "raw"
    for name, gz in files.items():
        assert (raw / name).read_bytes() == gz, name
        assert (raw / name[: -len(".gz")]).read_bytes() == gzip.decompress(gz), name[: -len(".gz")]
    # Everything under the root, dotfiles included: no temporary file, lock or staging folder may be left behind.
    expected_paths = {"MNIST", "MNIST/raw"} | {f"MNIST/raw/{n}" for n in MNIST_FILES}
    expected_paths |= {f"MNIST/raw/{n[: -len('.gz')]}" for n in MNIST_FILES}
    found = {p.relative_to(root).as_posix() for p in root.rglob("*")}
    assert found == expected_paths, f"left behind: {sorted(found - expected_paths)}"


def _start_gate(side, rank, world_size):
    """Line all ranks up after their (slow) imports, so that the start skew is exactly the one asked for."""
    (side / f"imported.{rank}").write_text("")
    deadline = time.monotonic() + GATE_TIMEOUT
    while sum(1 for p in side.iterdir() if p.name.startswith("imported.")) < world_size:
        if time.monotonic() > deadline:
            raise TimeoutError(f"not all {world_size} ranks reached the start gate within {GATE_TIMEOUT} s")
        time.sleep(0.05)


def _member(argv):
    """One torchrun rank: build ``MNIST(root, train=True, download=True)`` and write ``<results>/<rank>.json``."""
    parser = argparse.ArgumentParser()
    for option in ("--root", "--results", "--side", "--url", "--resources"):
        parser.add_argument(option, required=True)
    parser.add_argument("--skew", type=float, required=True)
    parser.add_argument("--world-size", type=int, required=True)
    args = parser.parse_args(argv)
    rank = int(os.environ["RANK"])

    import torch
    from torchvision.datasets import MNIST

    _start_gate(Path(args.side), rank, args.world_size)
    time.sleep(rank * args.skew)

    MNIST.mirrors = [args.url]
    MNIST.resources = [tuple(resource) for resource in json.loads(args.resources)]
    result = {"rank": rank, "status": "ok"}
    try:
        ds = MNIST(args.root, train=True, download=True)
        result["data_sha256"] = hashlib.sha256(ds.data.contiguous().numpy().tobytes()).hexdigest()
        result["targets_sha256"] = hashlib.sha256(ds.targets.to(torch.uint8).numpy().tobytes()).hexdigest()
    except Exception as exc:
        result.update(status="error", error_type=type(exc).__name__, error=str(exc))
    Path(args.results, f"{rank}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    _member(sys.argv[1:])
