"""``CheckpointConfig``: every knob, validated, from kwargs, a dict or YAML.

Keys follow the checkpoint config of the source article (§3.1). An unknown key
or a bad value raises :class:`ConfigError` naming the key and what is allowed.
"""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any, Mapping

from rl_ckpt.errors import ConfigError

CHECKSUM_ALGOS = ("xxh3_128", "blake3", "sha256")
BEST_MODES = ("max", "min")
DEFAULT_LIGHT_COMPONENTS = ("progress", "rng", "lr_scheduler", "scheduler")
_RUN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def _int(minimum: int, optional: bool = False, maximum: int | None = None):
    def check(key: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if (
            isinstance(value, bool)
            or not isinstance(value, int)
            or value < minimum
            or (maximum is not None and value > maximum)
        ):
            allowed = (
                f"an integer from {minimum} to {maximum}" if maximum is not None else f"an integer >= {minimum}"
            ) + (" or null" if optional else "")
            raise ConfigError(f"config key {key!r}: got {value!r}; allowed: {allowed}", key=key, allowed=allowed)
        return value

    return check


def _number(minimum: float, optional: bool = False):
    def check(key: str, value: Any) -> Any:
        if value is None and optional:
            return None
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < minimum:
            allowed = f"a number >= {minimum}" + (" or null" if optional else "")
            raise ConfigError(f"config key {key!r}: got {value!r}; allowed: {allowed}", key=key, allowed=allowed)
        return float(value)

    return check


def _bool(key: str, value: Any) -> bool:
    if not isinstance(value, bool):
        raise ConfigError(f"config key {key!r}: got {value!r}; allowed: true or false", key=key, allowed="true/false")
    return value


def _choice(choices: tuple[str, ...]):
    def check(key: str, value: Any) -> str:
        if value not in choices:
            raise ConfigError(
                f"config key {key!r}: got {value!r}; allowed: {', '.join(choices)}", key=key, allowed=list(choices)
            )
        return value

    return check


def _str_or_list(choices: tuple[str, ...] | None = None):
    """A string, or a non-empty list of strings (multi-objective, priority order)."""

    def check(key: str, value: Any) -> Any:
        items = [value] if isinstance(value, str) else value
        if not isinstance(items, (list, tuple)) or not items or not all(isinstance(v, str) and v for v in items):
            raise ConfigError(
                f"config key {key!r}: got {value!r}; allowed: a name or a list of names",
                key=key,
                allowed="str | list[str]",
            )
        if choices is not None:
            for v in items:
                _choice(choices)(key, v)
        return value if isinstance(value, str) else list(items)

    return check


def _str(key: str, value: Any) -> str:
    if not isinstance(value, str) or not value:
        raise ConfigError(f"config key {key!r}: got {value!r}; allowed: a non-empty string", key=key, allowed="str")
    return value


def _run_name(key: str, value: Any) -> str:
    if not isinstance(value, str) or not _RUN_NAME.match(value) or value in (".", ".."):
        raise ConfigError(
            f"config key {key!r}: got {value!r}; allowed: letters, digits, '.', '_', '-' (no '/'), 1-128 chars",
            key=key,
            allowed=_RUN_NAME.pattern,
        )
    return value


def _mapping(key: str, value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise ConfigError(f"config key {key!r}: got {value!r}; allowed: a mapping", key=key, allowed="dict")
    return dict(value)


def _names(key: str, value: Any) -> tuple[str, ...]:
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) and v for v in value):
        raise ConfigError(
            f"config key {key!r}: got {value!r}; allowed: a list of component names", key=key, allowed="list[str]"
        )
    return tuple(value)


