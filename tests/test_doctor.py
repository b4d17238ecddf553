"""``nemo-safe doctor`` tells the truth: every line it prints is checked against the real process.

A program runs doctor in-process (``nemo_safe_tools.cli.main(["doctor"])``) between steps
(reloads, re-executions, ``patch()``/``unpatch()``, changed upstream sources) and then
reports facts read from the real modules, never from nemo_safe's bookkeeping: whether
each patched name holds a function whose code lives in the nemo_safe package, the
imported libraries' versions, whether nemo_safe's finder is in ``sys.meta_path``. The
console script's output is compared with the same facts. The expected versions come
from ``importlib.metadata`` in the test process, the environment lines from the
launcher variables the test sets, the filesystem from ``findmnt``.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

from procs import clean_env, slurm_env, torchrun_env

NEMO_SAFE = str(Path(sys.executable).with_name("nemo-safe"))
HANG_GUARD = 300

EXP_MANAGER = "nemo-exp-manager-resume"
NEMO_LOGGER = "nemo-logger-resume-order"
DOWNLOADS = "torchvision-atomic-downloads"
BINDINGS = "torchvision-download-url-bindings"
MNIST = "torchvision-mnist-single-flight"
DATASETS = "torchvision-datasets-single-flight"
HUB = "torch-hub-single-flight"
CLOUD = "nemo-cloud-single-flight"
CLOUD_BINDING = "nemo-cloud-binding-common"
MEGATRON = "nemo-megatron-single-flight"
#: Patch -> (the module it patches, the distribution whose release it must recognise).
PATCHES = {
    EXP_MANAGER: ("nemo.utils.exp_manager", "nemo_toolkit"),
    NEMO_LOGGER: ("nemo.lightning.nemo_logger", "nemo_toolkit"),  # NeMo 2.x only: not applicable on 3.0
    DOWNLOADS: ("torchvision.datasets.utils", "torchvision"),
    BINDINGS: ("torchvision.datasets", "torchvision"),
    MNIST: ("torchvision.datasets.mnist", "torchvision"),
    DATASETS: ("torchvision.datasets", "torchvision"),
    HUB: ("torch.hub", "torch"),
    CLOUD: ("nemo.utils.cloud", "nemo_toolkit"),
    CLOUD_BINDING: ("nemo.core.classes.common", "nemo_toolkit"),
    MEGATRON: ("nemo.collections.common.tokenizers.megatron_utils", "nemo_toolkit"),
}
#: The releases nemo_safe's patches were verified against (README).
SUPPORTED = {
    "torchvision": ("0.29.1",),
    "nemo_toolkit": ("1.23.0", "2.0.0", "2.3.3", "2.7.3", "3.0.0"),
    "torch": ("2.14.1",),
}
DISTRIBUTIONS = {
    "nemo_toolkit": "nemo",
    "torch": "torch",
    "torchvision": "torchvision",
    "lightning": "lightning",
    "pytorch-lightning": "pytorch_lightning",
}
#: What an inactive patch must say runs instead (upstream's behaviour).
UPSTREAM_WORDS = ("upstream", "non-atomic", "every process downloads")

PROGRAM = r'''
import contextlib, importlib, importlib.machinery, importlib.util, inspect, io, json, os, sys
from importlib import metadata

steps, tmp = sys.argv[1].split(","), sys.argv[2]
CHANGES = {  # module -> (a line of the installed source, what a release the gate declines has there instead)
    # A body the overlay replaces, changed: not a verified release's shape.
    "torchvision.datasets.utils": ("chunk_size: int = 1024 * 32) -> None:", "chunk_size: int = 1024 * 64) -> None:"),
    # MNIST's check takes another parameter: not the check the wrapper and its waiters were built for.
    "torchvision.datasets.mnist": (
        "    def _check_exists(self) -> bool:\n",
        "    def _check_exists(self, strict=True) -> bool:\n",
    ),
    # The move into run_N no longer rank 0's alone.
    "nemo.utils.exp_manager": (
        "    if is_global_rank_zero():\n        # Check to see if any files exist that need to be moved\n",
        "    if True:\n        # Check to see if any files exist that need to be moved\n",
    ),
}
DISTRIBUTIONS = __DISTRIBUTIONS__
MODULES = __MODULES__
reports, latest = [], {}


def installed_source(name):
    top, _, rest = name.partition(".")
    return os.path.join(importlib.util.find_spec(top).submodule_search_locations[0], *rest.split(".")) + ".py"


def load_changed(name):
    """The installed module with one line changed, as an unknown upstream release would have it."""
    marker, replacement = CHANGES[name]
    text = open(installed_source(name)).read()
    assert marker in text, (name, marker)
    path = os.path.join(tmp, name + ".py")
    with open(path, "w") as f:
        f.write(text.replace(marker, replacement, 1))
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)


def import_libraries():
    for name in ("torchvision.datasets", "nemo.utils.exp_manager", "nemo.collections.common.tokenizers.megatron_utils"):
        with contextlib.suppress(ImportError):
            importlib.import_module(name)


def ours(value):
    code = getattr(value, "__code__", None)
    if code is not None:
        return code.co_filename.startswith(os.path.dirname(sys.modules["nemo_safe"].__file__) + os.sep)
    return type(value).__module__.split(".")[0] == "nemo_safe"


def state(values):
    return {"in_place": bool(values) and all(map(ours, values)), "any": any(map(ours, values))}


def facts():
    import nemo_safe.patching
    modules = {}
    for name in MODULES:
        try:
            module = importlib.import_module(name)
            modules[name] = {"importable": True, "file": getattr(module, "__file__", None)}
        except ImportError as exc:
            modules[name] = {"importable": False, "error": str(exc)}
    patches, bound = {}, {}
    em = sys.modules.get("nemo.utils.exp_manager")
    if em is not None:
        patches["nemo-exp-manager-resume"] = state([em.get_log_dir, em.check_resume, em.exp_manager, em.time])
    nl = sys.modules.get("nemo.lightning.nemo_logger")
    if nl is not None:
        patches["nemo-logger-resume-order"] = state(
            [vars(nl.NeMoLogger)["setup"], vars(nl.NeMoLogger)["_setup_files_to_move"]]
        )
    utils = sys.modules.get("torchvision.datasets.utils")
    if utils is not None:
        patches["torchvision-atomic-downloads"] = state(
            [utils._urlretrieve, utils._decompress, utils.download_url, *utils._ARCHIVE_EXTRACTORS.values()]
        )
        for name, module in list(sys.modules.items()):
            if name.startswith("torchvision.datasets.") and module is not None and module is not utils:
                for attr in ("download_url", "_decompress"):
                    value = vars(module).get(attr)
                    if value is not None:
                        bound[f"{name}.{attr}"] = value is getattr(utils, attr) and ours(value)
        patches["torchvision-download-url-bindings"] = {
            "in_place": bool(bound) and all(bound.values()) and ours(utils.download_url),
            "any": any(bound.values()),
        }
    mnist = sys.modules.get("torchvision.datasets.mnist")
    if mnist is not None:
        patches["torchvision-mnist-single-flight"] = state(
            [vars(getattr(mnist, c))[m] for c in ("MNIST", "EMNIST", "QMNIST") for m in ("download", "_check_exists")]
        )
    datasets = sys.modules.get("torchvision.datasets")
    if datasets is not None:  # the download method of each class the patch covers, where that class defines it
        from nemo_safe.patches.torchvision_datasets import COVERED
        classes = [getattr(datasets, name) for name in COVERED]
        patches["torchvision-datasets-single-flight"] = state(
            [next(vars(k)[m] for k in c.__mro__ if m in vars(k)) for c, (m, _) in zip(classes, COVERED.values())]
        )
    hub = sys.modules.get("torch.hub")
    if hub is not None:
        patches["torch-hub-single-flight"] = state([hub.download_url_to_file])
    cloud = sys.modules.get("nemo.utils.cloud")
    if cloud is not None:
        patches["nemo-cloud-single-flight"] = state([cloud.maybe_download_from_cloud])
    common = sys.modules.get("nemo.core.classes.common")
    if common is not None and cloud is not None:
        patches["nemo-cloud-binding-common"] = state([common.maybe_download_from_cloud])
    megatron = sys.modules.get("nemo.collections.common.tokenizers.megatron_utils")
    if megatron is not None:
        patches["nemo-megatron-single-flight"] = state([megatron._download])
    versions = {}
    for dist, top in DISTRIBUTIONS.items():
        try:
            installed = metadata.version(dist)
        except metadata.PackageNotFoundError:
            installed = None
        module = sys.modules.get(top)
        versions[dist] = {"metadata": installed, "imported": getattr(module, "__version__", None)}
    return {
        "pid": os.getpid(),
        "nemo_safe_version": sys.modules["nemo_safe"].__version__,
        "nemo_safe_file": sys.modules["nemo_safe"].__file__,
        "finder": any(type(f).__module__ == "nemo_safe.patching" for f in sys.meta_path),
        "active": nemo_safe.patching.active(),
        "modules": modules,
        "patches": patches,
        "bound_modules": len({key.rpartition(".")[0] for key in bound}),
        "versions": versions,
    }


for step in steps:
    if step.startswith("block:"):  # as if not installed: import raises ModuleNotFoundError
        sys.modules[step.partition(":")[2]] = None
    elif step.startswith("changed:"):
        name = step.partition(":")[2]
        if name.startswith("torchvision"):
            importlib.import_module("torchvision.datasets")
        load_changed(name)
    elif step == "import":
        import_libraries()
    elif step == "nemo_safe":
        import nemo_safe
    elif step == "reload":
        for name in ("torchvision.datasets.utils", "torchvision.datasets.mnist", "torchvision.datasets", MODULES[0]):
            if sys.modules.get(name) is not None:
                importlib.reload(sys.modules[name])
    elif step == "bypass":  # re-execute the module with a plain loader, not through sys.meta_path
        for name in ("torchvision.datasets.utils", "nemo.utils.exp_manager"):
            module = sys.modules[name]
            importlib.machinery.SourceFileLoader(name, module.__file__).exec_module(module)
    elif step == "patch":
        nemo_safe.patch()
    elif step == "unpatch":
        utils, em = sys.modules.get("torchvision.datasets.utils"), sys.modules.get("nemo.utils.exp_manager")
        latest = {"download_url": inspect.unwrap(utils.download_url), "check_resume": inspect.unwrap(em.check_resume)}
        nemo_safe.unpatch()
    elif step == "report":
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            from nemo_safe_tools import cli
            rc = cli.main(["doctor"])
        report = {"step": len(reports), "rc": rc, "stdout": out.getvalue(), "facts": facts()}
        if latest:  # after unpatch: the functions the module defines now, not older ones
            report["facts"]["restored_latest"] = (
                sys.modules["torchvision.datasets.utils"].download_url is latest["download_url"]
                and sys.modules["nemo.utils.exp_manager"].check_resume is latest["check_resume"]
            )
        reports.append(report)
    else:
        raise SystemExit(f"unknown step {step}")
print("REPORTS " + json.dumps(reports))
'''


def _program() -> str:
    modules = tuple(dict.fromkeys(module for module, _ in PATCHES.values()))
    return PROGRAM.replace("__DISTRIBUTIONS__", repr(DISTRIBUTIONS)).replace("__MODULES__", repr(modules))


def run_program(steps: str, tmp_path: Path, cwd: Path | None = None, **env: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, "-c", _program(), steps, str(tmp_path)],
        env=clean_env(**env),
        cwd=cwd or tmp_path,
        capture_output=True,
        text=True,
        timeout=HANG_GUARD,
    )
    lines = [ln for ln in out.stdout.splitlines() if ln.startswith("REPORTS ")]
    assert out.returncode == 0 and lines, out.stderr[-4000:]
    return json.loads(lines[-1][len("REPORTS ") :])


def installed_file(module: str) -> str:
    top, _, rest = module.partition(".")
    spec = importlib.util.find_spec(top)  # a top-level package: nothing is imported
    assert spec is not None and spec.submodule_search_locations
    base = os.path.join(spec.submodule_search_locations[0], *rest.split("."))
    return os.path.join(base, "__init__.py") if os.path.isdir(base) else base + ".py"


def installed_version(dist: str) -> str | None:
    try:
        return metadata.version(dist)
    except metadata.PackageNotFoundError:
        return None


def filesystem_of(path: Path) -> str:
    if not shutil.which("findmnt"):
        pytest.fail("findmnt (util-linux) is needed to check doctor's cwd filesystem line")
    out = subprocess.run(
        ["findmnt", "-n", "-o", "FSTYPE", "--target", str(path)], capture_output=True, text=True, check=True
    )
    return out.stdout.split()[-1]  # a mount point mounted over lists every mount: the last is on top


def public(version: str) -> str:
    return version.split("+")[0]


def check_report(
    stdout: str,
    facts: dict,
    *,
    cwd: Path,
    causes: dict[str, str] | None = None,
    env: dict[str, str] | None = None,
    environment: dict[str, str] | None = None,
    warnings: tuple[str, ...] = (),
    shadowed: tuple[str, ...] = (),
) -> None:
    """Check every line doctor printed against the facts of its process and of this installation.

    ``causes``: for each patch expected inactive, what the line must give as the cause.
    ``environment``: the expected environment lines (default: no launcher).
    ``shadowed``: distributions whose metadata the run shadowed on purpose.
    """
    causes = causes or {}
    environment = environment or {
        "launcher": "none",
        "rank": "0 (local 0, node 0)",
        "world size": "1",
        "attempt key": f"local-{facts['pid']}",
    }
    lines = stdout.splitlines()
    seen: dict[str, set[str]] = {"libraries": set(), "patches": set(), "environment": set()}
    section = None
    warnings_seen = []
    for line in lines:
        where = f"doctor line {line!r}"
        if line.startswith("nemo_safe "):
            assert section is None, where
            assert line == f"nemo_safe {installed_version('nemo_safe')}", where
            assert facts["nemo_safe_version"] == installed_version("nemo_safe"), where
            continue
        if line in ("libraries (installed distributions):", "patches:", "settings:", "environment:"):
            section = line.split()[0].rstrip(":")
            continue
        assert section is not None and line.startswith("  "), where
        if section == "libraries":
            dist, _, shown = line.strip().partition(" ")
            shown = shown.strip()
            assert dist in DISTRIBUTIONS, where
            seen["libraries"].add(dist)
            fact = facts["versions"][dist]
            if dist not in shadowed:
                assert fact["metadata"] == installed_version(dist), where
            expected = fact["metadata"] or "not installed"
            imported = fact["imported"]
            if imported is not None and public(imported) != public(fact["metadata"] or ""):
                assert shown.startswith(expected + " ") and f"imported here is {imported}," in shown, where
            else:
                assert shown == expected, where
        elif section == "patches" and line.startswith("  patching "):
            if facts["finder"]:
                expected = "enabled"
            elif (env or {}).get("NEMO_SAFE_DISABLE"):
                expected = "disabled by NEMO_SAFE_DISABLE"
            else:
                expected = "not enabled"
            assert line.split(None, 1)[1].strip() == expected, where
            seen["patches"].add("patching")
        elif section == "settings":  # a NEMO_SAFE_* variable of this run: its value as given, then the verdict
            name, value = re.split(r" {2,}", line.strip(), maxsplit=1)
            assert value.startswith(f"{(env or {})[name]!r}: "), where
        elif section == "patches":
            match = re.fullmatch(r"  (\S+) +(ACTIVE|inactive|not applicable): (.*)", line)
            assert match, where
            name, shown_state, text = match.groups()
            assert name in PATCHES, where
            seen["patches"].add(name)
            _check_patch_line(name, shown_state, text, facts, causes.get(name, ""), where)
        else:
            key, value = re.split(r" {2,}", line.strip(), maxsplit=1)
            if key == "WARNING":
                warnings_seen.append(value)
            elif key == "cwd filesystem":
                assert value == filesystem_of(cwd), where
                seen["environment"].add(key)
            else:
                assert environment.get(key) == value, where
                seen["environment"].add(key)
    assert seen["libraries"] == set(DISTRIBUTIONS), stdout
    assert seen["patches"] == {"patching", *PATCHES}, stdout
    assert seen["environment"] == {*environment, "cwd filesystem"}, stdout
    assert len(warnings_seen) == len(warnings), stdout
    for warning, expected in zip(warnings_seen, warnings, strict=True):
        assert expected in warning, stdout
    in_place = {name for name, fact in facts["patches"].items() if fact["in_place"]}
    assert set(facts["active"]) == in_place, f"nemo_safe.patching.active() says {facts['active']}"


def _check_patch_line(name: str, shown_state: str, text: str, facts: dict, cause: str, where: str) -> None:
    module, dist = PATCHES[name]
    if not facts["modules"][module]["importable"]:
        assert shown_state == "not applicable", where
        assert f"{module} cannot be imported" in text, where
        return
    fact = facts["patches"][name]
    assert (shown_state == "ACTIVE") == fact["in_place"], f"{where}: really in place: {fact['in_place']}"
    installed = installed_version(dist)
    if shown_state == "ACTIVE":
        if name == BINDINGS:
            assert text.startswith(f"{facts['bound_modules']} dataset modules "), where
        elif name == CLOUD_BINDING:
            assert text == f"{module} calls the single-flight maybe_download_from_cloud", where
        else:
            # The release it recognised is the one installed, and what it does is said.
            assert f"{dist} " in text and installed in text, where
            assert "unknown" not in text and "not patched" not in text.lower(), where
        return
    # What runs instead: upstream's behaviour, or why the patch is no longer in place.
    assert any(word in text for word in (*UPSTREAM_WORDS, "no longer in place")), where
    assert cause in text, f"{where}: expected cause {cause!r}"
    if "no longer in place" in cause:
        return
    if name == BINDINGS:
        if not facts["patches"][DOWNLOADS]["in_place"]:
            assert f"{DOWNLOADS} is not in place" in text, where
        return
    if name == CLOUD_BINDING:
        if not facts["patches"].get(CLOUD, {}).get("in_place"):
            assert f"{CLOUD} is not in place" in text, where
        return
    pristine = facts["modules"][module]["file"] == installed_file(module)
    if pristine and installed in SUPPORTED[dist]:
        assert installed in text and "verified on" in text and "declined" not in text, where
    else:  # an edited module: the gate's verdict, whichever it is, and what runs instead
        assert any(verdict in text for verdict in ("declined: ", "recognised by structure", "verified on")), where


def test_doctor_console_script_in_a_fresh_process(tmp_path: Path) -> None:
    """What a user runs: doctor imports NeMo and torchvision through the hook; every line is true."""
    (report,) = run_program("nemo_safe,report", tmp_path)
    facts = report["facts"]
    assert all(fact["in_place"] for fact in facts["patches"].values()), facts
    proc = subprocess.Popen(
        [NEMO_SAFE, "doctor"], env=clean_env(), cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    stdout, stderr = proc.communicate(timeout=HANG_GUARD)
    assert proc.returncode == 0, stderr[-4000:]
    check_report(stdout, {**facts, "pid": proc.pid}, cwd=tmp_path)
    check_report(report["stdout"], facts, cwd=tmp_path)
    attempt = re.compile(r"attempt key .*")
    assert attempt.sub("", stdout) == attempt.sub("", report["stdout"])


def test_doctor_with_nemo_safe_disabled(tmp_path: Path) -> None:
    env = {"NEMO_SAFE_DISABLE": "1"}
    (report,) = run_program("nemo_safe,report", tmp_path, **env)
    facts = report["facts"]
    assert not any(fact["any"] for fact in facts["patches"].values()), facts
    out = subprocess.run(
        [NEMO_SAFE, "doctor"], env=clean_env(**env), cwd=tmp_path, capture_output=True, text=True, timeout=HANG_GUARD
    )
    assert out.returncode == 0, out.stderr[-4000:]
    causes = dict.fromkeys(PATCHES, "NEMO_SAFE_DISABLE is set")
    check_report(report["stdout"], facts, cwd=tmp_path, causes=causes, env=env)
    attempt = re.compile(r"attempt key .*")
    assert attempt.sub("", out.stdout) == attempt.sub("", report["stdout"])


@pytest.fixture(scope="module")
def reload_reports(tmp_path_factory: pytest.TempPathFactory) -> list[dict]:
    """One process: doctor, reload every patched module, doctor, re-execute two of them bypassing the
    import hook, doctor, nemo_safe.patch(), doctor, nemo_safe.unpatch(), doctor."""
    tmp = tmp_path_factory.mktemp("reload")
    return [
        {**report, "cwd": tmp}
        for report in run_program("nemo_safe,report,reload,report,bypass,report,patch,report,unpatch,report", tmp)
    ]


def test_doctor_before_any_reload(reload_reports: list[dict]) -> None:
    report = reload_reports[0]
    check_report(report["stdout"], report["facts"], cwd=report["cwd"])


def test_reload_reapplies_the_patches(reload_reports: list[dict]) -> None:
    """importlib.reload re-executes the module through nemo_safe's finder: the patches are in place again."""
    report = reload_reports[1]
    check_report(report["stdout"], report["facts"], cwd=report["cwd"])
    assert all(fact["in_place"] for fact in report["facts"]["patches"].values()), report["facts"]


