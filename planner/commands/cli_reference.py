"""The CLI reference page of the docs, generated from the parser: `python -m planner.commands.cli_reference`
prints it, and `make docs` writes it to docs/reference/cli.md before building the site. It is never written by
hand; `tests/test_docs.py` checks the committed page equals what the parser gives now."""

from __future__ import annotations

import argparse
import sys

from planner.commands.cli import build_parser

WIDTH = 100  # usage lines are wrapped at a fixed width, so the page does not depend on the terminal
HEADER = (
    "# CLI reference\n\n"
    "Generated from the parser by `python -m planner.commands.cli_reference` (`make docs` does it); do not edit by"
    " hand. Every command also prints this with `planner COMMAND --help`.\n"
)


def _formatter(prog: str) -> argparse.HelpFormatter:
    return argparse.HelpFormatter(prog, width=WIDTH, max_help_position=40)


def _usage(parser: argparse.ArgumentParser) -> str:
    formatter = _formatter(parser.prog)
    formatter.add_usage(parser.usage, parser._actions, parser._mutually_exclusive_groups)
    return formatter.format_help().strip()


def _help(parser: argparse.ArgumentParser, action: argparse.Action) -> str:
    if not action.help:
        return ""
    text = _formatter(parser.prog)._expand_help(action)
    return " ".join(text.split()).replace("|", "\\|")


def _invocation(action: argparse.Action) -> str:
    if not action.option_strings:
        return f"`{action.metavar or action.dest}`"
    names = ", ".join(action.option_strings)
    if action.nargs == 0:
        return f"`{names}`"
    metavar = action.metavar
    if metavar is None:
        metavar = "{" + ",".join(map(str, action.choices)) + "}" if action.choices else action.dest.upper()
    if isinstance(metavar, tuple):
        metavar = " ".join(metavar)
    return f"`{names} {metavar}`"


def _default(action: argparse.Action) -> str:
    if action.required:
        return "required"
    if action.nargs == 0 or action.default in (None, argparse.SUPPRESS) or not action.option_strings:
        return ""
    if isinstance(action.default, (list, tuple)):
        return "`" + ",".join(str(v) for v in action.default) + "`"
    return f"`{action.default}`"


def _arguments(parser: argparse.ArgumentParser, skip_help: bool = True) -> list[str]:
    rows = ["| argument | default | what it does |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)) and skip_help:
            continue
        if action.help == argparse.SUPPRESS:
            continue
        rows.append(f"| {_invocation(action)} | {_default(action)} | {_help(parser, action)} |")
    return rows if len(rows) > 2 else ["No arguments."]


def markdown(parser: argparse.ArgumentParser | None = None) -> str:
    """The whole page: the top-level options, then each command in `planner --help`'s order."""
    parser = parser or build_parser()
    lines = [HEADER, f"```text\n{_usage(parser)}\n```\n", *_arguments(parser), ""]
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    for name, command in sub.choices.items():
        lines += [f"## planner {name}\n", (command.description or "").strip() + "\n",
                  f"```text\n{_usage(command)}\n```\n", *_arguments(command), ""]
    return "\n".join(lines).rstrip() + "\n"


if __name__ == "__main__":
    sys.stdout.write(markdown())
