"""Reproducing the papers: their headline claims (shipped claims files), the grids that measure them, the
verdicts and the report (``splitleak reproduce``)."""
