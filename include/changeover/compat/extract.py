"""The new code's stage plans, read inside the runtime of the Spark version the job will run on."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path
from typing import Any

from changeover.compat.describe_job import MARKER
from changeover.errors import ChangeoverError
from changeover.runtimes import find_runtime, java_home
from changeover.settings import Settings
from changeover.shipping import runtime_artifacts, store_job_code
from changeover.spark_settings import SparkSettings


def stage_plans(settings: Settings, job: str, code: str, options: dict[str, Any], version: str
                ) -> dict[str, dict[str, Any]]:
    """Each stage's plan as `changeover.compat.plan` describes it, from the job's code shipped as for a launch."""
    runtime = find_runtime(settings.runtimes_dir, version)
    package, _ = runtime_artifacts(settings)
    shipped = store_job_code(settings, job, code)
    if shipped.entry != "build":
        raise ChangeoverError(f"job code {code}", "it has no build(spark, ctx), so no streaming stages to check",
                              "check a streaming job; batch jobs keep no state between runs")
    code_path = shipped.artifact if shipped.artifact.suffix == ".zip" else shipped.artifact.parent
    confs = SparkSettings.from_options(options.get("spark") or {}).confs()
    command = [str(runtime.python), "-m", "changeover.compat.describe_job", "--job", job, "--module",
               shipped.module, "--options", json.dumps(options),
               *(arg for key, value in confs.items() for arg in ("--conf", f"{key}={value}"))]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(package), str(code_path)]),
           "JAVA_HOME": str(java_home()), "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": str(runtime.python)}
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300, cwd=Path.cwd())
    found = [line for line in result.stdout.splitlines() if line.startswith(MARKER)]
    if result.returncode != 0 or not found:
        last = [line for line in result.stderr.splitlines() if line.strip()][-3:]
        raise ChangeoverError(f"the stages of job {job} ({code}) on Spark {version}",
                              f"building them failed: {' | '.join(last) or 'no output'}",
                              "run the job's build(spark, ctx) on a local session to see the whole error")
    return json.loads(found[-1].removeprefix(MARKER))
