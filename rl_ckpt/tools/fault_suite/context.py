"""The shared context every scenario runs in: case folders, templates, worker threads, child processes and
the common invariant check (``invariants.check_invariants``, as ``Suite.check``)."""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import tempfile
import threading
from typing import Callable

from rl_ckpt.tools.fault_suite.common import PROFILES, build, engine_cfg, run_url, save_step
from rl_ckpt.tools.fault_suite.invariants import check_invariants
from rl_ckpt.tools.fault_suite.report import ScenarioResult
from rl_ckpt.tools.fault_suite.targets import LocalTarget, S3Endpoint


class Suite:
    """Runs the scenarios. Cases are independent jobs (own folder or prefix), run on a few threads:
    most of a case's time is fsync, child processes and HTTP, which do not hold the GIL."""

    def __init__(
        self,
        mode: str = "quick",
        base_dir: str | None = None,
        *,
        s3_storage_options: dict | None = None,
        progress: Callable[[str], None] | None = None,
        keep_failed: int = 20,
        workers: int | None = None,
    ) -> None:
        if mode not in PROFILES:
            raise ValueError(f"mode must be one of {sorted(PROFILES)}")
        self.profile = PROFILES[mode]
        self.workers = workers or self.profile.workers
        parent = base_dir or tempfile.gettempdir()
        os.makedirs(parent, exist_ok=True)
        self.root = tempfile.mkdtemp(prefix=f"rlckpt-faults-{mode}-", dir=parent)
        self.journal_dir = os.path.join(self.root, "_powerloss-journal")
        self.progress = progress or (lambda msg: None)
        self.keep_failed = keep_failed
        self.kept: list[str] = []
        self._case_no = 0
        self._lock = threading.Lock()
        self._templates: dict[str, str] = {}
        self._s3: S3Endpoint | None = None
        self._s3_options = s3_storage_options
        self._ctx = None

    @property
    def ctx(self):
        """The forkserver context, its preloads set when the first child is about to start (the preload
        list is process-wide; it only matters if this process has not started its forkserver yet)."""
        if self._ctx is None:
            ctx = mp.get_context("forkserver")
            # pandas: pyarrow imports it on the first array it builds (0.2 s in every child otherwise);
            # s3fs/botocore: every S3 writer process would import them again
            ctx.set_forkserver_preload(
                [
                    "torch",
                    "numpy",
                    "pyarrow",
                    "pandas",
                    "s3fs",
                    "rl_ckpt",
                    "rl_ckpt._core.engine",
                    # the sharded scenarios' children save and load through DCP (DTensor: seconds to import)
                    "rl_ckpt._sharded.component",
                    "rl_ckpt._sharded.dcp_reader",
                    "rl_ckpt._sharded.dcp_writer",
                    "rl_ckpt.tools.fault_suite",
                ]
            )
            self._ctx = ctx
        return self._ctx

    # -- plumbing --------------------------------------------------------------------------
    def s3(self) -> S3Endpoint:
        with self._lock:
            if self._s3 is None:
                self._s3 = S3Endpoint(self._s3_options, self.ctx)
            return self._s3

    def close(self) -> None:
        if self._s3 is not None:
            self._s3.close()
            self._s3 = None
        if not self.kept:
            shutil.rmtree(self.root, ignore_errors=True)
        else:  # keep the failed cases (listed in the report) for a person to look at
            shutil.rmtree(os.path.join(self.root, "_templates"), ignore_errors=True)
            shutil.rmtree(self.journal_dir, ignore_errors=True)

    def run_jobs(self, res: ScenarioResult, jobs: list[Callable[[ScenarioResult], None]]) -> None:
        """Run ``jobs`` (each fills its own part of the result) on the worker threads; merge into ``res``."""
        from concurrent.futures import ThreadPoolExecutor

        def one(job) -> ScenarioResult:
            part = ScenarioResult(res.key, res.title)
            try:
                job(part)
            except Exception as exc:  # a suite bug must show, not hide a case
                part.violate("?", getattr(job, "__name__", "job"), "crash", f"{type(exc).__name__}: {exc}")
            return part

        with ThreadPoolExecutor(max_workers=self.workers) as pool:
            for part in pool.map(one, jobs):
                res.merge(part)

    def case(self, label: str, cfg_kwargs: dict | None = None, template: str | None = None) -> LocalTarget:
        with self._lock:
            self._case_no += 1
            number = self._case_no
        safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in label)[:80]
        target = LocalTarget(os.path.join(self.root, f"{number:05d}-{safe}"), cfg_kwargs)
        if template is not None:
            shutil.copytree(template, target.run, symlinks=True)
        return target

    def done(self, target: LocalTarget, ok: bool) -> None:
        with self._lock:
            keep = not ok and len(self.kept) < self.keep_failed
            if keep:
                self.kept.append(target.parent)
        if not keep:
            shutil.rmtree(target.parent, ignore_errors=True)

    def template(self, name: str, cfg_kwargs: dict, steps=(1, 2)) -> str:
        """A run folder with ``steps`` committed; cases copy it (call from the main thread)."""
        key = f"{name}:{sorted(cfg_kwargs.items())}:{steps}"
        if key not in self._templates:
            parent = os.path.join(self.root, "_templates", f"{len(self._templates):02d}-{name.replace('/', '-')}")
            cfg = engine_cfg(parent, **cfg_kwargs)
            os.makedirs(run_url(cfg), exist_ok=True)
            engine, model, buf = build(cfg)
            for step in steps:
                save_step(engine, model, buf, step)
            engine.close()
            self._templates[key] = run_url(cfg)
        return self._templates[key]

    def record_ops(self, template: str, cfg_kwargs: dict, step: int) -> list[tuple[str, str]]:
        """The storage calls of one save of ``step`` on a copy of ``template``."""
        from rl_ckpt.tools.faults import FaultyStorage
        from rl_ckpt._storage import LocalStorage

        target = self.case("record", cfg_kwargs, template)
        storage = FaultyStorage(LocalStorage(target.run))
        engine, model, buf = build(target.cfg, storage)
        engine.catalog.refresh()
        storage.ops.clear()
        save_step(engine, model, buf, step)
        ops = list(storage.ops)
        self.done(target, True)
        return ops

    def run_child(self, fn, args: tuple, *, timeout: float = 120.0) -> tuple[int | None, list[int]]:
        recv, send = self.ctx.Pipe(duplex=False)
        proc = self.ctx.Process(target=fn, args=(*args, send), daemon=True)
        proc.start()
        send.close()
        proc.join(timeout)
        if proc.is_alive():
            proc.kill()
            proc.join(10)
        acks = []
        while recv.poll(0):
            try:
                acks.append(int(recv.recv_bytes()))
            except (EOFError, ValueError):
                break
        recv.close()
        return proc.exitcode, acks

    # -- the common invariant check (invariants.py) ----------------------------------------------
    check = staticmethod(check_invariants)
