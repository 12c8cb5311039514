"""Entry point kept for ``python -m rl_ckpt.fault_suite``: the suite lives in :mod:`rl_ckpt.tools.fault_suite`.

    python -m rl_ckpt.fault_suite [--quick | --long] [--json] [--base-dir DIR] [--only NAME ...]
"""

import sys

from rl_ckpt.tools.fault_suite import *  # noqa: F401,F403
from rl_ckpt.tools.fault_suite import __all__  # noqa: F401

if __name__ == "__main__":
    # Child processes find their targets in the importable rl_ckpt.tools.fault_suite; without a spec and a file
    # for __main__, multiprocessing does not re-run this file as each child's __main__.
    _this = sys.modules["__main__"]
    _this.__spec__ = None
    del _this.__file__
    from rl_ckpt.tools.fault_suite import main as _main

    sys.exit(_main())
