"""How a snapshot becomes visible: the commit protocol, in one package.

=================  ==========================================================================================
``base``           ``CommitStrategy``: the interface every topology commits through, and its call order
``local``          ``StagedRenameCommit``: a staging folder and one no-replace rename (local disks, NFS)
``object_store``   ``ManifestLastCommit``: data first, the manifest last as a create-only write (object stores)
``parts``          ``merge_parts``: several participants' manifest parts -> the one manifest committed
``two_phase``      ``CommitProtocol``: the coordinator of a commit with several participants (pure Python,
                   no Ray; the ``CheckpointManager`` actor drives it through ``actors/_manager/commits.py``)
``participant``    ``ParticipantCommit``: one participant's side of that protocol
``collective``     ``DistributedCommit``: ranks of a torch.distributed group, rank 0 coordinating, no manager
``flush``          ``flush_snapshot``: a memory-tier snapshot committed again on durable storage
=================  ==========================================================================================

Attempt folders and report files are named by :mod:`rl_ckpt._run.layout` (the run folder's one map).
"""

from rl_ckpt._commit.base import Attempt, CommitStrategy
from rl_ckpt._commit.local import StagedRenameCommit
from rl_ckpt._commit.object_store import ManifestLastCommit
from rl_ckpt._storage import Storage


def strategy_for(storage: Storage, atomic_write: bool = True) -> CommitStrategy:
    """Staged rename where the backend can rename folders atomically, else manifest-last."""
    if atomic_write and storage.supports_rename:
        return StagedRenameCommit(storage)
    return ManifestLastCommit(storage)


__all__ = ["Attempt", "CommitStrategy", "ManifestLastCommit", "StagedRenameCommit", "strategy_for"]
