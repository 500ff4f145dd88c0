"""docs/operations.md and the README's "Deploy" section say only what the code does.

Every flag they show belongs to the `prefixlb` command it is shown with (or, inline, to one of
the commands an operator runs), every Helm value they name exists in values.yaml, and every
default the failure-handling table states is the router's real default. The metric names they
name are checked against live servers in tests/integration/test_observability_metrics.py.
"""
from __future__ import annotations

import re

import pytest
import yaml

from tests.deploy_support import CHART, command_flags, markdown_section
from tests.support import ROOT

GUIDE = (ROOT / "docs/operations.md").read_text()
README_DEPLOY = markdown_section((ROOT / "README.md").read_text(), "## Deploy")
DOCS = {"operations.md": GUIDE, "README Deploy": README_DEPLOY}
# The commands the guide runs, and the flags of other tools shown inline (docker build's, and
# docker compose's profile switch).
COMMANDS = ("router", "worker", "sweep", "sim")
OTHER_TOOLS_FLAGS = {"--build-arg", "--profile"}
VALUE_ROOTS = ("router", "worker", "redis", "discovery", "metrics", "networkPolicy", "serviceAccount", "rbac")


def _inline_code(text: str) -> list[str]:
    without_blocks = re.sub(r"```.*?```", "", text, flags=re.S)
    return re.findall(r"`([^`\n]+)`", without_blocks)


def _command_lines(text: str) -> list[tuple[str, str]]:
    """(command, line) for each `prefixlb <command> ...` line of a code block (continuations joined)."""
    out = []
    for block in re.findall(r"```[a-z]*\n(.*?)```", text, flags=re.S):
        for line in block.replace("\\\n", " ").splitlines():
            m = re.match(r"\s*prefixlb (\w+)\b(.*)", line)
            if m:
                out.append((m.group(1), m.group(2)))
    return out


def test_the_guide_shows_prefixlb_commands_in_its_code_blocks():
    assert {c for c, _ in _command_lines(GUIDE)} >= {"sweep"}


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_flag_in_a_prefixlb_command_line_is_one_that_command_accepts(doc):
    for command, rest in _command_lines(DOCS[doc]):
        used = set(re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", rest))
        assert sorted(used - command_flags(command)) == [], (doc, command, rest)


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_inline_flag_is_a_flag_of_a_prefixlb_command(doc):
    known = set().union(*(command_flags(c) for c in COMMANDS)) | OTHER_TOOLS_FLAGS
    mentioned = {f for code in _inline_code(DOCS[doc]) for f in re.findall(r"(?<![\w-])--[a-z0-9][a-z0-9-]*", code)
                 if not code.startswith(("prefixlb ", "docker ", "helm ", "kubectl "))}
    assert mentioned or doc != "operations.md"
    assert sorted(mentioned - known) == [], doc


def _has_value(values: dict, path: str) -> bool:
    node = values
    for part in path.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_helm_value_named_exists_in_values_yaml(doc):
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    pattern = re.compile(r"^(?:%s)(?:\.[A-Za-z][A-Za-z0-9]*)+$" % "|".join(VALUE_ROOTS))
    named = {c.split(":")[0].split("=")[0].strip() for c in _inline_code(DOCS[doc])}
    paths = sorted(n for n in named if pattern.match(n))
    missing = [p for p in paths if not _has_value(values, p)]
    assert missing == [], doc
    if doc == "operations.md":
        assert len(paths) > 20


def _failure_settings_rows() -> list[tuple[str, str, str]]:
    section = markdown_section(GUIDE, "### Failure-handling settings")
    rows = []
    for line in section.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[1].startswith("`--"):
            rows.append((cells[0], cells[1], cells[2]))
    return rows


def _number(text: str) -> float:
    m = re.fullmatch(r"([\d.]+)(?: (KiB|MiB))?(?: \(off\))?", text)
    assert m, text
    return float(m.group(1)) * {None: 1, "KiB": 1024, "MiB": 1024 ** 2}[m.group(2)]


def test_failure_handling_settings_table_states_the_routers_real_defaults_and_values():
    from router.config import RouterConfig

    from tests.deploy_support import load_router_config, render_chart

    defaults = RouterConfig()
    values = yaml.safe_load((CHART / "values.yaml").read_text())
    rows = _failure_settings_rows()
    assert len(rows) >= 14
    settings: dict = {}        # chart values to render, each a number the router does not default to
    expected: dict = {}        # RouterConfig field -> that number
    for value_cell, flag_cell, default_cell in rows:
        flags = re.findall(r"`(--[a-z-]+)`", flag_cell)
        paths = re.findall(r"`([A-Za-z.]+)`", value_cell)
        # "`router.health.a` / `b`": the second name is a sibling of the first.
        parent = paths[0].rsplit(".", 1)[0]
        paths = [paths[0]] + [f"{parent}.{p}" for p in paths[1:]]
        stated = [d.strip() for d in default_cell.split("/")]
        assert len(flags) == len(paths) == len(stated), value_cell
        for flag, path, default in zip(flags, paths, stated):
            assert flag in command_flags("router"), flag
            assert _has_value(values, path), path
            name = flag[2:].replace("-", "_")
            if not default.startswith("2 ×"):  # the per-worker limit's default depends on the worker
                assert getattr(defaults, name) == _number(default), (flag, default)
            number = getattr(defaults, name) * 2 or 7
            cursor = settings
            *parents, leaf = path.split(".")
            for part in parents:
                cursor = cursor.setdefault(part, {})
            cursor[leaf] = number
            expected[name] = number
    # Setting each value reaches its flag.
    docs = render_chart(settings)
    router = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"].endswith("-router"))
    cfg = load_router_config(router["spec"]["template"]["spec"]["containers"][0]["args"])
    assert {name: getattr(cfg, name) for name in expected} == expected
