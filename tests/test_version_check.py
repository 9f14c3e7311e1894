"""The runtime wrapper refuses a Spark version other than the one it was launched for, before any batch."""

import os
import subprocess
from pathlib import Path

import pytest
from changeover.cluster import shipping
from changeover.cluster.runtimes import find_runtime, java_home
from changeover.registry.db import session_scope
from changeover.registry.models import Job, JobRun
from changeover.settings import Settings
from conftest import ONE_REGISTRY

pytestmark = [pytest.mark.slow, pytest.mark.parametrize("database_url", ONE_REGISTRY, indirect=True)]


def test_mismatched_spark_version_is_refused_before_any_batch(settings: Settings, tmp_path: Path) -> None:
    runtime = find_runtime(settings.runtimes_dir, "4.2.0")
    with session_scope(settings.database_url) as s:
        s.add(Job(name="clicks", module="jobs.clicks", fault_tolerant=True, block_shutdown=False,
                  options={"landing": str(tmp_path / "landing")}))
        s.flush()
        run = JobRun(job="clicks", spark_version="4.3.0", master_url="local[1]", state="SUBMITTED", progress={})
        s.add(run)
        s.flush()
        s.get(Job, "clicks").current_run_id = run_id = run.id
    checkpoints = tmp_path / "checkpoints"
    package, entry = shipping.runtime_artifacts(settings)  # as a launch ships it: no checkout on the path
    env = {**{k: v for k, v in os.environ.items() if k != "PYTHONPATH"}, **settings.as_env(),
           "PYSPARK_PYTHON": str(runtime.python), "JAVA_HOME": str(java_home()), "SPARK_HOME": str(runtime.spark_home)}
    result = subprocess.run(
        [str(runtime.spark_home / "bin" / "spark-submit"), "--master", "local[1]", "--conf", "spark.ui.enabled=false",
         "--py-files", str(package), str(entry), "--job", "clicks", "--run-id", str(run_id), "--module", "clicks",
         "--expected-version", "4.3.0", "--checkpoint-root", str(checkpoints)],
        env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 3
    # spark-submit forwards the Python driver's stderr to its own stdout.
    output = result.stdout + result.stderr
    assert "job clicks: refused to start on Spark 4.2.0: it was launched for the 4.3.0 version group" in output
    with session_scope(settings.database_url) as s:
        run = s.get(JobRun, run_id)
        assert run.state == "FAILED" and "refused to start on Spark 4.2.0" in run.error
        assert run.first_commit_at is None
    assert not list(checkpoints.rglob("commits/*")), "no batch may run on a mismatched version"
