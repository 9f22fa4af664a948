"""The documentation: the CLI reference is the parser's, the README stays short, and the guide's key snippets (the
own-model factory, the training loop, the K-FAC loop, under docs/snippets/ and included in the pages from there) run
as a user runs them."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

from planner.commands.cli import main
from planner.commands.cli_reference import markdown
from planner.models import build_workload
from tests.factories import synthetic_kfac_plan

ROOT = Path(__file__).resolve().parent.parent
SNIPPETS = ROOT / "docs" / "snippets"
BIN = Path(sys.executable).parent


def test_cli_reference_is_the_parsers() -> None:
    committed = (ROOT / "docs" / "reference" / "cli.md").read_text(encoding="utf-8")
    assert committed == markdown(), "docs/reference/cli.md is stale: run `make docs` (or " \
                                    "`python -m planner.commands.cli_reference > docs/reference/cli.md`)"


def test_cli_reference_lists_every_command_and_option() -> None:
    page = markdown()
    from planner.commands.cli import build_parser

    parser = build_parser()
    sub = next(a for a in parser._actions if a.dest == "command")
    for name, command in sub.choices.items():
        assert f"## planner {name}\n" in page
        for action in command._actions:
            for option in action.option_strings:
                if option not in ("-h", "--help"):
                    assert f"`{option}" in page or f", {option}" in page, (name, option)


def test_readme_instructs_in_at_most_250_lines() -> None:
    readme = (ROOT / "README.md").read_text(encoding="utf-8").splitlines()
    assert len(readme) <= 250
    dated = [line for line in readme if re.search(r"\b20\d\d-\d\d-\d\d\b", line)]
    assert not dated, "dated lines belong in docs/results"


def _section(path: Path, name: str) -> str:
    text = path.read_text(encoding="utf-8")
    return text.split(f"# --8<-- [start:{name}]\n")[1].split(f"# --8<-- [end:{name}]")[0]


def test_readme_code_is_the_tested_snippets() -> None:
    """The README shows the factory and the loop as docs/snippets/ has them (which the tests below run); only the
    plan's path differs (the runnable loop takes it from the command line)."""
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(encoding="utf-8"), re.S)
    factory = next(b for b in blocks if b.startswith("# my_workloads.py\n"))
    assert factory.removeprefix("# my_workloads.py\n") == _section(SNIPPETS / "my_workloads.py", "factory")
    loop = next(b for b in blocks if "GradientExchange.from_file" in b)
    expected = "from planner.runtime import GradientExchange\n\n" + _section(SNIPPETS / "train.py", "loop")
    assert loop == expected.replace("sys.argv[1]", '"runs/plans/lm.json"')


def test_pages_include_the_snippets_that_exist() -> None:
    """Every `--8<--` include in the docs names a snippet file (and section) that exists."""
    for page in (ROOT / "docs").rglob("*.md"):
        for target in re.findall(r'--8<-- "([^"]+)"', page.read_text(encoding="utf-8")):
            path, _, section = target.partition(":")
            text = (ROOT / path).read_text(encoding="utf-8")
            if section:
                assert f"--8<-- [start:{section}]" in text and f"--8<-- [end:{section}]" in text, (page, target)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(SNIPPETS), str(ROOT), env.get("PYTHONPATH", "")])
    return env


def _torchrun(script: str, plan: Path, tmp_path: Path) -> list[str]:
    done = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
         str(SNIPPETS / script), str(plan)],
        cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    # Found anywhere in the output, not only at a line's start: both ranks write to one pipe.
    lines = sorted(re.findall(r"rank \d+ loss [-\d.]+ checksum -?\d+\.\d{6}", done.stdout))
    assert len(lines) == 2, f"expected a line from each rank; stdout: {done.stdout!r}; stderr: {done.stderr[-2000:]!r}"
    return lines


def _checksums(lines: list[str]) -> set[str]:
    return {line.split("checksum ")[1] for line in lines}


def test_own_model_factory_passes_the_trial_step() -> None:
    sys.path.insert(0, str(SNIPPETS))
    try:
        workload = build_workload("my_workloads:small_lm")
    finally:
        sys.path.remove(str(SNIPPETS))
    assert workload.name == "small-lm" and workload.batch_size == 16


def test_own_model_in_three_steps_then_the_training_loop(tmp_path: Path) -> None:
    """The README's path for one's own model: quick profile, solve, then the loop of docs/snippets/train.py."""
    profile, plan = tmp_path / "small-lm.json", tmp_path / "small-lm-plan.json"
    done = subprocess.run([str(BIN / "planner"), "profile", "--quick", "--model", "my_workloads:small_lm", "--nproc",
                           "2", "-o", str(profile)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    # The solve reads only the profile: its command line runs in this process (the `planner` script ran above).
    assert main(["solve", str(profile), "-o", str(plan)]) == 0
    lines = _torchrun("train.py", plan, tmp_path)
    assert [line.split()[1] for line in lines] == ["0", "1"]
    assert len(_checksums(lines)) == 1, lines  # both ranks applied the same averaged gradients


def test_kfac_loop_runs_on_a_plan(tmp_path: Path) -> None:
    sys.path.insert(0, str(SNIPPETS))
    try:
        plan = synthetic_kfac_plan("my_workloads:small_lm", world_size=2)
    finally:
        sys.path.remove(str(SNIPPETS))
    path = tmp_path / "small-lm-kfac.json"
    plan.save(path)
    lines = _torchrun("train_kfac.py", path, tmp_path)
    assert [line.split()[1] for line in lines] == ["0", "1"]
    assert len(_checksums(lines)) == 1, lines
