"""Which :class:`Storage` class serves a URL: a protocol -> class table, as fsspec's registry.

Plain paths and ``file://`` go to :class:`LocalStorage` (real fsync, atomic
rename), ``s3://``/``s3a://`` to :class:`S3Storage`, ``memory://`` to
:class:`MemoryStorage`. Other packages add protocols through the ``rl_ckpt.storage``
entry-point group (``[project.entry-points."rl_ckpt.storage"]``, name = protocol, value =
the class), loaded on first use of that protocol; this is how ``raymem://`` (the Ray memory
tier) comes in without this package naming it. Any other protocol fsspec knows falls back to
:class:`FsspecStorage`. Every registered class is built as ``cls(url, storage_options)``.
"""

from __future__ import annotations

from importlib.metadata import entry_points

from rl_ckpt.errors import ConfigError
from rl_ckpt._storage.base import Storage
from rl_ckpt._storage.fsspec_store import FsspecStorage
from rl_ckpt._storage.local import LocalStorage
from rl_ckpt._storage.memory import MemoryStorage
from rl_ckpt._storage.s3 import S3Storage

registry: dict[str, type[Storage]] = {
    "file": LocalStorage,
    "memory": MemoryStorage,
    "s3": S3Storage,
    "s3a": S3Storage,
}


ENTRY_POINT_GROUP = "rl_ckpt.storage"


def register_storage(protocol: str, cls: type[Storage], *, clobber: bool = False) -> None:
    """Serve ``protocol://`` URLs with ``cls`` (built as ``cls(url, storage_options)``).

    Replacing a protocol that already has a class needs ``clobber=True``, so two
    plugins cannot silently take the same protocol.
    """
    if not (isinstance(cls, type) and issubclass(cls, Storage)):
        raise ConfigError(f"cannot register {cls!r} for {protocol!r}: not a Storage subclass", key=protocol)
    key = protocol.lower()
    if key in registry and registry[key] is not cls and not clobber:
        raise ConfigError(
            f"protocol {protocol!r} is already served by {registry[key].__name__}; pass clobber=True to replace it",
            key=protocol,
        )
    registry[key] = cls


def protocol_of(url: str) -> str:
    """The protocol of ``url`` as the registry keys it: ``file`` for plain paths; for a chained fsspec URL
    (``simplecache::s3://...``) the outermost one."""
    if "://" not in url:
        return "file"
    return url.split("::", 1)[0].split("://", 1)[0].lower()


def storage_class(url: str) -> type[Storage]:
    """The class that serves ``url``: the registered one, else :class:`FsspecStorage`."""
    protocol = protocol_of(url)
    if protocol not in registry:
        _load_entry_point(protocol)
    return registry.get(protocol, FsspecStorage)


def _load_entry_point(protocol: str) -> None:
    """Register the class an installed package declares for ``protocol`` (imported only now, so opening other
    URLs never imports, e.g., Ray)."""
    for ep in entry_points(group=ENTRY_POINT_GROUP, name=protocol):
        try:
            cls = ep.load()
        except Exception as exc:
            raise ConfigError(
                f"storage protocol {protocol!r}: its entry point {ep.value!r} failed to load ({exc}); "
                "check that the package providing it is installed with its dependencies",
                key=protocol,
            ) from exc
        register_storage(protocol, cls)
        return


def open_storage(url: str, storage_options: dict | None = None) -> Storage:
    """Open the storage rooted at ``url`` (a run folder)."""
    return storage_class(url)(url, storage_options)
