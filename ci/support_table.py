"""The release sweep's record of each environment, and the support table (docs/releases.md) made from those records.

    python ci/support_table.py record PROFILE nemo torchvision --exit N   # in PROFILE's environment
    python ci/support_table.py write docs/releases.md                      # the table, from .sweep/*.json

``record`` imports the installed libraries with nemo_safe and keeps, per patch, what ``nemo-safe doctor`` says
(verified on a release / recognised by structure / declined, and why), the installed releases, and the test
counts of the profile's junit files. ``write`` replaces the lines between the two support-table markers of that file.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import json
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

HERE = Path(__file__).resolve().parent
SWEEP = HERE.parent / ".sweep"
BEGIN, END = "<!-- support-table: begin (ci/release_sweep.sh writes it) -->", "<!-- support-table: end -->"
DISTRIBUTIONS = ("nemo_toolkit", "torchvision", "torch", "lightning", "pytorch-lightning")
MODULES = {"nemo": ("nemo.utils.exp_manager", "nemo.utils.cloud"), "torchvision": ("torchvision.datasets", "torch.hub")}
#: Imported where they exist (NeMo 2.x's NeMoLogger: not in 1.x nor 3.0; Megatron's downloads: not there in 1.x).
OPTIONAL = {
    "nemo": ("nemo.lightning.nemo_logger", "nemo.collections.common.tokenizers.megatron_utils"),
    "torchvision": (),
}
#: Patch -> its column in the table.
COLUMNS = {
    "nemo-exp-manager-resume": "NeMo exp_manager",
    "nemo-logger-resume-order": "NeMo 2.x NeMoLogger",
    "nemo-cloud-single-flight": "NeMo NGC from_pretrained",
    "nemo-megatron-single-flight": "Megatron vocab/merges",
    "torchvision-atomic-downloads": "torchvision downloads",
    "torchvision-mnist-single-flight": "MNIST family",
    "torchvision-datasets-single-flight": "27 dataset classes",
    "torch-hub-single-flight": "torch.hub",
}


def _version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _counts(path: Path) -> dict[str, int]:
    if not path.exists():
        return {}
    suites = ET.parse(path).getroot()
    suite = suites if suites.tag == "testsuite" else suites.find("testsuite")
    tests, failures, errors, skipped = (int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped"))
    return {"passed": tests - failures - errors - skipped, "failed": failures + errors, "skipped": skipped}


def record(profile: str, parts: list[str], exit_code: int) -> None:
    import nemo_safe  # noqa: F401  (patches apply as the modules are imported below)
    from nemo_safe import patching

    for part in parts:
        for module in MODULES[part]:
            importlib.import_module(module)
        for module in OPTIONAL[part]:
            try:
                importlib.import_module(module)
            except ImportError:
                pass
    verdicts = {}
    for patch in patching.registered():
        if patch.name in COLUMNS and patch.module in sys.modules:
            in_place, text = patching.status(patch)
            verdicts[patch.name] = {"in_place": in_place, "text": text}
    out = {
        "profile": profile,
        "parts": parts,
        "versions": {name: _version(name) for name in DISTRIBUTIONS},
        "verdicts": verdicts,
        "tests": {part: _counts(SWEEP / f"{profile}-{part}.xml") for part in parts},
        "exit": exit_code,
    }
    SWEEP.mkdir(exist_ok=True)
    (SWEEP / f"{profile}.json").write_text(json.dumps(out, indent=1) + "\n")


def _short(verdict: str) -> str:
    """``verified on torchvision 0.29.1`` -> ``verified (0.29.1)``; ``recognised by structure (...)`` -> ``by
    structure``; ``declined: <fact>: does not hold ...`` -> ``declined: <fact>``."""
    for library in ("nemo_toolkit ", "torchvision ", "torch "):
        verdict = verdict.replace(library, "")
    if verdict.startswith("verified on "):
        return f"verified ({verdict[len('verified on ') :]})"
    if verdict.startswith("recognised by structure"):
        return "by structure"
    if verdict.startswith("declined: "):
        return "declined: " + verdict[len("declined: ") :].split(": does not hold")[0].split(" (")[0]
    return verdict


def _cell(verdict: dict[str, object]) -> str:
    text = str(verdict["text"])
    if text.startswith("one download per root for"):  # the dataset classes: a count per verdict
        counts = text[text.index("(") + 1 : text.rindex(")")]
        return counts.replace("recognised by structure", "by structure").replace(" on torchvision ", " ")
    if verdict["in_place"]:
        return _short(text.split(": ")[0] if not text.startswith("recognised") else text)
    # Not in place: doctor's text is "<cause>; <verdict>: <what upstream does>" (the cause may be absent).
    return _short(text.split("; ")[-1])


def table() -> list[str]:
    rows = [json.loads(path.read_text()) for path in sorted(SWEEP.glob("*.json"))]
    rows.sort(key=lambda r: tuple(str(r["versions"].get(n) or "") for n in ("nemo_toolkit", "torchvision", "torch")))
    head = ["NeMo", "torchvision", "torch", *COLUMNS.values(), "sweep tests"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for row in rows:
        versions = row["versions"]
        nemo = versions["nemo_toolkit"] if "nemo" in row["parts"] else "-"
        tests = ", ".join(
            f"{part}: {c.get('passed', 0)} passed" + (f", {c['failed']} failed" if c.get("failed") else "")
            for part, c in row["tests"].items()
        )
        cells = [_cell(row["verdicts"].get(name)) if name in row["verdicts"] else "-" for name in COLUMNS]
        lines.append("| " + " | ".join([nemo or "-", versions["torchvision"] or "-", versions["torch"] or "-",
                                         *cells, tests + ("" if row["exit"] == 0 else " (red)")]) + " |")  # fmt: skip
    return lines


def write(readme: Path) -> None:
    text = readme.read_text()
    start, end = text.index(BEGIN) + len(BEGIN), text.index(END)
    readme.write_text(text[:start] + "\n" + "\n".join(table()) + "\n" + text[end:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    rec = sub.add_parser("record")
    rec.add_argument("profile")
    rec.add_argument("parts", nargs="+", choices=sorted(MODULES))
    rec.add_argument("--exit", type=int, default=0)
    wr = sub.add_parser("write")
    wr.add_argument("readme", type=Path)
    args = parser.parse_args()
    if args.command == "record":
        record(args.profile, args.parts, args.exit)
    else:
        write(args.readme)


if __name__ == "__main__":
    main()
