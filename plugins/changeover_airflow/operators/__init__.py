"""Changeover's operators, one module a family as Airflow's providers lay them out: `upgrade` (a version upgrade's
steps), `update` (a job's code update, and the compatibility check), `savepoints`, `light`; their base and helpers in
`base`. Re-exported here, so DAGs import them from `changeover_airflow.operators`."""

from changeover_airflow.operators.base import ChangeoverOperator, acting_settings, upgrade_key
from changeover_airflow.operators.light import LightJobOperator
from changeover_airflow.operators.savepoints import (
    SAVEPOINTS_ASSET,
    SAVEPOINTS_TAKEN,
    SavepointMaintenanceOperator,
    SavepointOperator,
)
from changeover_airflow.operators.update import (
    CompatibilityCheckOperator,
    ResumeWithCodeOperator,
    RollbackJobOperator,
    StabilityGateOperator,
    UpdateStopOperator,
    UpdateSummaryOperator,
)
from changeover_airflow.operators.upgrade import (
    FinishUpgradeOperator,
    PreflightOperator,
    RebalanceJobsOperator,
    RollingUpgradeOperator,
    VerifyUpgradeOperator,
)

__all__ = [
    "SAVEPOINTS_ASSET", "SAVEPOINTS_TAKEN", "ChangeoverOperator", "CompatibilityCheckOperator", "FinishUpgradeOperator",
    "LightJobOperator", "PreflightOperator", "RebalanceJobsOperator", "ResumeWithCodeOperator", "RollbackJobOperator",
    "RollingUpgradeOperator", "SavepointMaintenanceOperator", "SavepointOperator", "StabilityGateOperator",
    "UpdateStopOperator", "UpdateSummaryOperator", "VerifyUpgradeOperator", "acting_settings", "upgrade_key",
]
