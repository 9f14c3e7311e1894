"""Bad input gets one clear error that names what was refused, why, and what to do instead."""

import re
import socket
from pathlib import Path

import pytest
from changeover.cluster import LocalCluster, routing
from changeover.cluster.ports import require_free
from changeover.cluster.runtimes import find_runtime
from changeover.errors import ChangeoverError
from changeover.names import check_name
from changeover.runtime import Stage
from changeover.settings import Settings
from changeover.upgrade.member_upgrade import upgrade_member


@pytest.mark.parametrize("name", ["a/b", "..", "../etc", "x..y", "/abs", ""])
def test_unsafe_savepoint_names_are_refused(name: str) -> None:
    with pytest.raises(ChangeoverError) as err:
        check_name("savepoint", name)
    assert "savepoint name" in str(err.value) and "'/'" in str(err.value) and "choose a name" in str(err.value)


@pytest.mark.parametrize("name", ["../totals", "my stage", "totals/2"])
def test_a_stage_whose_name_would_leave_its_checkpoint_folder_is_refused_where_it_is_declared(name: str) -> None:
    with pytest.raises(ChangeoverError, match=rf"stage name {re.escape(repr(name))}: names may only hold"):
        Stage(name, frame=None, sink=None)  # type: ignore[arg-type]  # refused before either is used


def test_unknown_version_is_refused() -> None:
    with pytest.raises(ChangeoverError, match=r"Spark version '9\.9\.9'.*known: 4\.2\.0"):
        find_runtime(Path("/nonexistent"), "9.9.9")


def test_missing_runtime_says_how_to_install_it(tmp_path: Path) -> None:
    expected = r"Spark runtime 4\.3\.0: it is not installed.*changeover runtime install"
    with pytest.raises(ChangeoverError, match=expected):
        find_runtime(tmp_path, "4.3.0")


def test_busy_port_is_refused() -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        with pytest.raises(ChangeoverError, match=rf"port {port} on 127.0.0.1 .* already in use"):
            require_free("127.0.0.1", port, "a Spark master")


def test_unknown_member_is_refused_and_nothing_changes(settings: Settings) -> None:
    cluster = LocalCluster(settings)
    with pytest.raises(ChangeoverError, match=r"member 'nope': no such member \(known: none\)"):
        upgrade_member(settings, cluster, "nope", "4.3.0")
    assert cluster.status() == {"members": [], "masters": []}


def test_largest_group_wins_and_a_tie_goes_to_the_higher_version() -> None:
    assert routing.largest_group({"4.2.0": ["a", "b"], "4.3.0": ["c"]}) == "4.2.0"
    assert routing.largest_group({"4.2.0": ["a"], "4.3.0": ["c"]}) == "4.3.0"
    assert routing.largest_group({"4.2.1": ["a"], "4.2.0": ["b"]}) == "4.2.1"
    with pytest.raises(ChangeoverError, match="no ACTIVE member"):
        routing.largest_group({})
