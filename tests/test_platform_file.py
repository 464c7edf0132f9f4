"""The one platform-file loader (`comm.topology.platform.load_platform_file`) behind its three readers:
the planner's `tuner.load_platform`, the cost model's `comm.CostModel.from_platform` and the
simulator's `comm.netsim.from_platform`. A name and a path to the same file read the same, and
an unknown name or a syntax error is refused with the same message by each."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

from comm import CostModel
from comm.netsim import from_platform as network_from_platform
from comm.topology.platform import PLATFORM_DIR, load_platform_file, platform_names
from tuner import load_platform

READERS = {
    "tuner": load_platform,
    "cost": CostModel.from_platform,
    "netsim": lambda p: network_from_platform(p, 2),
}


def test_file_is_the_toml_table() -> None:
    pf = load_platform_file("frontier")
    # The reference: tomllib on the file itself.
    assert pf.data == tomllib.loads((PLATFORM_DIR / "frontier.toml").read_text())
    assert pf.name == "frontier" and pf.path == PLATFORM_DIR / "frontier.toml"
    assert pf.number("network", "nic_bandwidth_gbs", 1e9) == 25e9
    assert {"frontier", "dgx-h100", "h200-node"} <= set(platform_names())
    with pytest.raises(ValueError, match=r"lacks a number \[network\] colour \(got None\)"):
        pf.number("network", "colour")


@pytest.mark.parametrize("reader", sorted(READERS))
def test_name_and_path_read_alike(reader: str, tmp_path: Path) -> None:
    read = READERS[reader]
    copy = tmp_path / "mine.toml"
    copy.write_text((PLATFORM_DIR / "dgx-h100.toml").read_text())
    by_name, by_path = read("dgx-h100"), read(copy)
    if reader == "netsim":  # a Network has no __eq__: compare its name and link capacities
        assert by_name.name == by_path.name and (by_name.capacity == by_path.capacity).all()
    else:  # a Platform / CostModel compares by value (CostModel's `source`, the path, aside)
        assert by_name == by_path


@pytest.mark.parametrize("reader", sorted(READERS))
def test_bad_files_refused_alike(reader: str, tmp_path: Path) -> None:
    read = READERS[reader]
    with pytest.raises(ValueError, match=r"unknown platform 'summit'; valid: .*frontier.* or a "
                                         r"path to a \.toml file"):
        read("summit")
    bad = tmp_path / "bad.toml"
    bad.write_text("[network\nnic_bandwidth_gbs = 1\n")
    with pytest.raises(ValueError, match=f"platform file '{bad}' is not valid TOML"):
        read(bad)
