"""The ``nemo-safe`` command: ``selftest``, ``demo`` and ``doctor``."""

from __future__ import annotations

import argparse
import importlib
import importlib.util
import json
import logging
import math
import os
import sys
import tempfile
from collections.abc import Callable
from importlib import metadata
from pathlib import Path

from nemo_safe import __version__, cluster_identity, patching, platform_support, settings
from nemo_safe.errors import NemoSafeError
from nemo_safe_tools import selftest
from nemo_safe_tools.mounts import filesystem_type

#: Distributions whose versions doctor reports (from their metadata), with the module each provides:
#: when doctor's imports brought that module in, its ``__version__`` is checked against the metadata.
WATCHED_DISTRIBUTIONS = {
    "nemo_toolkit": "nemo",
    "torch": "torch",
    "torchvision": "torchvision",
    "lightning": "lightning",
    "pytorch-lightning": "pytorch_lightning",
}
#: The download race: the largest file takes this long through the throttled mirror, and rank i starts
#: i x DEMO_SKEW s late (between half and all of it, upstream breaks by construction).
DEMO_DOWNLOAD_SECONDS = 2.0
DEMO_SKEW = 1.5
#: The from_pretrained race: the .nemo takes this long through the throttled mirror, and rank i starts
#: i x DEMO_FROM_PRETRAINED_SKEW s late (every later rank arrives while the first one downloads).
DEMO_FROM_PRETRAINED_SECONDS = 3.0
DEMO_FROM_PRETRAINED_SKEW = 0.3
#: The races ``nemo-safe demo`` runs without ``--only`` (about 3 minutes on 2 cores); from_pretrained's only when
#: asked for: its 17 NeMo imports add about 2.5 minutes.
DEFAULT_RACES = ("exp_manager", "download")


