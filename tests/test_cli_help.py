"""The CLI's help: every option's whole name in 80 columns, fast (nothing heavy imported), no internal citations,
and docs/cli.md naming exactly the commands and options the CLI has."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer.main
from changeover.cli.commands import app
from typer.testing import CliRunner

CHECKOUT = Path(__file__).resolve().parents[1]
DOC = CHECKOUT / "docs" / "cli.md"
# Click's own option on every command; documented nowhere but in every help.
HELP = "--help"
# What `changeover --help` must not load: the help of every command stays well under half a second.
HEAVY = ("sqlalchemy", "alembic", "rich", "pydantic", "pyspark", "pandas", "pyarrow", "grpc", "httpx", "psutil",
         "airflow", "changeover.registry", "changeover.cluster", "changeover.jobs", "changeover.upgrade",
         "changeover.light", "changeover.savepoints", "changeover.compat", "changeover.audit")
OPTION = re.compile(r"(?<![\w-])(--[a-z][a-z0-9-]*|-[A-Za-z])(?![\w-])")


def _commands(command: Any, path: tuple[str, ...] = ()) -> Iterator[tuple[tuple[str, ...], Any]]:
    """Every command and group under `command` by its path. (Typer brings its own copy of Click, hence Any.)"""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _commands(sub, (*path, name))


ROOT = typer.main.get_command(app)
COMMANDS = dict(_commands(ROOT))


def _options(command: Any) -> set[str]:
    """Every name an option of the command answers to, long and short, negative forms included; --help aside."""
    return {name for param in command.params if param.param_type_name == "option"
            for name in (*param.opts, *param.secondary_opts)} - {HELP}


def _help(path: tuple[str, ...]) -> str:
    result = CliRunner().invoke(app, [*path, HELP], env={"COLUMNS": "80", "TERMINAL_WIDTH": "80"},
                                prog_name="changeover")
    assert result.exit_code == 0, result.output
    return result.output


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=lambda path: " ".join(path) or "changeover")
def test_every_help_shows_every_option_whole_in_80_columns(path: tuple[str, ...]) -> None:
    shown = _help(path)
    lines = shown.splitlines()
    assert max(len(line) for line in lines) <= 80, shown
    # whole: a name cut short ("--state-partitio…") or glued to other text is not there
    named = set(OPTION.findall(shown))
    missing = _options(COMMANDS[path]) - named
    assert not missing, f"`changeover {' '.join(path)} --help` at 80 columns lacks {sorted(missing)}:\n{shown}"
    assert not re.search(r"seeds? \d{3}", shown, re.IGNORECASE), shown


def test_no_seed_is_cited_in_the_cli_code() -> None:
    cited = [f"{path.name}:{n}: {line.strip()}" for path in sorted((CHECKOUT / "include/changeover/cli").glob("*.py"))
             for n, line in enumerate(path.read_text().splitlines(), 1) if re.search(r"seeds? \d{3}", line, re.I)]
    assert not cited, cited


def test_help_imports_nothing_heavy() -> None:
    """Help is parsed and printed from Typer and the standard library alone: each command imports the rest when it
    runs. A subprocess, since this one has SQLAlchemy and the rest loaded already."""
    probe = (
        "import sys\n"
        "from changeover.cli import main\n"
        "for args in (['--help'], ['submit', '--help'], ['sql', '--help'], ['upgrade', 'status', '--help']):\n"
        "    sys.argv = ['changeover', *args]\n"
        "    try:\n"
        "        main()\n"
        "    except SystemExit as exc:\n"
        "        assert exc.code in (0, None), exc.code\n"
        "import json\n"
        "print(json.dumps(sorted(sys.modules)), file=sys.stderr)\n"
    )
    import changeover

    include = str(Path(changeover.__file__).parents[1])  # this checkout's, whatever the venv installed
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60,
                            env={**os.environ, "COLUMNS": "80", "PYTHONPATH": include})
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stderr.strip().splitlines()[-1])
    heavy = sorted(m for m in loaded if any(m == h or m.startswith(f"{h}.") for h in HEAVY))
    assert not heavy, heavy
    # every module that holds commands was among those loaded, so none of them escapes the check
    holders = {f"changeover.cli.{path.stem}" for path in (CHECKOUT / "include/changeover/cli").glob("*.py")
               if re.search(r"^@\w*app\.(command|callback)\(", path.read_text(), re.MULTILINE)}
    assert {"changeover.cli.commands", "changeover.cli.app"} | holders <= set(loaded), sorted(holders - set(loaded))


def _entries() -> list[tuple[str, str]]:
    """docs/cli.md's reference block as (synopsis's first line, whole entry): an entry begins with `changeover` and
    goes on over the indented lines below it."""
    block = DOC.read_text().split("```", 2)[1]
    entries: list[list[str]] = []
    for line in block.splitlines():
        if line.startswith("changeover"):
            entries.append([line])
        elif line.strip():
            assert entries and line.startswith(" "), f"docs/cli.md: a line outside any entry: {line!r}"
            entries[-1].append(line)
    return [(lines[0], "\n".join(lines)) for lines in entries]


def _documented_path(first_line: str) -> tuple[tuple[str, ...], list[str]]:
    """The command an entry documents (the longest run of command names after `changeover`) and the synopsis words
    after it."""
    words = re.split(r"\s{2,}", first_line.strip())[0].split()[1:]
    path: tuple[str, ...] = ()
    while words and (*path, words[0]) in COMMANDS:
        path, words = (*path, words[0]), words[1:]
    return path, words


def test_docs_cli_md_documents_every_command_and_option_and_nothing_else() -> None:
    documented: dict[tuple[str, ...], set[str]] = {}
    for first_line, entry in _entries():
        path, rest = _documented_path(first_line)
        command = COMMANDS[path]
        # a lowercase word after the command is a subcommand the CLI lacks, unless the command's usage names it
        # (`savepoint delete JOB NAME`)
        if rest and re.fullmatch(r"[a-z][a-z_-]*", rest[0]):
            usage = " ".join(command.collect_usage_pieces(command.context_class(command)))
            assert rest[0] in usage, f"docs/cli.md names `changeover {' '.join((*path, rest[0]))}`: no such command"
        named = set(OPTION.findall(entry)) - {HELP}
        unknown = named - _options(command)
        assert not unknown, f"docs/cli.md gives `changeover {' '.join(path)}` options it lacks: {sorted(unknown)}"
        documented.setdefault(path, set()).update(named)
    for path, command in COMMANDS.items():
        runs_itself = not hasattr(command, "commands") or command.invoke_without_command
        if not (runs_itself or _options(command)):
            continue  # a group that only holds subcommands
        assert path in documented, f"docs/cli.md has no entry for `changeover {' '.join(path)}`"
        missing = _options(command) - documented[path]
        assert not missing, f"docs/cli.md lacks `changeover {' '.join(path)}` options {sorted(missing)}"


def test_docs_cli_md_names_no_option_outside_the_cli() -> None:
    """The prose around the reference, too: every option it names is some command's."""
    every = set().union(*map(_options, COMMANDS.values())) | {HELP}
    stray = set(OPTION.findall(DOC.read_text())) - every
    assert not stray, sorted(stray)


def test_what_the_commands_import_on_use_exists() -> None:
    """The commands import in their bodies, so a module moved or renamed would fail only when the command runs:
    every `from changeover... import ...` in the CLI's code must resolve now."""
    import ast
    import importlib

    unresolved = []
    for path in sorted((CHECKOUT / "include/changeover/cli").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "changeover":
                module = importlib.import_module(node.module)
                for alias in node.names:
                    if not hasattr(module, alias.name):
                        try:
                            importlib.import_module(f"{node.module}.{alias.name}")
                        except ImportError:
                            unresolved.append(f"{path.name}:{node.lineno}: from {node.module} import {alias.name}")
    assert not unresolved, unresolved
