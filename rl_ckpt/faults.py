"""Entry point kept for ``from rl_ckpt.faults import ...``: the fault-injection storages live in
:mod:`rl_ckpt.tools.faults`."""

from rl_ckpt.tools.faults import *  # noqa: F401,F403
from rl_ckpt.tools.faults import __all__  # noqa: F401
