"""``python -m posteriorzoo``: the same as the ``posteriorzoo`` command."""

import sys

from posteriorzoo.cli import main

sys.exit(main())
