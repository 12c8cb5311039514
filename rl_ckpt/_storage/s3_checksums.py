"""Verify-after-write on S3 through checksums the server checks (``S3Storage``'s mixin; docs/storage.md says why
it is as strong as a read-back).

Each part and PUT of ``S3Storage.write`` carries the CRC32 (or SHA-256) of its body, computed from the memory sent
(``s3_transfer``). Whether the endpoint checks them is shown, not assumed: before the first write that relies on
it, one PUT of a small probe object carries a wrong checksum, without retries. S3 refuses it (``BadDigest``) and
stores nothing; an endpoint that stores it (moto's plain server, some S3-compatible stores) does not check, and
the probe object is deleted. The answer is kept per endpoint, bucket and algorithm for the process. A write whose
every request carried a checksum to an endpoint that checks is remembered (path and size) until
``write_attested`` is asked about it once; verify-after-write then does not read the object back.
"""

from __future__ import annotations

import copy
import logging
import threading
import uuid

from rl_ckpt.errors import ConfigError
from rl_ckpt._storage.fsspec_store import client_error
from rl_ckpt._storage.s3_transfer import REFUSED_DIGEST, b64, raw_checksum

log = logging.getLogger(__name__)

SERVER_CHECKSUMS = {"crc32": "CRC32", "sha256": "SHA256"}  # the storage option's values -> S3's names
# (endpoint, bucket, algorithm) -> whether the endpoint refused a body whose checksum was wrong, for this process
_ENDPOINT_CHECKS: dict[tuple[str, str, str], bool] = {}
_ENDPOINT_CHECKS_LOCK = threading.Lock()
_ATTESTED_KEPT = 4096  # writes remembered as checked by the server (the oldest forgotten first)


def server_checksum(wanted) -> str | None:
    """The storage option ``server_checksums`` as S3 names the algorithm (None: off); ConfigError naming it."""
    if wanted is False or wanted is None:
        return None
    if isinstance(wanted, str) and wanted.lower() in SERVER_CHECKSUMS:
        return SERVER_CHECKSUMS[wanted.lower()]
    raise ConfigError(
        f'storage option \'server_checksums\': got {wanted!r}; allowed: "crc32", "sha256" or false',
        key="server_checksums",
        allowed="crc32 | sha256 | false",
    )


class S3Checksums:
    """The probe and the attested writes of an ``S3Storage`` (which sets ``_server_checksum``, ``_fs_options``,
    ``_attested`` and ``_attested_lock``)."""

    def part_checksum(self) -> tuple[bool, str | None]:
        """(whether the endpoint checks what the parts carry, the checksum they carry: None for none) for a write."""
        try:
            checked = self.endpoint_checks_checksums()
        except Exception as exc:  # noqa: BLE001 - the probe could not run: no checksum is trusted
            log.info("%s: the checksum probe failed (%s); objects are read back to verify them", self.url, exc)
            checked = False
        if checked:
            return True, self._server_checksum
        if getattr(self.fs.s3.meta.config, "request_checksum_calculation", None) != "when_required":
            return False, "CRC32"  # the caller's config asks for a checksum of every body (not trusted)
        return False, None

    def endpoint_checks_checksums(self) -> bool:
        """Whether this endpoint refuses a body whose checksum (``server_checksums``) is wrong: probed once per
        process, endpoint and bucket (one PUT, no retries), before the first write that relies on it."""
        if self._server_checksum is None:
            return False
        bucket, _, _ = self.fs.split_path(self.root)
        opts = self._fs_options
        endpoint = str(opts.get("endpoint_url") or (opts.get("client_kwargs") or {}).get("endpoint_url") or "aws")
        key = (endpoint, bucket, self._server_checksum)
        with _ENDPOINT_CHECKS_LOCK:  # the writers of a process wait for one probe
            if key not in _ENDPOINT_CHECKS:
                _ENDPOINT_CHECKS[key] = self._probe_checksums(bucket)
            return _ENDPOINT_CHECKS[key]

    def _probe_checksums(self, bucket: str) -> bool:
        import s3fs

        options = copy.deepcopy(self._fs_options)
        options["config_kwargs"]["retries"] = {"mode": "standard", "max_attempts": 1}  # botocore retries BadDigest
        fs = s3fs.S3FileSystem(**options, skip_instance_cache=True)
        _, prefix, _ = fs.split_path(self.root)
        probe = f"{prefix}/.rl-ckpt-checksum-probe-{uuid.uuid4().hex}".lstrip("/")
        body = b"rl-ckpt: does this endpoint refuse a body whose checksum is wrong?"
        algo = self._server_checksum
        wrong = b64(raw_checksum(algo, [memoryview(body + b"!")]))
        try:
            fs.call_s3("put_object", Bucket=bucket, Key=probe, Body=body, **{f"Checksum{algo}": wrong})
        except Exception as exc:  # noqa: BLE001 - any refusal but the one asked about means "does not check"
            code, _status = client_error(exc)
            if code in REFUSED_DIGEST:
                return True
            log.info(
                "%s: the checksum probe failed (%s: %s); objects are read back to verify them",
                self.url,
                type(exc).__name__,
                exc,
            )
            return False
        log.info(
            "%s: the endpoint stored a body whose %s is wrong (it does not check checksums); verify-after-write "
            "reads objects back",
            self.url,
            algo,
        )
        try:
            fs.call_s3("delete_object", Bucket=bucket, Key=probe)
        except Exception as exc:  # noqa: BLE001 - a stray probe object is harmless; say so
            log.warning("%s: could not delete the checksum probe s3://%s/%s: %s", self.url, bucket, probe, exc)
        return False

    def attest(self, path: str, size: int) -> None:
        """Remember that the write of ``path`` (``size`` bytes) was checked by the server, until asked once; only the
        newest ``_ATTESTED_KEPT`` are kept (a write nobody verifies is never asked about)."""
        with self._attested_lock:
            self._attested.pop(path, None)
            self._attested[path] = size
            while len(self._attested) > _ATTESTED_KEPT:
                self._attested.pop(next(iter(self._attested)))

    def write_attested(self, path: str, size: int) -> bool:
        with self._attested_lock:
            return self._attested.pop(path, None) == size