def test_reexecution_bypassing_the_hook_is_reported(reload_reports: list[dict]) -> None:
    """A plain loader re-executes exp_manager and utils: those patches (and the bindings to utils'
    old functions) are no longer in place, and neither active() nor doctor claims them."""
    report = reload_reports[2]
    facts = report["facts"]
    causes = dict.fromkeys((EXP_MANAGER, DOWNLOADS, BINDINGS), "no longer in place")
    check_report(report["stdout"], facts, cwd=report["cwd"], causes=causes)
    assert {name for name, fact in facts["patches"].items() if not fact["in_place"]} == {
        EXP_MANAGER,
        DOWNLOADS,
        BINDINGS,
    }, facts


def test_patch_again_after_the_bypass(reload_reports: list[dict]) -> None:
    report = reload_reports[3]
    check_report(report["stdout"], report["facts"], cwd=report["cwd"])
    assert all(fact["in_place"] for fact in report["facts"]["patches"].values()), report["facts"]


def test_unpatch_after_reloads_restores_the_modules_current_functions(reload_reports: list[dict]) -> None:
    """unpatch() restores what the module defines now, never a function of an earlier execution."""
    report = reload_reports[4]
    facts = report["facts"]
    assert facts["restored_latest"], "unpatch() put back functions of an earlier execution of the module"
    assert not any(fact["any"] for fact in facts["patches"].values()), facts
    causes = dict.fromkeys(PATCHES, "not enabled")
    check_report(report["stdout"], facts, cwd=report["cwd"], causes=causes)


