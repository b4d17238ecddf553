"""``nemo-safe demo --only from_pretrained``: NeMo's NGC ``from_pretrained`` on every rank, upstream vs nemo_safe
(:mod:`nemo_safe_tools.from_pretrained_race`). The race itself, its faults and its twins are tested in
``tests/test_nemo_downloads.py``; this is the command's table, on the pinned NeMo (not in the release sweep: where
a release's gate declines the patch, the nemo_safe row runs as upstream)."""

from __future__ import annotations

import pytest

from procs import demo_rows

pytest.importorskip("nemo")

HANG_GUARD = 600
RANKS = 4


def test_demo_from_pretrained_race() -> None:
    """4 ranks (each imports NeMo: the cheapest that still has waiters): upstream shows the race (a rank restores
    a partial file, or the model is downloaded more than once), with nemo_safe every rank restores the model's
    weights from one download."""
    rows, output = demo_rows("from_pretrained", RANKS, HANG_GUARD)
    failed, other_weights, downloads, served, _ = rows["with nemo_safe"]
    assert (failed, other_weights, downloads, served) == (f"0 of {RANKS}", "0", "1", "1.00x"), output
    failed, _, downloads, _, _ = rows["upstream NeMo"]
    assert not failed.startswith("0 of") or int(downloads) > 1, output
