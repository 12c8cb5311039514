"""Fault injection over the storage interface, for tests and reliability drills.

``FaultyStorage(inner)`` forwards every call to ``inner`` and records it in
``ops`` as ``(operation, path)``. Rules make chosen operations misbehave:

    fs = FaultyStorage(open_storage(url))
    fs.fail("write", nth=3, error=errno.ENOSPC)          # the 3rd write: disk full
    fs.fail("rename_dir", error=errno.EIO)                # every rename: I/O error
    fs.before("write", hook=gate.wait, path_contains=".safetensors")  # block until released
    fs.before("remove_tree", nth=1, hook=lambda: os.kill(os.getpid(), signal.SIGKILL))

Operations: write, write_atomic, read, open_read, list, exists, size, remove,
remove_tree, makedirs, rename_dir, sync_dir; ``"*"`` matches any of them, so
``fs.before("*", hook, nth=k)`` runs ``hook`` before the k-th call of any kind.

``PowerLossStorage(LocalStorage(root))`` simulates a power cut on a local disk:
it keeps a journal of every effect that is not yet durable (data written
without fsync, names created, renamed or removed in a folder that was not
fsynced since) and ``power_cut()`` undoes them on the real files, as the disk
would after losing power. See its docstring for the exact model.
"""

from rl_ckpt.tools.faults.faulty import ANY, OPERATIONS, FaultyStorage, Rule
from rl_ckpt.tools.faults.powerloss import Effect, PowerCut, PowerLossStorage

__all__ = ["ANY", "OPERATIONS", "Effect", "FaultyStorage", "PowerCut", "PowerLossStorage", "Rule"]
