"""Tables on storage: one Arrow IPC file per ``pyarrow.Table`` (written at save, read and fully validated at load).

pyarrow is imported on first use, so runs without tables never import it.
"""

from __future__ import annotations

from typing import Any

from rl_ckpt.errors import CorruptSnapshotError


def table_bytes(table: Any) -> Any:
    """``table`` as the bytes of an Arrow IPC file (a ``pyarrow.Buffer``)."""
    import pyarrow as pa

    sink = pa.BufferOutputStream()
    with pa.ipc.new_file(sink, table.schema) as w:
        w.write_table(table)
    return sink.getvalue()


def read_table(data: bytes | bytearray | memoryview, where: str) -> Any:
    """The table in an Arrow IPC file's bytes, validated in full; ``CorruptSnapshotError`` naming ``where`` if not."""
    import pyarrow as pa

    try:
        table = pa.ipc.open_file(pa.py_buffer(bytes(data))).read_all()
        table.validate(full=True)
    except (pa.ArrowException, ValueError, OSError) as exc:
        raise CorruptSnapshotError(f"{where}: not a valid Arrow IPC file ({exc})", problems=["bad arrow"]) from None
    return table
