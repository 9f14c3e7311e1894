"""The measured Spark version table: kept as data, shown in the docs, re-measured here for one cell, and
used to refuse a resume that the table marks as refused or wrong."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from changeover.cluster.runtimes import SUPPORTED_VERSIONS
from changeover.compat import version_table
from changeover.errors import ChangeoverError
from changeover.settings import CHECKOUT, Settings

SHOWN_IN = CHECKOUT / "docs" / "compatibility.md"


def test_the_table_covers_every_pair_of_known_versions_and_the_docs_show_it() -> None:
    table = version_table.load()
    pairs = {(c["created_with"], c["resumed_with"]) for c in table["cells"]}
    assert pairs == {(a, b) for a in SUPPORTED_VERSIONS for b in SUPPORTED_VERSIONS}
    assert {entry["version"] for entry in table["repartition"]} == set(SUPPORTED_VERSIONS)
    assert version_table.render(table) in SHOWN_IN.read_text(), "regenerate the docs' table from the data"


@pytest.mark.slow
def test_the_downgrade_cell_measures_again_as_the_table_says(tmp_path: Path) -> None:
    """A real savepoint-like checkpoint written by 4.3.0 and resumed by 4.2.0, as the script does it."""
    settings = Settings.from_env(home=tmp_path / "home")
    folder, created = tmp_path / "input", tmp_path / "created-4.3.0"
    result = version_table._probe(settings, "4.3.0", "create", folder, created / "checkpoint")
    assert result.returncode == 0, result.stderr[-2000:]
    shutil.copytree(folder, created / "input")
    measured = version_table.measure_cell(settings, created, "4.2.0", tmp_path)
    assert measured["outcome"] == version_table.cell("4.3.0", "4.2.0")["outcome"], measured


def test_a_pair_the_table_marks_refused_is_refused_up_front_with_the_reason(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    table = tmp_path / "version_table.json"
    table.write_text(json.dumps({"measured_at": "2026-11-22", "cells": [
        {"created_with": "4.3.0", "resumed_with": "4.2.0", "outcome": "refused",
         "reason": "[STATE_STORE_UNSUPPORTED_OPERATION] format version 2"}]}))
    monkeypatch.setattr(version_table, "TABLE", table)
    refusal = (r"move of job clicks.*state written by Spark 4\.3\.0 was refused when Spark 4\.2\.0 resumed it"
               r".*format version 2.*resume it on Spark 4\.3\.0")
    with pytest.raises(ChangeoverError, match=refusal):
        version_table.require_resumable("4.3.0", "4.2.0", "move of job clicks")
    version_table.require_resumable("4.2.0", "4.3.0", "move of job clicks")  # not in this table: allowed
    version_table.require_resumable("4.3.0", "4.3.0", "move of job clicks")  # the same version
