"""``python -m nemo_safe`` is the ``nemo-safe`` command (where the console script is not on ``PATH``).

Only this entry point names the tooling: ``import nemo_safe`` never loads ``nemo_safe_tools``."""

import sys

from nemo_safe_tools.cli import main

sys.exit(main())
