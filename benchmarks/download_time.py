"""MNIST(root, download=True) on 8 ranks: upstream vs nemo_safe vs one rank alone, side by side.

Every configuration downloads from a real HTTP mirror on 127.0.0.1 whose link
is shared by all responses and throttled (``--link-mbps``, default 5 MB/s: a
site's internet uplink, which 8 upstream ranks fetching the same files share).
Ranks are started by torch.multiprocessing.spawn and released together after
init_process_group (the FSDP tutorial). Measured: body bytes served (without
torchvision's own redirect probes), and the slowest rank's seconds inside
``MNIST(...)``, from release to loaded. Uses the original MNIST files when
``../shared/data/mnist`` exists, else synthetic files of MNIST's sizes.

Run: .venv/bin/python benchmarks/download_time.py [--rounds 3] [--ranks 8]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

from nemo_safe import download_race
from nemo_safe.loopback_mirror import LoopbackMirror

MNIST_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "mnist"


def load_files() -> tuple[dict[str, bytes], str]:
    if all((MNIST_DIR / n).is_file() for n in download_race.MNIST_FILES):
        return {n: (MNIST_DIR / n).read_bytes() for n in download_race.MNIST_FILES}, "original MNIST files"
    return download_race.synthetic_mnist(60000, 10000), "synthetic files of MNIST's sizes"


def measure(
    files: dict[str, bytes], ranks: int, disable: bool, link: float, on_disk: bool = False
) -> tuple[float, float, list[str]]:
    """(slowest rank's seconds, bytes served / dataset bytes, failed ranks) of one run.
    ``on_disk``: the data is downloaded first (not measured), so only loading is timed."""
    with tempfile.TemporaryDirectory(prefix="nemo_safe_bench_") as tmp, LoopbackMirror(files, link_rate=link) as m:
        resources = download_race.resources_of(files)
        if on_disk:
            download_race.run_spawn(1, Path(tmp, "root"), Path(tmp, "pre"), m.url, disable=True, resources=resources)
            m.reset_stats()
        out = download_race.run_spawn(
            ranks, Path(tmp, "root"), Path(tmp, "res"), m.url, disable=disable, resources=resources
        )
        results = download_race.read_results(Path(tmp, "res"))
        served = m.total_body_bytes()
    if len(results) < ranks:
        raise SystemExit(f"only {len(results)} of {ranks} ranks reported:\n{out.stderr[-2000:]}")
    failed = [f"{r['error_type']}: {r['error']}" for r in results.values() if r["status"] != "ok"]
    return max(r["seconds"] for r in results.values()), served / sum(map(len, files.values())), failed


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--ranks", type=int, default=8)
    p.add_argument("--link-mbps", type=float, default=5.0, help="shared mirror link, MB/s")
    args = p.parse_args(argv)
    files, what = load_files()
    link = args.link_mbps * 1e6
    configs = [
        ("one rank alone, upstream", 1, True, False),
        ("one rank alone, nemo_safe", 1, False, False),
        (f"{args.ranks} ranks, upstream", args.ranks, True, False),
        (f"{args.ranks} ranks, nemo_safe", args.ranks, False, False),
        ("one rank alone, data already on disk (loading only)", 1, False, True),
        (f"{args.ranks} ranks, data already on disk (loading only)", args.ranks, False, True),
    ]
    rows = {}
    for _ in range(args.rounds):  # interleaved, so drift hits every configuration alike
        for name, ranks, disable, on_disk in configs:
            rows.setdefault(name, []).append(measure(files, ranks, disable, link, on_disk))
    alone = statistics.median(s for s, _, _ in rows["one rank alone, upstream"])
    print(
        f"MNIST download, {what} ({sum(map(len, files.values())) / 1e6:.1f} MB), mirror link {args.link_mbps:g} MB/s "
        f"shared, {args.rounds} rounds, medians"
    )
    print()
    print("| configuration | slowest rank in MNIST(), s | vs one rank alone | bytes served / dataset | failed ranks |")
    print("|---|---|---|---|---|")
    for name, ranks, *_ in configs:
        secs = statistics.median(s for s, _, _ in rows[name])
        served = statistics.median(b for _, b, _ in rows[name])
        failed = sum(len(f) for _, _, f in rows[name])
        print(f"| {name} | {secs:.2f} | {secs / alone:.2f}x | {served:.2f}x | {failed} of {ranks * args.rounds} |")
    errors = [(name, e) for name, *_ in configs for _, _, failed in rows[name] for e in failed]
    if errors:
        print()
        print("Errors of failed ranks:")
        for name, error in errors:
            print(f"- {name}: {error.splitlines()[0][:300]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
