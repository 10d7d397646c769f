"""The packages import one way: tools (load_tests, cluster, examples, tests) -> deployments ->
router -> batcher. An import running back up fails here, naming the file and the import."""

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
FLOORS = ["batcher", "router", "deployments"]  # each may import only the floors before it
TOOLS = {"load_tests", "cluster", "examples", "tests"}


def imported_packages(path: Path):
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            yield from ((a.name.split(".")[0], node.lineno) for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module.split(".")[0], node.lineno


@pytest.mark.parametrize("package", FLOORS)
def test_imports_run_one_way(package):
    allowed = set(FLOORS[: FLOORS.index(package) + 1])
    forbidden = (set(FLOORS) | TOOLS) - allowed
    wrong = [
        f"{p.relative_to(ROOT)}:{line} imports {name}"
        for p in sorted((ROOT / package).rglob("*.py"))
        for name, line in imported_packages(p)
        if name in forbidden
    ]
    assert not wrong, "\n".join(wrong)
