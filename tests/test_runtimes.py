"""A runtime's class archive: handed to its JVMs where it exists, and mapped by them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

from changeover.cluster.runtimes import QUIET_CDS, Runtime, find_runtime, java_home
from changeover.settings import Settings


def test_a_runtime_hands_its_class_archive_to_its_jvms_only_where_it_has_one(tmp_path: Path) -> None:
    runtime = Runtime("4.2.0", tmp_path / "spark-4.2.0")
    assert runtime.java_options("-XX:+UseSerialGC") == "-XX:+UseSerialGC"
    assert runtime.java_options(None) == ""
    runtime.root.mkdir()
    runtime.class_archive.write_bytes(b"made by install_runtime")
    assert runtime.java_options("-XX:+UseSerialGC") == (
        f"-XX:+UseSerialGC -XX:SharedArchiveFile={runtime.class_archive} {QUIET_CDS}")


def test_a_spark_jvm_of_the_runtime_maps_its_classes_from_the_archive(tmp_path: Path) -> None:
    """Under the tests' own JVM flags (C1, the serial collector), which differ from the archive's dump."""
    runtime = find_runtime(Settings.from_env(home=tmp_path).runtimes_dir, "4.2.0")
    assert runtime.class_archive.exists(), "make runtimes (changeover runtime install) makes it"
    loaded = tmp_path / "classes.log"
    options = runtime.java_options(os.environ.get("JAVA_TOOL_OPTIONS")) + f" -Xlog:class+load=info:file={loaded}"
    env = {**os.environ, "JAVA_HOME": str(java_home()), "SPARK_HOME": str(runtime.spark_home),
           "JAVA_TOOL_OPTIONS": options}
    done = subprocess.run([str(runtime.spark_class), "org.apache.spark.deploy.SparkSubmit", "--version"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "version 4.2.0" in done.stdout + done.stderr
    lines = loaded.read_text().splitlines()
    shared = [line for line in lines if "shared objects file (top)" in line]  # the runtime's archive, not the JDK's
    from_jars = [line for line in lines if "source: jar:" in line or "source: file:" in line]
    assert len(shared) > 500 and len(shared) > 5 * len(from_jars), (len(shared), len(from_jars))
