"""Ray Train v2's placement-group cleaner, made to tell "dead" from "not answered" (importable by Ray workers
through the test cluster's PYTHONPATH).

Ray Train v2 (2.60) starts a detached ``PlacementGroupCleaner`` per run that removes the run's placement group
when it thinks the controller died. It decides with ``is_actor_alive``, which returns falsy when the State API
returns no record for the controller, which a loaded GCS does: the cleaner then removes the placement group of a
live run, every worker of the attempt is destroyed ("Destroying worker since its placement group was removed")
and the run fails once more than the test made it fail. Upstream knows it ("is_actor_alive also treats a missing
State API result as dead", ray-project/ray#65447). Here only a record that says DEAD counts as dead.

``install()`` (the session's driver) makes Ray Train use ``TolerantCleanerCallback``; the controller unpickles it
from this module, whose import there swaps the cleaner class, and the cleaner's process imports this module for
its class, whose import there swaps the liveness check.
"""

from __future__ import annotations

from ray.train.v2._internal.callbacks import placement_group_callback
from ray.train.v2._internal.execution.controller import placement_group_cleaner
from ray.train.v2._internal.state.util import get_actor


def alive_unless_recorded_dead(actor_id: str, timeout: int) -> bool:
    """False only when the State API has the actor and says DEAD (no record: not known dead, keep watching)."""
    state = get_actor(actor_id, timeout=timeout)
    return state is None or state.state != "DEAD"


class TolerantCleaner(placement_group_cleaner.PlacementGroupCleaner):
    """The cleaner, run from this module so its process applies the liveness check above."""


class TolerantCleanerCallback(placement_group_callback.PlacementGroupCleanerCallback):
    """The cleaner callback, unpickled from this module by the controller (which then launches ``TolerantCleaner``)."""


placement_group_cleaner.is_actor_alive = alive_unless_recorded_dead
placement_group_callback.PlacementGroupCleaner = TolerantCleaner


def install() -> None:
    """Make Ray Train runs started by this process use the tolerant cleaner."""
    from ray.train.v2.api import data_parallel_trainer

    data_parallel_trainer.PlacementGroupCleanerCallback = TolerantCleanerCallback
