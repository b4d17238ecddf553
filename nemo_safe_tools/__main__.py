"""``python -m nemo_safe_tools`` is the ``nemo-safe`` command."""

import sys

from nemo_safe_tools.cli import main

sys.exit(main())
