"""``python -m vramguard``: the same as the ``vramguard`` command."""

import sys

from vramguard.cli import main

sys.exit(main())
