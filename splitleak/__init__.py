"""splitleak: measure what crosses the split in split learning of language models.

One subpackage per stage of the data flow (``../shared/DESIGN.md``), each importing only from those
before it: ``data`` → ``models`` → ``wire`` (what crosses: frames, channels, the tap, transports) →
``defences`` (transforms of what crosses) → ``runs`` (the run directory: journal, store, captures,
manifest, and the truth only the scorer reads) → ``deploy`` → ``training`` → ``attacks`` →
``metrics`` → ``stats`` → ``audit`` → ``experiments`` → ``report`` → ``cli``.
"""

__version__ = "0.1.0"
