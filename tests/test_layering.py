"""The floors of docs/architecture.md: an import only ever goes down a floor."""
from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OURS = {"prefixlb", "bench", "router", "worker", "kernels", "protocol"}
ALLOWED = {
    "prefixlb": OURS,
    "bench": {"bench", "router", "worker", "kernels", "protocol"},
    "router": {"router", "kernels", "protocol"},
    "worker": {"worker", "kernels", "protocol"},
    "kernels": {"kernels"},
    "protocol": {"protocol"},
}


def _imported_packages(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module.split(".")[0])
    return found & OURS


def test_every_import_goes_down_a_floor():
    violations = []
    for package, allowed in ALLOWED.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            for imported in sorted(_imported_packages(path) - allowed):
                violations.append(f"{path.relative_to(ROOT)} imports {imported}")
    assert violations == []


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


# Inside a package, the sub-floors: the engine runs without the server (the simulator and the
# benchmarks drive it directly), and routing is pure (the simulator makes a million decisions).
FORBIDDEN_WITHIN = {
    "worker/engine": ("worker.server", "aiohttp", "redis"),
    "worker/simulator": ("worker.server", "aiohttp", "redis"),
    "router/routing": ("router.http", "router.fleet", "router.state", "router.context", "aiohttp", "redis"),
}


def _forbidden(module: str, prefixes: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def test_the_engine_never_imports_the_server_and_routing_never_does_io():
    violations = []
    for folder, prefixes in FORBIDDEN_WITHIN.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            for module in sorted(m for m in _imported_modules(path) if _forbidden(m, prefixes)):
                violations.append(f"{path.relative_to(ROOT)} imports {module}")
    assert violations == []