def test_reload_of_modules_imported_before_nemo_safe(tmp_path: Path) -> None:
    """Their loaders are not nemo_safe's, but reload finds the spec again through sys.meta_path."""
    reports = run_program("import,nemo_safe,reload,report,unpatch,report", tmp_path)
    check_report(reports[0]["stdout"], reports[0]["facts"], cwd=tmp_path)
    assert all(fact["in_place"] for fact in reports[0]["facts"]["patches"].values()), reports[0]["facts"]
    assert reports[1]["facts"]["restored_latest"]
    check_report(reports[1]["stdout"], reports[1]["facts"], cwd=tmp_path, causes=dict.fromkeys(PATCHES, "not enabled"))


def test_unknown_torchvision_release(tmp_path: Path) -> None:
    """torchvision's utils and mnist with one changed line each, NeMo not installed: nothing of theirs is
    patched, and every line says why. The other dataset classes and torch.hub are unchanged (each class is
    gated on its own sources), so their single flights stay."""
    steps = "block:nemo,changed:torchvision.datasets.utils,changed:torchvision.datasets.mnist,nemo_safe,report"
    (report,) = run_program(steps, tmp_path)
    facts = report["facts"]
    unchanged = (DATASETS, HUB)
    assert not any(fact["any"] for name, fact in facts["patches"].items() if name not in unchanged), facts
    assert all(facts["patches"][name]["in_place"] for name in unchanged), facts
    assert not facts["modules"]["nemo.utils.exp_manager"]["importable"]
    check_report(report["stdout"], facts, cwd=tmp_path)


