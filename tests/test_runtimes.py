"""A runtime's class archive: handed to its JVMs where it exists, and mapped by them."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest
from changeover.cluster.runtimes import QUIET_CDS, Runtime, find_runtime, java_home, java_identity
from changeover.settings import Settings


def test_a_runtime_hands_its_class_archive_to_its_jvms_only_where_it_has_one_made_by_their_java(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime, java, other = Runtime("4.2.0", tmp_path / "spark-4.2.0"), tmp_path / "jdk-17", tmp_path / "jdk-21"
    for home, version in ((java, "17.0.15"), (other, "21.0.2")):
        home.mkdir()
        (home / "release").write_text(f'IMPLEMENTOR="x"\nJAVA_VERSION="{version}"\n')
    assert runtime.java_options("-XX:+UseSerialGC", java) == "-XX:+UseSerialGC"
    monkeypatch.delenv("JAVA_TOOL_OPTIONS", raising=False)
    assert runtime.java_env(java) == {"JAVA_HOME": str(java)}  # no empty JAVA_TOOL_OPTIONS: JVMs would say so
    runtime.root.mkdir()
    runtime.class_archive.write_bytes(b"made by install_runtime")
    assert runtime.java_options("-XX:+UseSerialGC", java) == "-XX:+UseSerialGC"  # no record of its Java: unfinished
    (runtime.root / "spark-classes.java").write_text(java_identity(java))
    assert runtime.java_options("-XX:+UseSerialGC", java) == (
        f"-XX:+UseSerialGC -XX:SharedArchiveFile={runtime.class_archive} {QUIET_CDS}")
    assert runtime.java_options(None, other) == ""  # another Java would ignore it: not handed over


def test_a_spark_jvm_of_the_runtime_maps_its_classes_from_the_archive(tmp_path: Path) -> None:
    """Under the tests' own JVM flags (C1, the serial collector), which differ from the archive's dump."""
    runtime = find_runtime(Settings.from_env(home=tmp_path).runtimes_dir, "4.2.0")
    assert runtime.archive_made_with(java_home()), "make runtimes (changeover runtime install) makes it"
    loaded = tmp_path / "classes.log"
    java = java_home()
    options = runtime.java_options(os.environ.get("JAVA_TOOL_OPTIONS"), java) + f" -Xlog:class+load=info:file={loaded}"
    env = {**os.environ, "JAVA_HOME": str(java), "SPARK_HOME": str(runtime.spark_home), "JAVA_TOOL_OPTIONS": options}
    done = subprocess.run([str(runtime.spark_class), "org.apache.spark.deploy.SparkSubmit", "--version"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "version 4.2.0" in done.stdout + done.stderr
    lines = loaded.read_text().splitlines()
    shared = [line for line in lines if "shared objects file (top)" in line]  # the runtime's archive, not the JDK's
    from_jars = [line for line in lines if "source: jar:" in line or "source: file:" in line]
    assert len(shared) > 500 and len(shared) > 5 * len(from_jars), (len(shared), len(from_jars))
