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
    assert "changeover.jobs.launching" in graph and "changeover.registry.models" in graph["changeover.jobs.launching"]
    assert cycles(graph) == []


# The few flat modules every role uses, one package here; the audit is apart, above the registry it writes to.
BASE = ("errors", "faults", "names", "private_file", "settings", "timeutil")
# Each package imports only packages of the layers before its own (docs/architecture.md, "Layers").
LAYERS: list[set[str]] = [
    {"base"},
    {"registry"},
    {"audit"},
    {"cluster", "handoff"},
    {"runtime"},
    {"savepoints"},
    {"compat"},
    {"jobs", "light"},
    {"upgrade", "housekeeping"},
    {"cli"},
]


def _package(module: str) -> str:
    """The package a core module belongs to: its folder, `base` for the flat modules every role uses, and `cli`
    for `python -m changeover`."""
    parts = module.split(".")
    if len(parts) == 1 or parts[1] in BASE:
        return "base"
    return "cli" if parts[1] == "__main__" else parts[1]


def package_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """The module graph collapsed to packages: each package's imports of other packages."""
    packages: dict[str, set[str]] = {}
    for module, imported in graph.items():
        source = _package(module)
        packages.setdefault(source, set()).update(_package(m) for m in imported)
    return {package: imported - {package} for package, imported in packages.items()}


def upward_imports(packages: dict[str, set[str]], layers: list[set[str]]) -> list[str]:
    """Each import of a package from its own layer or one above it."""
    layer = {package: i for i, members in enumerate(layers) for package in members}
    return [f"{source} -> {target}" for source, imported in sorted(packages.items()) for target in sorted(imported)
            if layer[target] >= layer[source]]


def test_the_layer_check_finds_an_import_that_looks_up() -> None:
    layers = [{"low"}, {"mid", "side"}, {"high"}]
    assert upward_imports({"low": set(), "mid": {"low"}, "side": {"low"}, "high": {"mid", "side"}}, layers) == []
    assert upward_imports({"low": {"high"}, "mid": {"side"}, "side": set(), "high": set()}, layers) == [
        "low -> high", "mid -> side"]
    assert package_graph({"changeover.a.x": {"changeover.b.y", "changeover.a.z"}, "changeover.a.z": set(),
                          "changeover.b.y": {"changeover.errors"}, "changeover.errors": set()}) == {
        "a": {"b"}, "b": {"base"}, "base": set()}


def test_the_core_s_packages_import_each_other_in_layers() -> None:
    """Packages that only look down: no two packages import each other, however indirectly (function-level imports
    included), and each imports only packages of the layers below its own."""
    packages = package_graph(import_graph())
    assert cycles(packages) == []
    assert sorted(set().union(*LAYERS)) == sorted(packages), "each package sits in exactly one layer"
    assert sum(len(members) for members in LAYERS) == len(packages)
    assert upward_imports(packages, LAYERS) == []


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
        "cli", "cluster", "compat", "handoff", "housekeeping", "jobs", "light", "registry", "runtime", "savepoints",
        "upgrade"}


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
