"""Metrics as a manifest holds them: JSON numbers, with non-finite floats spelled as strings; encoded by
:func:`clean_metrics` at save, decoded by :func:`decode_metrics` when read back."""

from __future__ import annotations

import math
from typing import Any, Mapping

from rl_ckpt.errors import ConfigError


def clean_metrics(metrics: Mapping[str, Any] | None) -> dict:
    """Metrics as JSON: numbers (numpy/0-d tensors too) become floats; non-finite ones become strings."""
    out = {}
    for key, value in (metrics or {}).items():
        if hasattr(value, "item") and not isinstance(value, (int, float)):
            value = value.item()
        if isinstance(value, bool) or value is None or isinstance(value, str):
            out[str(key)] = value
        elif isinstance(value, (int, float)):
            out[str(key)] = value if math.isfinite(value) else repr(float(value))
        else:
            raise ConfigError(f"metric {key!r}: {type(value).__name__} is not a number", key=str(key))
    return out


def decode_metrics(metrics: dict) -> dict:
    """Manifest metrics back to numbers: non-finite floats are stored as 'nan', 'inf', '-inf'."""
    return {k: float(v) if v in ("nan", "inf", "-inf") else v for k, v in metrics.items()}
