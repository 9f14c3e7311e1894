"""The light job operator: SQL on the largest version group, through a member's Spark Connect server."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from changeover.errors import ChangeoverError
from changeover.settings import Settings

from changeover_airflow.operators.base import ChangeoverOperator, _bool


class LightJobOperator(ChangeoverOperator):
    """Runs SQL as a light job on the largest version group, through a member's Spark Connect server.

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
