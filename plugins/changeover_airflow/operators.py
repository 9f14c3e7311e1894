from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict
from datetime import UTC, datetime, timedelta
from typing import Any

from airflow.sdk import Asset, AssetAlias, BaseOperator
from airflow.sdk.exceptions import AirflowSkipException
from changeover import audit, jobs, savepoints
from changeover.cluster import Membership, membership_for
from changeover.errors import ChangeoverError, NeedsOperator
from changeover.jobs import code_update, move_history
from changeover.registry.models import Savepoint
from changeover.settings import Settings
from changeover.upgrade import lock, maintenance, member_upgrade, roll, verify
from changeover.upgrade.windows import DrainWindow
from changeover.upgrade.zero_downtime import CatchUp, CatchUpTimedOut

from changeover_airflow.hooks import ChangeoverHook
from changeover_airflow.links import ChangeoverViewLink, SparkMasterLink
from changeover_airflow.triggers import ReconcileTrigger


def upgrade_key(context: Any) -> str:
    """An upgrade is its DAG run: run ids are unique only within one DAG."""
    return f"{context['ti'].dag_id}/{context['ti'].run_id}"


def acting_settings(context: Any, conn_id: str, upgrade_step: bool, person: str | None = None) -> Settings:
    """The connection's settings, with the audit trail's actor set: the person first (the user who triggered the run,
    a scheduled run has none; or who answered the task), then where it ran."""
    ti = context["ti"]
    user = person or getattr(context.get("dag_run"), "triggering_user_name", None) or "scheduler"
    audit.act_as(audit.Acting(f"{user} via airflow:{ti.dag_id}/{ti.run_id}/{ti.task_id}#{ti.try_number}",
                              upgrade_key(context) if upgrade_step else None))
    return ChangeoverHook(conn_id).get_settings()