# key -> (default, validator, help). docs/configuration.md is generated from this table (reference_markdown).
FIELDS: dict[str, tuple[Any, Any, str]] = {
    "base_dir": (
        "./checkpoints",
        _str,
        "Where runs live: a plain path, file://, memory://, s3://bucket/prefix, or any fsspec URL.",
    ),
    "run_name": ("run", _run_name, "Folder under base_dir holding this run's snapshots."),
    "storage_options": (
        {},
        _mapping,
        "Passed to fsspec (e.g. S3 endpoint_url, key, secret). Never written to manifests. On S3 also "
        "max_concurrency (requests in flight per file, default 16) and default_block_size (bytes of a part and of "
        "a ranged GET, default 8 MiB) and server_checksums (the checksum each part carries for the server to check: "
        "crc32, sha256 or false; default crc32): docs/storage.md.",
    ),
    "save_interval_steps": (500, _int(0, optional=True), "Full snapshot every N training steps (0/null: off)."),
    "save_interval_seconds": (
        1800.0,
        _number(0, optional=True),
        "...or every N seconds, whichever comes first (0/null: off).",
    ),
    "light_interval_steps": (
        0,
        _int(0, optional=True),
        "Light snapshot (progress, RNG, scheduler) every N steps (0: off).",
    ),
    "light_components": (DEFAULT_LIGHT_COMPONENTS, _names, "Components saved in light snapshots (by registered name)."),
    "keep_latest": (5, _int(1), "Keep the N newest full snapshots."),
    "keep_best": (3, _int(0), "Also keep the N best snapshots by best_metric."),
    "best_metric": (
        "avg_reward",
        _str_or_list(),
        "Metric (or list of metrics in priority order) that ranks snapshots.",
    ),
    "best_mode": ("max", _str_or_list(BEST_MODES), "max or min (or a list matching best_metric)."),
    "keep_interval_steps": (
        None,
        _int(1, optional=True),
        "Also keep every snapshot whose step is a multiple of N (archive points).",
    ),
    "atomic_write": (True, _bool, "Stage the snapshot and publish it with one atomic rename (local/NFS)."),
    "verify_after_write": (True, _bool, "Re-read every written file and compare checksums before committing."),
    # xxh3_128 by default: 20+ GB/s here against 1.7 GB/s for sha256, and a save hashes twice. It is a
    # 128-bit corruption check, not a security hash; neither is sha256 in an unsigned manifest, since
    # whoever can rewrite a shard can rewrite the manifest too. sha256 stays one key away.
    "checksum_algo": (
        "xxh3_128",
        _choice(CHECKSUM_ALGOS),
        "Checksum of every file: xxh3_128 (fast, detects corruption), blake3 or sha256 (cryptographic).",
    ),
    "writer_nice": (
        10,
        _int(0, maximum=19),
        "save_async: run the background writer thread this much nicer (Linux, 0-19) so training threads win a "
        "contended core; 0 keeps normal priority.",
    ),
    "save_optimizer": (True, _bool, "Save optimizer components (torch.optim.Optimizer)."),
    "save_rng_state": (True, _bool, "Save RNGState components."),
    "save_replay_buffer": (True, _bool, "Save components named like *buffer*."),
    "dedup": (False, _bool, "Store tensor data content-addressed in objects/ so unchanged tensors are written once."),
    "dedup_min_tensor_bytes": (
        64 << 10,
        _int(0),
        "With dedup: smaller tensors stay in the snapshot's own safetensors file (an object costs a file and "
        "an fsync).",
    ),
    "schema_version": (
        1,
        _int(1),
        "Your state layout version; bump it when the model structure changes. A mismatch refuses to load.",
    ),
    "post_load_check": (
        True,
        _bool,
        "Record a probe forward pass of each module at save; re-run and compare after load.",
    ),
    "probe_shapes": (
        {},
        _mapping,
        "Probe input shape per component when it cannot be inferred, e.g. {policy: [1, 8]}.",
    ),
    "probe_rtol": (1e-5, _number(0), "Relative tolerance of the post-load probe comparison (allclose)."),
    "probe_atol": (1e-6, _number(0), "Absolute tolerance of the post-load probe comparison (allclose)."),
    "new_rank_state": (
        "derive",
        _choice(("derive", "empty", "error")),
        "Restoring on more ranks than saved, the new ranks' per-rank components: derive (RNGState seeded from "
        "the saved ranks' streams and the rank; buffers start empty), empty (all start as constructed) or "
        "error (refuse, naming ranks and components).",
    ),
    "max_failures": (10, _int(1), "Recovery: give up after this many failures in one run."),
    "max_same_snapshot_failures": (
        3,
        _int(1),
        "Recovery: stop using a snapshot that failed again this many times after restore.",
    ),
    "max_acceptable_loss_steps": (
        None,
        _int(0, optional=True),
        "Recovery: if the newest snapshot is more steps behind the failure, consider the best one.",
    ),
    "divergence_threshold": (
        None,
        _number(0, optional=True),
        "Recovery: restore the best snapshot when the newest one's best_metric is worse by more than this fraction.",
    ),
    "heartbeat_interval_seconds": (
        10.0,
        _number(0.01),
        "Ray: participants send a heartbeat at most this often; two missed ones are a failure.",
    ),
    "commit_timeout_seconds": (
        300.0,
        _number(0.1),
        "Ray: abort a sharded snapshot when a participant has not reported by then.",
    ),
    "memory_interval_steps": (
        0,
        _int(0, optional=True),
        "Memory tier (Ray): memory snapshot every N steps into the run's per-node memory stores (0/null: off).",
    ),
    "memory_interval_seconds": (
        None,
        _number(0, optional=True),
        "Memory tier: ...or every N seconds, whichever comes first (0/null: off).",
    ),
    "memory_flush_every": (
        10,
        _int(1, optional=True),
        "Memory tier: durable copy (made from memory, in the background) of every K-th memory snapshot (null: "
        "by time only).",
    ),
    "memory_flush_interval_seconds": (
        None,
        _number(0, optional=True),
        "Memory tier: ...or of the newest memory snapshot once N seconds passed since the last durable copy "
        "(null: off).",
    ),
    "memory_budget_bytes": (
        None,
        _int(1, optional=True),
        "Memory tier: bytes each node's store may hold; the oldest memory snapshots are evicted first, never "
        "the newest committed one (null: no limit).",
    ),
    "memory_replicas": (
        1,
        _int(0),
        "Memory tier: copies of each memory snapshot file on stores of other nodes (0: none; a node lost then "
        "falls back to durable).",
    ),
    "min_free_bytes": (1 << 30, _int(0), "Health patrol: warn when the storage has less free space than this."),
    "scrub_bytes_per_second": (64 << 20, _int(1), "Health patrol: read-rate limit when re-hashing old snapshots."),
}


