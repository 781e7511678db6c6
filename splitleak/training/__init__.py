"""Running split training: client and server roles, the step loop, utility, the all-local baseline."""

from splitleak.runtime import resolve_device
from splitleak.training.config import DefenceConfig, TrainConfig, config_from_record, make_train_config
from splitleak.training.loop import (
    TrainLog,
    capture_traffic,
    evaluate_ce,
    train_all_local,
    train_split,
    training_order,
    utility,
)
from splitleak.training.record import RunResult
from splitleak.training.roles import ClientRole, ServerRole
from splitleak.training.run import read_metrics, run_training

__all__ = [
    "ClientRole",
    "DefenceConfig",
    "RunResult",
    "ServerRole",
    "TrainConfig",
    "TrainLog",
    "capture_traffic",
    "evaluate_ce",
    "config_from_record",
    "make_train_config",
    "read_metrics",
    "resolve_device",
    "run_training",
    "train_all_local",
    "train_split",
    "training_order",
    "utility",
]
