"""`pip install prefixlb` is the router alone; the extras bring the engine, the benchmarks, k8s.

The requirements are read from the wheel metadata this checkout builds, closed over the installed
distributions' own metadata, and held against every import statement of each package (lazy ones
included). Then the commands run as a router-only install would run them: in a real process in
which every module outside the base requirements' distributions fails to import, the router serves
a completion through a simulated worker, and the commands that need an extra say which one.
tests/integration/test_base_install.py (slow) does the same in a fresh virtualenv with pip.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request

import pytest

from prefixlb.cli import COMMAND_EXTRA, EXTRA_MODULES, SUBCOMMANDS
from tests.packaging_support import (
    BASE, NOT_IN_BASE, OUR_PACKAGES, closure, declared_requirements, normalize, provided_extras,
    statically_imported_distributions, top_level_modules,
)
from tests.support import ROOT, free_port, processes, spawn

EXTRAS = {
    "worker": {"torch", "triton", "safetensors", "tokenizers", "jinja2", "numpy"},
    "bench": {"numpy", "matplotlib", "tqdm"},
    "k8s": {"kubernetes"},
    "engines": {"tokenizers", "jinja2"},
}
# Imports of bench/ no extra of the package installs, each with why that is right.
BENCH_OUTSIDE_EXTRAS = {
    # the reference `make bench-engine` compares against; that target installs the test extra
    "transformers": {"bench/engine.py"},
    # cuda-python's driver bindings, optional (``except Exception``) in the GPU kernel sweep
    "<no installed distribution: cuda>": {"bench/kernels_sweep.py"},
    # the official client, driving routers in front of real vLLM servers as a user would; that
    # benchmark needs `make vllm` and the test extra anyway
    "openai": {"bench/real_engines.py"},
}


def _names(extras: tuple[str, ...] = ()) -> set[str]:
    return {normalize(r.name) for r in declared_requirements(extras)}


def _closure(*extras: str) -> set[str]:
    return closure(declared_requirements(tuple(extras)))


def test_pip_install_prefixlb_asks_for_the_routers_dependencies_only():
    assert _names() == set(BASE)
    assert _closure() & NOT_IN_BASE == set()


def test_the_extras_add_the_engine_the_benchmarks_and_kubernetes_and_test_has_them_all():
    assert provided_extras() == {"worker", "bench", "k8s", "engines", "test"}
    for extra, added in EXTRAS.items():
        assert _names((extra,)) - _names() == added, extra
    assert _names(("test",)) >= _names(("worker", "bench", "k8s", "engines"))
    assert _closure("test") >= {"pytest", "openai", "transformers", "helm-python-sdk", "kubernetes-validate"}


def _uncovered(packages: tuple[str, ...], installed: set[str]) -> dict[str, set[str]]:
    imported: dict[str, set[str]] = {}
    for package in packages:
        for dist, files in statically_imported_distributions(package).items():
            imported.setdefault(dist, set()).update(files)
    return {d: files for d, files in imported.items() if d not in installed}


def test_every_import_of_the_router_and_the_cli_is_a_base_requirement_or_kubernetes_discovery():
    uncovered = _uncovered(("prefixlb", "protocol", "router"), _closure())
    # Only the Kubernetes discovery imports the k8s extra (and only with --k8s-selector), and only
    # the backends' chat tokenization the engines extra (the worker extra has both too).
    assert uncovered == {"kubernetes": {"router/fleet/k8s_discovery.py"},
                         "tokenizers": {"router/routing/chat_tokens.py"},
                         "jinja2": {"router/routing/chat_tokens.py", "protocol/hf_chat_template.py"}}
    assert "kubernetes" in _closure("k8s")
    assert {"tokenizers", "jinja2"} <= _closure("engines") and {"tokenizers", "jinja2"} <= _closure("worker")


def test_every_import_of_the_worker_and_the_kernels_comes_with_the_worker_extra():
    assert _uncovered(("worker", "kernels"), _closure("worker")) == {}


def test_every_import_of_the_benchmarks_comes_with_the_bench_and_worker_extras():
    assert _uncovered(("bench",), _closure("worker", "bench")) == BENCH_OUTSIDE_EXTRAS
    assert "transformers" in _closure("test")


def test_the_cli_names_for_each_extra_the_modules_its_requirements_install():
    assert set(EXTRA_MODULES) == set(EXTRAS)
    for extra, modules in EXTRA_MODULES.items():
        direct = {normalize(r.name) for r in declared_requirements((extra,))} - _names()
        provided = top_level_modules(direct)
        assert set(modules) <= provided, extra
        for dist in direct:  # and every requirement of the extra has a module listed
            assert set(modules) & top_level_modules({dist}), (extra, dist)
    assert set(COMMAND_EXTRA) <= set(SUBCOMMANDS) and set(COMMAND_EXTRA.values()) <= set(EXTRAS)


# A process of the base install: every top-level module installed here that no distribution of
# the base requirements' closure provides is made unimportable (None in sys.modules: ``import``
# fails, ``importlib.util.find_spec`` answers None), as in a virtualenv where only `pip install
# prefixlb` ran.
BASE_INSTALL_SITECUSTOMIZE = """
import os, pkgutil, sys