_REFERENCE_HEAD = """# Configuration

<!-- Generated from rl_ckpt.config.FIELDS; do not edit. Regenerate with:
python -c "from rl_ckpt.config import reference_markdown as r; print(r(), end='')" > docs/configuration.md -->

Keys follow the YAML of `configs/ppo.yaml`. Build a config from keywords (`CheckpointConfig(keep_latest=3)`, or the
same keywords on `CheckpointEngine(...)`), `CheckpointConfig.from_dict(...)` or `CheckpointConfig.from_yaml(path)`
(keys at the top level or under `checkpoint:`). An unknown key or a bad value raises `ConfigError` naming the key
and what is allowed. Defaults are written as YAML values.

| key | default | meaning |
|---|---|---|
"""


def reference_markdown() -> str:
    """docs/configuration.md: every key of ``FIELDS``, its default and help (tests/test_docs.py keeps it current)."""
    rows = [
        f"| `{key}` | `{json.dumps(list(default) if isinstance(default, tuple) else default)}` | {text} |"
        for key, (default, _check, text) in FIELDS.items()
    ]
    return _REFERENCE_HEAD + "\n".join(rows) + "\n"


class CheckpointConfig:
    """Validated checkpoint configuration. Build with kwargs, ``from_dict`` or ``from_yaml``.

    Every key of ``FIELDS`` is readable as an attribute (``cfg.keep_latest``).
    """

    def __init__(self, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - set(FIELDS))
        if unknown:
            raise ConfigError(
                f"unknown config key {unknown[0]!r}; allowed keys: {', '.join(FIELDS)}",
                key=unknown[0],
                allowed=list(FIELDS),
            )
        values = {}
        for key, (default, check, _help) in FIELDS.items():
            raw = kwargs.get(key, default)
            values[key] = check(key, raw)
        if isinstance(values["best_mode"], list) and not isinstance(values["best_metric"], list):
            raise ConfigError("config key 'best_mode': a list needs best_metric to be a list too", key="best_mode")
        if isinstance(values["best_mode"], list) and len(values["best_mode"]) != len(values["best_metric"]):
            raise ConfigError(
                "config key 'best_mode': give one mode per metric in best_metric",
                key="best_mode",
                allowed="same length",
            )
        self.values = values

    def __repr__(self) -> str:
        return f"CheckpointConfig({self.public_dict()!r})"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CheckpointConfig) and other.values == self.values

    def __getattr__(self, name: str) -> Any:
        values = self.__dict__.get("values", {})
        if name in values:
            return values[name]
        raise AttributeError(name)

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> "CheckpointConfig":
        """Accepts the keys at top level or under a ``checkpoint:`` section."""
        if not isinstance(data, Mapping):
            raise ConfigError(f"config must be a mapping, got {type(data).__name__}", key="<root>")
        if set(data) == {"checkpoint"} and isinstance(data["checkpoint"], Mapping):
            data = data["checkpoint"]
        return cls(**dict(data))

    @classmethod
    def from_yaml(cls, path: str) -> "CheckpointConfig":
        import yaml

        try:
            with open(path, encoding="utf-8") as f:
                data = yaml.safe_load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}", key="<file>", path=path) from exc
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {path} is not valid YAML: {exc}", key="<file>", path=path) from exc
        return cls.from_dict(data or {})

    def replace(self, **changes: Any) -> "CheckpointConfig":
        return CheckpointConfig(**{**self.values, **changes})

    def to_dict(self) -> dict:
        out = {k: (list(v) if isinstance(v, tuple) else v) for k, v in self.values.items()}
        return out

    def public_dict(self) -> dict:
        """The config as recorded in manifests: storage_options are secrets and stay out."""
        out = self.to_dict()
        out["storage_options"] = sorted(out["storage_options"])  # key names only
        return out

    @property
    def run_url(self) -> str:
        return self.base_dir.rstrip("/") + "/" + self.run_name


