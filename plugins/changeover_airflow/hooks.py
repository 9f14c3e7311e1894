from __future__ import annotations

from pathlib import Path
from typing import Any

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException
from airflow.sdk.log import mask_secret
from changeover.registry.schema import require_current
from changeover.settings import Settings
from sqlalchemy.engine import make_url


class ChangeoverHook(BaseHook):
    """Where the registry and the cluster folder are: the `changeover_default` connection.

    Extra fields: `home` (cluster and savepoint folder) and the registry as `database_url`, or by reference as
    `database_url_file` (a file only the Airflow user reads). A password in the connection's own password field
    goes into that URL. `rest_key_file` is the key that signs submissions to the masters (default: one under
    `home`). `cluster_file` describes a Spark standalone cluster Changeover did not start (its masters, members and
command templates; `changeover.cluster.platform`), whose `home` must be on storage every host sees. With no
connection defined, the CHANGEOVER_* environment variables and their defaults
    apply. The password is masked in Airflow's logs.
    """

    conn_name_attr = "changeover_conn_id"
    default_conn_name = "changeover_default"
    conn_type = "changeover"
    hook_name = "Changeover"

    def __init__(self, changeover_conn_id: str = default_conn_name, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.changeover_conn_id = changeover_conn_id

    def get_settings(self) -> Settings:
        try:
            conn = self.get_connection(self.changeover_conn_id)
        except AirflowNotFoundException:
            conn = None
        extra = conn.extra_dejson if conn else {}
        url = self.registry_url(extra, conn.password if conn else None)
        settings = Settings.from_env(home=extra.get("home"), database_url=url,
                                     rest_key_file=extra.get("rest_key_file"), cluster_file=extra.get("cluster_file"))
        self._mask(settings.database_url)
        require_current(settings.database_url)
        return settings

    @staticmethod
    def registry_url(extra: dict[str, Any], password: str | None) -> str | None:
        """The registry URL from the connection: `database_url`, or the file `database_url_file` names, with the
        connection's password put in (for a database server; SQLite has none)."""
        url = extra.get("database_url")
        if not url and extra.get("database_url_file"):
            url = Path(extra["database_url_file"]).read_text().strip()
        if url and password and make_url(url).host:
            url = make_url(url).set(password=password).render_as_string(hide_password=False)
        return url

    @staticmethod
    def _mask(url: str) -> None:
        """Airflow replaces these with *** wherever a task or trigger would log them."""
        password = make_url(url).password
        if password:
            mask_secret(str(password))
            mask_secret(url)
