"""The barrier through two bindfs views with 3 s entry/attr/negative caches (an NFS-like setting)."""

from __future__ import annotations

import secrets

import pytest

from procs import start_ranks, torchrun_env

pytestmark = pytest.mark.fuse
HANG_GUARD = 180


def _args(view1, view2, *extra: str) -> list[str]:
    return ["--dir", str(view1), "--dir-for-odd-ranks", str(view2), *extra]


def test_barrier_orders_across_cached_views(bindfs_views) -> None:
    """Rank 0 (view 1) enters 4 s late so waiters on view 2 have cached negative lookups."""
    base, view1, view2 = bindfs_views
    run_id = secrets.token_hex(4)
    ranks = start_ranks(
        8, lambda r: torchrun_env(r, 8, run_id), _args(view1, view2, "--rank0-delay", "4", "--work-seconds", "1")
    ).finish(HANG_GUARD)
    assert set(ranks.codes.values()) == {0}, ranks.results
    assert all(ranks.results[r]["saw_marker"] for r in range(1, 8)), ranks.results
    assert sorted(p.name for p in base.iterdir()) == ["marker"]


def test_cached_views_without_barrier_show_the_race(bindfs_views) -> None:
    base, view1, view2 = bindfs_views
    run_id = secrets.token_hex(4)
    ranks = start_ranks(
        8, lambda r: torchrun_env(r, 8, run_id), _args(view1, view2, "--work-seconds", "1", "--no-barrier")
    ).finish(HANG_GUARD)
    assert [r for r in range(1, 8) if not ranks.results[r]["saw_marker"]], ranks.results
