"""Configuration values, exception types and unsupported platforms; all in real processes.

* ``NEMO_SAFE_*`` seconds that are NaN, infinite, zero, negative or not numbers give one warning
  naming the variable and its value, and the default is used: a setting never stops a job (a NaN
  poll cap once made ranks busy-poll the shared filesystem; a NaN or infinite timeout never expired;
  a refusal failed even a complete dataset, where nothing needs waiting).
* A download that breaks off keeps the exception types upstream callers rely on: torchvision's
  MNIST mirror loop (RuntimeError, URLError), ``download_url``'s https-to-http retry and SBU's
  ``except OSError``. Each case runs next to its upstream twin (no ``import nemo_safe``) against
  real loopback servers, HTTPS included (a self-signed certificate made with the openssl CLI).
* Without ``os.O_NOFOLLOW`` or ``os.link`` (Windows), ``import nemo_safe`` patches nothing and
  says so once; torchvision and NeMo run as upstream.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import shutil
import ssl
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import IN_CI
from test_torchvision_downloads import mnist

import nemo_safe
from nemo_safe.single_flight import DEFAULT_STALE_AFTER, STALE_AFTER_ENV
from nemo_safe.waiting import (
    DEFAULT_TIMEOUT,
    POLL_MAX_ENV,
    POLL_MAX_FLOOR,
    POLL_MAX_SETTING_CEIL,
    POLL_MIN,
    TIMEOUT_ENV,
)

from faulty_mirror import Faults, FaultyMirror
from procs import clean_env, torchrun_env

__all__ = ["mnist"]  # the fixture shared with the torchvision tests

GUARD = 300


def run_script(script: str, *args: str, timeout: float = GUARD, **env: str) -> tuple[dict, subprocess.CompletedProcess]:
    """Run ``script`` in a fresh interpreter; its last stdout line is a JSON object."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script), *args],
        env=clean_env(**env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("{")]
    assert lines, f"no result (exit {out.returncode}):\n{out.stderr[-4000:]}"
    return json.loads(lines[-1]), out


# -- (8) environment values ----------------------------------------------------------------------------------

CONSTRUCT = """
import json, sys, tempfile
import nemo_safe
from nemo_safe.errors import ConfigurationError
what, d = sys.argv[1], tempfile.mkdtemp()
try:
    if what == "barrier":
        b = nemo_safe.Barrier(d, 2, "env", rank=1, attempt_key="k")
        got = {"timeout": b.timeout, "poll_max": b.poll_max}
    else:
        f = nemo_safe.SingleFlight(d, "env")
        got = {"timeout": f.timeout, "stale_after": f.stale_after}
    print(json.dumps({"status": "accepted", **got}))
except ConfigurationError as exc:
    print(json.dumps({"status": "refused", "error": str(exc)}))
"""

#: Every NEMO_SAFE_* variable holding seconds, with what reads it.
SECONDS_VARIABLES = [
    ("NEMO_SAFE_POLL_MAX", "barrier"),
    ("NEMO_SAFE_BARRIER_TIMEOUT", "barrier"),
    ("NEMO_SAFE_BARRIER_TIMEOUT", "single_flight"),
    ("NEMO_SAFE_STALE_AFTER", "single_flight"),
]
BAD_SECONDS = ["nan", "NaN", "-nan", "inf", "-inf", "Infinity", "1e999", "0", "-1", "abc"]


#: The defaults a bad value falls back to (what reads it -> field -> seconds).
DEFAULTS = {
    "barrier": {"timeout": DEFAULT_TIMEOUT, "poll_max": POLL_MAX_FLOOR},
    "single_flight": {"timeout": DEFAULT_TIMEOUT, "stale_after": DEFAULT_STALE_AFTER},
}
FIELD = {POLL_MAX_ENV: "poll_max", TIMEOUT_ENV: "timeout", STALE_AFTER_ENV: "stale_after"}


