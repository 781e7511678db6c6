"""Defaults of the audit that the command line shows without importing torch."""

#: the injected-leak coverage ladder of Politis & Pappas 2026, Table 4 (zero dose is always added as the reference)
DEFAULT_COVERAGES = (0.02, 0.04, 0.06, 0.10, 0.30, 1.0)
