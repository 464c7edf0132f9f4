"""Platform files (configs/platforms/<name>.toml): the one loader every reader uses.

A platform file describes one machine type in human units (TFLOPS, GB, GB/s per direction,
microseconds): [compute], [memory], [node], [network] and the tuner's tables. Three readers
interpret it: the planner (`tuner.load_platform`, every field), the all-to-all cost model
(`comm.CostModel.from_platform`, the link rates) and the network simulator
(`comm.netsim.topologies.from_platform`, the node and network shape). All of them find and
parse the file here, so a name, a path, a missing file and a syntax error mean the same
everywhere; what a reader takes from the parsed table is its own business.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

__all__ = ["PLATFORM_DIR", "PlatformFile", "load_platform_file", "platform_names"]

PLATFORM_DIR = Path(__file__).resolve().parents[2] / "configs" / "platforms"


@dataclass(frozen=True)
class PlatformFile:
    """A parsed platform file: `data` the TOML table as read, `path` where it came from."""

    data: dict[str, Any]
    path: Path

    @property
    def source(self) -> str:
        """The path as a string, for error messages that name the file."""
        return str(self.path)

    @property
    def name(self) -> str:
        """The file's `name` key, else the file's stem."""
        return str(self.data.get("name", self.path.stem))

    def number(self, section: str, key: str, scale: float = 1.0) -> float:
        """[section] key as a float times `scale` (to SI units); a ValueError naming the file
        and the key when it is absent or not a number."""
        v = self.data.get(section, {}).get(key)
        if isinstance(v, bool) or not isinstance(v, int | float):
            raise ValueError(f"platform file {self.source!r} lacks a number [{section}] {key} "
                             f"(got {v!r})")
        return float(v) * scale


def platform_names(directory: str | Path = PLATFORM_DIR) -> list[str]:
    """Names of the platform files under `directory`."""
    return sorted(p.stem for p in Path(directory).glob("*.toml"))


def load_platform_file(name_or_path: str | Path,
                       directory: str | Path | None = None) -> PlatformFile:
    """Read the platform `name_or_path` names: a path to a .toml file, or a name under
    `directory` (default configs/platforms). Raises ValueError naming the valid names for an
    unknown one, and the file for one that is not valid TOML."""
    directory = Path(directory) if directory is not None else PLATFORM_DIR
    p = Path(name_or_path)
    if p.suffix != ".toml" or not p.is_file():
        p = directory / f"{name_or_path}.toml"
    if not p.is_file():
        raise ValueError(
            f"unknown platform {str(name_or_path)!r}; valid: {', '.join(platform_names(directory))} "
            f"(files in {directory}), or a path to a .toml file"
            + ("; run `python -m tuner measure` to create 'local'" if str(name_or_path) == "local" else "")
        )
    try:
        data = tomllib.loads(p.read_text())
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"platform file {str(p)!r} is not valid TOML: {e}") from None
    return PlatformFile(data, p)
