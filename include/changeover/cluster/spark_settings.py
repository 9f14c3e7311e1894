"""Per-job Spark settings: resources, shuffle partitions, extra confs, and code or jars shipped with the job.

Kept in the job's options under "spark", so a move or resume launches the job as it was submitted.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from changeover.errors import ChangeoverError

_MEMORY = re.compile(r"^\d+[kmgt]?$", re.IGNORECASE)
# Set by Changeover itself: a job that overrode them would break the launch or the version check.
RESERVED = ("spark.master", "spark.submit.deployMode", "spark.pyspark.python", "spark.app.name")


@dataclass(frozen=True)
class SparkSettings:
    executor_cores: int = 1
    executor_memory: str = "1g"
    driver_memory: str = "1g"
    cores_max: int | None = None  # default: one executor's cores
    shuffle_partitions: int = 4
    extra_confs: dict[str, str] = field(default_factory=dict)
    py_files: tuple[str, ...] = ()
    jars: tuple[str, ...] = ()
    packages: tuple[str, ...] = ()  # Maven coordinates; the runtime must be able to reach a repository

    @classmethod
    def from_options(cls, options: dict[str, Any]) -> SparkSettings:
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(options) - known)
        if unknown:
            raise ChangeoverError(f"Spark settings {', '.join(unknown)}", "Changeover does not know them",
                                  f"use {', '.join(sorted(known))}, or pass a Spark conf with extra_confs")
        values = {k: tuple(v) if k in ("py_files", "jars", "packages") else v for k, v in options.items()}
        settings = cls(**values)
        settings.check()
        return settings

    def check(self) -> None:
        for name in ("executor_memory", "driver_memory"):
            if not _MEMORY.match(str(getattr(self, name))):
                raise ChangeoverError(f"{name} {getattr(self, name)!r}", "it is not a JVM memory size",
                                      "write it as Spark does, e.g. 512m or 2g")
        if self.executor_cores < 1 or self.shuffle_partitions < 1 or (self.cores_max or 1) < self.executor_cores:
            raise ChangeoverError(f"cores {self.executor_cores}, cores_max {self.cores_max}, shuffle partitions "
                                  f"{self.shuffle_partitions}", "each must be at least 1, and cores_max at least "
                                  "one executor's cores", "pass positive numbers")
        clash = sorted(set(self.extra_confs) & set(RESERVED))
        if clash:
            raise ChangeoverError(f"Spark conf {', '.join(clash)}", "Changeover sets it for every launch",
                                  "leave it out; Changeover picks the master and the Python of the version group")

    def confs(self) -> dict[str, str]:
        return {
            "spark.executor.cores": str(self.executor_cores),
            "spark.executor.memory": self.executor_memory,
            "spark.cores.max": str(self.cores_max or self.executor_cores),
            "spark.sql.shuffle.partitions": str(self.shuffle_partitions),
            **{k: str(v) for k, v in self.extra_confs.items()},
        }

    def submit_args(self, shipped: list[str]) -> list[str]:
        """spark-submit's own options: the job's code and Changeover's runtime first, then the job's extras."""
        args = ["--py-files", ",".join([*shipped, *self.py_files])]
        if self.jars:
            args += ["--jars", ",".join(self.jars)]
        if self.packages:
            args += ["--packages", ",".join(self.packages)]
        return args
