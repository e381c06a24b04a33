"""The README's two set-up commands stay true: CI runs the test command verbatim."""

import re
from pathlib import Path

ROOT = Path(__file__).parent.parent


def readme_commands() -> list[str]:
    section = (ROOT / "README.md").read_text().split("## Set-up", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```bash\n(.+?)\n```", section)


def test_ci_runs_the_readme_test_command():
    main_job, tests = readme_commands()
    assert tests.endswith("python -m pytest -q")
    ci_lines = (ROOT / ".ci" / "run").read_text().splitlines()
    assert tests in ci_lines


def test_readme_main_job_runs_an_existing_command():
    main_job, _ = readme_commands()
    command = re.search(r"dflash-mlx (\w+)", main_job)
    if command:
        from dflash_mlx.cli import build_parser

        assert build_parser().parse_args([command.group(1)]).func
    else:
        assert (ROOT / re.search(r"python (\S+\.py)", main_job).group(1)).exists()
