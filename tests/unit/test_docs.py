"""The design docs point at things that exist: files, modules, names, sections, one affinity table.

A doc that names ``router/routing/load.py``, ``worker.engine.stats.SpeedMeter``,
``LoadBoard.least_loaded`` or ``docs/routing.md ("Affinity strength")`` is checked against the
tree: the file exists, the module defines the name, the class has the attribute, the page has
the section. Code, comments and config files that cite a doc section are checked the same way,
so moving a section breaks here, not for the reader. (Whether a sentence is *true* is for the
reviewer; the operations guide's flags, values and defaults are checked in
tests/unit/test_operations_guide.py.) The CHANGELOG is history and may name paths that no
longer exist; only its links into the docs are checked.
"""
from __future__ import annotations

import ast
import functools
import re
from fractions import Fraction
from pathlib import Path

import pytest
import yaml

from tests.deploy_support import CHART, markdown_anchors, markdown_section
from tests.support import ROOT

DOCS = sorted((ROOT / "docs").glob("*.md"))
DESIGN_TEXTS = [ROOT / "README.md", *DOCS]
PACKAGES = ("prefixlb", "bench", "router", "worker", "kernels", "protocol")
TOP_FOLDERS = (*PACKAGES, "tests", "deploy", "docker", "helm", "scripts")
# Files outside docs/ that cite docs: code, chart, dashboards and alerts.
CITING_SUFFIXES = (".py", ".yml", ".yaml", ".json", ".txt", ".tpl")


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT))


def _citing_files() -> list[Path]:
    files = [ROOT / "README.md", ROOT / "CHANGELOG.md", *DOCS]
    for folder in (*PACKAGES, "deploy", "docker", "helm"):
        files += sorted(p for p in (ROOT / folder).rglob("*") if p.suffix in CITING_SUFFIXES and p.is_file())
    return files


def _headings(markdown: str) -> list[str]:
    """Heading titles without their ``#`` marks and section numbers ("7. Failure modes")."""
    out = []
    for line in markdown.splitlines():
        m = re.match(r"^#{1,6}\s+(?:\d+\.\s+)?(.*?)\s*$", line)
        if m:
            out.append(m.group(1))
    return out


def _names_section(heading: str, title: str) -> bool:
    """``title`` cites ``heading``: equal, or the heading's leading words before "(" or ":"."""
    heading, title = heading.rstrip("?.!"), title.rstrip("?.!")
    return heading == title or heading.startswith((title + " (", title + ":"))


# ``docs/x.md`` or a relative ``](x.md`` link, an optional #anchor, then optionally the quoted
# section titles the citation names: ``docs/x.md ("A", "B")``, ``docs/x.md, "A"``, ``](x.md) "A"``.
_CITATION = re.compile(r"(?:\bdocs/|\]\()(?P<name>[\w-]+)\.md(?:#(?P<anchor>[\w-]+))?")
_TITLES = re.compile(r"""^`?\)?`?(?:,\s*|\s+)?\(?\s*((?:(?:"[^"]+"|'[^']+')(?:\s*(?:,|and)\s*)?)+)""")


def _citations(path: Path) -> list[tuple[str, str | None, list[str]]]:
    text = path.read_text(encoding="utf-8")
    out = []
    for m in _CITATION.finditer(text):
        # A title may wrap onto the next line, behind a comment marker.
        following = re.sub(r"\s*\n\s*(?:#|//|\*)?\s*", " ", text[m.end():m.end() + 300])
        t = _TITLES.match(following)
        titles = re.findall(r""""([^"]+)"|'([^']+)'""", t.group(1)) if t else []
        out.append((m.group("name"), m.group("anchor"), [a or b for a, b in titles]))
    return out


def test_every_citation_of_a_doc_names_an_existing_page_anchor_and_section():
    problems = []
    cited = 0
    for path in _citing_files():
        for name, anchor, titles in _citations(path):
            page = ROOT / "docs" / f"{name}.md"
            if not page.exists():
                if name not in ("README", "CHANGELOG"):
                    problems.append(f"{_rel(path)}: docs/{name}.md does not exist")
                continue
            cited += 1
            text = page.read_text(encoding="utf-8")
            if anchor is not None and anchor not in markdown_anchors(text):
                problems.append(f"{_rel(path)}: {name}.md has no anchor #{anchor}")
            headings = _headings(text)
            for title in titles:
                if not any(_names_section(h, title) for h in headings):
                    problems.append(f"{_rel(path)}: {name}.md has no section {title!r}")
    assert problems == []
    assert cited > 50  # the check saw the citations (README, docs, code comments, chart, alerts)


_PATH = re.compile(r"(?<![\w./-])((?:%s)/[\w./*-]*)" % "|".join(TOP_FOLDERS))


@pytest.mark.parametrize("doc", DESIGN_TEXTS, ids=_rel)
def test_every_repository_path_a_design_doc_names_exists(doc):
    text = doc.read_text(encoding="utf-8")
    text = re.sub(r"https?://\S+", "", text)
    missing = []
    for raw in set(_PATH.findall(text)):
        path = raw.rstrip(".,;:)")
        if not path or "<" in path:
            continue
        if "*" in path:
            if not list(ROOT.glob(path)):
                missing.append(path)
        elif not (ROOT / path).exists():
            missing.append(path)
    assert sorted(missing) == []


