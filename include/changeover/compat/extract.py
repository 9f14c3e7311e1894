"""The new code's stage plans, read inside the runtime of the Spark version the job will run on."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path
from typing import Any
from urllib.parse import urlparse

from changeover.cluster.runtimes import find_runtime, java_home
from changeover.cluster.shipping import JobCode, runtime_artifacts, store_job_code
from changeover.cluster.spark_settings import SparkSettings
from changeover.compat.describe_job import MARKER
from changeover.errors import ChangeoverError
from changeover.settings import Settings


def shipped_code(settings: Settings, job: str, code: str) -> JobCode:
    """The job's code as a launch ships it; only streaming jobs have stages to check."""
    shipped = store_job_code(settings, job, code)
    if shipped.entry != "build":
        raise ChangeoverError(f"job code {code}", "it has no build(spark, ctx), so no streaming stages to check",
                              "check a streaming job; batch jobs keep no state between runs")
    return shipped


def in_runtime(settings: Settings, version: str, shipped: JobCode, entry: str, args: list[str],
               options: dict[str, Any], marker: str, what: str, timeout: float = 300) -> Any:
    """Run a `changeover.compat` entry module in the runtime's Python with the job's code and Spark settings
    on its path, as a driver has them; return the JSON it printed after `marker`."""
    runtime = find_runtime(settings.runtimes_dir, version)
    package, _ = runtime_artifacts(settings)
    code_path = shipped.artifact if shipped.artifact.suffix == ".zip" else shipped.artifact.parent
    spark = SparkSettings.from_options(options.get("spark") or {})
    confs = spark.confs()
    if spark.jars:
        confs["spark.jars"] = ",".join(spark.jars)
    if spark.packages:
        confs["spark.jars.packages"] = ",".join(spark.packages)
    command = [str(runtime.python), "-m", entry, "--module", shipped.module, "--options", json.dumps(options),
               *args, *(arg for key, value in confs.items() for arg in ("--conf", f"{key}={value}"))]
    with tempfile.TemporaryDirectory(prefix="changeover-py-files-") as loose:
        # the job's own --py-files, on the path as spark-submit puts them: a .py file by its folder, a zip as it is
        # (a remote URI, hdfs:// or http://, only the drivers fetch: the check builds without it)
        local = [urlparse(f).path if urlparse(f).scheme in ("file", "local") else f for f in spark.py_files
                 if urlparse(f).scheme in ("", "file", "local")]
        extra = [f for f in local if Path(f).suffix != ".py"]
        for f in local:
            if not Path(f).exists():
                raise ChangeoverError(f"py_files entry {f}", "no such file where the check runs",
                                      "give the path of a file this machine has, as spark-submit's --py-files")
            if Path(f).suffix == ".py":
                shutil.copy2(f, loose)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package), str(code_path), loose, *extra]),
               **runtime.java_env(java_home()), "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": str(runtime.python)}
        result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout, cwd=Path.cwd(),
                                stdin=subprocess.DEVNULL)
    found = [line for line in result.stdout.splitlines() if line.startswith(marker)]
    if result.returncode != 0 or not found:
        last = [line for line in result.stderr.splitlines() if line.strip()][-3:]
        raise ChangeoverError(f"{what} on Spark {version}", f"it failed: {' | '.join(last) or 'no output'}",
                              "run the job's build(spark, ctx) on a local session to see the whole error")
    return json.loads(found[-1].removeprefix(marker))


def describe_stages_of(settings: Settings, job: str, shipped: JobCode, options: dict[str, Any], version: str
                       ) -> dict[str, dict[str, Any]]:
    """Each stage's plan as `changeover.runtime.plan` describes it, from the job's code shipped as for a launch."""
    return in_runtime(settings, version, shipped, "changeover.compat.describe_job", ["--job", job], options,
                      MARKER, f"building the stages of job {job} ({shipped.module})")
