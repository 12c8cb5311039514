"""The README stays true: every config key is documented and the quick start is what CI runs."""

from __future__ import annotations

import pathlib

from rl_ckpt.cli import build_parser
from rl_ckpt.config import FIELDS

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def test_every_config_key_is_in_the_readme():
    for key in FIELDS:
        assert f"| `{key}` |" in README, key


def test_quick_start_test_command_is_what_ci_runs():
    ci = (ROOT / ".ci" / "run").read_text()
    for line in ('pip install "torch==2.13.0" -e ".[dev]"', "python -m pytest -q"):
        assert line in ci and line in README


def test_every_cli_command_is_in_the_readme():
    sub = next(a for a in build_parser()._actions if a.dest == "command")
    for name in sub.choices:
        assert f"rl-ckpt {name}" in README, name
