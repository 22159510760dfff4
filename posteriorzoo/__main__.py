import sys

from posteriorzoo.cli import main

sys.exit(main())
