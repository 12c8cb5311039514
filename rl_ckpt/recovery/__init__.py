"""Recovery: the plan (what to load, in which order, with which checks), the coordinator (failure -> action), the post-load probe."""