@pytest.mark.parametrize("value", BAD_SECONDS)
@pytest.mark.parametrize(("variable", "reader"), SECONDS_VARIABLES)
def test_bad_seconds_warn_once_and_take_the_default(variable: str, reader: str, value: str) -> None:
    res, out = run_script(CONSTRUCT, reader, timeout=60, **{variable: value})
    assert res["status"] == "accepted", res
    assert res[FIELD[variable]] == DEFAULTS[reader][FIELD[variable]], res
    assert out.stderr.count(f"{variable}={value!r} is not a finite, positive number") == 1, out.stderr


def test_seconds_below_a_minimum_take_the_minimum() -> None:
    """A stale limit shorter than two beats took over from every live leader (83 downloads instead of one);
    a poll cap below the poll floor busy-polls: each warns once and the minimum is used."""
    res, out = run_script(CONSTRUCT, "single_flight", timeout=60, NEMO_SAFE_STALE_AFTER="1e-9")
    assert res["status"] == "accepted" and res["stale_after"] == 2.0, res
    assert out.stderr.count("NEMO_SAFE_STALE_AFTER='1e-9' is below its minimum") == 1, out.stderr
    res, out = run_script(CONSTRUCT, "barrier", timeout=60, NEMO_SAFE_POLL_MAX="1e-9")
    assert res["status"] == "accepted" and res["poll_max"] == POLL_MIN, res


def test_poll_cap_above_its_maximum_takes_the_maximum() -> None:
    """NEMO_SAFE_POLL_MAX=100 made a waiter learn of a release up to 100 s late; it warns once and the maximum
    (10 s) is used."""
    res, out = run_script(CONSTRUCT, "barrier", timeout=60, NEMO_SAFE_POLL_MAX="100")
    assert res["status"] == "accepted" and res["poll_max"] == POLL_MAX_SETTING_CEIL, res
    assert out.stderr.count("NEMO_SAFE_POLL_MAX='100' is above its maximum") == 1, out.stderr


def test_good_seconds_accepted() -> None:
    res, _ = run_script(CONSTRUCT, "barrier", NEMO_SAFE_POLL_MAX=" 0.25 ", NEMO_SAFE_BARRIER_TIMEOUT="1e3")
    assert res == {"status": "accepted", "timeout": 1000.0, "poll_max": 0.25}
    res, _ = run_script(CONSTRUCT, "single_flight", NEMO_SAFE_STALE_AFTER="7", NEMO_SAFE_BARRIER_TIMEOUT="")
    assert res == {"status": "accepted", "timeout": 1800.0, "stale_after": 7.0}


RANK = """
import json, os, sys, time
import nemo_safe
from nemo_safe.errors import ConfigurationError
try:
    with nemo_safe.rank_zero_first(sys.argv[1], 2, "poll") as barrier:
        if barrier.rank == 0:
            time.sleep(1.0)
    print(json.dumps({"status": "ok", "polls": barrier.polls}))
except ConfigurationError as exc:
    print(json.dumps({"status": "refused", "error": str(exc)}))
"""


