"""A streamed write to an fsspec filesystem that never publishes a truncated file.

The chunks go through ``open("wb")`` (a block-buffered file, such as s3fs's, uploads a part each
time a block fills; the last part, or a one-shot PUT, happens at ``close``). If the chunk iterator or a
write fails, the partial file is thrown away: a buffered file discards its multipart upload without the
final flush, any other file is closed and removed (e.g. ``memory://``, where a file is visible from
``open``).
"""

from __future__ import annotations

import logging
from typing import Callable, Iterable

from rl_ckpt.errors import StorageError

log = logging.getLogger("rl_ckpt")


def stream_file(fs, full: str, chunks: Iterable, error: Callable[[Exception], StorageError]) -> int:
    """Write ``chunks`` to ``full`` on ``fs``; returns the bytes written. ``error`` turns a filesystem
    exception into the ``StorageError`` raised; errors of the chunk producer propagate unchanged."""
    try:
        f = fs.open(full, "wb")
    except Exception as exc:
        raise error(exc) from exc
    total = 0
    try:
        for chunk in chunks:  # errors of the chunk producer propagate unchanged
            view = memoryview(chunk).cast("B")
            try:
                f.write(view)  # uploads a part each time a block fills
            except Exception as exc:
                raise error(exc) from exc
            total += view.nbytes
    except BaseException:
        abandon(fs, f, full)
        raise
    try:
        f.close()  # the last part / one-shot PUT happens here
    except Exception as exc:
        raise error(exc) from exc
    return total


def abandon(fs, f, full: str) -> None:
    """Throw away a half-written file without publishing it (best effort)."""
    from fsspec.spec import AbstractBufferedFile

    try:
        if isinstance(f, AbstractBufferedFile):
            f.discard()  # s3fs: abort the multipart upload
            f.closed = True  # skip close()'s final flush, which would publish the partial object
        else:
            f.close()
            fs.rm_file(full)  # e.g. memory://, where the file is visible from open()
    except Exception as exc:  # best effort: gc removes whatever remains
        log.warning("could not abandon partial upload of %s: %s", full, exc)
