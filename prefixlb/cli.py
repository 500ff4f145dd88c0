"""The ``prefixlb`` command: a thin dispatcher to one module per subcommand.

Each subcommand lives in ``prefixlb/commands/<name>.py`` and exposes ``main(argv) -> int``;
modules are imported lazily so that ``prefixlb router`` never imports torch: ``pip install
prefixlb`` is the router alone, and the other commands need an extra (pyproject.toml).
"""
from __future__ import annotations

import importlib
import sys

SUBCOMMANDS = {
    "run": "start a local cluster: a router in front of CPU workers (what `make run` does)",
    "router": "the cache-aware router (OpenAI-compatible ingress)",
    "worker": "one replica: the paged-KV engine (or --simulate) behind the OpenAI API",
    "bench": "load generator, workloads and trace replay; `bench compare` for reports",
    "sim": "offline fleet simulator in virtual time (same policies, no HTTP)",
    "sweep": "sweep affinity 0..1 in the fleet simulator and plot hit rate vs p99 TTFT",
    "model": "model utilities: `model save tiny DIR` writes a Hugging Face checkpoint",
    "cost": "what prefix caching saves on a trace or a run, priced with price books",
    "signing-key": "a worker's key for signing what it writes into Redis (from the fleet secret)",
}

# What the base install lacks, by the extra that brings it (pyproject.toml's optional
# dependencies; tests/unit/test_packaging.py keeps the two in step). A command that needs one of
# these modules says which extra to install instead of ending in a traceback.
EXTRA_MODULES = {
    "worker": ("torch", "triton", "safetensors", "tokenizers", "jinja2", "numpy"),
    "bench": ("numpy", "matplotlib", "tqdm"),
    "k8s": ("kubernetes",),
    "engines": ("tokenizers", "jinja2"),
}
COMMAND_EXTRA = {"run": "worker", "worker": "worker", "model": "worker",
                 "bench": "bench", "sim": "bench", "sweep": "bench", "router": "k8s"}


def missing_extra(command: str, module: str | None) -> str | None:
    """The extra that installs ``module`` (a module ``command`` failed to import), or None when
    no extra provides it (then the failure is a bug, not a missing install)."""
    top = (module or "").split(".")[0]
    extras = [e for e, modules in EXTRA_MODULES.items() if top in modules]
    if not extras:
        return None
    return COMMAND_EXTRA[command] if COMMAND_EXTRA.get(command) in extras else extras[0]


def _usage() -> str:
    lines = ["usage: prefixlb <command> [options]", "", "commands:"]
    lines += [f"  {name:<11} {text}" for name, text in SUBCOMMANDS.items()]
    lines += ["", "`prefixlb <command> --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``prefixlb <command> ...`` to ``prefixlb.commands.<command>.main``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("--version", "-V"):
        from protocol.version import version

        print(f"prefixlb {version()}")
        return 0
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"prefixlb: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(f"prefixlb.commands.{name.replace('-', '_')}")
        return int(module.main(rest) or 0)
    except ModuleNotFoundError as exc:
        extra = missing_extra(name, exc.name)
        if extra is None:
            raise
        print(f"prefixlb {name}: needs {exc.name}, which `pip install prefixlb` (the router alone) "
              f"leaves out: pip install 'prefixlb[{extra}]'", file=sys.stderr)
        return 2


if __name__ == "__main__":
    raise SystemExit(main())