def test_nan_poll_cap_two_ranks(tmp_path: Path) -> None:
    """The reported case: NEMO_SAFE_POLL_MAX=nan made a waiting rank poll thousands of times a second.
    Both ranks now warn naming the variable and its value, and wait with the default cap: rank 1
    polls tens of times during rank 0's 1 s, not thousands."""
    procs = []
    for rank in range(2):
        env = clean_env(**torchrun_env(rank, 2, f"nan-poll-{tmp_path.name}"), NEMO_SAFE_POLL_MAX="nan")
        procs.append(
            subprocess.Popen(
                [sys.executable, "-c", textwrap.dedent(RANK), str(tmp_path)],
                env=env,
                text=True,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
        )
    results = []
    for p in procs:
        out, err = p.communicate(timeout=120)
        lines = [ln for ln in out.splitlines() if ln.startswith("{")]
        assert lines, err[-3000:]
        results.append(json.loads(lines[-1]))
        assert "NEMO_SAFE_POLL_MAX='nan' is not a finite, positive number" in err, err[-3000:]
    assert [res["status"] for res in results] == ["ok", "ok"], results
    assert results[1]["polls"] < 200, results  # 50 ms cap over ~1 s; a NaN cap polled thousands of times


# -- (10) exception types callers rely on -----------------------------------------------------------------------


@pytest.fixture(scope="session")
def tls(tmp_path_factory: pytest.TempPathFactory) -> tuple[ssl.SSLContext, str]:
    """A server context with a self-signed certificate for 127.0.0.1, and the certificate's path
    (clients trust it through SSL_CERT_FILE)."""
    openssl = shutil.which("openssl")
    if openssl is None:
        if IN_CI:
            pytest.fail("CI needs the openssl command", pytrace=False)
        pytest.skip("the openssl command is not installed")
    d = tmp_path_factory.mktemp("tls")
    cert, key = d / "cert.pem", d / "key.pem"
    subprocess.run(
        [openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", str(key), "-out", str(cert),
         "-days", "2", "-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"],
        check=True, capture_output=True, timeout=60,
    )  # fmt: skip
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    return ctx, str(cert)


#: Twins: with ``import nemo_safe`` (patched) and without it (upstream torchvision).
TWINS = ["nemo_safe", "upstream"]

OUTCOME = """
def outcome(exc):
    if exc is None:
        return {"status": "ok"}
    return {"status": "error", "type": type(exc).__name__, "mro": [c.__name__ for c in type(exc).__mro__],
            "error": str(exc)[:2000]}
"""

MNIST_SCRIPT = (
    """
import json, sys
if sys.argv[1] == "nemo_safe":
    import nemo_safe
from torchvision.datasets import MNIST
if sys.argv[1] == "nemo_safe":
    assert nemo_safe.patching.active(), "nemo_safe patched nothing"
"""
    + OUTCOME
    + """
MNIST.mirrors = sys.argv[3:]
try:
    n = len(MNIST(sys.argv[2], train=True, download=True))
    res = {**outcome(None), "n": n}
except Exception as exc:
    res = outcome(exc)
import importlib.util
print(json.dumps({**res, "nemo_safe_from": importlib.util.find_spec("nemo_safe").origin}))
"""
)


@pytest.mark.parametrize("twin", TWINS)
@pytest.mark.parametrize("fault", ["closed", "reset"])
def test_mnist_goes_to_next_mirror_when_first_breaks_off(tmp_path: Path, mnist, twin: str, fault: str) -> None:
    """The first mirror breaks a file off mid-body; MNIST's mirror loop (except RuntimeError, URLError)
    goes on to the second mirror for a closed connection: upstream's md5 check raises RuntimeError,
    nemo_safe's (upstream's patched) _urlretrieve ContentTooShortError, a URLError. A reset is a
    ConnectionResetError on both twins (errors reading the body keep their type, as upstream), which
    that loop does not catch: the job fails as upstream's does, with nothing left under the file's name."""
    name = "train-labels-idx1-ubyte.gz"
    faults = Faults(drop_after={name: 10_000}) if fault == "closed" else Faults(reset_after={name: 10_000})
    root = tmp_path / "root"
    with FaultyMirror(mnist, faults=faults) as first, FaultyMirror(mnist) as second:
        res, out = run_script(MNIST_SCRIPT, twin, str(root), first.url, second.url)
        s1, s2 = first.stats(), second.stats()
    assert s1[name].requests == 1 and s1[name].complete == 0, s1
    if fault == "reset":
        # MNIST's loop does not catch ConnectionResetError: the job dies although a mirror works.
        assert res["status"] == "error" and res["type"] == "ConnectionResetError", res
        assert s2[name].requests == 0, s2
        if twin == "nemo_safe":
            assert not (root / "MNIST" / "raw" / name).exists(), "a partial file was published"
        return
    assert res == {"status": "ok", "n": 60000, "nemo_safe_from": nemo_safe.__file__}, (res, out.stderr[-3000:])
    assert (s2[name].requests, s2[name].complete) == (1, 1), s2
    assert all(s2[n].requests == 0 for n in mnist if n != name), s2
    raw = root / "MNIST" / "raw"
    for n, gz in mnist.items():
        assert (raw / n).read_bytes() == gz, n
        assert (raw / n[:-3]).read_bytes() == gzip.decompress(gz), n
    assert not [p for p in raw.iterdir() if p.name.startswith(".tmp.")]


DOWNLOAD_SCRIPT = (
    """
import hashlib, json, os, sys
if sys.argv[1] == "nemo_safe":
    import nemo_safe
from torchvision.datasets.utils import download_url
if sys.argv[1] == "nemo_safe":
    assert nemo_safe.patching.active(), "nemo_safe patched nothing"
"""
    + OUTCOME
    + """
url, root, md5 = sys.argv[2], sys.argv[3], sys.argv[4] or None
try:
    download_url(url, root, md5=md5)
    res = outcome(None)
except OSError as exc:  # what SBU and download_url's own retry catch
    res = {**outcome(exc), "caught_as_oserror": True}
except Exception as exc:
    res = {**outcome(exc), "caught_as_oserror": False}
path = os.path.join(root, os.path.basename(url))
res["file_md5"] = hashlib.md5(open(path, "rb").read()).hexdigest() if os.path.exists(path) else None
res["leftovers"] = sorted(n for n in os.listdir(root) if n != os.path.basename(url)) if os.path.isdir(root) else []
print(json.dumps(res))
"""
)

BLOB_NAME = "blob.bin"


@pytest.fixture(scope="session")
def blob() -> bytes:
    return hashlib.sha256(b"nemo_safe").digest() * (3_000_000 // 32)


def _download(twin: str, url: str, root: Path, md5: str | None, cert: str | None = None) -> dict:
    env = {"SSL_CERT_FILE": cert} if cert else {}
    res, _ = run_script(DOWNLOAD_SCRIPT, twin, url, str(root), md5 or "", **env)
    return res


@pytest.mark.parametrize("twin", TWINS)
def test_https_bad_record_falls_back_to_http_as_upstream(tmp_path: Path, tls, blob: bytes, twin: str) -> None:
    """The https body breaks off with a TLS error (ssl.SSLError, an OSError): download_url retries the
    same URL over http (same host and port), which serves the whole file. Same outcome on both twins."""
    ctx, cert = tls
    md5 = hashlib.md5(blob).hexdigest()
    faults = Faults(bad_tls_record_after={BLOB_NAME: 1_000_000}, schemes=frozenset({"https"}))
    with FaultyMirror({BLOB_NAME: blob}, faults=faults, tls=ctx) as mirror:
        res = _download(twin, mirror.https_url + BLOB_NAME, tmp_path / "root", md5, cert)
        s = mirror.stats()[BLOB_NAME]
    assert res["status"] == "ok", res
    assert (s.requests, s.https_requests, s.complete) == (2, 1, 1), s  # https broke off, then http complete
    assert res["file_md5"] == md5 and res["leftovers"] == [], res


@pytest.mark.parametrize("twin", TWINS)
def test_https_dropped_connection_falls_back_to_http(tmp_path: Path, tls, blob: bytes, twin: str) -> None:
    """The https server drops the connection mid-body (TCP reset, no TLS close_notify). Python 3.11's ssl
    reports that as a ragged EOF, which http.client hides: upstream sees a short body and no error, so
    it does not retry over http and fails the md5 check ("File not found or corrupted."). nemo_safe sees
    the announced length was not reached and raises urllib's ContentTooShortError, a URLError, so
    download_url's retry takes the same URL over http and gets the whole file."""
    ctx, cert = tls
    md5 = hashlib.md5(blob).hexdigest()
    faults = Faults(reset_after={BLOB_NAME: 1_000_000}, schemes=frozenset({"https"}))
    with FaultyMirror({BLOB_NAME: blob}, faults=faults, tls=ctx) as mirror:
        res = _download(twin, mirror.https_url + BLOB_NAME, tmp_path / "root", md5, cert)
        s = mirror.stats()[BLOB_NAME]
    if twin == "upstream":
        assert res["status"] == "error" and res["type"] == "RuntimeError", res
        assert res["error"] == "File not found or corrupted.", res
        assert (s.requests, s.https_requests) == (1, 1), s  # no retry over http
        return
    assert res["status"] == "ok", res
    assert (s.requests, s.https_requests, s.complete) == (2, 1, 1), s
    assert res["file_md5"] == md5 and res["leftovers"] == [], res


@pytest.mark.parametrize("twin", TWINS)
def test_http_reset_mid_body_is_an_oserror(tmp_path: Path, blob: bytes, twin: str) -> None:
    """A plain-http body reset mid-file (no md5, as SBU downloads its photos): upstream raises
    ConnectionResetError, which SBU's ``except OSError`` skips. nemo_safe raises the same error (errors
    reading the body keep their type) and leaves no partial file behind."""
    faults = Faults(reset_after={BLOB_NAME: 1_000_000})
    with FaultyMirror({BLOB_NAME: blob}, faults=faults) as mirror:
        res = _download(twin, mirror.url + BLOB_NAME, tmp_path / "root", None)
    assert res["status"] == "error" and res["caught_as_oserror"], res
    assert "ConnectionResetError" in res["mro"], res
    if twin == "upstream":
        assert res["file_md5"] is not None, "upstream leaves the partial file"
    else:
        assert res["type"] == "ConnectionResetError", res
        assert res["file_md5"] is None and res["leftovers"] == [], res


@pytest.mark.parametrize("twin", TWINS)
def test_http_closed_early_without_md5(tmp_path: Path, blob: bytes, twin: str) -> None:
    """The server closes before the announced length, no md5 given (SBU's photos). Upstream raises
    nothing and keeps a truncated file. nemo_safe publishes nothing and raises urllib's
    ContentTooShortError (a URLError), which an ``except OSError`` caller such as SBU skips and MNIST's
    mirror loop (``except URLError``) goes past."""
    faults = Faults(drop_after={BLOB_NAME: 1_000_000})
    with FaultyMirror({BLOB_NAME: blob}, faults=faults) as mirror:
        res = _download(twin, mirror.url + BLOB_NAME, tmp_path / "root", None)
    if twin == "upstream":
        assert res["status"] == "ok", res
        assert res["file_md5"] == hashlib.md5(blob[:1_000_000]).hexdigest(), "upstream keeps the truncated file"
        return
    assert res["status"] == "error" and res["caught_as_oserror"], res
    assert res["type"] == "ContentTooShortError" and "URLError" in res["mro"], res
    assert res["error"] == f"<urlopen error retrieval incomplete: got only 1000000 out of {len(blob)} bytes>", res
    assert res["file_md5"] is None and res["leftovers"] == [], res


@pytest.mark.parametrize("twin", TWINS)
def test_wrong_md5_is_a_runtime_error(tmp_path: Path, blob: bytes, twin: str) -> None:
    """Upstream raises RuntimeError("File not found or corrupted."); nemo_safe raises the same, before
    publishing, so the wrong bytes are not left under the file's name."""
    md5 = hashlib.md5(blob).hexdigest()
    with FaultyMirror({BLOB_NAME: blob}, faults=Faults(corrupt={BLOB_NAME})) as mirror:
        res = _download(twin, mirror.url + BLOB_NAME, tmp_path / "root", md5)
    assert res["status"] == "error" and "RuntimeError" in res["mro"] and not res["caught_as_oserror"], res
    assert res["error"].startswith("File not found or corrupted"), res
    if twin == "nemo_safe":
        assert res["type"] == "RuntimeError" and res["file_md5"] is None and res["leftovers"] == [], res


# -- (12) platforms without os.O_NOFOLLOW or os.link ----------------------------------------------------------------

PLATFORM_SCRIPT = """
import json, logging, os, sys
missing, library, url = sys.argv[1].split(","), sys.argv[2], sys.argv[3]
for name in missing:
    delattr(os, name)

records = []
class Keep(logging.Handler):
    def emit(self, record):
        records.append([record.name, record.levelname, record.getMessage()])
logging.getLogger().addHandler(Keep())
logging.getLogger().setLevel(logging.DEBUG)

import nemo_safe
patched_later = nemo_safe.patch()
res = {"patch()": patched_later}
if library == "torchvision":
    import torchvision
    import torchvision.datasets.utils as utils
    import torchvision.datasets.mnist as mnist
    import torchvision.datasets.sbu as sbu
    upstream = [utils._urlretrieve, utils._decompress, utils.download_url, sbu.download_url,
                mnist.MNIST.download, mnist.MNIST._check_exists, mnist.EMNIST.download, mnist.QMNIST.download,
                *utils._ARCHIVE_EXTRACTORS.values()]
    res["foreign"] = [f.__qualname__ for f in upstream if not f.__code__.co_filename.startswith(
        os.path.dirname(torchvision.__file__))]
    root = os.path.join(sys.argv[4], "root")
    utils.download_url(url, root, md5=sys.argv[5])
    res["downloaded"] = sorted(os.listdir(root))
else:
    import nemo.utils.exp_manager as em
    import time
    res["foreign"] = [f.__qualname__ for f in (em.exp_manager, em.get_log_dir, em.check_resume)
                      if not f.__code__.co_filename.endswith(os.path.join("nemo", "utils", "exp_manager.py"))]
    if em.time is not time:
        res["foreign"].append("time")
res["active"] = nemo_safe.patching.active()
res["nemo_safe.active()"] = getattr(nemo_safe, "active", lambda: "missing")()
res["finders"] = [type(f).__module__ for f in sys.meta_path if type(f).__module__.startswith("nemo_safe")]
res["records"] = [r for r in records if r[0].startswith("nemo_safe") and r[1] != "DEBUG"]
print(json.dumps(res))
"""


@pytest.mark.parametrize("missing", ["O_NOFOLLOW", "link", "O_NOFOLLOW,link"])
def test_without_nofollow_or_link_torchvision_runs_as_upstream(tmp_path: Path, blob: bytes, missing: str) -> None:
    md5 = hashlib.md5(blob).hexdigest()
    with FaultyMirror({BLOB_NAME: blob}) as mirror:
        res, out = run_script(PLATFORM_SCRIPT, missing, "torchvision", mirror.url + BLOB_NAME, str(tmp_path), md5)
    _assert_untouched_with_one_warning(res, out, missing)
    assert res["downloaded"] == [BLOB_NAME], res
    assert hashlib.md5((tmp_path / "root" / BLOB_NAME).read_bytes()).hexdigest() == md5


def test_without_nofollow_and_link_nemo_runs_as_upstream(tmp_path: Path) -> None:
    res, out = run_script(PLATFORM_SCRIPT, "O_NOFOLLOW,link", "nemo", "-", timeout=600)
    _assert_untouched_with_one_warning(res, out, "O_NOFOLLOW,link")


def _assert_untouched_with_one_warning(res: dict, out: subprocess.CompletedProcess, missing: str) -> None:
    assert out.returncode == 0, out.stderr[-3000:]
    assert res["foreign"] == [], res
    assert res["active"] == res["nemo_safe.active()"] == [] and res["finders"] == [] and res["patch()"] is False, res
    assert len(res["records"]) == 1, res["records"]
    logger, level, message = res["records"][0]
    assert (logger, level) == ("nemo_safe", "WARNING"), res["records"]
    for name in missing.split(","):
        assert f"os.{name}" in message, message
    assert "no library is patched" in message, message


@pytest.mark.parametrize(
    ("value", "patched", "warned"),
    [("", True, False), ("0", True, False), ("off", True, False), ("False", True, False), ("1", False, False),
     ("on", False, False), ("maybe", False, True)],
)  # fmt: skip
def test_disable_variable_values(value: str, patched: bool, warned: bool) -> None:
    """NEMO_SAFE_DISABLE: the usual spellings of yes and no; anything else means upstream, with a warning."""
    code = "import nemo_safe, json; print(json.dumps(nemo_safe.patching.is_enabled()))"
    out = subprocess.run([sys.executable, "-c", code], env=clean_env(NEMO_SAFE_DISABLE=value), capture_output=True,
                         text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout) is patched, (value, out.stdout)
    assert ("NEMO_SAFE_DISABLE='maybe' is neither" in out.stderr) is warned, out.stderr


TURN_OFF_SOME = """
import json, nemo_safe, torch.hub, torchvision.datasets.utils as utils
print(json.dumps([nemo_safe.active(), hasattr(utils.download_url, "__nemo_safe__"),
                  hasattr(torch.hub.download_url_to_file, "__wrapped__")]))
"""


@pytest.mark.parametrize(
    ("value", "active", "said"),
    [
        ("torchvision", ["torch-hub-single-flight"], "torchvision-atomic-downloads, torchvision-datasets-single"),
        ("torch_hub", [f"torchvision-{p}" for p in ("atomic-downloads", "mnist-single-flight",
                                                    "download-url-bindings", "datasets-single-flight")],
         "torch-hub-single-flight left as upstream has them"),
        # the bindings only rebind the atomic downloads' functions: off with them
        (" Torchvision-Atomic-Downloads , torch-hub", ["torchvision-mnist-single-flight",
                                                       "torchvision-datasets-single-flight"],
         "torch-hub-single-flight, torchvision-atomic-downloads left"),
        ("torchvison", [], "NEMO_SAFE_DISABLE='torchvison' is neither 1/true/yes/on nor 0/false/no/off nor patches"),
        ("torchvision,nemoo", [], "(nemoo: no patch or family of that name; families nemo, torchvision, torch-hub"),
        ("torch", [], "(torch: no patch or family of that name"),  # a family is a library, not any prefix
    ],
    ids=["family", "underscore", "names", "typo", "one-unknown", "prefix"],
)  # fmt: skip
def test_disable_one_patch_keeps_the_others(value: str, active: list[str], said: str) -> None:
    """Issue 24: NEMO_SAFE_DISABLE names patches or their families; those stay as upstream has them (the library's
    own function, not a wrapper), the others are applied; one line says which. A name that names no patch turns
    every patch off (the safe reading), with one warning."""
    out = subprocess.run([sys.executable, "-c", TURN_OFF_SOME], env=clean_env(NEMO_SAFE_DISABLE=value),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stderr
    applied, atomic, hub = json.loads(out.stdout)
    assert applied == active, out.stderr
    assert atomic == ("torchvision-atomic-downloads" in active) and hub == ("torch-hub-single-flight" in active)
    assert said in out.stderr and out.stderr.count("NEMO_SAFE_DISABLE") == 1 + (not active), out.stderr


def test_doctor_says_which_patch_is_turned_off() -> None:
    """Also ``python -m nemo_safe``, the command where its script is not on PATH."""
    out = subprocess.run([sys.executable, "-m", "nemo_safe", "doctor"], env=clean_env(NEMO_SAFE_DISABLE="torch-hub"),
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    rows = {line.split()[0]: line for line in out.stdout.splitlines() if line.startswith("  ")}
    assert "turned off by NEMO_SAFE_DISABLE=torch-hub" in rows["torch-hub-single-flight"], out.stdout
    assert "every patch except torch-hub-single-flight" in out.stdout, out.stdout


@pytest.mark.parametrize("error_class", [nemo_safe.RankZeroFailed, nemo_safe.LeaderFailed])
def test_remote_failures_keep_the_remote_error_through_pickling(error_class: type) -> None:
    """A failure raised in a spawned child reaches the parent pickled (mp.spawn, multiprocessing pools):
    the remote type and message must survive, as filelock's Timeout keeps its path."""
    import pickle

    error = error_class("rank 0 failed: OSError: disk full", "OSError", "disk full")
    copy = pickle.loads(pickle.dumps(error))
    assert type(copy) is error_class and isinstance(copy, nemo_safe.RemoteFailure)
    assert (str(copy), copy.remote_type, copy.remote_message) == (str(error), "OSError", "disk full")
