"""Write one component's files into an attempt, hashing while writing.

Per component: ``<name>.safetensors`` (tensors and arrays), ``<name>.tN.arrow``
(tables) and ``<name>.json`` (the structure). Each file's checksum is computed
from the very bytes handed to storage, then (``verify_after_write``) compared
with an independent re-read before the snapshot may commit (both in
:mod:`rl_ckpt._format.hashed_io`).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

from rl_ckpt._format import safetensors_io
from rl_ckpt._format.arrow_io import table_bytes
from rl_ckpt._run.layout import Attempt
from rl_ckpt._format.hashed_io import verify_written, write_hashed
from rl_ckpt._format.manifest import FileEntry
from rl_ckpt._format.state_codec import EncodedState, array_nbytes
from rl_ckpt._storage import Storage

if TYPE_CHECKING:
    from rl_ckpt._run.dedup import ObjectWriter


def write_component(
    storage: Storage,
    attempt: Attempt,
    name: str,
    enc: EncodedState,
    *,
    algo: str,
    verify: bool,
    objects: "ObjectWriter | None" = None,
) -> tuple[list[FileEntry], dict]:
    """Write one component; returns its file entries and its manifest section.

    With ``objects`` (dedup), tensors go to the content-addressed object store
    instead of a per-snapshot safetensors file.
    """
    files: list[FileEntry] = []
    section: dict = {"tensors": {}, "tables": {}}

    def put(file_name: str, role: str, chunks: list) -> None:
        path = attempt.data_path(file_name)
        size, digest = write_hashed(storage, path, chunks, algo)
        entry = FileEntry(attempt.manifest_path(file_name), size, digest, algo, name, role)
        if verify:
            verify_written(storage, path, entry)
        files.append(entry)

    in_file = enc.arrays
    if enc.arrays and objects is not None:
        # Tensors below dedup_min_tensor_bytes (norms, biases, step counters: ~0.1 % of the bytes, most
        # of the tensors) go to the snapshot's own safetensors file: one object each would cost a file
        # and an fsync apiece, for nothing worth deduplicating.
        big = {k: v for k, v in enc.arrays.items() if array_nbytes(v) >= objects.min_bytes}
        in_file = {k: v for k, v in enc.arrays.items() if k not in big}
        if big:
            section["objects_algo"] = objects.algo
            section["objects"] = {}
            for key in sorted(big):
                value = big[key]
                section["tensors"][key] = {"dtype": safetensors_io.array_code(value), "shape": list(value.shape)}
                section["objects"][key] = objects.put(safetensors_io.byte_view(value), verify)
            objects.flush(verify)  # every object this section names is durable before it can be committed
    if in_file:
        chunks, tensor_meta = safetensors_io.encode(in_file, metadata={"component": name})
        section["tensors"].update(tensor_meta)
        put(f"{name}.safetensors", "tensors", chunks)
    for i, (table_name, table) in enumerate(sorted(enc.tables.items())):
        file_name = f"{name}.t{i}.arrow"
        section["tables"][table_name] = attempt.manifest_path(file_name)
        put(file_name, "table", [table_bytes(table)])
    tree = json.dumps(enc.tree, separators=(",", ":"), allow_nan=False).encode()
    put(f"{name}.json", "json", [tree])
    return files, section
