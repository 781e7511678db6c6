"""The run directory: what a run wrote, recorded in a hash-chained journal, and the readers of it.

- ``journal``: the journal's format and the readers of one recorded file (checked against its digest);
- ``store``: ``RunStore``, the append-only writer (the tap writes the frames that crossed through it);
- ``verify``: ``verify_run`` and ``require_verified``, the gate every reader of a run passes;
- ``wire`` and ``captures``: the recorded frames read back and checked against what crossed, and split
  per document into the channels an attack reads;
- ``manifest``: the manifest, the split mode, server sessions paired with their client's run;
- ``truth``: what only the scorer reads (the evaluation and training text, the latent mode's real-row
  record); ``splitleak.attacks`` never imports it (``tests/test_layout.py``).

The package face imports nothing, so that reading a manifest loads no torch and importing
``splitleak.runs`` reaches no truth."""