def test_unknown_nemo_release(tmp_path: Path) -> None:
    """NeMo's exp_manager with one changed line (torchvision stays: NeMo imports it)."""
    (report,) = run_program("changed:nemo.utils.exp_manager,nemo_safe,report", tmp_path)
    facts = report["facts"]
    assert not facts["patches"][EXP_MANAGER]["any"], facts
    check_report(report["stdout"], facts, cwd=tmp_path)


def test_stale_distribution_metadata_is_not_taken_for_the_imported_library(tmp_path: Path) -> None:
    """A torchvision-9.9.9.dist-info first on the path (left over by a broken install): doctor must not
    claim torchvision 9.9.9 is what runs."""
    shadow = tmp_path / "shadow"
    info = shadow / "torchvision-9.9.9.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: torchvision\nVersion: 9.9.9\n")
    pythonpath = os.pathsep.join(p for p in (str(shadow), os.environ.get("PYTHONPATH", "")) if p)
    (report,) = run_program("block:nemo,nemo_safe,report", tmp_path, PYTHONPATH=pythonpath)
    facts = report["facts"]
    assert facts["versions"]["torchvision"]["metadata"] == "9.9.9"
    check_report(report["stdout"], facts, cwd=tmp_path, shadowed=("torchvision",))


def _torchrun_key() -> str:
    raw = "torchrun-run7-127.0.0.1:29500"
    return "torchrun-run7-127.0.0.1_29500-" + hashlib.sha256(raw.encode()).hexdigest()[:12]


