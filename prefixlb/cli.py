"""The ``prefixlb`` command: a thin dispatcher to one module per subcommand.

Each subcommand lives in ``prefixlb/commands/<name>.py`` and exposes ``main(argv) -> int``;
modules are imported lazily so that ``prefixlb router`` never imports torch.
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
}


def _usage() -> str:
    lines = ["usage: prefixlb <command> [options]", "", "commands:"]
    lines += [f"  {name:<8} {text}" for name, text in SUBCOMMANDS.items()]
    lines += ["", "`prefixlb <command> --help` shows a command's options."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``prefixlb <command> ...`` to ``prefixlb.commands.<command>.main``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(_usage())
        return 0
    name, rest = argv[0], argv[1:]
    if name not in SUBCOMMANDS:
        print(f"prefixlb: unknown command {name!r}\n\n{_usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(f"prefixlb.commands.{name}")
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    raise SystemExit(main())
