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
    """Create a venv holding pyspark==version. Idempotent: an installed runtime is left as it is."""
    check_version(version)
    runtime = Runtime(version, runtimes_dir / f"spark-{version}")
    if runtime.spark_class.exists():
        return runtime
    subprocess.run([sys.executable, "-m", "venv", "--clear", str(runtime.root)], check=True)
    uv = shutil.which("uv", path=str(Path(sys.executable).parent)) or shutil.which("uv")
    packages = [f"pyspark=={version}", *RUNTIME_EXTRAS]
    if uv:
        cmd = [uv, "pip", "install", "--quiet", "--python", str(runtime.python), *packages]
    else:
        cmd = [str(runtime.python), "-m", "pip", "install", "--quiet", *packages]
    subprocess.run(cmd, check=True)
    return find_runtime(runtimes_dir, version)


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
