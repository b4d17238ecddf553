"""One process of a SingleFlight test: runs a job that sleeps and then succeeds or raises. Prints one JSON line."""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from nemo_safe import single_flight
from nemo_safe.single_flight import SingleFlight


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--work", type=float, default=1.0, help="seconds the job takes")
    p.add_argument("--fail", action="store_true", help="the job raises after its work")
    p.add_argument("--fence", action="store_true", help="the job checks every 0.1 s that it still leads")
    args = p.parse_args()
    directory = Path(args.dir)
    product = directory / "product"

    # Looked up, not imported, so that the same test shows what a version without the check does.
    fence = getattr(single_flight, "check_still_leading", lambda: None) if args.fence else lambda: None

    def job() -> None:
        end = time.monotonic() + args.work
        while time.monotonic() < end:
            time.sleep(0.1)
            fence()
        if args.fail:
            raise OSError(28, "No space left on device (simulated by the test job)")
        (directory / f"made-by.{os.getpid()}").write_text("x")
        product.write_text("done")

    flight = SingleFlight(directory, "job")
    result: dict = {"pid": os.getpid(), "status": "ok"}
    started = time.monotonic()
    try:
        flight.run(job, done=product.exists)
    except Exception as exc:
        result.update(status="error", error_type=type(exc).__name__, error=str(exc))
    result.update(led=flight.led, seconds=time.monotonic() - started)
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
