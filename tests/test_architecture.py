"""The layering rules of docs/architecture.md (The shape), checked on the source."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jobs_server"


def imported_modules(path: Path, *, with_names: bool = False) -> set[str]:
    """Every module `path` imports; `with_names`: `from a import b` counts as `a.b` too."""
    tree = ast.parse(path.read_text(), filename=str(path))
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
            if with_names:
                modules.update(f"{node.module}.{alias.name}" for alias in node.names)
    return modules


def _top_level(module: str) -> str:
    return module.split(".")[0]


@pytest.mark.parametrize(
    ("folder", "forbidden"),
    [
        ("routes", "ray"),
        ("serving", "ray"),
        ("access", "ray"),
        ("webhooks", "ray"),
        ("manager", "aiohttp"),
    ],
)
def test_layers_do_not_import_across(folder: str, forbidden: str) -> None:
    files = sorted((PACKAGE / folder).rglob("*.py"))
    assert files
    offenders = {
        str(path.relative_to(PACKAGE)): sorted(
            module for module in imported_modules(path) if _top_level(module) == forbidden
        )
        for path in files
    }
    assert {path: found for path, found in offenders.items() if found} == {}


def test_the_import_checker_sees_imports(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("import ray.util\nfrom aiohttp import web\n")
    assert imported_modules(sample) == {"ray.util", "aiohttp"}


# What a worker node has: the standard library and Ray (`ray[default]` brings pydantic; Ray
# vendors psutil).
SUPERVISOR_MAY_IMPORT = {"ray", "pydantic", "psutil"}


def _jobs_server_imports(path: Path) -> set[Path]:
    files = set()
    for module in imported_modules(path):
        if _top_level(module) == "jobs_server":
            candidate = PACKAGE.parent / (module.replace(".", "/") + ".py")
            package = PACKAGE.parent / module.replace(".", "/") / "__init__.py"
            files.add(candidate if candidate.exists() else package)
    return files


def test_the_supervisor_needs_nothing_on_a_worker_node_but_ray() -> None:
    """The supervisor's code travels pickled by value to any node; what it imports must be
    there already."""
    seen: set[Path] = set()
    pending = [PACKAGE / "manager" / "supervisor" / "actor.py"]
    third_party: set[str] = set()
    while pending:
        path = pending.pop()
        if path in seen:
            continue
        seen.add(path)
        pending.extend(_jobs_server_imports(path))
        third_party |= {
            _top_level(module)
            for module in imported_modules(path)
            if _top_level(module) not in sys.stdlib_module_names
            and _top_level(module) not in {"jobs_server", "__future__"}
        }
    assert PACKAGE / "manager" / "logs.py" in seen  # the walk follows jobs_server imports
    assert third_party <= SUPERVISOR_MAY_IMPORT, third_party - SUPERVISOR_MAY_IMPORT


# What the supervisor's side (manager/supervisor/) may use of the rest of the package: the
# records and their store, the log files, and leaf rules. Never the server's side (the facade,
# the watchers, the archive, the queue's dispatcher, anything HTTP): a module added here is a
# decision, not an accident.
SUPERVISOR_MAY_USE = {
    "errors.py",
    "manager/__init__.py",
    "manager/records.py",
    "manager/limits.py",
    "manager/webhook_events.py",
    "manager/tenancy.py",
    "manager/logs.py",
    "manager/log_watch.py",
    "manager/packages.py",
    "manager/runtime_envs.py",
    "manager/runtime_env_failures.py",
    "manager/live/__init__.py",
    "manager/live/kv.py",
    "manager/live/store.py",
    "manager/queue/__init__.py",
    "manager/queue/retries.py",
    "manager/cluster/__init__.py",
    "manager/cluster/ray_metrics.py",
    # log_shipping.py holds both ends of a worker node's log: the spool, and the head's pull.
    "manager/supervisor_calls.py",
}


def _imported_closure(start: list[Path]) -> set[Path]:
    seen: set[Path] = set()
    pending = list(start)
    while pending:
        path = pending.pop()
        if path not in seen:
            seen.add(path)
            pending.extend(_jobs_server_imports(path))
    return seen


def test_the_supervisor_side_imports_nothing_of_the_server_side() -> None:
    supervisor_side = PACKAGE / "manager" / "supervisor"
    used = {
        str(path.relative_to(PACKAGE))
        for path in _imported_closure(sorted(supervisor_side.rglob("*.py")))
        if not path.is_relative_to(supervisor_side)
    }
    assert "manager/live/store.py" in used  # the walk sees what the supervisor shares
    assert used - SUPERVISOR_MAY_USE == set()


# The HTTP side and the wiring above the manager: the manager never reaches back up into them.
ABOVE_THE_MANAGER = {
    "jobs_server.app",
    "jobs_server.app_state",
    "jobs_server.api_models",
    "jobs_server.cli",
    "jobs_server.metrics",
    "jobs_server.settings",
    "jobs_server.routes",
    "jobs_server.serving",
    "jobs_server.access",
    # The webhooks' sender and policy: the archive writes deliveries through the planner it is
    # given, and never calls back up into them.
    "jobs_server.webhooks",
    "jobs_server.client",
    "jobs_server.web",
}


def _is_above_the_manager(module: str) -> bool:
    return any(module == top or module.startswith(f"{top}.") for top in ABOVE_THE_MANAGER)


def test_the_manager_never_imports_back_up() -> None:
    offenders = {
        str(path.relative_to(PACKAGE)): found
        for path in sorted((PACKAGE / "manager").rglob("*.py"))
        if (found := sorted(filter(_is_above_the_manager, imported_modules(path, with_names=True))))
    }
    assert offenders == {}


def test_the_upward_import_check_sees_the_http_side(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text("from jobs_server import app\nfrom jobs_server.serving.streams import x\n")
    assert sorted(filter(_is_above_the_manager, imported_modules(sample, with_names=True))) == [
        "jobs_server.app",
        "jobs_server.serving.streams",
        "jobs_server.serving.streams.x",
    ]


TESTS = PACKAGE.parent / "tests"
BENCHMARKS = PACKAGE.parent / "benchmarks"


def _is_test_module(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "tests" and len(parts) > 1 and parts[1].startswith(("test_", "conftest"))


def _is_tests_but_not_support(module: str) -> bool:
    parts = module.split(".")
    return parts[0] == "tests" and len(parts) > 1 and parts[1] != "support"


def test_tests_and_benchmarks_share_only_tests_support() -> None:
    """No module imports a test module or conftest (pytest loads those), and benchmarks import
    from tests/ only tests/support: what they share lives there."""
    offenders = {}
    for path in sorted([*TESTS.rglob("*.py"), *BENCHMARKS.rglob("*.py")]):
        in_benchmarks = path.is_relative_to(BENCHMARKS)
        found = sorted(
            {
                ".".join(module.split(".")[:2])
                for module in imported_modules(path, with_names=True)
                if _is_test_module(module) or (in_benchmarks and _is_tests_but_not_support(module))
            }
        )
        if found:
            offenders[str(path.relative_to(PACKAGE.parent))] = found
    assert offenders == {}


def test_the_shared_import_checker_sees_test_modules(tmp_path: Path) -> None:
    sample = tmp_path / "sample.py"
    sample.write_text(
        "from tests import conftest\nimport tests.test_logs\nfrom tests.support import x\n"
    )
    assert {
        module for module in imported_modules(sample, with_names=True) if _is_test_module(module)
    } == {
        "tests.conftest",
        "tests.test_logs",
    }
