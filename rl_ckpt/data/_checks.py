"""What every data component checks at restore: the saved position must fit the data given now."""

from __future__ import annotations

from typing import Any

from rl_ckpt.errors import DataPositionError


def require_same(component: str, field: str, saved: Any, given: Any, hint: str) -> None:
    """Raise a ``DataPositionError`` naming both values when ``saved != given`` (never a silent restart)."""
    if saved != given:
        raise DataPositionError(
            f"{component}: the snapshot's data position was saved with {field}={saved!r}, but the data given at "
            f"restore has {field}={given!r}; resuming would skip or repeat data. {hint}",
            component=component,
            field=field,
            saved=saved,
            given=given,
        )


def state_int(component: str, state: dict, key: str, low: int = 0) -> int:
    """``state[key]`` as an int >= ``low`` (a saved state is checked before it moves anything)."""
    value = state.get(key)
    if isinstance(value, bool) or not isinstance(value, int) or value < low:
        raise DataPositionError(
            f"{component}: the saved state's {key!r} is {value!r}, not an int >= {low}",
            component=component,
            field=key,
            saved=value,
            given=None,
        )
    return value
