"""Storage protocols from entry points: ``raymem://`` comes in through the ``rl_ckpt.storage`` group, so
``rl_ckpt/_storage`` names nothing above it, and opening other URLs never imports Ray."""

from __future__ import annotations

import pathlib
import subprocess
import sys
from importlib.metadata import EntryPoint

import pytest

from rl_ckpt.errors import ConfigError
from rl_ckpt._storage import registry

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_storage_package_names_no_module_above_it():
    for path in (ROOT / "rl_ckpt" / "storage").rglob("*.py"):
        text = path.read_text()
        assert "actors" not in text, f"{path} names the Ray side (actors/): declare it as an entry point instead"


def test_raymem_is_served_through_its_entry_point_and_other_urls_do_not_import_ray():
    code = (
        "import sys\n"
        "from rl_ckpt._storage.registry import storage_class\n"
        "assert storage_class('memory://a').__name__ == 'MemoryStorage'\n"
        "assert storage_class('file:///tmp/a').__name__ == 'LocalStorage'\n"
        "assert 'ray' not in sys.modules, 'opening memory:// or file:// imported ray'\n"
        "cls = storage_class('raymem://run-key')\n"
        "print(cls.__module__, cls.__name__)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["actors._memory.storage", "RayMemoryStorage"]


def test_an_entry_point_that_fails_to_load_is_a_config_error_naming_the_protocol(monkeypatch):
    broken = EntryPoint(name="brokenproto", value="no_such_module_rl_ckpt:Storage", group=registry.ENTRY_POINT_GROUP)
    monkeypatch.setattr(registry, "entry_points", lambda group, name: [broken] if name == "brokenproto" else [])
    with pytest.raises(ConfigError, match="brokenproto") as info:
        registry.storage_class("brokenproto://x/run")
    assert info.value.key == "brokenproto"
    assert "brokenproto" not in registry.registry


def test_an_unknown_protocol_without_entry_point_falls_back_to_fsspec():
    assert registry.storage_class("gcs://bucket/run").__name__ == "FsspecStorage"