def _seconds(allow_zero: bool) -> Callable[[str], float]:
    """An argparse type: a finite number of seconds, positive (or also zero): NaN and infinity are refused here,
    not by a child process's traceback."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            value = math.nan
        if not math.isfinite(value) or value < 0 or (value == 0 and not allow_zero):
            raise argparse.ArgumentTypeError(
                f"{text!r}: seconds must be a finite number {'>= 0' if allow_zero else '> 0'}"
            )
        return value

    return parse


def _cmd_selftest(args: argparse.Namespace) -> int:
    ident = cluster_identity.detect()
    if not args.member:
        for warning in ident.warnings:  # -J bash: every task would run its own local selftest
            print(f"nemo-safe selftest: WARNING: {warning}", file=sys.stderr)
        if args.dir or ident.is_multi_process:
            selftest.check_directory(args.dir or os.getcwd())
    if args.member or ident.is_multi_process:
        report = selftest.run_member(args.dir or os.getcwd(), args.timeout, args.work_seconds)
        if report is not None:
            if args.member:
                print(selftest.REPORT_PREFIX + json.dumps(report), flush=True)
            else:
                print(selftest.format_report(report), flush=True)
        return 0
    report = selftest.run_local(args.procs, args.dir, args.timeout, args.work_seconds)
    report["launcher"] = f"none: {args.procs} local processes with torchrun-style variables"
    print(selftest.format_report(report), flush=True)
    return 0 if report["all_saw_rank0_work"] else 1


def _cmd_demo(args: argparse.Namespace) -> int:
    from nemo_safe_tools import demo

    if args.member:
        result = demo.run_member(Path(args.log_dir), Path(args.side), args.devices, args.nodes, args.rank0_delay)
        demo.write_result(Path(args.side), result)
        print(json.dumps(result), flush=True)
        return 0 if result["status"] == "ok" else 1
    use_slurm = False if args.local else None
    workdir = Path(args.dir) if args.dir else None
    races = DEFAULT_RACES if args.only is None else (args.only,)
    ran = 0
    for race in races:
        if race in ("exp_manager", "from_pretrained") and importlib.util.find_spec("nemo") is None:
            print(f"{race} race skipped: nemo_toolkit is not installed (pip install nemo_safe[nemo])\n")
            continue
        if race == "download" and importlib.util.find_spec("torchvision") is None:
            print("download race skipped: torchvision is not installed (pip install nemo_safe[torchvision])\n")
            continue
        with tempfile.TemporaryDirectory(prefix="nemo_safe_demo_", dir=workdir) as tmp:
            if race == "exp_manager":
                where, world, variants = demo.run(
                    Path(tmp), args.old_files, args.rank0_delay, args.nodes, args.tasks_per_node, use_slurm
                )
                print(demo.format_table(where, variants, world, args.old_files, args.rank0_delay) + "\n", flush=True)
            elif race == "from_pretrained":
                from nemo_safe_tools import from_pretrained_race

                seconds, skew = DEMO_FROM_PRETRAINED_SECONDS, DEMO_FROM_PRETRAINED_SKEW
                outcomes = from_pretrained_race.compare(Path(tmp), args.download_ranks, seconds, skew)
                table = from_pretrained_race.format_table(outcomes, args.download_ranks, seconds, skew)
                print(table + "\n", flush=True)
            else:
                from nemo_safe_tools import download_race

                outcomes = download_race.compare(Path(tmp), args.download_ranks, DEMO_DOWNLOAD_SECONDS, DEMO_SKEW)
                table = download_race.format_table(outcomes, args.download_ranks, DEMO_DOWNLOAD_SECONDS, DEMO_SKEW)
                print(table + "\n", flush=True)
        ran += 1
    if not ran:
        print("nemo-safe demo: no race could run (install nemo_toolkit and/or torchvision)", file=sys.stderr)
        return 1
    return 0


def _library_version(dist: str, module_name: str) -> str:
    """The installed version, and the imported module's own when the two disagree (a stale
    dist-info, or a source tree on ``PYTHONPATH`` shadowing the installed package)."""
    try:
        version = metadata.version(dist)
    except metadata.PackageNotFoundError:
        version = "not installed"
    module = sys.modules.get(module_name)
    imported = getattr(module, "__version__", None)
    if isinstance(imported, str) and imported.split("+")[0] != version.split("+")[0]:
        where = os.path.dirname(getattr(module, "__file__", None) or "?")
        version += f" (but the {module_name} imported here is {imported}, from {where})"
    return version


def _cmd_doctor(args: argparse.Namespace) -> int:
    # Import every patched module first (through the import hook, which applies its patches),
    # so that each line below describes the modules as this process really has them.
    import_errors: dict[str, str] = {}
    for patch in patching.registered():
        if patch.module in import_errors or patch.module in sys.modules:
            continue
        try:
            importlib.import_module(patch.module)
        except Exception as exc:  # an absent library, or one that fails to import here
            import_errors[patch.module] = f"{type(exc).__name__}: {exc}"
    found = settings.verdicts()
    labels = [*WATCHED_DISTRIBUTIONS, *(patch.name for patch in patching.registered()), "cwd filesystem"]
    labels += [verdict.name for verdict in found]
    width = max(len(label) for label in labels)  # one column for every section

    def row(label: str, text: str) -> None:
        print(f"  {label:<{width}}  {text}")  # two spaces at least, also after a longer label

    print(f"nemo_safe {__version__}")
    print("libraries (installed distributions):")
    for dist, module_name in WATCHED_DISTRIBUTIONS.items():
        row(dist, _library_version(dist, module_name))
    print("patches:")
    if patching.is_enabled():
        state = "enabled"
    elif patching.disabled_by_env():
        state = "disabled by NEMO_SAFE_DISABLE"
    elif not platform_support.supported():
        state = f"off: this platform has no {' and no '.join(platform_support.missing())} (libraries run as upstream)"
    else:
        state = "not enabled"
    row("patching", state)
    for patch in patching.registered():
        if patch.module in import_errors:
            reason = import_errors[patch.module]
            row(patch.name, f"not applicable: {patch.module} cannot be imported ({reason})")
            continue
        in_place, text = patching.status(patch)
        row(patch.name, f"{'ACTIVE' if in_place else 'inactive'}: {text}")
    bad_settings = 0
    if found:
        print("settings:")
    for verdict in found:
        bad_settings += bool(verdict.problem)
        said = f"INVALID: {verdict.problem}" if verdict.problem else f"uses {verdict.used}"
        row(verdict.name, f"{verdict.raw!r}: {said}")
    print("environment:")
    try:
        ident = cluster_identity.detect()
    except NemoSafeError as exc:
        row("ERROR", str(exc))
        return 1
    row("launcher", ident.launcher)
    row("rank", f"{ident.rank} (local {ident.local_rank}, node {ident.node_rank})")
    row("world size", str(ident.world_size))
    row("attempt key", ident.attempt_key)
    row("cwd filesystem", filesystem_type(os.getcwd()))
    for warning in ident.warnings:
        row("WARNING", warning)
    if bad_settings:
        print(f"nemo-safe doctor: {bad_settings} setting(s) nemo_safe cannot use as given (see 'settings:' above)",
              file=sys.stderr)  # fmt: skip
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="nemo-safe", description="nemo_safe's command: selftest, demo and doctor (also python -m nemo_safe)."
    )
    parser.add_argument("--version", action="version", version=f"nemo_safe {__version__}")
    parser.add_argument("-v", "--verbose", action="store_true", help="log progress lines")
    # -v after the subcommand too (nemo-safe selftest -v); SUPPRESS keeps the top level's value when absent.
    verbose = argparse.ArgumentParser(add_help=False)
    verbose.add_argument("-v", "--verbose", action="store_true", default=argparse.SUPPRESS, help="log progress lines")
    sub = parser.add_subparsers(dest="command", required=True)
    st = sub.add_parser(
        "selftest", parents=[verbose], help="run the barrier across local processes or the current srun/torchrun job"
    )
    st.add_argument(
        "--dir",
        help="directory for the barrier (default: a temp dir locally, the cwd under a launcher); "
        "use your shared filesystem",
    )
    st.add_argument("--procs", type=int, default=4, help="local processes when not under a launcher (default 4)")
    st.add_argument(
        "--timeout",
        type=_seconds(allow_zero=False),
        default=None,
        help=f"barrier timeout in seconds (default {selftest.DEFAULT_TIMEOUT:g})",
    )
    st.add_argument(
        "--work-seconds", type=_seconds(allow_zero=True), default=0.5, help="how long rank 0 works inside the barrier"
    )
    st.add_argument("--member", action="store_true", help=argparse.SUPPRESS)
    st.set_defaults(func=_cmd_selftest)
    dm = sub.add_parser(
        "demo",
        parents=[verbose],
        help="NeMo's exp_manager resume race and torchvision's download race, upstream vs nemo_safe "
        "(NeMo's from_pretrained race with --only from_pretrained)",
    )
    dm.add_argument("--dir", help="where the demo's log dirs go (shared by all nodes under SLURM; default: a temp dir)")
    dm.add_argument("--nodes", type=int, default=2, help="SLURM nodes (default 2)")
    dm.add_argument("--tasks-per-node", type=int, default=4, help="tasks (devices) per node (default 4)")
    dm.add_argument("--old-files", type=int, default=2000, help="old files in log_dir (default 2000)")
    dm.add_argument(
        "--rank0-delay", type=_seconds(allow_zero=True), default=6.0, help="seconds rank 0 starts late (default 6)"
    )
    dm.add_argument("--local", action="store_true", help="use local processes even if SLURM is reachable")
    dm.add_argument(
        "--only",
        choices=["exp_manager", "download", "from_pretrained"],
        help="run one race (default: exp_manager and download; from_pretrained, NeMo's NGC download on every rank, "
        "runs only when named here: it adds about 2.5 minutes)",
    )
    dm.add_argument(
        "--download-ranks",
        type=int,
        default=8,
        help="ranks of the download races: torch.multiprocessing.spawn ranks of download, local processes of "
        "from_pretrained (default 8)",
    )
    dm.add_argument("--member", action="store_true", help=argparse.SUPPRESS)
    dm.add_argument("--log-dir", help=argparse.SUPPRESS)
    dm.add_argument("--side", help=argparse.SUPPRESS)
    dm.add_argument("--devices", type=int, default=4, help=argparse.SUPPRESS)
    dm.set_defaults(func=_cmd_demo)
    doc = sub.add_parser("doctor", parents=[verbose], help="show versions, active patches and the detected environment")
    doc.set_defaults(func=_cmd_doctor)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING, format="%(asctime)s %(name)s: %(message)s"
    )
    for name in ("procs", "nodes", "tasks_per_node", "download_ranks"):
        if getattr(args, name, 1) < 1:
            print(f"nemo-safe: --{name.replace('_', '-')} must be at least 1", file=sys.stderr)
            return 2
    if getattr(args, "old_files", 0) < 0:
        print("nemo-safe: --old-files must not be negative", file=sys.stderr)
        return 2
    if getattr(args, "dir", None) and not os.path.isdir(args.dir):
        print(f"nemo-safe: --dir {args.dir} is not an existing directory", file=sys.stderr)
        return 2
    try:
        return args.func(args)
    except NemoSafeError as exc:
        print(f"nemo-safe: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("nemo-safe: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
