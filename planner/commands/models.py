"""`planner models`: the table of built-in models."""

from __future__ import annotations

import argparse

from rich.table import Table

from planner.commands.common import Command
from planner.console import console


class ModelsCommand(Command):
    name = "models"
    help = "list the built-in models"

    def configure(self, parser: argparse.ArgumentParser) -> None:
        pass

    def run(self, args: argparse.Namespace) -> int:
        from planner.models import BUILTIN_MODELS, DEFAULT_MODEL  # deferred (start-up)

        table = Table(title="built-in models (or --model package.module:factory returning a planner.models.Workload)")
        table.add_column("name")
        table.add_column("description")
        for name, desc in BUILTIN_MODELS.items():
            table.add_row(name + (" (default)" if name == DEFAULT_MODEL else ""), desc)
        console.print(table)
        return 0
