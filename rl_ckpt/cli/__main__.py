"""``python -m rl_ckpt.cli``: the ``rl-ckpt`` command."""

import sys

from rl_ckpt.cli import main

sys.exit(main())
