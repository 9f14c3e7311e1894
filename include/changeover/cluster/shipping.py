"""What a driver is shipped with: the job's code and Changeover's runtime, frozen as content-addressed artifacts.

A job's code is copied when the job is submitted, so that every later launch (a move, a resume) runs the code
that was submitted, whatever happens to the file afterwards. The driver finds both through `--py-files`,
never through the checkout.
"""

from __future__ import annotations

import ast
import hashlib
import importlib.util
import os
import shutil
import zipfile
from dataclasses import dataclass
from pathlib import Path

from changeover.errors import ChangeoverError
from changeover.settings import CHECKOUT, Settings

PACKAGE = CHECKOUT / "include" / "changeover"
ENTRY_SCRIPT = CHECKOUT / "include" / "changeover_driver.py"


@dataclass(frozen=True)
class JobCode:
    module: str  # the name the driver imports
    entry: str  # build (streaming stages) | run (a batch function) | script (an unchanged script)
    artifact: Path  # the file or zip shipped with --py-files


def _digest(files: list[Path], root: Path) -> str:
    sha = hashlib.sha256()
    for file in files:
        sha.update(str(file.relative_to(root)).encode() + b"\0" + file.read_bytes())
    return sha.hexdigest()[:16]


def _python_files(package: Path) -> list[Path]:
    return sorted(p for p in package.rglob("*.py") if "__pycache__" not in p.parts)


def _zip(package: Path, files: list[Path], target: Path) -> Path:
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = target.with_name(f".{target.name}.{os.getpid()}")
        with zipfile.ZipFile(staging, "w", zipfile.ZIP_DEFLATED) as archive:
            for file in files:
                archive.write(file, str(file.relative_to(package.parent)))
        os.replace(staging, target)  # whole or absent, also when two launches build it at once
    return target


def runtime_artifacts(settings: Settings) -> tuple[Path, Path]:
    """Changeover's package as a zip, and the driver's entry script, both under the artifact store."""
    files = _python_files(PACKAGE)
    digest = _digest(files, PACKAGE.parent)
    archive = _zip(PACKAGE, files, settings.home / "artifacts" / f"changeover-{digest}.zip")
    entry = archive.with_suffix(".py")
    if not entry.exists():
        shutil.copy2(ENTRY_SCRIPT, entry)
    return archive, entry


def _entry_of(source: Path) -> str:
    tree = ast.parse(source.read_text(), filename=str(source))
    functions = {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}
    return "build" if "build" in functions else "run" if "run" in functions else "script"


def _locate(code: str) -> Path:
    """A path to a .py file or a package folder, or a module importable by this process (e.g. jobs.clicks)."""
    path = Path(code).expanduser()
    if path.suffix == ".py" or os.sep in code or path.is_dir():
        if path.is_file() or (path.is_dir() and (path / "__init__.py").is_file()):
            return path.resolve()
        raise ChangeoverError(f"job code {code!r}", "no such Python file or package folder",
                              "pass the path of the job's .py file or package folder")
    try:
        spec = importlib.util.find_spec(code)
    except (ImportError, ValueError):
        spec = None
    if spec is None or spec.origin is None:
        raise ChangeoverError(f"job code {code!r}", "it is neither a file nor an importable module",
                              "pass the path of the job's .py file (anywhere), or a module such as jobs.clicks")
    origin = Path(spec.origin)
    return origin.parent if origin.name == "__init__.py" else origin


def store_job_code(settings: Settings, job: str, code: str) -> JobCode:
    """Freeze the job's code under the artifact store. The same code gives the same artifact."""
    source = _locate(code)
    store = settings.home / "artifacts" / "jobs" / job
    if source.is_dir():
        files = _python_files(source)
        artifact = _zip(source, files, store / _digest(files, source.parent) / f"{source.name}.zip")
        return JobCode(source.name, _entry_of(source / "__init__.py"), artifact)
    if not source.stem.isidentifier():
        raise ChangeoverError(f"job file {source}", "its name is not a Python module name",
                              f"rename it, e.g. to {''.join(c if c.isalnum() else '_' for c in source.stem)}.py")
    artifact = store / _digest([source], source.parent) / source.name
    if not artifact.exists():
        artifact.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(source, artifact)
    return JobCode(source.stem, _entry_of(source), artifact)
