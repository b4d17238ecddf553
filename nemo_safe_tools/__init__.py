"""nemo_safe's tooling, above the library: the ``nemo-safe`` command (:mod:`nemo_safe_tools.cli`:
``selftest``, ``demo``, ``doctor``), the demo's races (:mod:`~nemo_safe_tools.demo`,
:mod:`~nemo_safe_tools.download_race`), the loopback HTTP mirror they download from and the starter of
local ranks with torchrun-style variables. It imports ``nemo_safe``; ``nemo_safe`` never imports it."""
