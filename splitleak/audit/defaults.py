"""Defaults of the audit that the command line shows without importing torch."""

#: the injected-leak coverage ladder of Politis & Pappas 2026, Table 4 (zero dose is always added as the reference)
DEFAULT_COVERAGES = (0.02, 0.04, 0.06, 0.10, 0.30, 1.0)

#: the audit's training and evaluation document counts (ours): sized so that `make audit` runs in about five
#: minutes on two CPU cores (benchmarks/RESULTS.md) — the training steps and the attacks scale with them. The
#: report states the interval widths they give; `--n-train 128 --n-eval 256 --epochs 1` are What Gradients
#: Add's counts (splitleak.data.N_TRAIN, N_EVAL), at about four times the time
AUDIT_N_TRAIN = 16
AUDIT_N_EVAL = 48
#: passes over the training documents (ours: transformers' ``Trainer`` trains ``num_train_epochs=3`` by default,
#: what a practitioner's fine-tuning would use); 16 documents x 3 passes keep the 48 training steps of one pass
#: over 48, and each training document crosses three times (``splitleak.audit.passes`` reads them all)
AUDIT_EPOCHS = 3

#: documents of each arm's mis-paired negative control (ours; splitleak.audit.verdicts): a twin on every document
#: would double each attack's time, and a planted reader of the evaluation text reads +60 pp or more above its
#: floor on 16 (tests/test_controls.py)
CONTROL_DOCS = 16

#: bootstrap replicates of a single attack's control interval (the audit recomputes its arms' with ARM_BOOT)
CONTROL_BOOT = 2000
