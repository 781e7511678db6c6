"""The audit: the main job on embedded defaults, the pre-registered protocols and their analysis, the
verdict words of the calibrated audit (002), injected-leak calibration and the channel table."""
