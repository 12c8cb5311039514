"""Where a ``raymem://`` storage finds the run's stores: one named ``MemoryStore`` actor per node
(``actors/_memory/store.py``). The stores already found are kept (``known_stores``) and asked first; the cluster's
named actors are listed (``stores``) for a listing of the run, or when no known store holds a file.

A mixin of ``RayMemoryStorage``: it uses the storage's key, namespace, budget, replicas, node and handles, and
counts its Ray round trips in ``calls``.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from rl_ckpt.errors import StorageError

from .store import STORE_PREFIX, store_actor

log = logging.getLogger("rl_ckpt")


def need_ray():
    """The ``ray`` module, once a Ray cluster is connected (StorageError saying how otherwise)."""
    import ray

    if not ray.is_initialized():
        raise StorageError("raymem:// storage needs a Ray cluster: call ray.init() (or run inside a Ray task)", path="")
    return ray


class StoreDirectory:
    # -- stores ---------------------------------------------------------------
    @property
    def node_id(self) -> str:
        """The node whose store takes this process's writes."""
        if self._node is None:
            self._node = need_ray().get_runtime_context().get_node_id()
        return self._node

    def store_of(self, node_id: str):
        handle = self._handles.get(node_id)
        if handle is None:
            handle = store_actor(self.key, node_id, self.budget_bytes, self.namespace)
            self._handles[node_id] = handle
        return handle

    def stores(self) -> dict[str, Any]:
        """The live stores of this run: node id -> actor handle. A store already known keeps its handle (no lookup
        per listing); one a call found dead was forgotten (``forget``), so it is looked up again."""
        ray = need_ray()
        prefix = f"{STORE_PREFIX}:{self.key}:"
        found = {}
        self.calls["store_listings"] += 1
        known = dict(self._handles)
        for item in ray.util.list_named_actors(all_namespaces=True):
            name, namespace = item["name"], item["namespace"]
            if namespace != self.namespace or not name.startswith(prefix):
                continue
            node = name[len(prefix) :]
            handle = known.get(node) or self.lookup(node)
            if handle is not None:
                found[node] = handle
        self._handles = found
        return found

    def lookup(self, node: str):
        """The handle of ``node``'s store as the cluster names it now (None: no such store)."""
        try:
            return need_ray().get_actor(f"{STORE_PREFIX}:{self.key}:{node}", namespace=self.namespace)
        except ValueError:  # died between the listing and the lookup
            return None

    def warm_up(self) -> None:
        """List the run's stores and get their handles on a thread (``Storage.warm_up``): a restore that follows
        finds them known (``known_stores`` waits for the thread). Without a Ray cluster, nothing."""
        import ray

        if self._warming is not None or not ray.is_initialized():
            return

        def contact() -> None:
            try:
                self.stores()
                _ = self.node_id
            except Exception as exc:  # the restore's own calls meet the problem and report it
                log.debug("memory stores of %s: first contact failed (%s)", self.key, exc)

        self._warming = threading.Thread(target=contact, name="rl_ckpt-mem-contact", daemon=True)
        self._warming.start()

    def each(self, method: str, *args: Any, stores: dict | None = None) -> dict[str, Any]:
        """``method(*args)`` on every live store at once: node id -> result (dead stores are left out)."""
        ray = need_ray()
        stores = self.stores() if stores is None else stores
        refs = {node: getattr(h, method).remote(*args) for node, h in stores.items()}
        self.calls["store_calls"] += len(refs)
        out = {}
        for node, ref in refs.items():
            try:
                out[node] = ray.get(ref)
            except ray.exceptions.RayActorError:
                self._handles.pop(node, None)
        return out

    def peers(self, node_id: str | None = None) -> list[str]:
        """The nodes that receive copies of what ``node_id`` (default: this one) writes: the next ``replicas``
        alive nodes in node-id order."""
        node_id = node_id or self.node_id
        if self.replicas == 0:
            return []
        alive = sorted(n["NodeID"] for n in need_ray().nodes() if n.get("Alive"))
        ring = [n for n in alive if n > node_id] + [n for n in alive if n < node_id]
        return ring[: self.replicas]

    def holders(self, fresh: bool = True) -> list[tuple[str, Any]]:
        """Stores to ask for a file, this node's first: listed now (``fresh``), else the ones already known."""
        stores = self.stores() if fresh or not self._handles else dict(self._handles)
        local = self._node if self._node in stores else None
        order = ([local] if local else []) + sorted(n for n in stores if n != local)
        return [(n, stores[n]) for n in order]

    def known_stores(self) -> dict[str, Any]:
        """The stores this process has already found (some may have died since): node id -> handle. Waits for the
        first contact ``warm_up`` started, if it is still under way."""
        warming = self._warming
        if warming is not None and warming is not threading.current_thread():
            warming.join()
        return dict(self._handles)

    def forget(self, node: str) -> None:
        """Drop the handle of ``node``'s store (it died)."""
        self._handles.pop(node, None)

    def remember(self, node: str, handle: Any) -> None:
        """Keep ``handle`` as ``node``'s store (found by ``lookup`` after the one known died)."""
        self._handles[node] = handle
