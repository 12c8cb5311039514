"""``python -m rl_ckpt.tools.fault_suite``: run the suite (options: ``--help``)."""

import sys

if __name__ == "__main__":
    # Child processes find their targets in the importable rl_ckpt.tools.fault_suite; without a spec and a file
    # for __main__, multiprocessing does not re-run this file as each child's __main__.
    _this = sys.modules["__main__"]
    _this.__spec__ = None
    del _this.__file__
    from rl_ckpt.tools.fault_suite import main

    sys.exit(main())
