"""Submitting, observing, stopping and resuming jobs on a version group.

Launching is in `jobs.launching` (submit, resume, launch for an intent of `jobs.intents`), observing a run's driver
in `jobs.observing`, ending runs in `jobs.ending`; this package re-exports them.
"""

from changeover.jobs.ending import cancel, dismiss_standby, end_for_restart, kill_driver
from changeover.jobs.launching import LAYING_OUT, continue_ended_on, launch, master_url, resume, submit
from changeover.jobs.observing import (
    DRIVER_STATES,
    drivers_on,
    fault_tolerant_jobs,
    list_jobs,
    observe,
    options_of,
    parked_runs_on,
    refresh,
    refresh_all,
    wait_until_committed,
)
from changeover.registry.records import LIVE, current_run, get_job

__all__ = [
    "DRIVER_STATES", "LAYING_OUT", "LIVE", "cancel", "continue_ended_on", "current_run", "dismiss_standby",
    "drivers_on", "end_for_restart", "fault_tolerant_jobs", "get_job", "kill_driver", "launch", "list_jobs",
    "master_url", "observe", "options_of", "parked_runs_on", "refresh", "refresh_all", "resume", "submit",
    "wait_until_committed",
]
