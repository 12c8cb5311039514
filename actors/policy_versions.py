"""Policy versions: the learners publish their policy weights into the memory tier; rollout workers pull them.

    # learners (every rank of an FSDP2 group calls it; with replicated learners rank 0 writes, the rest skip)
    versions = PolicyVersions("grpo", model, dtype=torch.bfloat16)
    versions.publish(step)

    # a rollout worker, on any node
    sub = WeightSubscriber("grpo")
    result = sub.pull(policy)                      # "latest", or a version number (the learners' step)
    result.version, result.bytes_moved             # what it holds now; what moved (only changed chunks)

A version is a snapshot of one component (``policy``) in the run's version stores (``raymem://versions/
<run>``, a ``MemoryStore`` per node): the same manifest, per-chunk checksums, verify-after-write and
create-only commit as any snapshot, written by a ``CheckpointEngine`` with ``dedup`` on, so each tensor's
8 MiB chunks are content-addressed objects and versions share what did not change. Retention keeps the
newest ``keep`` versions; a version a worker is reading is pinned and stays until it lets go. A publish
places the version on the nodes where workers pull as it writes it (:class:`VersionsStorage`), so their
pulls find it on their node.

``publish`` returns once the version is committed in the publisher's node's store, not once its placement
has landed: the transfers to the other nodes overlap the workers' pulls. A store never holds a manifest
whose files it does not hold: each placement target commits the version itself once every file it vouches
for has landed there (``MemoryStore.commit_after``), and a worker pulling there meanwhile waits for the
announced files instead of copying them again (``MemoryStore.expect``). ``wait_placed`` waits for the
placements, ``wait_owned`` for the stores' own copies too. A publisher killed before its placement landed
leaves the targets without the manifest; their workers then take the version from the publisher's node
whole (checksummed) or fall back to the previous one, never a partial module.

Publishing cast (``dtype=torch.bfloat16``) writes the floating-point tensors in that dtype and records it
in the manifest's tags (``policy_dtype``); the learners' fp32 state stays theirs (and in their snapshots).
The pulling side is :class:`~actors.weight_subscriber.WeightSubscriber`.
"""

from __future__ import annotations

import logging
import threading

import torch

from rl_ckpt.errors import CheckpointError, ConfigError

from ._versions.held import (  # noqa: F401 (also imported from here)
    COMPONENT,
    FAULTS,
    VERSIONS_BASE,
    not_found,
    published,
    versions_status,
    versions_storage,
)

log = logging.getLogger("rl_ckpt")


class CastPolicy:
    """The module's state with its floating-point tensors cast to ``dtype`` (publishing only)."""

    def __init__(self, module: torch.nn.Module, dtype: torch.dtype) -> None:
        self.module = module
        self.dtype = dtype

    def state_dict(self) -> dict:
        return {
            k: (v.detach().to(self.dtype) if v.is_floating_point() else v.detach())
            for k, v in self.module.state_dict().items()
        }

    def load_state_dict(self, state: dict) -> None:
        raise CheckpointError(
            "a cast policy version is published, never restored into the learners: their "
            "full-precision state is in their own snapshots"
        )


