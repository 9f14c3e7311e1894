"""The description of a Spark standalone cluster that Changeover did not start (a platform team's): its masters, one
per version group, its members and their hosts, and the command templates that stop a member's worker and start it
at a version. Read from the JSON file the connection's `cluster_file` (or CHANGEOVER_CLUSTER_FILE) names.

    {
      "masters": {"4.2.0": {"url": "spark://m.example:7077", "rest_url": "http://m.example:6066",
                            "webui_url": "http://m.example:8080"}},
      "members": {"w1": {"host": "10.0.0.11", "worker_ui": "http://10.0.0.11:8081"}},
      "commands": {"start_worker": "ssh {host} sudo systemctl start spark-worker@{version}",
                   "stop_worker": "ssh {host} sudo systemctl stop spark-worker",
                   "check": "ssh {host} true", "decommission": null, "timeout_seconds": 120},
      "spark_home": "/opt/spark-{version}",
      "python": "/opt/spark-{version}/venv/bin/python"
    }

Templates may use {member}, {host}, {version}, {master_url} and {spark_home}.
"""

from __future__ import annotations

import json
import re
import string
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from changeover.errors import ChangeoverError
from changeover.names import check_name

FIELDS = frozenset({"member", "host", "version", "master_url", "spark_home"})
REQUIRED_COMMANDS = ("start_worker", "stop_worker")
HOST = re.compile(r"[A-Za-z0-9][A-Za-z0-9.:_-]*")  # a name or address, never an option (`-oProxyCommand=...`)


@dataclass(frozen=True)
class MasterSpec:
    version: str
    url: str  # spark://host:port, as workers and drivers reach it
    rest_url: str
    webui_url: str

    @property
    def host(self) -> str:
        return str(urlsplit(self.webui_url).hostname)

    @property
    def webui_port(self) -> int:
        return _port(self.webui_url, 8080)

    @property
    def rest_port(self) -> int:
        return _port(self.rest_url, 6066)


@dataclass(frozen=True)
class MemberSpec:
    name: str
    host: str
    worker_ui: str

    @property
    def webui_port(self) -> int:
        return _port(self.worker_ui, 8081)


@dataclass(frozen=True)
class PlatformSpec:
    source: Path
    masters: dict[str, MasterSpec]
    members: dict[str, MemberSpec]
    commands: dict[str, str]
    timeout_seconds: float
    spark_home: str
    python: str

    def member(self, name: str) -> MemberSpec:
        if name not in self.members:
            raise ChangeoverError(f"member {name!r}", f"the cluster file {self.source} does not describe it "
                                  f"(its members: {', '.join(sorted(self.members)) or 'none'})",
                                  "add it under \"members\" with its host and worker_ui, or use one of those")
        return self.members[name]

    def master(self, version: str) -> MasterSpec:
        if version not in self.masters:
            raise ChangeoverError(f"version group {version}", f"the cluster file {self.source} names no master for "
                                  f"it (its masters: {', '.join(sorted(self.masters)) or 'none'})",
                                  "start a master of that version on the platform and add it under \"masters\"")
        return self.masters[version]

    def command(self, verb: str, member: str, version: str) -> str | None:
        """The verb's command line for a member at a version, or None when the file gives no template for it."""
        template = self.commands.get(verb)
        if not template:
            return None
        spec = self.member(member)
        master_url = self.masters[version].url if version in self.masters else ""
        return template.format(member=member, host=spec.host, version=version, master_url=master_url,
                               spark_home=self.spark_home.format(version=version))


def load(path: Path) -> PlatformSpec:
    """The file parsed and checked; each refusal names the field and what to put there."""
    try:
        raw = json.loads(path.read_text())
    except OSError as exc:
        raise ChangeoverError(f"the cluster file {path}", f"it cannot be read: {exc.strerror}",
                              "point cluster_file (or CHANGEOVER_CLUSTER_FILE) at the cluster's description") from None
    except json.JSONDecodeError as exc:
        raise ChangeoverError(f"the cluster file {path}", f"it is not JSON ({exc})",
                              "fix it; docs/operations.md, \"Pointing Changeover at your cluster\", shows its "
                              "shape") from None
    if not isinstance(raw, dict):
        raise _bad(path, "the whole file", "it is not a JSON object")
    masters = {str(v): MasterSpec(str(v), *(str(_field(path, f"masters.{v}", m, k))
                                            for k in ("url", "rest_url", "webui_url")))
               for v, m in _mapping(path, raw, "masters").items()}
    for master in masters.values():
        if not master.url.startswith("spark://"):
            raise _bad(path, f"masters.{master.version}.url", f"{master.url!r} is not a spark:// URL")
    members = {}
    for name, m in _mapping(path, raw, "members").items():
        check_name("member", name)
        members[name] = MemberSpec(name, str(_field(path, f"members.{name}", m, "host")),
                                   str(_field(path, f"members.{name}", m, "worker_ui")))
        if not HOST.fullmatch(members[name].host):
            raise _bad(path, f"members.{name}.host", f"{members[name].host!r} is not a host name or address")
    commands = raw.get("commands") or {}
    if not isinstance(commands, dict):
        raise _bad(path, "commands", "it is not an object of command templates")
    timeout = float(commands.get("timeout_seconds", 120))
    templates = {k: str(v) for k, v in commands.items() if k != "timeout_seconds" and v}
    for verb in REQUIRED_COMMANDS:
        if verb not in templates:
            raise _bad(path, f"commands.{verb}", "it is missing: Changeover cannot restart a member without it")
    for verb, template in templates.items():
        unknown = {f for _, f, _, _ in string.Formatter().parse(template) if f} - FIELDS
        if unknown:
            raise _bad(path, f"commands.{verb}", f"it uses {', '.join(sorted(unknown))}, which is not one of "
                       f"{', '.join(sorted(FIELDS))}")
    spark_home, python = (str(_field(path, "the file", raw, key)) for key in ("spark_home", "python"))
    return PlatformSpec(path, masters, members, templates, timeout, spark_home, python)


def _port(url: str, default: int) -> int:
    """The URL's port, or Spark's default for that endpoint."""
    return int(urlsplit(url).port or default)


def _mapping(path: Path, raw: dict[str, Any], key: str) -> dict[str, Any]:
    value = raw.get(key)
    if not isinstance(value, dict) or not value:
        raise _bad(path, key, "it is missing or empty")
    return value


def _field(path: Path, where: str, raw: Any, key: str) -> Any:
    if not isinstance(raw, dict) or not raw.get(key):
        raise _bad(path, f"{where}.{key}", "it is missing")
    return raw[key]


def _bad(path: Path, field: str, why: str) -> ChangeoverError:
    return ChangeoverError(f"the cluster file {path}: {field}", why,
                           "fix the file; docs/operations.md, \"Pointing Changeover at your cluster\", shows its shape")
