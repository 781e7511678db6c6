"""What no reader can read: upper bounds on reconstruction from the noised wire traffic.

``guarantee``: the noise guarantees a defence chain declares per channel (a per-row or per-document clip and
Gaussian noise of a public scale), and why a chain gives none. ``accounting``: the composition of every
crossing of one document (exact for Gaussian mechanisms in Gaussian differential privacy, and ε(δ) from
dp-accounting's PLD accountant). ``bound``: the informed adversary's reconstruction bound (Hayes, Mahloujifar
& Balle 2023) per token and per document, against a prior success κ.
"""
