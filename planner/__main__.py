"""`python -m planner` is the `planner` command."""

import sys

from planner.commands.cli import main

sys.exit(main())
