"""The audit: the main job on embedded defaults (later: the pre-registered protocol and verdicts)."""