_allowed = set(os.environ["PREFIXLB_TEST_BASE_MODULES"].split(",")) | set(sys.stdlib_module_names)
for _module in pkgutil.iter_modules():
    if _module.name not in _allowed and _module.name not in sys.modules:
        sys.modules[_module.name] = None
"""


@pytest.fixture(scope="module")
def base_install_env(tmp_path_factory) -> dict[str, str]:
    site = tmp_path_factory.mktemp("base-install-site")
    (site / "sitecustomize.py").write_text(BASE_INSTALL_SITECUSTOMIZE)
    modules = top_level_modules(_closure()) | OUR_PACKAGES
    assert not modules & {"torch", "numpy", "matplotlib", "kubernetes"}
    path = os.pathsep.join(p for p in (str(site), os.environ.get("PYTHONPATH", "")) if p)
    return {"PYTHONPATH": path, "PREFIXLB_TEST_BASE_MODULES": ",".join(sorted(modules))}


def _run(args: list[str], env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "prefixlb", *args], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, env={**os.environ, **env})


def test_the_base_install_process_cannot_import_torch(base_install_env):
    """The stand-in for a router-only install can fail: torch really is unimportable there."""
    proc = subprocess.run([sys.executable, "-c", "import torch"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60, env={**os.environ, **base_install_env})
    assert proc.returncode == 1 and "ModuleNotFoundError: import of torch halted" in proc.stderr


def test_router_help_runs_on_the_base_install(base_install_env):
    proc = _run(["router", "--help"], base_install_env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.startswith("usage: prefixlb router")


def test_the_router_serves_a_simulated_worker_on_the_base_install(base_install_env, tmp_path):
    worker_port, router_port = free_port(), free_port()
    with processes() as procs:
        procs.append(spawn(["worker", "--simulate", "--gpu", "H100-80G", "--time-scale", "1000",
                            "--worker-id", "sim-1", "--port", str(worker_port)],
                           tmp_path, "worker", port=worker_port, env=base_install_env))
        procs.append(spawn(["router", "--port", str(router_port), "--worker", f"http://127.0.0.1:{worker_port}"],
                           tmp_path, "router", port=router_port, env=base_install_env))
        request = urllib.request.Request(
            f"http://127.0.0.1:{router_port}/v1/completions", method="POST",
            data=json.dumps({"model": "llama-3-8b", "prompt": "hello", "max_tokens": 4}).encode(),
            headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=30) as resp:
            body = json.loads(resp.read())
            assert (resp.status, resp.headers["X-Prefixlb-Worker"]) == (200, "sim-1")
        assert body["usage"]["completion_tokens"] == 4
        for proc in procs:
            assert "Traceback" not in proc.output(), proc.output()[-3000:]


@pytest.mark.parametrize("args,extra,module", [
    (["worker", "--model", "tiny"], "worker", "torch"),
    (["model", "info", "tiny"], "worker", "torch"),
    (["sim", "--workload", "doc-qa", "--workers", "2"], "bench", "matplotlib"),
    (["router", "--k8s-selector", "app=worker"], "k8s", "kubernetes"),
])
def test_a_command_that_needs_an_extra_says_which_to_install_on_the_base_install(base_install_env, args,
                                                                                 extra, module):
    servers = ("worker", "router")
    proc = _run([*args, "--port", str(free_port())] if args[0] in servers else args, base_install_env)
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert (f"prefixlb {args[0]}: needs {module}, which `pip install prefixlb` (the router alone) leaves out: "
            f"pip install 'prefixlb[{extra}]'") in proc.stderr.splitlines()
    assert "Traceback" not in proc.stderr
