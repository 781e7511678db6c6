"""Doing each piece of work once per grid: the attack jobs of one run and one attacker copy run as one
worker task, and share what each would otherwise compute for itself.

The scheduler (``runner``) hands a worker the ready attack jobs of one run and one client copy at once
(``task_key`` names the group); the worker (``worker.execute_jobs``) runs them one after another with one
``Shared``, which gives them

- the run directory verified once (``splitleak verify``'s check, which re-hashes every file),
- its capture read once per phase (a job that reads no gradients gets the same traffic without them),
- the public model loaded once and one ``Knowledge`` per copy (with or without the pretrained Top), whose
  memo (``Knowledge.memo``) then computes the ridge fit, the ranked candidate lists and the mis-paired
  control's traffic once for all of them, and whose ``planned`` names the group's attacks, so that SipIt's
  budgets come from one search (``search.sipit_budgets``); a search of the same tensors (the beam search,
  SipIt's, GMA-SL's matching of a frame), such as a twin's that covers every document, is run once
  (``Knowledge.memo_content``);
- one reading per configuration whatever its attack seed, for the attacks that draw nothing from it
  (``AttackInfo.seeded`` False: activation, joint, SipIt and others; ``audit.evaluate._reconstruct``): the
  second seed's job reads the first one's search and runs only its own mis-paired twin (the seed draws
  the pairing), and its result names the seed whose search it read.

A reuse never changes a result: each job's rows are, bit for bit, those it gives alone (every shared value
is computed by the same code from the same inputs; tests/test_grouping.py checks it on whole grids). Each
job still writes its own row file as it finishes, so a task killed midway loses only its unfinished jobs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

from splitleak.attacks.config import make_attack_config
from splitleak.attacks.core import make_attack
from splitleak.attacks.knowledge import load_traffic
from splitleak.errors import SplitleakError
from splitleak.runs.verify import require_verified


def task_key(job: dict[str, Any]) -> tuple:
    """The jobs that run together as one task: an attack job's run and client copy; a train job alone."""
    if job["kind"] == "attack":
        return ("attack", job["train_key"], job["config"]["attack"].get("client_copy"))
    return (job["kind"], job["key"])


class Shared:
    """What the attack jobs of one worker task share (module docstring). Nothing is computed before a job
    asks for it; a failure (a run that does not verify, a model that does not load) is raised to each job
    that asks, as it would be to that job alone."""

    def __init__(self, jobs: list[dict[str, Any]]):
        self.jobs = jobs
        self._knowledge: dict[tuple, Any] = {}
        self._traffic: dict[tuple, Any] = {}
        self._verified: set[str] = set()

    def verify(self, run_dir: Path) -> None:
        """``require_verified`` on the run, once (a failure is not remembered: the next job checks again)."""
        if str(run_dir) not in self._verified:
            require_verified(run_dir, "the attack")
            self._verified.add(str(run_dir))

    def knowledge(self, run_dir: Path, copy: str, with_top: bool, load: Callable[[], Any]) -> Any:
        """The knowledge ``load()`` gives, loaded once per run, copy and Top; its ``planned`` holds the
        group's attacks on that copy."""
        key = (str(run_dir), copy, with_top)
        if key not in self._knowledge:
            kn = load()
            kn.planned = self._planned(copy)
            self._knowledge[key] = kn
        return self._knowledge[key]

    def _planned(self, copy: str) -> tuple[Any, ...]:
        """The group's attacks on ``copy``, unfitted (one whose configuration is refused is left out: its job
        fails on its own)."""
        out = []
        for job in self.jobs:
            try:
                cfg = make_attack_config(**job["config"]["attack"])
                if cfg.client_copy == copy:
                    out.append(make_attack(cfg.attack, **cfg.attack_params()))
            except (SplitleakError, TypeError, ValueError):
                continue
        return tuple(out)

    def traffic(self, run_dir: Path, phase: str, with_gradients: bool) -> Any:
        """The run's traffic of ``phase``, read once: one object with its gradients, one without (what
        ``load_traffic(..., with_gradients=False)`` builds), on the same activations tensor."""
        key = (str(run_dir), phase)
        if key not in self._traffic:
            full = load_traffic(run_dir, with_gradients=True, phase=phase)
            bare = full.replace(gradients=None, probe_gradients=None, output_gradients=None)
            self._traffic[key] = {True: full, False: bare}
        return self._traffic[key][with_gradients]
