"""Spark runtimes: one virtual environment per Spark version, found by version."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from changeover.errors import ChangeoverError

SUPPORTED_VERSIONS = ("4.2.0", "4.2.1", "4.3.0")
# What a runtime needs besides pyspark: the driver's registry access and pandas for collect().
RUNTIME_EXTRAS = ("sqlalchemy==2.1.9", "psycopg[binary]==3.3.9")
# The work whose classes a runtime's class archive holds: a batch aggregation and a stateful streaming query.
ARCHIVE_WORK = """
import pathlib, tempfile
from pyspark.sql import SparkSession
spark = (SparkSession.builder.master("local[1]").config("spark.ui.enabled", "false")
         .config("spark.sql.shuffle.partitions", "1").getOrCreate())
spark.range(1000).selectExpr("id % 3 AS k").groupBy("k").count().collect()
root = pathlib.Path(tempfile.mkdtemp())
(root / "in").mkdir()
(root / "in" / "a.json").write_text('{"k": "a"}\\n')
stream = spark.readStream.schema("k string").json(str(root / "in")).groupBy("k").count()
query = (stream.writeStream.outputMode("update").format("memory").queryName("archive")
         .option("checkpointLocation", str(root / "cp")).trigger(availableNow=True).start())
query.awaitTermination()
spark.stop()
"""
# Kept quiet: a JVM whose classpath or Java differ from the archive's starts without it, as it would anyway.
QUIET_CDS = "-Xlog:cds=off -Xlog:cds+dynamic=off"


@dataclass(frozen=True)
class Runtime:
    version: str
    root: Path

    @property
    def python(self) -> Path:
        return self.root / "bin" / "python"

    @property
    def spark_home(self) -> Path:
        python = f"python{sys.version_info.major}.{sys.version_info.minor}"
        return self.root / "lib" / python / "site-packages" / "pyspark"

    @property
    def spark_class(self) -> Path:
        return self.spark_home / "bin" / "spark-class"

    @property
    def class_archive(self) -> Path:
        """The JDK's class data sharing archive of this runtime's Spark classes (made by `install_runtime`)."""
        return self.root / "spark-classes.jsa"

    @property
    def _archive_java(self) -> Path:
        """The Java the archive was made with: written last, so an archive without it is not used."""
        return self.root / "spark-classes.java"

    def java_options(self, inherited: str | None, java: Path) -> str:
        """JAVA_TOOL_OPTIONS for a JVM of this runtime run by `java` (a JAVA_HOME): the inherited ones, then its class
        archive where it has one made with that Java. Mapped instead of parsed and verified, Spark's classes cost a
        JVM's start about half its CPU time (a local SQL job: 4.1 s of CPU instead of 7.8 s on 2 cores)."""
        parts = [inherited] if inherited else []
        if self.archive_made_with(java):
            parts += [f"-XX:SharedArchiveFile={self.class_archive}", QUIET_CDS]
        return " ".join(parts)

    def java_env(self, java: Path) -> dict[str, str]:
        """JAVA_HOME and JAVA_TOOL_OPTIONS for a JVM of this runtime (the latter left out when empty: set, even
        empty, it makes every JVM say so on stderr)."""
        options = self.java_options(os.environ.get("JAVA_TOOL_OPTIONS"), java)
        return {"JAVA_HOME": str(java), **({"JAVA_TOOL_OPTIONS": options} if options else {})}

    def archive_made_with(self, java: Path) -> bool:
        # JAVA_TOOL_OPTIONS splits on spaces: a path holding one would be an unknown option to every JVM
        return (" " not in str(self.class_archive) and self.class_archive.exists() and self._archive_java.exists()
                and self._archive_java.read_text() == java_identity(java))


def java_identity(java: Path) -> str:
    """Which Java a JAVA_HOME is: its path and the version its release file names."""
    release = java / "release"
    version = next((line for line in release.read_text(errors="replace").splitlines()
                    if line.startswith("JAVA_VERSION=")), "") if release.exists() else ""
    return f"{java} {version}".strip()


def check_version(version: str) -> str:
    if version not in SUPPORTED_VERSIONS:
        raise ChangeoverError(
            f"Spark version {version!r}",
            f"it is not a version Changeover knows (known: {', '.join(SUPPORTED_VERSIONS)})",
            "pick one of the known versions",
        )
    return version


