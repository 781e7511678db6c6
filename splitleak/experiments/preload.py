"""What a local grid's fork server imports once, before it forks any worker (``executors.worker_context``).

A worker forked from the server starts with torch, transformers, the model classes of the presets and every
registered attack already imported, instead of importing them again in each worker of each grid (about 4 s of
CPU a worker on 2 cores). The server only imports: it runs no torch operation (so no thread pool exists when it
forks) and loads no weights."""

from __future__ import annotations

import splitleak.experiments.worker as _worker

_worker.import_job_modules()
