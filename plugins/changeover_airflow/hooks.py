from __future__ import annotations

from typing import Any

from airflow.sdk import BaseHook
from airflow.sdk.exceptions import AirflowNotFoundException
from changeover.cluster import LocalCluster
from changeover.registry.schema import migrate
from changeover.settings import Settings


class ChangeoverHook(BaseHook):
    """Where the registry and the cluster folder are: the `changeover_default` connection.

    Extra fields: `home` (cluster and savepoint folder) and `database_url` (the registry). With no
    connection defined, the CHANGEOVER_* environment variables and their defaults apply.
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
            extra = self.get_connection(self.changeover_conn_id).extra_dejson
        except AirflowNotFoundException:
            extra = {}
        settings = Settings.from_env(home=extra.get("home"), database_url=extra.get("database_url"))
        migrate(settings.database_url)
        return settings

    def get_cluster(self) -> LocalCluster:
        return LocalCluster(self.get_settings())
