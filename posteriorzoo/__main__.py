"""``python -m posteriorzoo``: the same as the ``posteriorzoo`` command."""

from posteriorzoo.cli import run

run()
