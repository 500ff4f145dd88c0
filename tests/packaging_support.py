"""Support for the packaging tests: what the package declares, and what the code imports.

The declared side is read from the wheel metadata that setuptools (the build backend of
pyproject.toml) writes for this checkout, not from pyproject.toml's text, so the extras are the
ones ``pip install prefixlb[...]`` would see. Requirement sets are closed over the metadata of the
distributions installed here (the ones the suite runs with). The imported side is read two ways:
statically (every ``import`` statement, lazy ones in functions included) and dynamically (the
distributions a fresh interpreter loads when importing a module).
"""
from __future__ import annotations

import ast
import email.parser
import functools
import importlib.metadata as md
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import Requirement

from tests.support import ROOT

OUR_PACKAGES = frozenset({"prefixlb", "protocol", "router", "worker", "kernels", "bench"})
# What `pip install prefixlb` asks for: the router's dependencies.
BASE = ("aiohttp", "jsonschema", "prometheus-client", "pyyaml", "redis", "uhashring", "uvloop", "xxhash")
# Nothing of these may come with the base install: the engine's, the benchmarks', Kubernetes'.
NOT_IN_BASE = frozenset({"torch", "triton", "numpy", "safetensors", "tokenizers", "jinja2",
                         "matplotlib", "tqdm", "kubernetes", "transformers"})
# Imported only when installed (``try: import ... except ImportError``), and not installed in the
# images: the kubernetes client's dynamic module uses kubernetes-validate if it finds it (our tests
# install it).
OPTIONAL_IMPORTS = frozenset({"kubernetes_validate"})


def normalize(name: str) -> str:
    """A distribution name as PEP 503 compares them (``PyYAML`` = ``pyyaml``, ``a_b`` = ``a-b``)."""
    return re.sub(r"[-_.]+", "-", name).lower()


@functools.lru_cache(maxsize=1)
def built_metadata() -> email.message.Message:
    """The METADATA of the wheel this checkout builds (setuptools' PEP 517 metadata hook).

    Built from a copy of pyproject.toml and README.md, so no ``*.egg-info`` lands in the checkout.
    """
    with tempfile.TemporaryDirectory(prefix="prefixlb-metadata-") as tmp:
        src, out = Path(tmp, "src"), Path(tmp, "out")
        src.mkdir()
        out.mkdir()
        for name in ("pyproject.toml", "README.md"):
            shutil.copy(ROOT / name, src / name)
        code = ("import sys, setuptools.build_meta as backend\n"
                "print(backend.prepare_metadata_for_build_wheel(sys.argv[1]))\n")
        proc = subprocess.run([sys.executable, "-c", code, str(out)], cwd=src, capture_output=True,
                              text=True, timeout=120)
        assert proc.returncode == 0, proc.stderr[-3000:]
        dist_info = out / proc.stdout.split()[-1]
        return email.parser.Parser().parsestr((dist_info / "METADATA").read_text())


def declared_requirements(extras: tuple[str, ...] = ()) -> list[Requirement]:
    """What ``pip install prefixlb[extras]`` asks for directly: the base requirements and those
    of each extra, with an extra's references to other extras (``prefixlb[worker]``) expanded."""
    meta = built_metadata()
    own = normalize(meta["Name"])
    reqs = [Requirement(line) for line in meta.get_all("Requires-Dist") or []]
    out, done, todo = [], set(), ["", *extras]
    while todo:
        extra = todo.pop()
        if extra in done:
            continue
        done.add(extra)
        for req in reqs:
            if not _belongs(req, extra):
                continue
            if normalize(req.name) == own:
                todo.extend(req.extras)
            else:
                out.append(req)
    return out


def _belongs(req: Requirement, extra: str) -> bool:
    """Whether ``req`` is a base requirement (``extra`` empty) or one of ``extra``'s, on this platform."""
    marker = req.marker
    if marker is None or "extra" not in str(marker):
        return extra == "" and (marker is None or marker.evaluate({"extra": ""}))
    return extra != "" and marker.evaluate({"extra": extra})


def provided_extras() -> set[str]:
    """The extras the wheel declares (``Provides-Extra``)."""
    return set(built_metadata().get_all("Provides-Extra") or [])


def closure(requirements: list[Requirement]) -> set[str]:
    """Normalized names of the distributions installing ``requirements`` (already chosen for this
    platform, as :func:`declared_requirements` gives them) brings in, resolved over the metadata
    of what is installed here; a requirement of nothing installed fails loudly."""
    todo = [(normalize(r.name), frozenset(r.extras)) for r in requirements]
    seen: set[tuple[str, frozenset[str]]] = set()
    names: set[str] = set()
    while todo:
        name, extras = todo.pop()
        if (name, extras) in seen:
            continue
        seen.add((name, extras))
        names.add(name)
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError as exc:
            raise AssertionError(f"{name} is required but not installed here") from exc
        for line in dist.requires or []:
            req = Requirement(line)
            if req.marker is not None:
                envs = [{"extra": e} for e in extras] or [{"extra": ""}]
                if not any(req.marker.evaluate(env) for env in envs):
                    continue
            todo.append((normalize(req.name), frozenset(req.extras)))
    return names


def top_level_modules(distributions: set[str]) -> set[str]:
    """The top-level import names of installed distributions."""
    out = set()
    for module, dists in md.packages_distributions().items():
        if {normalize(d) for d in dists} & distributions:
            out.add(module)
    return out


def statically_imported_distributions(package: str) -> dict[str, set[str]]:
    """{distribution: files of ``package`` importing it}: every third-party ``import`` statement in
    the package's source, at module level or inside a function."""
    dists = md.packages_distributions()
    out: dict[str, set[str]] = {}
    for path in sorted((ROOT / package).rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                tops = {alias.name.split(".")[0] for alias in node.names}
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                tops = {node.module.split(".")[0]}
            else:
                continue
            for top in tops - OUR_PACKAGES - set(sys.stdlib_module_names) - {"__future__"}:
                for dist in dists.get(top, [f"<no installed distribution: {top}>"]):
                    out.setdefault(normalize(dist), set()).add(str(path.relative_to(ROOT)))
    return out


def imported_distributions(modules: list[str]) -> set[str]:
    """Distributions (normalized names) a fresh interpreter loads when importing ``modules``."""
    code = (
        "import sys, importlib, importlib.metadata as md\n"
        "at_startup = set(sys.modules)  # site hooks (.pth files) are not the code's imports\n"
        f"for m in {sorted(OPTIONAL_IMPORTS)!r}: sys.modules[m] = None  # absent in the images\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "dists = md.packages_distributions()\n"
        f"ours = {sorted(OUR_PACKAGES | {'tests'})!r}\n"
        "loaded = {n for n, mod in sys.modules.items() if mod is not None}\n"
        "tops = {n.split('.')[0] for n in loaded - at_startup} - set(ours) - set(sys.stdlib_module_names)\n"
        "print('\\n'.join(sorted({d for t in tops for d in dists.get(t, [])})))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return {normalize(line) for line in proc.stdout.split()}