def installed_versions(runtimes_dir: Path) -> list[str]:
    return [v for v in SUPPORTED_VERSIONS if Runtime(v, runtimes_dir / f"spark-{v}").spark_class.exists()]


def find_runtime(runtimes_dir: Path, version: str) -> Runtime:
    check_version(version)
    runtime = Runtime(version, runtimes_dir / f"spark-{version}")
    if not runtime.spark_class.exists():
        raise ChangeoverError(
            f"Spark runtime {version}",
            f"it is not installed under {runtimes_dir}",
            f"install it with `changeover runtime install {version}` (or `make runtimes`)",
        )
    return runtime


def install_runtime(runtimes_dir: Path, version: str) -> Runtime:
    """Create a venv holding pyspark==version, and its class archive. Idempotent: what is there is left as it is."""
    check_version(version)
    runtime = Runtime(version, runtimes_dir / f"spark-{version}")
    if not runtime.spark_class.exists():
        _install_pyspark(runtime)
    build_class_archive(find_runtime(runtimes_dir, version))
    return runtime


def build_class_archive(runtime: Runtime) -> bool:
    """Record the classes a small Spark job loads in the runtime's archive (the JDK's dynamic class data sharing),
    for every JVM of that runtime to map at its start. Made again when the Java changed; a dump that failed with
    this Java is not tried again (remove spark-classes.failed to retry). Without an archive, JVMs start as they
    would. True if the runtime has one for the current Java."""
    java = java_home()
    if runtime.archive_made_with(java):
        return True
    failed = runtime.root / "spark-classes.failed"
    if " " in str(runtime.class_archive) or (failed.exists() and failed.read_text() == java_identity(java)):
        return False
    partial = runtime.root / f"spark-classes.{os.getpid()}.partial"  # two installs at once dump apart
    env = {**os.environ, "JAVA_HOME": str(java), "SPARK_HOME": str(runtime.spark_home),
           "SPARK_LOCAL_IP": "127.0.0.1", "PYSPARK_PYTHON": str(runtime.python),
           # the driver's JVM alone dumps: spark-class's launcher JVM, on a shorter classpath, must not
           "PYSPARK_SUBMIT_ARGS": f"--driver-java-options -XX:ArchiveClassesAtExit={partial} pyspark-shell"}
    env.pop("PYTHONPATH", None)
    try:
        done = subprocess.run([str(runtime.python), "-c", ARCHIVE_WORK], env=env, capture_output=True, timeout=900,
                              stdin=subprocess.DEVNULL)
        ok = done.returncode == 0 and partial.exists()
    except subprocess.TimeoutExpired:
        ok = False
    if not ok:
        partial.unlink(missing_ok=True)
        failed.write_text(java_identity(java))
        return False
    runtime._archive_java.unlink(missing_ok=True)
    partial.replace(runtime.class_archive)
    runtime._archive_java.write_text(java_identity(java))
    failed.unlink(missing_ok=True)
    return True


def _install_pyspark(runtime: Runtime) -> None:
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(runtime.root)], check=True)
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    packages = [f"pyspark=={runtime.version}", *RUNTIME_EXTRAS]
    if uv:
        cmd = [uv, "pip", "install", "--quiet", "--python", str(runtime.python), *packages]
    else:
        cmd = [str(runtime.python), "-m", "pip", "install", "--quiet", *packages]
    subprocess.run(cmd, check=True)


def java_home() -> Path:
    """The Java 17+ installation Spark will use, or a clear error saying what to install."""
    candidates = [os.environ.get("JAVA_HOME")]
    java = shutil.which("java")
    if java:
        candidates.append(str(Path(os.path.realpath(java)).parent.parent))
    for home in filter(None, candidates):
        binary = Path(home) / "bin" / "java"
        if not binary.exists():
            continue
        out = subprocess.run([str(binary), "-version"], capture_output=True, text=True).stderr
        match = re.search(r'version "(\d+)', out)
        if match and int(match.group(1)) >= 17:
            return Path(home)
    raise ChangeoverError(
        "Java",
        "Spark 4 needs Java 17 or newer and none was found on PATH or in JAVA_HOME",
        "install it (Debian/Ubuntu: `apt-get install openjdk-17-jre-headless`) or set JAVA_HOME",
    )
