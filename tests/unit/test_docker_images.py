"""The container images (docker/): linted, non-root, health-checked, pinned, and slim.

There is no Docker engine here, so the images are not built; instead the Dockerfiles are parsed
with the official BuildKit parser (``dockerfile``), linted with hadolint, and their contents are
checked against the code and the package: the router image carries every distribution the
router imports and everything `pip install prefixlb[k8s]` would install, and no torch; the worker
image what `prefixlb[worker]` would; the health-check script is run against real HTTP servers.
"""
from __future__ import annotations

import fnmatch
import http.server
import re
import subprocess
import sys
import threading
from pathlib import Path

import dockerfile
import pytest

from tests.packaging_support import OUR_PACKAGES, closure, declared_requirements, imported_distributions, normalize
from tests.support import ROOT, free_port

DOCKER = ROOT / "docker"
IMAGES = ("router", "worker")
PINNED_TAG = re.compile(r"^[\w./-]+:\d+(\.\d+)+[\w.-]*$")  # e.g. python:3.11.14-slim-bookworm
PIN = re.compile(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==([0-9][\w.+!-]*)$")


def _parse(image: str) -> list[dockerfile.Command]:
    return list(dockerfile.parse_file(str(DOCKER / f"Dockerfile.{image}")))


def _final_stage(commands: list[dockerfile.Command]) -> list[dockerfile.Command]:
    last_from = max(i for i, c in enumerate(commands) if c.cmd == "FROM")
    return commands[last_from:]


def _arg_defaults(commands: list[dockerfile.Command]) -> dict[str, str]:
    out = {}
    for c in commands:
        if c.cmd == "ARG" and "=" in c.value[0]:
            name, value = c.value[0].split("=", 1)
            out[name] = value
    return out


def _requirements(image: str) -> dict[str, str]:
    pins = {}
    for line in (DOCKER / f"requirements-{image}.txt").read_text().splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        m = PIN.match(line)
        assert m, f"requirements-{image}.txt: {line!r} is not pinned with =="
        pins[normalize(m.group(1))] = m.group(2)
    return pins


@pytest.mark.parametrize("image", IMAGES)
def test_dockerfile_passes_hadolint(image):
    hadolint = Path(sys.executable).parent / "hadolint"
    proc = subprocess.run([str(hadolint), "--no-color", str(DOCKER / f"Dockerfile.{image}")],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize("image", IMAGES)
def test_image_runs_its_command_as_a_non_root_user_with_a_health_check(image):
    final = _final_stage(_parse(image))
    users = [c.value[0] for c in final if c.cmd == "USER"]
    assert users and users[-1].split(":")[0] not in ("0", "root")
    assert int(users[-1].split(":")[0]) >= 1000
    entrypoint = [c for c in final if c.cmd == "ENTRYPOINT"][-1]
    assert entrypoint.json and list(entrypoint.value) == ["prefixlb", image]
    healthcheck = [c for c in final if c.cmd == "HEALTHCHECK"][-1]
    assert healthcheck.json and healthcheck.value[0] == "CMD"
    assert healthcheck.value[-1] == "/opt/prefixlb/healthcheck.py"
    env = {}
    for c in final:
        if c.cmd == "ENV":
            env.update(zip(c.value[::2], c.value[1::2]))
    exposed = [c.value[0] for c in final if c.cmd == "EXPOSE"]
    # The port the server listens on (its env setting) is the one exposed and health-checked.
    assert exposed == [env[f"PREFIXLB_{image.upper()}_PORT"]]
    assert env[f"PREFIXLB_{image.upper()}_HOST"] == "0.0.0.0"
    assert env["PYTHONDONTWRITEBYTECODE"] == "1"  # read-only root filesystem friendly


@pytest.mark.parametrize("image", IMAGES)
def test_base_images_and_torch_are_pinned_to_exact_versions(image):
    commands = _parse(image)
    args = _arg_defaults(commands)
    for c in commands:
        if c.cmd != "FROM":
            continue
        ref = re.sub(r"\$\{(\w+)\}", lambda m: args[m.group(1)], c.value[0])
        assert PINNED_TAG.match(ref), f"FROM {ref} is not pinned to a version"
    if image == "worker":
        assert re.fullmatch(r"\d+\.\d+\.\d+", args["TORCH_VERSION"])
    assert _requirements(image)  # every line pinned (checked while parsing)


def test_router_image_runs_the_python_the_suite_is_measured_on():
    # CPython 3.11: what CI tests and the benchmarks measure, and 1.09-1.15x less router CPU per
    # request than 3.13 and 3.12 (bench/router_pythons.py, docs/benchmarks.md).
    image = _arg_defaults(_parse("router"))["PYTHON_IMAGE"]
    assert re.fullmatch(r"python:3\.11\.\d+-slim-[a-z]+", image), image


def test_router_image_installs_no_torch_and_copies_no_worker_code():
    pins = _requirements("router")
    assert not {"torch", "triton", "numpy", "safetensors", "tokenizers"} & set(pins)
    copied = {c.value[0] for c in _parse("router") if c.cmd == "COPY" and not c.flags}
    assert "worker" not in copied and "kernels" not in copied and "bench" not in copied


def _dockerignore_allows(patterns: list[str], path: str) -> bool:
    """Docker's rule: the last pattern that matches a path (or a parent of it) decides."""
    allowed = True
    parts = path.split("/")
    for pattern in patterns:
        negate = pattern.startswith("!")
        pat = pattern[1:] if negate else pattern
        prefixes = ["/".join(parts[:i]) for i in range(1, len(parts) + 1)]
        if any(fnmatch.fnmatchcase(p, pat) for p in prefixes):
            allowed = negate
    return allowed


@pytest.mark.parametrize("image", IMAGES)
def test_every_copied_path_exists_and_is_in_the_build_context(image):
    ignore = [line.strip() for line in (DOCKER / f"Dockerfile.{image}.dockerignore").read_text().splitlines()
              if line.strip() and not line.startswith("#")]
    assert not _dockerignore_allows(ignore, ".venv/bin/python")
    assert not _dockerignore_allows(ignore, ".git/HEAD")
    for c in _parse(image):
        if c.cmd != "COPY" or any(f.startswith("--from") for f in c.flags):
            continue
        for src in c.value[:-1]:
            assert (ROOT / src).exists(), f"COPY {src}: no such path"
            assert _dockerignore_allows(ignore, src), f"COPY {src}: excluded by the .dockerignore"
    assert not _dockerignore_allows(ignore, "router/__pycache__/app.cpython-312.pyc")


def test_router_image_pins_every_distribution_the_router_imports():
    # router.fleet.k8s_discovery imports the kubernetes client only with --k8s-selector: import it too.
    used = imported_distributions(["prefixlb.cli", "prefixlb.commands.router", "router.app",
                                    "router.fleet.k8s_discovery", "kubernetes.client", "kubernetes.watch"])
    assert "torch" not in used, "the router imports torch: the slim image could not run it"
    missing = sorted(used - set(_requirements("router")))
    assert missing == [], f"imported by the router but not in docker/requirements-router.txt: {missing}"


def test_worker_image_pins_every_distribution_the_worker_imports():
    used = imported_distributions(["prefixlb.cli", "prefixlb.commands.worker", "worker.server.app",
                                    "worker.simulator.runner"])
    provided = set(_requirements("worker")) | {"torch", "triton"}  # torch from TORCH_INDEX_URL
    missing = sorted(used - provided)
    assert missing == [], f"imported by the worker but not in docker/requirements-worker.txt: {missing}"


def test_router_image_pins_what_pip_install_prefixlb_k8s_installs_and_nothing_of_the_other_extras():
    pins = set(_requirements("router"))
    wanted = closure(declared_requirements(("k8s",)))
    assert sorted(wanted - pins) == [], "docker/requirements-router.txt lacks part of prefixlb[k8s]"
    extras_only = closure(declared_requirements(("worker", "bench"))) - wanted
    assert sorted(pins & extras_only) == []
    assert "torch" in extras_only and "matplotlib" in extras_only


def test_worker_image_pins_what_pip_install_prefixlb_worker_installs_besides_torch():
    pins = set(_requirements("worker"))
    worker = declared_requirements(("worker",))
    torch_own = closure([r for r in worker if normalize(r.name) in ("torch", "triton")])
    wanted = closure([r for r in worker if normalize(r.name) not in ("torch", "triton")])
    assert sorted(wanted - pins) == [], "docker/requirements-worker.txt lacks part of prefixlb[worker]"
    # torch (from TORCH_INDEX_URL) brings its own dependencies, at the versions it was built for.
    assert sorted(pins & (torch_own - wanted)) == []
    assert not pins & {"matplotlib", "kubernetes"}


SERVES = {"router": ["router.app", "router.fleet.k8s_discovery"], "worker": ["worker.server.app", "worker.simulator.runner"]}


@pytest.mark.parametrize("image", IMAGES)
def test_the_packages_an_image_copies_are_enough_to_run_its_command(image):
    """Our packages the Dockerfile does not COPY are made unimportable (as in the image), and the
    command still parses its flags and imports everything it serves with."""
    copied = {c.value[0] for c in _parse(image) if c.cmd == "COPY" and not c.flags} & OUR_PACKAGES
    absent = sorted(OUR_PACKAGES - copied) + (["torch", "triton"] if image == "router" else [])
    code = (
        "import sys, importlib\n"
        f"for m in {absent!r}: sys.modules[m] = None\n"
        f"for m in {SERVES[image]!r}: importlib.import_module(m)\n"
        "from prefixlb.cli import main\n"
        f"sys.exit(main([{image!r}, '--help']))\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"usage: prefixlb {image}" in proc.stdout


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        code = 200 if self.path == "/health" and self.server.healthy else 503  # type: ignore[attr-defined]
        self.send_response(code)
        self.end_headers()

    def log_message(self, *args):
        pass


@pytest.fixture
def health_server():
    server = http.server.ThreadingHTTPServer(("127.0.0.1", free_port()), _Health)
    server.healthy = True  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield server
    server.shutdown()
    server.server_close()


def _healthcheck(env: dict[str, str]) -> int:
    return subprocess.run([sys.executable, str(DOCKER / "healthcheck.py")], env=env,
                          capture_output=True, timeout=30).returncode


def test_healthcheck_is_healthy_when_the_server_answers_health_with_200(health_server):
    port = str(health_server.server_address[1])
    assert _healthcheck({"PREFIXLB_ROUTER_PORT": port}) == 0
    assert _healthcheck({"PREFIXLB_WORKER_PORT": port}) == 0


def test_healthcheck_is_unhealthy_while_the_server_answers_503_as_a_draining_worker_does(health_server):
    health_server.healthy = False
    assert _healthcheck({"PREFIXLB_WORKER_PORT": str(health_server.server_address[1])}) == 1


def test_healthcheck_is_unhealthy_when_nothing_listens():
    assert _healthcheck({"PREFIXLB_ROUTER_PORT": str(free_port())}) == 1
