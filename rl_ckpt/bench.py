"""Entry point kept for ``rl-ckpt bench`` and ``from rl_ckpt.bench import ...``: the benchmark lives in
:mod:`rl_ckpt.tools.bench` (its docstring documents every figure)."""

import contextlib
import sys

from rl_ckpt.tools.bench import *  # noqa: F401,F403
from rl_ckpt.tools.bench import __all__, __doc__  # noqa: F401

if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        sys.exit(main())  # noqa: F405