# Config keys that change what training does or what a snapshot holds: a
# difference between the snapshot and the running job is worth a warning.
DIGEST_KEYS = ("save_optimizer", "save_rng_state", "save_replay_buffer", "schema_version", "light_components", "dedup")


def recorded_config(cfg: CheckpointConfig, train_config: Mapping[str, Any] | None) -> dict:
    """The config a manifest records (and a restore compares): DIGEST_KEYS plus ``train.<key>`` hyperparameters."""
    public = cfg.public_dict()
    rec = {k: public[k] for k in DIGEST_KEYS}
    for key, value in (train_config or {}).items():
        rec[f"train.{key}"] = value
    # As the manifest will hold it (tuples become lists), so a comparison sees only real changes.
    return json.loads(json.dumps(rec, default=str))


def config_digest(recorded: Mapping[str, Any]) -> str:
    """Stable digest of the settings that shape training (base_dir and storage excluded)."""
    canon = {k: v for k, v in recorded.items() if k not in ("base_dir", "storage_options", "run_name")}
    blob = json.dumps(canon, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def changed_keys(old: Mapping[str, Any], new: Mapping[str, Any]) -> list[str]:
    """Keys whose values differ between two recorded configs (storage location excluded)."""
    keys = (set(old) | set(new)) - {"base_dir", "storage_options", "run_name"}
    return sorted(k for k in keys if old.get(k) != new.get(k))
