"""``python -m nemo_safe`` is the ``nemo-safe`` command (selftest, demo, doctor)."""

import sys

from nemo_safe_tools.cli import main

sys.exit(main())
