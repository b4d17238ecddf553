# Copyright (c) 2025, NVIDIA CORPORATION.  All rights reserved.
#
# Licensed under the Apache License, Version 2.0 (the "License");
# you may not use this file except in compliance with the License.
# You may obtain a copy of the License at
#
#     http://www.apache.org/licenses/LICENSE-2.0
#
# Unless required by applicable law or agreed to in writing, software
# distributed under the License is distributed on an "AS IS" BASIS,
# WITHOUT WARRANTIES OR CONDITIONS OF ANY KIND, either express or implied.
# See the License for the specific language governing permissions and
# limitations under the License.

"""``nemo.utils.fs_barrier`` across real processes started by ``torchrun``, without torch.distributed.

One launch of 4 ranks runs two barriers in a shared directory:

* ``ordered``: rank 0 enters 3 s late and writes a file in two halves, 1 s apart, inside the
  barrier; every other rank reads it inside its own body and must see both halves.
* ``missing``: rank 3 never arrives; ranks 0-2 must each fail with ``BarrierTimeout`` naming
  rank 3 instead of hanging or going on.

Running this file as a script is one rank (what torchrun starts).
"""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

WORLD = 4
HANG_GUARD = 600  # 4 NeMo imports on a small CI machine take well under a minute
PAYLOAD = "first half, second half"


def _member(shared: Path, results: Path) -> None:
    from nemo.utils.fs_barrier import BarrierTimeout, detect, rank_zero_first

    ident = detect()
    report = {"rank": ident.rank, "launcher": ident.launcher, "world_size": ident.world_size}
    if ident.rank == 0:
        time.sleep(3)
    with rank_zero_first(shared, name="ordered"):
        if ident.rank == 0:
            with open(shared / "payload.txt", "w") as fh:
                fh.write(PAYLOAD[:11])
                fh.flush()
                time.sleep(1)
                fh.write(PAYLOAD[11:])
        else:
            report["seen"] = (shared / "payload.txt").read_text()
    if ident.rank != 3:
        try:
            with rank_zero_first(shared, name="missing", timeout=10):
                report["missing"] = "entered"
        except BarrierTimeout as exc:
            report["missing"] = f"BarrierTimeout: {exc}"
    (results / f"{ident.rank}.json").write_text(json.dumps(report))


@pytest.fixture(scope="module")
def launch(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("fs_barrier")
    shared, results = tmp / "shared", tmp / "results"
    shared.mkdir()
    results.mkdir()
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={WORLD}"]
    cmd += [__file__, str(shared), str(results)]
    out = subprocess.run(cmd, env=dict(os.environ), capture_output=True, text=True, timeout=HANG_GUARD)
    reports = {int(p.stem): json.loads(p.read_text()) for p in results.glob("*.json")}
    return out, reports, shared


@pytest.mark.unit
def test_rank_zero_first_orders_ranks(launch):
    out, reports, _ = launch
    assert sorted(reports) == list(range(WORLD)), out.stderr[-3000:]
    assert {r["launcher"] for r in reports.values()} == {"torchrun"}
    for rank in range(1, WORLD):
        assert reports[rank]["seen"] == PAYLOAD, f"rank {rank} entered before rank 0's body finished"


@pytest.mark.unit
def test_missing_rank_fails_every_rank(launch):
    _, reports, _ = launch
    for rank in range(WORLD - 1):
        outcome = reports[rank]["missing"]
        assert outcome.startswith("BarrierTimeout") and "3 never arrived" in outcome, (rank, outcome)


if __name__ == "__main__":
    _member(Path(sys.argv[1]), Path(sys.argv[2]))