LAUNCHERS = {
    "none": ({}, None, ()),
    "slurm": (
        slurm_env(2, 4, "77"),
        {
            "launcher": "slurm",
            "rank": "2 (local 2, node 0)",
            "world size": "4",
            "attempt key": "slurm-testcluster-77-r0-s0",
        },
        (),
    ),
    "slurm-shell": (
        {**slurm_env(0, 4, "77"), "SLURM_JOB_NAME": "bash"},
        None,
        ("SLURM job named 'bash' is treated as an interactive shell",),
    ),
    "torchrun": (
        torchrun_env(1, 2, "run7"),
        {"launcher": "torchrun", "rank": "1 (local 1, node 0)", "world size": "2", "attempt key": _torchrun_key()},
        (),
    ),
}


@pytest.mark.parametrize("launcher", list(LAUNCHERS))
def test_doctor_environment_lines(tmp_path: Path, launcher: str) -> None:
    """Libraries blocked (fast); the environment section against the variables set, cwd on tmpfs when there is one."""
    env, environment, warnings = LAUNCHERS[launcher]
    cwd = tmp_path
    if launcher == "none" and os.path.isdir("/dev/shm"):
        cwd = Path(__import__("tempfile").mkdtemp(dir="/dev/shm"))
    try:
        (report,) = run_program("block:nemo,block:torchvision,block:torch,nemo_safe,report", tmp_path, cwd=cwd, **env)
        check_report(report["stdout"], report["facts"], cwd=cwd, environment=environment, warnings=warnings)
    finally:
        if cwd != tmp_path:
            shutil.rmtree(cwd, ignore_errors=True)
