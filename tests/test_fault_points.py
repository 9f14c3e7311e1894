"""The crash and failure hooks are inert unless the test's environment switches them on."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from changeover import faults
from changeover.settings import Settings


def test_an_armed_point_fails_once_only_where_faults_are_enabled(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    settings = Settings.from_env(home=tmp_path, database_url="sqlite://")
    marker = faults.arm(settings, "drain.after_stop")
    monkeypatch.delenv(faults.SWITCH, raising=False)
    faults.point(settings, "drain.after_stop")  # a user's process: nothing happens, the marker stays
    assert marker.exists()
    monkeypatch.setenv(faults.SWITCH, "1")
    with pytest.raises(faults.InjectedFault, match="drain.after_stop"):
        faults.point(settings, "drain.after_stop")
    assert not marker.exists()
    faults.point(settings, "drain.after_stop")  # once only


@pytest.mark.parametrize(("switch", "returncode"), [(None, 0), ("1", -9)])
def test_a_crash_point_kills_only_where_faults_are_enabled(switch: str | None, returncode: int) -> None:
    env = {k: v for k, v in os.environ.items() if k != faults.SWITCH}
    env["CHANGEOVER_CRASH_AT"] = "manifest"
    if switch:
        env[faults.SWITCH] = switch
    code = "from changeover import faults; faults.crash('manifest')"
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == returncode


def test_a_point_armed_to_kill_ends_its_process_with_sigkill_once(tmp_path: Path) -> None:
    settings = Settings.from_env(home=tmp_path, database_url="sqlite://")
    faults.arm(settings, "drain.after_stop", kill=True)
    env = {**os.environ, faults.SWITCH: "1", "CHANGEOVER_HOME": str(tmp_path)}
    code = ("from changeover import faults; from changeover.settings import Settings; "
            "faults.point(Settings.from_env(database_url='sqlite://'), 'drain.after_stop'); print('survived')")
    first = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert first.returncode == -9 and "survived" not in first.stdout
    again = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert again.returncode == 0 and "survived" in again.stdout  # a retry passes the point
    assert [line.split(" pid ")[0] for line in faults.fired(settings)] == ["drain.after_stop kill"]
