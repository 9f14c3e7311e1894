"""The README stays a page a newcomer reads (what Changeover is, the two commands, a job, the CLI, links), and
every file it links to exists. The docs/ folder itself is built by `make docs` (mkdocs, strict) in make test.

The docs are user docs: what users read carries no commit hashes, no times of day and no citations of the design's
seed documents by number, every page's title is the one the nav shows, and every measurement lives in
docs/benchmarks.md, one row each with the command that reproduces it, the machine and the date of the run."""

from __future__ import annotations

import re
from pathlib import Path

import yaml
from changeover.settings import CHECKOUT

README = CHECKOUT / "README.md"
DOCS = CHECKOUT / "docs"
BENCHMARKS = DOCS / "benchmarks.md"
MKDOCS = CHECKOUT / "mkdocs.yml"

# A commit hash, full or abbreviated: a word of 7 to 40 lowercase hex digits. It must hold a digit and a letter
# a-f: a hex-only word without a digit is English ("decade", "facade", "accede"), and one without a letter is a
# number (a count, a date's digits, a run id such as 0365080000); an abbreviated hash is almost always both. The
# word may be followed by an apostrophe ("49ca1a4's code"), not by more letters, digits or an underscore.
COMMIT_HASH = re.compile(r"(?<![0-9A-Za-z_])(?=[0-9a-f]*[0-9])(?=[0-9a-f]*[a-f])[0-9a-f]{7,40}(?![0-9A-Za-z_])")

# A time of day in prose: part of a day, a machine's "slow hour", a clock time (hh:mm, 9 am). Looked for outside
# code, where a clock-like value is configuration (`SUN 02:00-04:00`) or an address (`127.0.0.1:8080`).
TIME_OF_DAY = re.compile(
    r"\b(?:mid-?)?(?:morning|afternoon|evening|midnight|noon)s?\b"
    r"|\b(?:slow|slower|slowest|fast|faster|fastest|quiet|busy) hours?\b"
    r"|\ban hour (?:earlier|later)\b"
    r"|(?<![\d.:])(?:[01]?\d|2[0-3]):[0-5]\d(?![\d:])"
    r"|\b\d{1,2} ?[ap]\.?m\b\.?",
    re.IGNORECASE)

# A citation of a seed document by its number ("seed 002", "seed 002's", "seeds 000 and 004", "seed_000").
SEED_CITATION = re.compile(r"\bseeds?[ _-]?0\d\d", re.IGNORECASE)

DATE = re.compile(r"\d{4}-\d{2}-\d{2}")


def _user_docs() -> list[Path]:
    return [README, *sorted(DOCS.glob("*.md"))]


def _user_code() -> list[Path]:
    """Every Python file whose docstrings, comments and help strings users read: the core (the CLI included), the
    Airflow plugin and the DAGs."""
    return sorted(path for root in ("include", "plugins", "dags") for path in (CHECKOUT / root).rglob("*.py"))


def _hits(pattern: re.Pattern[str], paths: list[Path], prose_only: bool = False) -> list[str]:
    found = []
    for path in paths:
        text = path.read_text()
        if prose_only:
            text = _without_code(text)
        for number, line in enumerate(text.splitlines(), 1):
            found += [f"{path.relative_to(CHECKOUT)}:{number}: {m.group(0)!r}" for m in pattern.finditer(line)]
    return found


def _without_code(markdown: str) -> str:
    """The prose of a Markdown page: fenced and indented code blocks blanked (their lines kept, so line numbers
    stay right), and inline code spans removed."""
    lines: list[str] = []
    fence, indented, previous = None, False, ""
    for line in markdown.splitlines():
        marker = re.match(r"\s*(`{3,}|~{3,})", line)
        if fence is None and marker:
            fence = marker.group(1)
            lines.append("")
        elif fence is not None:
            if line.strip().startswith(fence):
                fence = None
            lines.append("")
        elif line.startswith("    ") and (indented or (not previous.strip()
                                                         and not re.match(r"\s*([-*+|]|\d+\.)\s", line))):
            indented = True  # an indented code block: after a blank line outside a list, until the indent ends
            lines.append("")
        else:
            indented = indented and not line.strip()
            lines.append(re.sub(r"(`+).+?\1", "", line))
        previous = line
    return "\n".join(lines)


