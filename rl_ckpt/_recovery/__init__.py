"""Recovery: the plan (what to load, in which order, with which checks), the coordinator (failure -> action, a pure
function of settings, snapshots and history), the recorded history (failures/, decisions/), the post-load probe."""
