"""One call of ``torch.hub.download_url_to_file(--url, --dst, --hash-prefix)`` for tests/test_liveness.py,
timed from the call (not from the slow imports): prints one JSON line (status, error, seconds)."""

from __future__ import annotations

import argparse
import json
import sys
import time
from typing import Any


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--url", required=True)
    p.add_argument("--dst", required=True)
    p.add_argument("--hash-prefix", default=None)
    args = p.parse_args()
    import torch.hub

    import nemo_safe  # noqa: F401  (a no-op with NEMO_SAFE_DISABLE=1)

    result: dict[str, Any] = {"status": "ok"}
    started = time.monotonic()
    try:
        torch.hub.download_url_to_file(args.url, args.dst, args.hash_prefix, progress=False)
    except Exception as exc:
        result.update(status="error", error_type=type(exc).__name__, error=str(exc)[:2000])
    result["seconds"] = time.monotonic() - started
    print(json.dumps(result), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