class ChangeoverOperator(BaseOperator):
    """Base: resolves the connection and names the person and the task instance as the actor in the audit trail."""

    upgrade_step = False  # a step of an upgrade DAG: its events carry the upgrade's key
    operator_extra_links = (ChangeoverViewLink(), SparkMasterLink())
    # templated: an upgrade DAG's run chooses its cluster and registry (`params.connection`)
    template_fields: Sequence[str] = ("changeover_conn_id",)

    def __init__(self, *, changeover_conn_id: str = ChangeoverHook.default_conn_name,
                 overall_timeout: float | None = 6 * 3600, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.changeover_conn_id = changeover_conn_id
        self.overall_timeout = overall_timeout  # s a try may spend across all its deferrals

    def _setup(self, context: Any) -> tuple[Settings, Membership]:
        settings = acting_settings(context, self.changeover_conn_id, self.upgrade_step)
        return settings, membership_for(settings)

    def on_kill(self) -> None:
        """A killed task ends the platform commands it runs (a worker's stop or start over ssh): its retry runs them
        again from what it observes, never beside one left running."""
        from changeover.cluster import host_commands

        ended = host_commands.end_all()
        if ended:
            self.log.warning("ended the commands this task ran: %s", "; ".join(ended))

    def _skip_if_dry_run(self, context: Any) -> None:
        if context["params"].get("dry_run"):
            raise AirflowSkipException("dry run: nothing is changed")

    def _defer(
        self,
        kind: str,
        subject: str,
        settings: Settings,
        timeout: float | None,
        shutdown_timeout: int | None = None,
        fire_by: datetime | None = None,
        deadline: float | None = None,
        params: dict[str, Any] | None = None,
    ) -> None:
        """Wait in a trigger for the next step: at most `timeout` s for this wait, and never past `deadline`
        (epoch s), which the first deferral of a try sets from `overall_timeout` and each later one carries."""
        if deadline is None and self.overall_timeout:
            deadline = time.time() + self.overall_timeout
        if deadline is not None:
            left = deadline - time.time()
            if left <= 0:
                raise ChangeoverError(
                    f"task {self.task_id} ({kind} {subject})",
                    f"it has waited past its overall deadline of {self.overall_timeout:.0f} s across its waits",
                    "look at what it waits on in the task log and `changeover upgrade status`; clear the task to "
                    "retry with a new deadline, or raise overall_timeout",
                )
            # the trigger fires at the deadline, so the task comes back to say so; the wait's own timeout
            # is only a backstop behind it
            timeout = min(timeout, left + 60) if timeout else left + 60
        fire_at = min(x for x in (fire_by.timestamp() if fire_by else None, deadline) if x is not None) \
            if fire_by or deadline else None
        self.defer(
            trigger=ReconcileTrigger(kind, subject, params, shutdown_timeout,
                                     conn_id=self.changeover_conn_id, fire_by=fire_at,
                                     acting=asdict(acting) if (acting := audit.acting()) else None),
            method_name="execute_complete",
            kwargs={"deadline": deadline},
            timeout=timedelta(seconds=timeout) if timeout else None,
        )


class PreflightOperator(ChangeoverOperator):
    """Checks the target version, runtimes, Java and members; returns the members to roll, in order."""

    upgrade_step = True

    template_fields: Sequence[str] = ("changeover_conn_id", "target_version", "members")

    def __init__(self, *, target_version: str, members: Any = None, marked_only: bool = False, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target_version = target_version
        self.members = members
        self.marked_only = marked_only  # only the members marked for maintenance (a drain window's run)

    def execute(self, context: Any) -> list[str]:
        settings, cluster = self._setup(context)
        requested = list(self.members or [])
        if self.marked_only:
            requested = maintenance.marked(settings)
            if not requested:
                context["ti"].xcom_push(key="skipped", value="no member is marked for maintenance")
                raise AirflowSkipException("no member is marked for maintenance: "
                                           "mark one with `changeover maintenance mark MEMBER`")
        plan = verify.preflight(settings, cluster, self.target_version, requested,
                                upgrade_key=upgrade_key(context), dry_run=bool(context["params"].get("dry_run")))
        for line in plan.describe():
            self.log.info(line)
        context["ti"].xcom_push(key="plan", value=plan.describe())  # what an approver is shown
        return [] if context["params"].get("dry_run") else plan.members


class RollingUpgradeOperator(ChangeoverOperator):
    """Rolls the upgrade's members in order, one at a time: drain, then upgrade, then the next member.

    One task per run walks every member, so no waiting member ever holds a slot the previous member needs
    to retry. Progress lives in the registry: a resumed, retried or spuriously re-run try continues where
    the last one was. Between steps it waits in a trigger, which never fires before the scheduler settles.
    """

    upgrade_step = True
    template_fields: Sequence[str] = ("changeover_conn_id", "shutdown_timeout", "drain_needs_seconds", "surge",
                                      "move_strategy", "catch_up_seconds")

    def __init__(
        self,
        *,
        shutdown_timeout: Any = None,
        window: str | None = None,
        drain_needs_seconds: Any = 0,
        roll_timeout: float = 3600,
        surge: Any = 0,
        move_strategy: Any = None,
        catch_up_seconds: Any = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(**kwargs)
        self.surge = surge  # temporary members at the target for the upgrade's length
        self.move_strategy = move_strategy  # warm or zero_downtime; None: each job's option
        self.catch_up_seconds = catch_up_seconds
        self.shutdown_timeout = shutdown_timeout
        self.window = window  # a drain window: no member's drain starts, or goes on, outside it
        self.drain_needs_seconds = drain_needs_seconds
        self.roll_timeout = roll_timeout

    def execute(self, context: Any, event: dict[str, Any] | None = None,
                deadline: float | None = None) -> dict[str, Any]:
        self._skip_if_dry_run(context)
        settings, cluster = self._setup(context)
        timeout = int(self.shutdown_timeout) if self.shutdown_timeout not in (None, "") else None
        window = DrainWindow.parse(self.window) if self.window else None
        catch_up = CatchUp(float(self.catch_up_seconds or CatchUp.seconds))
        try:
            status = roll.step(settings, cluster, upgrade_key(context), timeout, window=window,
                               drain_needs_seconds=float(self.drain_needs_seconds or 0),
                               surge=int(self.surge or 0), move_strategy=self.move_strategy or None,
                               catch_up=catch_up)
        except NeedsOperator as exc:  # a retry would meet the same refusal: fail now, with what to do
            from airflow.sdk.exceptions import AirflowFailException

            raise AirflowFailException(str(exc)) from exc
        self.log.info("roll %s", status.as_dict())
        if not status.done:
            # with a window, come back when it closes at the latest, to undo a drain it closes on
            opening = window.opening_at(datetime.now(UTC)) if window else None
            # the trigger waits out a follower's catch-up too (`zero_downtime.waiting_on_successor`)
            self._defer("roll", upgrade_key(context), settings, max(self.roll_timeout, catch_up.seconds + 600), timeout,
                        fire_by=opening[1] if opening else None, deadline=deadline)
        return status.as_dict()

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None,
                         deadline: float | None = None) -> dict[str, Any]:
        return self.execute(context, event, deadline)


class RebalanceJobsOperator(ChangeoverOperator):
    """Moves fault-tolerant jobs onto the largest version group by savepoint and resume."""

    upgrade_step = True

    def __init__(self, *, rebalance_timeout: float = 900, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.rebalance_timeout = rebalance_timeout

    def execute(self, context: Any, event: dict[str, Any] | None = None, deadline: float | None = None) -> None:
        self._skip_if_dry_run(context)
        settings, cluster = self._setup(context)
        lock.require_active(settings, upgrade_key(context))
        moving = member_upgrade.rebalance_step(settings, cluster, upgrade_key=upgrade_key(context))
        if moving:
            self.log.info("still moving: %s", moving)
            self._defer("rebalance", "jobs", settings, self.rebalance_timeout, deadline=deadline)

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None,
                         deadline: float | None = None) -> None:
        self.execute(context, event, deadline)


class VerifyUpgradeOperator(ChangeoverOperator):
    """Checks every member, the masters and the jobs' placement, then ends the upgrade and frees its lock."""

    upgrade_step = True
    template_fields: Sequence[str] = ("changeover_conn_id", "target_version",)

    def __init__(self, *, target_version: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.target_version = target_version

    def execute(self, context: Any) -> dict[str, Any]:
        self._skip_if_dry_run(context)
        settings, cluster = self._setup(context)
        report = verify.verify(settings, cluster, self.target_version, upgrade_key=upgrade_key(context))
        self.log.info("verified: %s", report)
        return report


class FinishUpgradeOperator(ChangeoverOperator):
    """Runs whatever happened upstream: an upgrade not verified by now ends FAILED, its lock is freed, and the
    task fails, so that the run does too."""

    upgrade_step = True

    def execute(self, context: Any) -> None:
        settings, _ = self._setup(context)
        if context["params"].get("dry_run"):
            return
        from airflow.sdk.exceptions import AirflowFailException

        key = upgrade_key(context)
        rejected_by = context["ti"].xcom_pull(task_ids="approval", key="rejected_by")
        if rejected_by:  # the plan was rejected before anything drained: the run ends as asked, not failed
            lock.release(settings, key, "REJECTED", f"its plan was rejected by {rejected_by}", missing_ok=True)
            return
        released = lock.release(settings, key, "FAILED", "the run ended before verify succeeded", missing_ok=True)
        if context["ti"].xcom_pull(task_ids="preflight", key="skipped"):
            return  # nothing to upgrade this time: no upgrade began
        if lock.status(settings, key) != "SUCCEEDED":
            # the run's only leaf: failing here is what shows the run as failed in the UI
            freed = "; its lock is released" if released else ""
            raise AirflowFailException(
                f"upgrade {key} did not succeed{freed}. Read the failed task's log for the reason. "
                f"`changeover upgrade status {key}` shows where it stopped, `changeover upgrade abort {key}` returns "
                f"its members to service, `changeover upgrade resume {key}` lets its cleared tasks go on")


SAVEPOINTS_ASSET = Asset(name="changeover_savepoints", uri="changeover://savepoints")
# update_job's stop and resume: whichever took the update's savepoint publishes it (the resume, at a zero-downtime
# cut-over), and the other publishes nothing rather than an empty event. The Asset itself is declared by
# savepoint_maintenance's tasks, which keeps it active.
SAVEPOINTS_TAKEN = AssetAlias(name="changeover_savepoints_taken")


def _publish(context: Any, outlets: list[Any], sp: Savepoint) -> dict[str, Any]:
    """The savepoint as an event of SAVEPOINTS_ASSET, through the task's alias where it has one."""
    summary = {"job": sp.job, "savepoint": sp.name, "mode": sp.mode, "size_bytes": sp.size_bytes,
               "spark_version": sp.spark_version, "stages": sp.stages, "path": sp.path}
    if SAVEPOINTS_TAKEN in outlets:
        context["outlet_events"][SAVEPOINTS_TAKEN].add(SAVEPOINTS_ASSET, extra=summary)
    else:
        context["outlet_events"][SAVEPOINTS_ASSET].extra = summary
    return summary


class SavepointOperator(ChangeoverOperator):
    """Takes a savepoint (mode `continue` or `stop`) and publishes it as an Asset event. In mode `stop` it waits up
    to IN_TASK_WAIT_SECONDS in the task for the job's batch boundary (usually one batch), then in the triggerer.

    A retry with the same rendered name returns the savepoint taken before instead of a second one.
    """

    template_fields: Sequence[str] = ("changeover_conn_id", "job", "savepoint_name", "mode")

    def __init__(self, *, job: str, savepoint_name: str, mode: str = "continue", **kwargs: Any) -> None:
        kwargs.setdefault("outlets", [SAVEPOINTS_ASSET])
        super().__init__(**kwargs)
        self.job = job
        self.savepoint_name = savepoint_name
        self.mode = mode

    def execute(self, context: Any, event: dict[str, Any] | None = None,
                deadline: float | None = None) -> dict[str, Any]:
        settings, cluster = self._setup(context)
        if self.mode == "stop":
            savepoints.request_stop(settings, self.job, reason=f"savepoint {self.savepoint_name}")
            if not _within(lambda: (run := jobs.refresh(settings, cluster, self.job)) is None
                           or run.state not in jobs.LIVE, IN_TASK_WAIT_SECONDS):
                self._defer("stop", self.job, settings, timeout=600, deadline=deadline)
        sp = savepoints.take(settings, self.job, self.savepoint_name, mode=self.mode, exist_ok=True)
        summary = _publish(context, self.outlets, sp)
        self.log.info("savepoint %s/%s: %s", sp.job, sp.name, summary)
        return summary

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None,
                         deadline: float | None = None) -> dict[str, Any]:
        return self.execute(context, event, deadline)


class SavepointMaintenanceOperator(ChangeoverOperator):
    """Applies the retention policy to every fault-tolerant job, then reconciles crashed savepoints."""

    template_fields: Sequence[str] = ("changeover_conn_id", "max_count", "max_age_hours")

    def __init__(self, *, max_count: int | None = None, max_age_hours: float | None = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.max_count = max_count
        self.max_age_hours = max_age_hours

    def execute(self, context: Any) -> dict[str, Any]:
        settings, _ = self._setup(context)
        age = timedelta(hours=self.max_age_hours) if self.max_age_hours is not None else None
        deleted = {name: savepoints.apply_retention(settings, name, self.max_count, age)
                   for name in jobs.fault_tolerant_jobs(settings)}
        removed = savepoints.reconcile(settings)
        self.log.info("retention deleted %s; reconcile removed %s", deleted, removed)
        return {"deleted": deleted, "reconciled": removed}


class LightJobOperator(ChangeoverOperator):
    """Runs SQL as a light job on the largest version group, through a member's Spark Connect server (seed 004).

    The Changeover connection says where the registry is; the router picks the server. `spark_connect_conn_id`, a
    Spark provider `spark_connect` connection, gives the client's identity (its login as user_id, its token and
    use_ssl); its host is not used, since routing decides it. Returns the rows (at most max_rows) to XCom. A killed
    task interrupts its operations on the server (`on_kill`), and a drain of the member waits for it unless
    block_shutdown is off, when it is interrupted after shutdown_timeout.
    """

    template_fields: Sequence[str] = ("changeover_conn_id", "sql", "block_shutdown", "shutdown_timeout")
    template_ext: Sequence[str] = (".sql",)

    def __init__(self, *, sql: str, spark_connect_conn_id: str | None = None, block_shutdown: bool = True,
                 shutdown_timeout: int = 30, tries: int = 3, max_rows: int = 1000, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.sql = sql
        self.spark_connect_conn_id = spark_connect_conn_id
        self.block_shutdown, self.shutdown_timeout, self.tries = block_shutdown, shutdown_timeout, tries
        self.max_rows = max_rows
        self._running: tuple[Settings, str] | None = None

    def execute(self, context: Any) -> list[dict[str, Any]]:
        from changeover import light  # the Connect client loads pandas and gRPC: only in the tasks that use it

        settings, _ = self._setup(context)
        user_id, params = _connect_identity(self.spark_connect_conn_id)
        with light.session(settings, statement=self.sql, block_shutdown=_bool(self.block_shutdown),
                           shutdown_timeout=int(self.shutdown_timeout), tries=self.tries, user_id=user_id,
                           params=params) as job:
            self._running = (settings, job.tag)
            for refusal in job.refusals:
                self.log.warning("re-routed: %s", refusal)
            self.log.info("light job %s on member %s (Spark %s, %s)", job.tag, job.route.member,
                          job.route.version, job.route.server)
            rows = job.spark.sql(self.sql).limit(self.max_rows + 1).collect()
        self._running = None
        if len(rows) > self.max_rows:
            raise ChangeoverError(f"light job {self.task_id}'s result", f"it has more than {self.max_rows} rows, "
                                  "too many for XCom", "aggregate in the SQL, write the result to a table, or raise "
                                  "max_rows")
        return [row.asDict(recursive=True) for row in rows]

    def on_kill(self) -> None:
        super().on_kill()
        if self._running is not None:
            from changeover import light

            settings, tag = self._running
            # Airflow runs on_kill on the task's own thread, whose next operation waits meanwhile: a short settle, as
            # the supervisor's SIGKILL follows its SIGTERM within seconds
            light.interrupt(settings, tag, f"its Airflow task {self.task_id} was killed", settle=1.0)


def _connect_identity(conn_id: str | None) -> tuple[str | None, str]:
    """user_id and the other ChannelBuilder parameters (token, use_ssl) of a `spark_connect` connection."""
    if conn_id is None:
        return None, ""
    from airflow.providers.apache.spark.hooks.spark_connect import SparkConnectHook

    url = SparkConnectHook(conn_id).get_connection_url()  # sc://host:port/;user_id=...;token=...
    pairs = dict(part.split("=", 1) for part in url.split("/;", 1)[-1].split(";") if "=" in part) \
        if "/;" in url else {}
    user_id = pairs.pop(SparkConnectHook.PARAM_USER_ID, None)
    return user_id, "".join(f";{key}={value}" for key, value in pairs.items())


# A wait expected to be shorter than this is done in the task: a deferral costs the trigger's settle
# (`triggers.SETTLE_SECONDS`) and two trips through the scheduler, more than a batch boundary usually takes.
IN_TASK_WAIT_SECONDS = 15.0


def _within(condition: Callable[[], bool], seconds: float) -> bool:
    """Whether `condition` holds within `seconds`, polled twice a second in the task."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.5)
    return True


def _bool(value: Any) -> bool:
    """A templated flag: a native bool, or its rendering as text."""
    return value if isinstance(value, bool) else str(value).strip().lower() in ("true", "1", "yes")


def _rendered(report: dict[str, Any]) -> list[str]:
    """A check report's lines, from its XCom form."""
    lines = [f"job {report['job']} against savepoint {report['savepoint']}: {report['verdict']}"]
    return lines + [f"  [{f['verdict']}] {f['rule']} stage {f['stage']}: {f['title']}: {f['detail']}"
                    for f in report["findings"]]


def _partitions(value: Any) -> int | None:
    """A templated count of state partitions: 0, empty or None keeps each stage's own."""
    return int(value) if value not in (None, "", "None") and int(value) > 0 else None


class CompatibilityCheckOperator(ChangeoverOperator):
    """Checks jobs against a fresh `continue` savepoint before anything running is touched: the static check,
    and with `dry_run` a batch of each stage replayed on the target runtime from scratch copies.

    `job` None checks every live fault-tolerant job on its own code (a version upgrade's preflight); with `code`
    it checks that job's new code. The reports go to XCom (key `reports`, and `old_code` for a code update); a
    job that would break fails the task, with the whole report in its log, and is not retried.
    """

    template_fields: Sequence[str] = ("changeover_conn_id", "job", "code", "target_version", "savepoint_name",
                                      "rename_stages", "dry_run",
                                      "strict", "allow_non_restored_state", "state_partitions")

    def __init__(self, *, savepoint_name: str, job: str | None = None, code: str | None = None,
                 target_version: str | None = None, rename_stages: Any = None, dry_run: Any = True,
                 strict: Any = False, allow_non_restored_state: Any = False, upgrade_step: bool = False,
                 state_partitions: Any = None, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.state_partitions = state_partitions
        self.job, self.code, self.target_version = job, code, target_version
        self.savepoint_name = savepoint_name
        self.rename_stages = rename_stages
        self.dry_run, self.strict, self.allow_non_restored_state = dry_run, strict, allow_non_restored_state
        self.upgrade_step = upgrade_step

    def execute(self, context: Any) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowFailException

        settings, cluster = self._setup(context)
        job = str(self.job) if self.job else None
        if job and self.code:  # a code update: what to roll back to, and the new code shipped once, as checked
            context["ti"].xcom_push(key="old_code", value=code_update.current_code(settings, job))
            context["ti"].xcom_push(key="new_code", value=code_update.ship(settings, job, str(self.code)))
        reports: dict[str, Any] = {}
        refused: list[str] = []
        for name in [job] if job else jobs.fault_tolerant_jobs(settings):
            if job is None and (reason := code_update.not_checkable(settings, cluster, name)):
                self.log.info("job %s is not checked: %s", name, reason)  # an upgrade moves only running state
                continue
            report = code_update.check(settings, name, str(self.code) if self.code else None, self.savepoint_name,
                                  self.rename_stages or {}, dry_run=_bool(self.dry_run), strict=_bool(self.strict),
                                  target_version=self.target_version or None,
                                  state_partitions=_partitions(self.state_partitions))
            passed = report.passes(_bool(self.allow_non_restored_state))
            for line in report.render().splitlines():
                (self.log.info if passed else self.log.error)("%s", line)
            reports[name] = report.as_dict()
            if not passed:
                refused.append(report.render())
        context["ti"].xcom_push(key="reports", value=reports)
        context["ti"].xcom_push(key="refused", value=bool(refused))
        if job and self.code:  # what an approver of the update is shown
            plan = [line for report in reports.values() for line in _rendered(report)]
            partitions = _partitions(self.state_partitions)
            plan += [f"then: stop job {job} at a batch boundary with a savepoint, resume it on {self.code}"
                     + (f" with its state in {partitions} partitions" if partitions else "")
                     + ", wait for the stability gate, and roll back to the savepoint on failure"]
            context["ti"].xcom_push(key="plan", value=plan)
        if refused:
            raise AirflowFailException("the change would break these jobs; nothing was stopped:\n" + "\n".join(refused))
        return reports


def _update_strategy(settings: Settings, job: str, asked: Any) -> str:
    """An update's strategy: the Param's, else the job's option (`code_update.strategy_of`)."""
    return code_update.strategy_of(str(asked) if asked else None, jobs.options_of(settings, job))


class UpdateStopOperator(SavepointOperator):
    """An update's stop with a savepoint; with the strategy zero_downtime the job is not stopped here (the resume
    task's follower takes it over at a batch boundary), and an update that cannot go zero-downtime is refused
    before anything is touched."""

    template_fields: Sequence[str] = (*SavepointOperator.template_fields, "strategy", "rename_stages",
                                      "allow_non_restored_state", "state_partitions")

    def __init__(self, *, strategy: Any = None, rename_stages: Any = None, allow_non_restored_state: Any = False,
                 state_partitions: Any = None, **kwargs: Any) -> None:
        kwargs.setdefault("outlets", [SAVEPOINTS_TAKEN])
        super().__init__(mode="stop", **kwargs)
        self.strategy, self.rename_stages = strategy, rename_stages
        self.allow_non_restored_state, self.state_partitions = allow_non_restored_state, state_partitions

    def execute(self, context: Any, event: dict[str, Any] | None = None,
                deadline: float | None = None) -> dict[str, Any]:
        settings, _ = self._setup(context)
        if _update_strategy(settings, self.job, self.strategy) != "zero_downtime":
            return {**super().execute(context, event, deadline), "strategy": "stop"}
        code_update.require_followable(self.job, self.rename_stages, _bool(self.allow_non_restored_state),
                                       _partitions(self.state_partitions))
        self.log.info("zero_downtime: job %s is not stopped; the resume task's follower takes it over at a batch "
                      "boundary, and savepoint %s is taken there", self.job, self.savepoint_name)
        return {"job": self.job, "savepoint": None, "strategy": "zero_downtime"}


class ResumeWithCodeOperator(ChangeoverOperator):
    """Resumes a stopped job from its savepoint on new code. A retry finds the run it launched and returns it.
    With the strategy zero_downtime the job was not stopped: a follower on the new code catches up with it
    read-only and takes over at a batch boundary, where the savepoint is taken (`code_update.cut_over`); the task
    waits in the triggerer between its steps."""

    template_fields: Sequence[str] = ("changeover_conn_id", "job", "code", "savepoint_name", "rename_stages",
                                      "allow_non_restored_state", "state_partitions", "strategy",
                                      "catch_up_seconds")

    def __init__(self, *, job: str, code: Any, savepoint_name: str, rename_stages: Any = None,
                 allow_non_restored_state: Any = False, state_partitions: Any = None, strategy: Any = None,
                 catch_up_seconds: Any = CatchUp.seconds, **kwargs: Any) -> None:
        kwargs.setdefault("outlets", [SAVEPOINTS_TAKEN])
        super().__init__(**kwargs)
        self.job, self.code, self.savepoint_name = job, code, savepoint_name
        self.rename_stages, self.allow_non_restored_state = rename_stages, allow_non_restored_state
        self.state_partitions, self.strategy, self.catch_up_seconds = state_partitions, strategy, catch_up_seconds

    def execute(self, context: Any, event: dict[str, Any] | None = None,
                deadline: float | None = None) -> dict[str, Any]:
        settings, cluster = self._setup(context)
        options = {"renames": self.rename_stages or {},
                   "allow_non_restored_state": _bool(self.allow_non_restored_state),
                   "state_partitions": _partitions(self.state_partitions)}
        if _update_strategy(settings, str(self.job), self.strategy) == "zero_downtime":
            catch_up = CatchUp(seconds=float(self.catch_up_seconds))
            try:
                run = code_update.cut_over(settings, cluster, str(self.job), self.code, self.savepoint_name,
                                           catch_up, **options)
            except CatchUpTimedOut as exc:  # a retry would wait as long again: the update fails, the job runs on
                from airflow.sdk.exceptions import AirflowFailException

                raise AirflowFailException(str(exc)) from exc
            if run is None:  # the job runs on while its follower starts or catches up
                self._defer("follow", str(self.job), settings, timeout=catch_up.seconds + 600, deadline=deadline,
                            params={"catch_up": asdict(catch_up)})
            try:
                _publish(context, self.outlets, savepoints.completed(settings, str(self.job), self.savepoint_name))
            except ChangeoverError as exc:  # the job runs the new code; the gate fails on the same missing savepoint
                self.log.warning("job %s was cut over to its new code, but its savepoint is not published: %s",
                                 self.job, exc)
        else:
            run = code_update.resume_with(settings, cluster, str(self.job), self.code, self.savepoint_name, **options)
        assert run is not None
        return {"job": self.job, "run": run.id, "spark_version": run.spark_version, "from": run.from_savepoint,
                "state_partitions": run.state_partitions}

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None,
                         deadline: float | None = None) -> dict[str, Any]:
        return self.execute(context, event, deadline)


class StabilityGateOperator(ChangeoverOperator):
    """Passes once the job's run has committed `batches` batches in every stage since its savepoint, without a
    failure, with its last commit younger than `max_lag_seconds`; fails, not retried, `gate_timeout` seconds after
    the launch of the run that `resume_task_id` started, whichever try of the task is running then (any other run,
    a rollback's say, is timed from the try's start). It waits in the triggerer, not in a worker slot."""

    template_fields: Sequence[str] = ("changeover_conn_id", "job", "savepoint_name", "batches", "max_lag_seconds",
                                      "gate_timeout", "rename_stages")

    def __init__(self, *, job: str, savepoint_name: str, batches: Any = 5, max_lag_seconds: Any = 60,
                 gate_timeout: Any = 300, rename_stages: Any = None, resume_task_id: str = "resume",
                 **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job, self.savepoint_name, self.resume_task_id = job, savepoint_name, resume_task_id
        self.batches, self.max_lag_seconds, self.gate_timeout = batches, max_lag_seconds, gate_timeout
        self.rename_stages = rename_stages

    def execute(self, context: Any, event: dict[str, Any] | None = None,
                deadline: float | None = None) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowFailException

        settings, cluster = self._setup(context)
        result = code_update.stability(settings, cluster, str(self.job), self.savepoint_name, int(self.batches),
                                  float(self.max_lag_seconds), self.rename_stages or {})
        if deadline is None:  # a retry counts from the same launch as the first try: its deadline never starts again
            resumed = context["ti"].xcom_pull(task_ids=self.resume_task_id) or {}
            launched = result.launched_at if resumed.get("run") == result.run else None
            deadline = (launched or time.time()) + float(self.gate_timeout)
        if not (result.stable or result.ended or time.time() >= deadline):
            self._defer("stable", str(self.job), settings, timeout=float(self.gate_timeout) + 60,
                        fire_by=datetime.fromtimestamp(deadline, UTC), deadline=deadline,
                        params={"savepoint": self.savepoint_name, "batches": int(self.batches),
                                "max_lag_seconds": float(self.max_lag_seconds), "renames": self.rename_stages or {}})
        code_update.record_gate(settings, str(self.job), result)
        context["ti"].xcom_push(key="stability", value=result.__dict__)
        if not result.stable:
            raise AirflowFailException(f"job {self.job} is not stable on its new code: {result.reason}")
        self.log.info("job %s is stable: %s", self.job, result.reason)
        return result.__dict__

    def execute_complete(self, context: Any, event: dict[str, Any] | None = None,
                         deadline: float | None = None) -> dict[str, Any]:
        return self.execute(context, event, deadline)


class RollbackJobOperator(ChangeoverOperator):
    """Runs when a step of the update failed: the old code again from the update's savepoint, its sinks rewound
    to that batch. A job still on its old code (the check or the stop failed) is left running as it is."""

    template_fields: Sequence[str] = ("changeover_conn_id", "job", "savepoint_name")

    def __init__(self, *, job: str, savepoint_name: str, check_task_id: str = "check", **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job, self.savepoint_name, self.check_task_id = job, savepoint_name, check_task_id

    def execute(self, context: Any) -> dict[str, Any]:
        settings, cluster = self._setup(context)
        old_code = context["ti"].xcom_pull(task_ids=self.check_task_id, key="old_code")
        if not old_code:
            self.log.info("the check never read job %s's code: nothing was changed", self.job)
            return {"rolled_back": False}
        gate = context["ti"].xcom_pull(task_ids="gate", key="stability")
        why = (f"the stability gate failed: {gate['reason']}" if gate and not gate.get("stable")
               else "a step of the update failed before its stability gate")
        run = code_update.rollback(settings, cluster, str(self.job), old_code, self.savepoint_name, why=why)
        if run is None:
            self.log.info("job %s still runs its old code: nothing to roll back", self.job)
            return {"rolled_back": False}
        self.log.warning("job %s rolled back to %s from savepoint %s: run %s", self.job, old_code["code"],
                         self.savepoint_name, run.id)
        return {"rolled_back": True, "run": run.id}


class UpdateSummaryOperator(ChangeoverOperator):
    """Whatever happened upstream: the verdicts, the outcome and the job's downtime, in the log and in XCom.
    The run fails unless the new code is running and stable."""

    template_fields: Sequence[str] = ("changeover_conn_id", "job", "savepoint_name")

    def __init__(self, *, job: str, savepoint_name: str, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.job, self.savepoint_name = job, savepoint_name

    def execute(self, context: Any) -> dict[str, Any]:
        from airflow.sdk.exceptions import AirflowFailException

        settings, cluster = self._setup(context)
        ti = context["ti"]
        rejected_by = ti.xcom_pull(task_ids="approval", key="rejected_by")
        if rejected_by:  # nothing was stopped: the job runs its old code, as asked
            summary = {"job": self.job, "outcome": f"rejected by {rejected_by}"}
            self.log.info("update of job %s: %s", self.job, summary)
            return summary
        reports = ti.xcom_pull(task_ids="check", key="reports") or {}
        stability = ti.xcom_pull(task_ids="gate", key="stability") or {}
        rolled = ti.xcom_pull(task_ids="rollback") or {}
        old_code = ti.xcom_pull(task_ids="check", key="old_code")
        outcome = code_update.outcome(refused_at_check=bool(ti.xcom_pull(task_ids="check", key="refused")),
                                      resumed=bool(ti.xcom_pull(task_ids="resume")),
                                      stable=bool(stability.get("stable")), rolled_back=bool(rolled.get("rolled_back")),
                                      old_code_runs=code_update.live_run_on(settings, cluster, str(self.job),
                                                                            old_code) is not None)
        summary = {"job": self.job, "outcome": outcome,
                   "verdicts": {job: r["verdict"] for job, r in reports.items()},
                   "stability": stability.get("reason"),
                   "downtime_seconds": code_update.downtime(settings, str(self.job), self.savepoint_name)}
        resumed = ti.xcom_pull(task_ids="resume") or {}
        took = [m for m in move_history.of(settings, str(self.job)) if m.to_run == resumed.get("run")]
        if took and took[-1].zero_downtime:  # its follower's cut-over: how long an input file waited for the sink
            summary.update(strategy="zero_downtime")
            try:
                move_history.record(settings, took[-1:])
                summary.update(largest_gap_seconds=took[-1].freshness, usual_gap_seconds=took[-1].usual_freshness)
            except Exception as exc:  # noqa: BLE001 - a figure the checkpoints cannot give never fails an update
                self.log.warning("update of job %s: its freshness was not measured: %s", self.job, exc)
                summary.update(largest_gap_seconds=f"not measured: {exc}")
        self.log.info("update of job %s: %s", self.job, summary)
        if outcome != "updated":
            raise AirflowFailException(f"job {self.job} was not updated: {outcome}; {summary}")
        return summary