@functools.lru_cache(maxsize=None)
def _module_file(dotted: str) -> Path | None:
    base = ROOT / Path(*dotted.split("."))
    if base.with_suffix(".py").is_file():
        return base.with_suffix(".py")
    if (base / "__init__.py").is_file():
        return base / "__init__.py"
    return None


@functools.lru_cache(maxsize=None)
def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _top_level_names(path: Path) -> set[str]:
    names: set[str] = set()
    for node in _tree(path).body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in node.names)
        elif isinstance(node, ast.Assign):
            names.update(t.id for t in node.targets if isinstance(t, ast.Name))
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            names.add(node.target.id)
    return names


def _class_members(node: ast.ClassDef) -> set[str]:
    members: set[str] = set()
    for item in ast.walk(node):
        if isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
            members.add(item.name)
        elif isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
            members.add(item.target.id)
        elif isinstance(item, ast.Assign):
            members.update(t.id for t in item.targets if isinstance(t, ast.Name))
        elif isinstance(item, ast.Attribute) and isinstance(item.value, ast.Name) and item.value.id == "self":
            members.add(item.attr)
    return members


@functools.lru_cache(maxsize=None)
def _classes() -> dict[str, set[str]]:
    """Every class of our packages by name, with the names it defines (merged across same names)."""
    out: dict[str, set[str]] = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            for node in ast.walk(_tree(path)):
                if isinstance(node, ast.ClassDef):
                    out.setdefault(node.name, set()).update(_class_members(node))
    return out


def _inline_code(text: str) -> list[str]:
    """Inline code spans (a span may wrap onto the next line)."""
    without_blocks = re.sub(r"```.*?```", "", text, flags=re.S)
    return [" ".join(span.split()) for span in re.findall(r"`([^`]+)`", without_blocks)]


def _resolve_dotted(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        path = _module_file(".".join(parts[:i]))
        if path is not None:
            rest = parts[i:]
            if not rest:
                return True
            if rest[0] not in _top_level_names(path):
                return False
            return len(rest) == 1 or rest[1] in _classes().get(rest[0], set())
    return False


@functools.lru_cache(maxsize=None)
def _helm_values() -> dict:
    return yaml.safe_load((CHART / "values.yaml").read_text(encoding="utf-8"))


def _is_helm_value(name: str) -> bool:
    node = _helm_values()
    for part in name.split("."):
        if not isinstance(node, dict) or part not in node:
            return False
        node = node[part]
    return True


FILE_SUFFIXES = ("py", "md", "json", "yml", "yaml", "txt", "sh", "png", "jsonl")


@pytest.mark.parametrize("doc", DESIGN_TEXTS, ids=_rel)
def test_every_module_class_and_attribute_a_design_doc_names_is_defined(doc):
    unknown = []
    for code in _inline_code(doc.read_text(encoding="utf-8")):
        m = re.fullmatch(r"((?:%s)/[\w/]+\.py): (\w+)" % "|".join(PACKAGES), code)
        if m:  # `worker/engine/stats.py: prefill_work`
            if m.group(2) not in _top_level_names(ROOT / m.group(1)):
                unknown.append(code)
            continue
        head = re.match(r"[\w.]+", code)
        name = head.group(0).rstrip(".") if head else ""
        if "." not in name or name.rsplit(".", 1)[-1] in FILE_SUFFIXES or _is_helm_value(name):
            continue  # not dotted, a file name, or a Helm value (router.apiKeys)
        if name.split(".")[0] in PACKAGES:
            if not _resolve_dotted(name):
                unknown.append(code)
        elif re.fullmatch(r"[A-Z][A-Za-z0-9]+\.[a-z_][a-z0-9_]*", name):
            cls, attr = name.split(".")
            if cls in _classes() and attr not in _classes()[cls]:
                unknown.append(code)
    assert unknown == []


def test_the_affinity_table_is_the_policys_own_mapping_and_default():
    from router.config import RouterConfig
    from router.routing.policy import locality_weight

    section = markdown_section((ROOT / "docs/routing.md").read_text(encoding="utf-8"), "## Affinity strength")
    rows = {cells[0]: cells[1:] for line in section.splitlines() if line.startswith("| ")
            for cells in [[c.strip() for c in line.strip().strip("|").split("|")]]}
    header, weights = rows["a"], rows["locality weight L"]
    assert len(header) == len(weights) >= 5
    defaults = [h for h in header if "(default)" in h]
    assert defaults == [f"{RouterConfig().affinity:g} (default)"]
    for a, weight in zip(header, weights):
        a = float(a.split()[0])
        expected = locality_weight(a)
        assert (weight == "∞") if expected == float("inf") else Fraction(weight) == Fraction(expected).limit_denominator()


def test_there_is_one_affinity_table_and_the_readme_and_the_flag_help_link_to_it():
    from protocol.settings import build_parser
    from router.config import RouterConfig

    holders = [_rel(p) for p in DESIGN_TEXTS if re.search(r"^\| locality weight", p.read_text(encoding="utf-8"), re.M)]
    assert holders == ["docs/routing.md"]
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "(docs/routing.md#affinity-strength)" in readme
    flag_help = " ".join(build_parser(RouterConfig, prog="prefixlb router").format_help().split())
    assert re.search(r'--affinity AFFINITY [^-]*docs/routing\.md, "Affinity strength"', flag_help), flag_help
