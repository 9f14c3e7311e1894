"""The compatibility check builds a job inside the target runtime with the job's own Spark settings: a job whose
code imports a module it ships with `py_files` (spark-submit's --py-files) is built there as its driver builds it.
Found by the downtime benchmark's rolling upgrade through Airflow, whose check could not import such a module."""

from __future__ import annotations

from pathlib import Path

import pytest
from changeover.compat.extract import describe_stages_of, shipped_code
from changeover.errors import ChangeoverError
from changeover.settings import Settings
from conftest import ONE_REGISTRY

JOB = '''
from helper_queries import counts_of

from changeover.runtime import Files, Stage


def build(spark, ctx):
    return [Stage("counts", counts_of(spark, ctx.options["input"]), Files(ctx.options["output"], "parquet"))]
'''

HELPER = '''
def counts_of(spark, folder):
    return spark.readStream.schema("key string, ts timestamp").json(folder).withWatermark("ts", "10 seconds") \\
        .dropDuplicates(["key", "ts"])
'''


def _job(tmp_path: Path) -> tuple[Path, Path]:
    (tmp_path / "job").mkdir()
    (tmp_path / "lib").mkdir()
    (tmp_path / "input").mkdir()
    job, helper = tmp_path / "job" / "with_helper.py", tmp_path / "lib" / "helper_queries.py"
    job.write_text(JOB)
    helper.write_text(HELPER)
    return job, helper


@pytest.mark.slow
@pytest.mark.parametrize("database_url", ONE_REGISTRY, indirect=True)  # a check of Spark, not of the registry
def test_a_module_shipped_with_py_files_is_importable_where_the_check_builds_the_job(settings: Settings,
                                                                                      tmp_path: Path) -> None:
    job, helper = _job(tmp_path)
    options = {"input": str(tmp_path / "input"), "output": str(tmp_path / "output"),
               "spark": {"py_files": [str(helper)]}}

    plans = describe_stages_of(settings, "helped", shipped_code(settings, "helped", str(job)), options, "4.2.0")

    assert set(plans) == {"counts"}


def test_a_missing_py_file_is_refused_by_name(settings: Settings, tmp_path: Path) -> None:
    job, _ = _job(tmp_path)
    options = {"input": str(tmp_path / "input"), "spark": {"py_files": [str(tmp_path / "lib" / "gone.py")]}}

    with pytest.raises(ChangeoverError, match=r"py_files entry .*gone.py: no such file where the check runs"):
        describe_stages_of(settings, "helped", shipped_code(settings, "helped", str(job)), options, "4.2.0")
