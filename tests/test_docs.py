"""The docs stay true: the README's commands and examples are current, the config reference is generated from the
config's field table, every CLI command is shown, and every relative link resolves."""

from __future__ import annotations

import ast
import importlib
import pathlib
import re

import pytest

from rl_ckpt.cli import build_parser
from rl_ckpt.config import FIELDS, reference_markdown

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
REGENERATE = (
    """python -c "from rl_ckpt.config import reference_markdown as r; print(r(), end='')" > docs/configuration.md"""
)


def _blocks(text: str, lang: str) -> list[str]:
    return re.findall(rf"^```{lang}\n(.*?)^```", text, re.DOTALL | re.MULTILINE)


def _readme_section(title: str) -> str:
    start = README.index(f"\n## {title}\n")
    end = README.find("\n## ", start + 1)
    return README[start : end if end != -1 else None]


def test_configuration_reference_is_generated_from_the_config_fields():
    committed = (ROOT / "docs" / "configuration.md").read_text()
    assert committed == reference_markdown(), f"docs/configuration.md is stale; regenerate it: {REGENERATE}"


def test_every_config_key_is_in_the_configuration_reference():
    reference = (ROOT / "docs" / "configuration.md").read_text()
    for key in FIELDS:
        assert f"| `{key}` |" in reference, key


def test_quick_start_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    for line in ('pip install "torch==2.13.0" -e ".[dev]"', "python -m pytest -q"):
        assert line in ci and line in README


def test_every_cli_command_is_in_the_readme():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in sub.choices:
        assert f"rl-ckpt {name}" in README, name


def test_readme_stays_a_product_page():
    lines = README.count("\n")
    assert lines <= 250, f"README.md has {lines} lines; move detail into docs/ and link it"


def _slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def _anchors(text: str) -> set[str]:
    prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
    return {_slug(m) for m in re.findall(r"^#{1,6} (.+)$", prose, re.MULTILINE)}


def test_every_relative_link_resolves():
    """Links in README.md and docs/*.md (files, images, #anchors) point at files and headings that exist."""
    broken = []
    for page in PAGES:
        text = page.read_text()
        prose = re.sub(r"^```.*?^```", "", text, flags=re.DOTALL | re.MULTILINE)
        for target in re.findall(r"\]\(([^)\s]+)\)", prose):
            if re.match(r"[a-z]+:", target):
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.is_file():
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such file)")
            elif anchor and file.suffix == ".md" and anchor not in _anchors(file.read_text()):
                broken.append(f"{page.relative_to(ROOT)}: {target} (no such heading)")
    assert not broken, broken
    readme_links = re.findall(r"\]\(((?:docs|examples)/[^)#\s]+)", README)
    assert len(readme_links) >= 10  # the README links its docs; the check above ran over them


def test_every_repository_path_named_in_the_docs_exists():
    """`tests/...`, `examples/...`, `rl_ckpt/...` and the like, written in backticks, name files that exist."""
    missing = []
    for page in PAGES:
        named = re.findall(r"`((?:tests|examples|benchmarks|configs|rl_ckpt|actors)/[\w./*\-]+)`", page.read_text())
        missing += [
            f"{page.relative_to(ROOT)}: {path}" for path in sorted(set(named)) if not list(ROOT.glob(path.rstrip("/")))
        ]
    assert not missing, missing


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_python_blocks_compile_and_import_what_exists(page):
    """Every ```python block is valid Python, and every name it imports exists in the current API."""
    for block in _blocks(page.read_text(), "python"):
        tree = ast.parse(block)
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                module = importlib.import_module(node.module)
                for alias in node.names:
                    assert hasattr(module, alias.name) or importlib.util.find_spec(f"{node.module}.{alias.name}"), (
                        f"{page.name}: from {node.module} import {alias.name}"
                    )
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    importlib.import_module(alias.name)


def test_readme_single_process_example_runs_and_resumes(tmp_path, monkeypatch):
    """The README's one-process example, run as written (in a fresh folder), twice: the second run restores."""
    (example,) = _blocks(_readme_section("One process"), "python")
    monkeypatch.chdir(tmp_path)
    first: dict = {}
    exec(compile(example, "README.md", "exec"), first)  # noqa: S102 (the README's own example)
    assert first["result"].fresh
    newest = first["engine"].snapshots()[-1]
    assert newest.global_step > 0
    second: dict = {}
    exec(compile(example, "README.md", "exec"), second)  # noqa: S102
    assert second["result"].snapshot_id == newest.snapshot_id
    assert second["result"].global_step == newest.global_step
    assert second["progress"].global_step == 100
