"""Membership: the masters (one per version group) and workers (one per member) of a Spark cluster.

`membership.Membership` is the protocol every caller talks to, and `membership_for` the one place that chooses the
backend. `local.LocalCluster` starts masters and workers on loopback from the per-version runtimes;
`standalone.StandaloneCluster` rolls a platform's cluster through its own command templates (`platform`,
`host_commands`). `spark_master` is the client of one master's JSON and REST APIs, `rest_auth` signs its
submissions, `runtimes` installs a Spark version, `processes` and `ports` start and end the processes Changeover
owns. `routing` finds the largest version group, where jobs go; `shipping` and `spark_settings` are what a driver is
launched with: the job's code and Changeover's, and the job's Spark settings.
"""

from __future__ import annotations

from changeover.cluster.local import IDLE_STOP_GRACE, STOP_GRACE, WORKER_TIMEOUT, LocalCluster
from changeover.cluster.membership import (
    RETRYABLE,
    Membership,
    NoMaster,
    get_member,
    member_for_host,
    wait_for,
)
from changeover.settings import Settings

__all__ = ["IDLE_STOP_GRACE", "RETRYABLE", "STOP_GRACE", "WORKER_TIMEOUT", "LocalCluster", "Membership", "NoMaster",
           "get_member", "member_for_host", "membership_for", "wait_for"]


def membership_for(settings: Settings) -> Membership:
    """The cluster the settings describe (an Airflow connection's, through the hook, or the CLI's environment).
    The one place a backend is chosen: a standalone cluster Changeover did not start when a cluster file describes
    it, else the loopback cluster Changeover runs itself."""
    if settings.cluster_file is not None:
        from changeover.cluster.standalone import StandaloneCluster

        return StandaloneCluster(settings)
    return LocalCluster(settings)