def test_the_readme_is_short_and_its_links_lead_somewhere() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 200, "move the detail into docs/"
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links, "the README links to its docs"
    missing = [link for link in links if not link.startswith("http") and not (CHECKOUT / link).exists()]
    assert not missing, missing
    for command in ("make demo", "make test"):
        assert command in text


def test_no_commit_hash_in_the_docs() -> None:
    """Users read what Changeover does, not which commit did it: git's history keeps that."""
    assert COMMIT_HASH.search("the code of 2d354d2, 49ca1a4's code") and not COMMIT_HASH.search("a facade of 2026")
    hits = _hits(COMMIT_HASH, _user_docs())
    assert not hits, "commit hashes in the docs (git's history keeps them):\n" + "\n".join(hits)


def test_no_time_of_day_in_the_docs() -> None:
    """A figure carries the date of its run, never the hour or how fast the machine was that hour."""
    assert TIME_OF_DAY.search("on the slow hour of 2026-11-29 morning") and TIME_OF_DAY.search("ran at 09:30")
    assert not TIME_OF_DAY.search(_without_code("the window `SUN 02:00-04:00` UTC"))
    hits = _hits(TIME_OF_DAY, _user_docs(), prose_only=True)
    assert not hits, "times of day in the docs (give the date of the run only):\n" + "\n".join(hits)


def test_no_seed_document_cited_by_number() -> None:
    """Users never saw the seed documents: name the idea ("Jet's rolling-upgrade shutdown rules", "the stage rules
    of a job update", "read-only pre-hydration") instead of "seed 002"."""
    assert SEED_CITATION.search("(seed 001)") and SEED_CITATION.search("Seeds 000 and 004")
    hits = _hits(SEED_CITATION, _user_docs() + _user_code())
    assert not hits, "seed documents cited by number:\n" + "\n".join(hits)


def _nav_pages(nav: list[object]) -> list[tuple[str, str]]:
    pages = []
    for entry in nav:
        assert isinstance(entry, dict) and len(entry) == 1, f"a nav entry names its title: {entry!r}"
        ((title, target),) = entry.items()
        pages += _nav_pages(target) if isinstance(target, list) else [(title, target)]
    return pages


def test_each_page_is_titled_as_the_nav_names_it() -> None:
    """A page's first heading is its nav title. The heading's inline code is compared as it renders, without its
    backticks, since the nav shows plain text."""
    pages = _nav_pages(yaml.safe_load(MKDOCS.read_text())["nav"])
    assert pages
    wrong = []
    for title, page in pages:
        heading = next((line[2:].strip() for line in (DOCS / page).read_text().splitlines() if line.startswith("# ")),
                       None)
        shown = heading.replace("`", "") if heading else None
        if shown != title:
            wrong.append(f"{page}: nav {title!r}, first heading {heading!r}")
    assert not wrong, "\n".join(wrong)


def _cells(row: str) -> list[str]:
    """A Markdown table row's cells; a pipe inside a code span or escaped is part of its cell."""
    cells, cell, code = [], "", False
    body = row.strip().removeprefix("|").removesuffix("|")
    index = 0
    while index < len(body):
        char = body[index]
        if char == "\\" and index + 1 < len(body):
            cell += body[index:index + 2]
            index += 2
            continue
        if char == "`":
            code = not code
        if char == "|" and not code:
            cells.append(cell.strip())
            cell = ""
        else:
            cell += char
        index += 1
    return [*cells, cell.strip()]


def test_every_benchmark_has_its_command_machine_and_date() -> None:
    """The first table of docs/benchmarks.md holds every figure: one row each, with the command that reproduces
    it, the machine and the date of the run (a date, no time of day)."""
    lines = BENCHMARKS.read_text().splitlines()
    start = next(number for number, line in enumerate(lines) if line.startswith("|"))
    header = [cell.lower() for cell in _cells(lines[start])]
    assert {"what", "figure", "command", "machine", "date"} <= set(header), header
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append(dict(zip(header, _cells(line), strict=True)))
    assert len(rows) >= 10, "the table lists every measured figure"
    wrong = [row["what"] for row in rows
             if not row["figure"] or not re.search(r"`[^`]+`", row["command"]) or not row["machine"]
             or not DATE.fullmatch(row["date"])]
    assert not wrong, "rows without a figure, a command in code, a machine or a date (YYYY-MM-DD):\n" + "\n".join(wrong)
