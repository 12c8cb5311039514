"""The memory tier's pieces: the per-node ``MemoryStore`` actor (``store``, with its mixins ``reads``, ``pins``,
``landing``, ``borrow``, ``replication``), the ``raymem://`` storage over the run's stores (``storage``,
``directory``, ``view``), and the tier's section of the manager's health (``health``). The public faces are
``actors.memory_tier`` and ``rl_ckpt.integrations.memory_tier``."""
