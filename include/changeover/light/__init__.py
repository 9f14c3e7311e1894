"""Light jobs: short SQL or DataFrame work, not fault-tolerant, run through the Spark Connect
server of a member of the largest version group.

`routing` chooses the server, `ledger` records each light job so drains can wait for it or interrupt it, and
`client` opens the routed session, checks its version as Jet's coordinatorVersion check does, and re-routes
a refusal. `changeover.light.session()` is the user's entry point.
"""

from __future__ import annotations

from changeover.light.client import LightSession, VersionChanged, close_pool, interrupt, run_sql, session
from changeover.light.routing import NoLightServer, Route, choose, route

__all__ = ["LightSession", "NoLightServer", "Route", "VersionChanged", "choose", "close_pool", "interrupt", "route",
           "run_sql", "session"]
