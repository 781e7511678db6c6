"""The audit: the main job on embedded defaults, the pre-registered protocols and their analysis, the
verdict words of the calibrated audit (Politis & Pappas 2026), injected-leak calibration and the channel table."""
