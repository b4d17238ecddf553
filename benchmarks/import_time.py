"""What ``import nemo_safe`` costs every process of a job, and what applying the patches adds to
importing the patched libraries; side by side in one run, fresh interpreters, medians.

    .venv/bin/python benchmarks/import_time.py --rounds 15

Rows:
- ``import nemo_safe`` by ``python -X importtime`` (its cumulative line), with site disabled
  (``-S``, nemo_safe from this checkout on ``PYTHONPATH``) so that an editable install's finder
  is not counted, next to ``import logging`` (which nemo_safe needs) as the reference;
- the standard-library modules it pulls in that it should not (``http``, ``email``, ``inspect``,
  ``urllib.request``, ``socket``, ``json``, ``dataclasses``);
- wall time of ``import torchvision.datasets, torch.hub`` and of ``import nemo.utils.exp_manager``
  with ``import nemo_safe`` first (patches apply as the libraries load) and with
  ``NEMO_SAFE_DISABLE=1``, interleaved.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
HEAVY = ("http", "email", "inspect", "urllib.request", "socket", "json", "dataclasses")


def importtime_us(statement: str, module: str) -> tuple[int, set[str]]:
    """Cumulative microseconds of ``module`` in ``-X importtime`` output, and every module imported."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(
        [sys.executable, "-S", "-X", "importtime", "-c", statement], env=env, capture_output=True, text=True, check=True
    )
    cumulative, loaded = None, set()
    for line in out.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        _self_us, cum_us, name = line[len("import time:") :].split("|")
        name = name.strip()
        loaded.add(name)
        if name == module:
            cumulative = int(cum_us)
    if cumulative is None:
        raise RuntimeError(f"{module} not in -X importtime output of {statement!r}")
    return cumulative, loaded


def wall_seconds(statement: str, disable: bool) -> float:
    env = {**os.environ, "NEMO_SAFE_DISABLE": "1" if disable else "0"}
    code = f"import time; t = time.perf_counter(); {statement}; print(time.perf_counter() - t)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return float(out.stdout.strip().splitlines()[-1])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--no-nemo", action="store_true", help="skip the NeMo rows (NeMo takes ~8 s to import)")
    args = parser.parse_args()

    ours, reference, pulled = [], [], set()
    for _ in range(args.rounds):
        us, loaded = importtime_us("import nemo_safe", "nemo_safe")
        ours.append(us)
        pulled |= {m for m in loaded if any(m == h or m.startswith(h + ".") for h in HEAVY)}
        reference.append(importtime_us("import logging", "logging")[0])
    print(f"import cost, median of {args.rounds} fresh interpreters ({os.cpu_count()} cores)")
    print("| what | median ms | vs import logging |")
    print("|---|---|---|")
    med_ours, med_ref = statistics.median(ours) / 1000, statistics.median(reference) / 1000
    print(f"| import logging (reference) | {med_ref:.1f} | 1.00x |")
    print(f"| import nemo_safe (logging included) | {med_ours:.1f} | {med_ours / med_ref:.2f}x |")
    print(f"\nheavy standard-library modules `import nemo_safe` loads: {sorted(pulled) or 'none'}\n")

    workloads = [("import torchvision.datasets, torch.hub", "import nemo_safe, torchvision.datasets, torch.hub")]
    if not args.no_nemo:
        workloads.append(("import nemo.utils.exp_manager", "import nemo_safe, nemo.utils.exp_manager"))
    print("| libraries imported | upstream s | with nemo_safe s | ratio |")
    print("|---|---|---|---|")
    rounds = max(3, args.rounds // 3)
    for label, statement in workloads:
        up, with_ours = [], []
        for _ in range(rounds):  # interleaved, so that load on the machine hits both alike
            up.append(wall_seconds(statement, disable=True))
            with_ours.append(wall_seconds(statement, disable=False))
        u, w = statistics.median(up), statistics.median(with_ours)
        print(f"| `{label}` (median of {rounds}) | {u:.3f} | {w:.3f} | {w / u:.2f}x |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
