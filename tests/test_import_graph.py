"""The core's modules import each other without a cycle, function-level imports included: a cycle hidden in a
function still ties two modules into one, and breaks the first time someone moves the import up."""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "include" / "changeover"


def _module_name(path: Path) -> str:
    parts = path.relative_to(CORE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _type_checking_only(tree: ast.Module) -> set[int]:
    """Line numbers of imports under `if TYPE_CHECKING:`, which never run."""
    lines: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            for inner in node.body:
                lines.update(n.lineno for n in ast.walk(inner) if isinstance(n, ast.Import | ast.ImportFrom))
    return lines


def import_graph() -> dict[str, set[str]]:
    """Each core module's imports of other core modules, wherever in the module they are written."""
    paths = {_module_name(p): p for p in CORE.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in paths.items():
        tree = ast.parse(path.read_text(), str(path))
        skipped = _type_checking_only(tree)
        found: set[str] = set()
        for node in ast.walk(tree):
            if getattr(node, "lineno", None) in skipped:
                continue
            if isinstance(node, ast.Import):
                found.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                # `from package import module` names the module; the package's own import is Python's, not its
                for alias in node.names:
                    submodule = f"{node.module}.{alias.name}"
                    found.add(submodule if submodule in paths else node.module)
        graph[name] = {m for m in found if m in paths and m != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for target in sorted(graph[node]):
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_checker_finds_a_cycle_through_a_function_level_import() -> None:
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_core_has_no_import_cycle() -> None:
    graph = import_graph()
    assert "changeover.jobs" in graph and "changeover.registry.models" in graph["changeover.jobs"]
    assert cycles(graph) == []


def test_only_the_cluster_package_names_its_local_backend() -> None:
    """The seam: operators, triggers, the CLI, the control plane and the benches get a `Membership` from
    `cluster.membership_for`, so a second backend plugs in at one place."""
    root = CORE.parents[1]
    naming = [str(p.relative_to(root)) for folder in ("include", "plugins", "dags", "bench")
              for p in (root / folder).rglob("*.py")
              if "LocalCluster" in p.read_text() and CORE / "cluster" not in p.parents]
    assert naming == []


def test_the_core_is_grouped_by_role() -> None:
    """Beside the few modules every role uses, each module lives in the folder of its role."""
    flat = sorted(p.stem for p in CORE.glob("*.py"))
    assert flat == ["__init__", "__main__", "audit", "errors", "faults", "names", "private_file", "settings",
                    "timeutil"]
    assert {p.name for p in CORE.iterdir() if p.is_dir() and p.name != "__pycache__"} == {
        "cli", "cluster", "compat", "handoff", "jobs", "light", "registry", "runtime", "savepoints", "upgrade"}


def test_what_runs_inside_a_spark_runtime_imports_with_only_the_runtimes_packages() -> None:
    """A driver's Python is a runtime's venv (pyspark, SQLAlchemy, psycopg): the driver and the compatibility
    probes must not pull in the control plane's packages (httpx, typer...) through a package's __init__."""
    import os
    import subprocess

    from changeover.cluster.runtimes import find_runtime
    from changeover.settings import Settings

    runtime = find_runtime(Settings.from_env().runtimes_dir, "4.2.0")
    for module in ("changeover.runtime.driver", "changeover.compat.describe_job", "changeover.compat.dry_run_job",
                   "changeover.compat.version_probe"):
        done = subprocess.run([str(runtime.python), "-c", f"import {module}"], capture_output=True, text=True,
                              env={**os.environ, "PYTHONPATH": str(CORE.parent)}, timeout=120)
        assert done.returncode == 0, f"{module}: {done.stderr.strip().splitlines()[-1:]}"
