"""The layering rules of DESIGN.md, checked on the source."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "jobs_server"


def imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(), filename=str(path))
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            modules.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            modules.add(node.module)
    return modules


def _top_level(module: str) -> str:
    return module.split(".")[0]


@pytest.mark.parametrize(("folder", "forbidden"), [("routes", "ray"), ("manager", "aiohttp")])
def test_layers_do_not_import_across(folder: str, forbidden: str) -> None:
    files = sorted((PACKAGE / folder).glob("*.py"))
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
