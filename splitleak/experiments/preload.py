"""What a local grid's fork server imports once, before it forks any worker (``executors.worker_context``).

A worker forked from the server starts with torch, transformers, the model classes of the presets and every
registered attack already imported, instead of importing them again in each worker of each grid (about 4 s of
CPU a worker on 2 cores). The server only imports: it runs no torch operation and loads no weights (the idle
threads the libraries start on import, OpenBLAS's and pyarrow's, as in any process PyTorch's DataLoader forks,
are all it holds besides). It dies with the driver (``runtime.die_with_parent``); its workers, whose parent it
is, watch the driver themselves (``worker._die_with_driver``)."""

from __future__ import annotations

import gc

from splitleak.runtime import die_with_parent

die_with_parent()  # the server is the driver's child: it goes with it, even while it is still importing

import splitleak.experiments.worker as _worker  # noqa: E402  (after the line above: a killed driver stops it)

_worker.import_job_modules()
# what the server holds now lives as long as every worker forked from it: out of the collector's walk, so that a
# worker's collections neither take the time to walk it nor copy the pages it lies on (Python's gc.freeze advice)
gc.collect()
gc.freeze()