class PolicyVersions:
    """The learners' side: ``publish(step)`` makes the policy of that step a version (module docstring).

    Args:
        run_name: the run (its version stores are ``raymem://versions/<run_name>``).
        module: the policy: a plain module (replicated learners) or an FSDP2 one (every rank publishes its shards).
        keep: versions kept (older ones are retired after each publish, unless a worker pins them).
        replicas: peer stores each file is copied to as it is written (besides placement to pulling nodes).
        budget_bytes: per-store memory budget (a publish that does not fit is refused, nothing held is lost).
        dtype: publish floating-point tensors cast to this dtype (plain modules), recorded in the manifest.
        rank, world_size: this learner's place (default: torch.distributed's, else 0 of 1). With a plain
            module only rank 0 writes (the weights are the same on every rank).
        min_object_bytes: tensors from this size are content-addressed objects (smaller ones share a file).
    """

    def __init__(
        self,
        run_name: str,
        module: torch.nn.Module,
        *,
        keep: int = 4,
        replicas: int = 1,
        budget_bytes: int | None = None,
        dtype: torch.dtype | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        namespace: str = "rl_ckpt",
        min_object_bytes: int = 0,
    ) -> None:
        from rl_ckpt._core.engine import CheckpointEngine
        from rl_ckpt._run.retention import KeepLatest
        from rl_ckpt._sharded import holds_shards

        if keep < 1:
            raise ConfigError(f"PolicyVersions: keep={keep!r}; allowed: an integer >= 1", key="keep", allowed=">= 1")
        self.run_name = run_name
        self.sharded = holds_shards(module)
        if dtype is not None and self.sharded:
            raise ConfigError(
                "PolicyVersions: dtype= casts plain modules; an FSDP2 module is published as it is "
                "sharded (give its params the dtype wanted, or publish from a plain copy)",
                key="dtype",
            )
        if not self.sharded:
            if rank is None and torch.distributed.is_available() and torch.distributed.is_initialized():
                rank = torch.distributed.get_rank()
            rank, world_size = 0 if not rank else rank, 1  # one writer: the weights are the same on every rank
        self.rank = rank or 0
        self.dtype = dtype
        self.keep = keep
        self.storage = versions_storage(run_name, namespace=namespace, replicas=replicas, budget_bytes=budget_bytes)
        self.engine = None
        self.retention = None  # the engine's retention, run by ``_retire_later`` after each publish
        if self.sharded or self.rank == 0:
            self.engine = CheckpointEngine(
                base_dir=VERSIONS_BASE,
                run_name=run_name,
                storage=self.storage,
                retention=KeepLatest(keep),
                dedup=True,
                keep_latest=keep,
                keep_best=0,
                dedup_min_tensor_bytes=min_object_bytes,
                rank=rank,
                world_size=world_size,
            )
            self.engine.register(COMPONENT, CastPolicy(module, dtype) if dtype is not None else module)
            # Retention runs after each publish on a thread of its own (``_retire_later``), not inside the save:
            # the learner goes on while the versions past ``keep`` are retired.
            self.retention, self.engine.pipeline.maintenance = self.engine.pipeline.maintenance, None
        self.retiring: threading.Thread | None = None

    def publish(self, step: int, metrics: dict | None = None) -> str | None:
        """Publish the policy as version ``step`` (returns its snapshot id; None on a replicated rank that does
        not write). Returns once the version is written, verified and committed in this node's store: every
        reader sees it from then on, and it is whole wherever its manifest is. Its placement on the workers'
        other nodes may still be landing (their stores commit it once its files are there; a pull there
        meanwhile waits for them): :meth:`wait_placed` waits for that, :meth:`wait_owned` for everything."""
        if self.engine is None:
            return None
        self.settle()  # the previous publish's retention is done before this one looks at what is held
        # Versions kept past retention while a worker pinned them come back into view and are retired now,
        # before the new one needs room in the budget (retention also runs after the commit, as always).
        files = self.storage.inventory("")  # one listing of the stores for the versions held and the subscribers
        held = published(self.storage, files)
        if self.rank == 0 and len(held) > self.keep:  # (with none pinned, the last publish left ``keep``)
            self.engine.catalog.refresh()
            for warning in self.retention.after_commit():
                log.warning("policy versions of %s: %s", self.run_name, warning)
            held = published(self.storage)
        if self.sharded:  # no rank reuses an object of a version rank 0 is retiring right now
            torch.distributed.barrier()
            self.engine.catalog.refresh()
            held = published(self.storage)
        if step in held:  # published already on this timeline (a restored step): the same weights
            return held[step]
        dtype = str(self.dtype).replace("torch.", "") if self.dtype else "as trained"
        tags = {"policy_version": step, "policy_dtype": dtype}
        # Placement at publish: the nodes where workers pull get each file as it is written (see VersionsStorage).
        here = [self.storage.node_id, *self.storage.peers()]  # (the ``replicas`` peers get copies anyway)
        self.storage.push_to = [n for n in self.storage.subscriber_nodes(files) if n not in here]
        self.storage.wait_pushed(0)  # the placements of earlier publishes that are done: counted, let go
        self.storage.hold_listing(True)
        try:
            info = self.engine.save(step, metrics, tags=tags)
        except BaseException:
            self.storage.wait_pushed()  # a save that failed leaves no copy in flight
            raise
        finally:
            self.storage.push_to = []
            self.storage.hold_listing(False)
        self._retire_later()
        return info.snapshot_id

    def _retire_later(self) -> None:
        """Retire the versions past ``keep`` (those no worker pins) on a thread, while the learner goes on; the
        publisher's next call that looks at the versions (``publish``, ``versions``, ``rewind``, ``status``,
        ``wait_owned``, ``close``) waits for it first (:meth:`settle`). A publisher killed meanwhile leaves
        ``keep`` + 1 versions at most, retired by the next publish."""
        if self.retention is None or not self.engine.pipeline.topology.runs_maintenance:
            return

        def run() -> None:
            self.storage.hold_listing(True)  # one listing; the objects swept go at once, waited for at the end
            try:
                for warning in self.retention.after_commit():
                    log.warning("policy versions of %s: %s", self.run_name, warning)
            except Exception as exc:  # the version is committed whatever happens here; the next publish retries
                log.warning("policy versions of %s: retention after publishing failed: %s", self.run_name, exc)
            finally:
                self.storage.hold_listing(False)

        self.retiring = threading.Thread(target=run, name="rl_ckpt-versions-retention", daemon=True)
        self.retiring.start()

    def settle(self) -> None:
        """Wait for the retention started by the last publish (see :meth:`_retire_later`)."""
        if self.retiring is not None:
            self.retiring.join()
            self.retiring = None

    def rewind(self, step: int) -> list[str]:
        """After the learners restored ``step``: retire the versions newer than it (they belong to the timeline
        that failed; the steps are published anew). Rank 0 does it; returns the snapshot ids retired."""
        from rl_ckpt._run.delete import delete_snapshot

        if self.engine is None or self.rank != 0:
            return []
        self.settle()
        self.storage.wait_pushed()  # no target commits a version of the failed timeline after it is retired
        gone = [sid for v, sid in published(self.storage).items() if v > step]
        for sid in gone:
            delete_snapshot(self.storage, sid)
        self.engine.catalog.refresh()
        if gone:
            log.info("policy versions of %s: retired %s (newer than the restored step %d)", self.run_name, gone, step)
        return gone

    def wait_placed(self, timeout: float | None = None) -> bool:
        """Block until the placements of what was published have landed (or failed: logged, the workers of that
        node place the version when they pull) and each target committed or refused it; True when none is left
        in flight, False when ``timeout`` passed first."""
        self.storage.wait_pushed(timeout)
        return not self.storage.pushing

    def wait_owned(self, timeout: float | None = None) -> bool:
        """Block until the placements landed (:meth:`wait_placed`) and every store owns its copy of what was
        published (True: from then on the versions outlive this publisher), or ``timeout`` passed (False).
        ``publish`` returns before both: see ``VersionsStorage``."""
        import time

        self.settle()
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self.wait_placed(timeout):
            return False
        left = None if deadline is None else max(deadline - time.monotonic(), 0.0)
        return all(self.storage.each("wait_owned", left).values())

    def versions(self) -> list[int]:
        """The versions published and not retired, oldest first."""
        self.settle()
        return list(published(self.storage))

    def status(self) -> dict:
        """Versions held, bytes per node, pins and the faults rollout workers reported (for /healthz)."""
        self.settle()
        return versions_status(self.storage)

    def close(self) -> None:
        self.settle()
        if self.engine is not None:
            self.engine.close()
