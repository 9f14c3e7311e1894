"""The README stays a page a newcomer reads (what Changeover is, the two commands, a job, the CLI, links), and
every file it links to exists. The docs/ folder itself is built by `make docs` (mkdocs, strict) in make test."""

from __future__ import annotations

import re

from changeover.settings import CHECKOUT

README = CHECKOUT / "README.md"


def test_the_readme_is_short_and_its_links_lead_somewhere() -> None:
    text = README.read_text()
    assert len(text.splitlines()) < 200, "move the detail into docs/"
    links = re.findall(r"\]\(([^)#]+)(?:#[^)]*)?\)", text)
    assert links, "the README links to its docs"
    missing = [link for link in links if not link.startswith("http") and not (CHECKOUT / link).exists()]
    assert not missing, missing
    for command in ("make demo", "make test"):
        assert command in text
