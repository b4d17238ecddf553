"""``python -m nemo_safe`` is the ``nemo-safe`` command."""

import sys

from nemo_safe.cli import main

sys.exit(main())
