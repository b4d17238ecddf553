"""One rank of a ``rank_zero_first`` test, run as a real process (local processes, srun, torchrun).

For each form in ``--forms`` (``dir``: meet in ``--dir``; ``store``: no directory, torchrun's agent store;
a ``-local`` suffix: ``local=True``, per node) the group's first rank works ``--work`` seconds inside the
block and then writes a marker; every other rank records whether it saw that marker on entering. Prints
one JSON line: per form the wall-clock times of entering, starting and ending the block and leaving it.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time

from nemo_safe import NemoSafeError, detect_identity, rank_zero_first
from nemo_safe.atomic_files import publish, read_if_exists

MARKER_TEXT = b"the first rank finished its block\n"


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", help="where the ranks meet (forms 'dir' and 'dir-local')")
    p.add_argument("--marker-dir", required=True, help="a directory every rank sees, for the markers")
    p.add_argument("--forms", default="dir")
    p.add_argument("--work", type=float, default=1.0)
    p.add_argument("--delay", default="", help="RANK:SECONDS,...: these global ranks enter late")
    p.add_argument("--timeout", type=float, default=60)
    args = p.parse_args()
    ident = detect_identity()
    delays = dict(item.split(":") for item in args.delay.split(",") if item)
    result = {"rank": ident.rank, "local_rank": ident.local_rank, "node": ident.node_rank, "host": socket.gethostname(),
              "local_world_size": ident.local_world_size, "agent_store": os.environ.get("TORCHELASTIC_USE_AGENT_STORE"),
              "forms": {}, "status": "ok"}  # fmt: skip
    time.sleep(float(delays.get(str(ident.rank), 0)))
    code = 0
    for form in args.forms.split(","):
        local = form.endswith("-local")
        first = (ident.local_rank if local else ident.rank) == 0
        marker = os.path.join(args.marker_dir, f"marker.{form}.{ident.node_rank if local else 'all'}")
        times: dict = {"entered": time.time()}
        result["forms"][form] = times
        directory = args.dir if form.startswith("dir") else None
        try:
            per_node = {"local": True} if local else {}  # the plain call as a user writes it
            with rank_zero_first(directory, name=f"rzf-{form}", timeout=args.timeout, **per_node):
                times["started"] = time.time()
                if first:
                    time.sleep(args.work)
                    publish(args.marker_dir, os.path.basename(marker), MARKER_TEXT)
                else:
                    times["saw_marker"] = read_if_exists(marker) == MARKER_TEXT
                times["ended"] = time.time()
            times["left"] = time.time()
        except NemoSafeError as exc:
            result.update(status="error", error_type=type(exc).__name__, error=str(exc))
            code = 3
            break
    print(json.dumps(result), flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
