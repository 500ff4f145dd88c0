"""What ``prefixlb router`` and ``prefixlb worker`` share: settings in, a server run until SIGTERM.

Each command describes itself with a :class:`ServerCommand`; :meth:`ServerCommand.main` parses
flags, environment and YAML into its settings schema, sets up logging and runs the server on
``prefixlb.aio``'s event loop. Exit status: 2 for settings (or start-up checks) that are not
valid, 1 when the server cannot start (e.g. the port is taken), else the server's own.
"""
from __future__ import annotations

import argparse
import sys
from dataclasses import dataclass
from typing import Any, Callable, Coroutine

from prefixlb.aio import run as run_loop
from protocol.log_format import configure_logging
from protocol.settings import SettingsError, build_parser, load_settings

Serve = Callable[[Any], Coroutine[Any, Any, int]]


@dataclass(frozen=True, kw_only=True, slots=True)
class ServerCommand:
    """One server subcommand.

    ``load`` imports the server only once the settings are valid (``--help`` and a bad flag stay
    fast and never import torch) and returns its ``serve(config)`` coroutine function with the
    exceptions that mean "these settings cannot start" (exit 2). ``check`` validates what the
    schema cannot (raising :class:`SettingsError`).
    """

    name: str
    schema: type
    env_prefix: str
    description: str
    epilog: str
    load: Callable[[], tuple[Serve, tuple[type[BaseException], ...]]]
    check: Callable[[Any], None] | None = None
    help_groups: dict[str, tuple[str, ...]] | None = None  # --help by topic (protocol/settings.py)

    def main(self, argv: list[str]) -> int:
        """Parse settings, run the server until SIGTERM, return its exit status."""
        parser = build_parser(self.schema, env_prefix=self.env_prefix, groups=self.help_groups,
                              prog=f"prefixlb {self.name}",
                              description=self.description, epilog=self.epilog,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
        args = parser.parse_args(argv)
        try:
            cfg = load_settings(self.schema, args, env_prefix=self.env_prefix)
            if self.check is not None:
                self.check(cfg)
        except SettingsError as exc:
            print(f"prefixlb {self.name}: {exc}", file=sys.stderr)
            return 2
        configure_logging(cfg.log_level, cfg.log_format)
        serve, invalid = self.load()
        try:
            return run_loop(serve(cfg))
        except invalid as exc:
            print(f"prefixlb {self.name}: {exc}", file=sys.stderr)
            return 2
        except OSError as exc:  # e.g. the port is taken
            print(f"prefixlb {self.name}: cannot start: {exc}", file=sys.stderr)
            return 1
