"""Our top-level package names are ours alone, wherever Python is started.

transformers 5.25 depends on Hugging Face's `kernels` distribution, whose top-level module was
named like our grouped-GEMM package was: a script started outside the repository imported theirs
instead of ours, and transformers, run from the repository, imported ours instead of theirs (a
fresh `make test` failed in every test that builds a transformers model). The package is now
`piper_kernels`; these checks catch the next such clash when an installed distribution brings
it, before a user's run does.
"""

from __future__ import annotations

import importlib.metadata
import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def top_level_packages() -> list[str]:
    """The importable top-level names pyproject.toml installs (sub-packages left out)."""
    cfg = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return sorted({p for p in cfg["tool"]["setuptools"]["packages"] if "." not in p})


def test_the_package_list_is_what_the_checkout_holds():
    names = top_level_packages()
    assert "piper_kernels" in names and "kernels" not in names
    for n in names:
        assert (ROOT / n / "__init__.py").is_file(), f"pyproject lists {n!r}, no {n}/__init__.py"


def test_no_installed_distribution_provides_one_of_our_names():
    claimed = importlib.metadata.packages_distributions()
    clashes = {n: sorted(set(claimed[n]) - {"piper-moe", "piper_moe"})
               for n in top_level_packages() if n in claimed}
    clashes = {n: d for n, d in clashes.items() if d}
    assert not clashes, (
        f"installed distributions provide top-level modules named like ours: {clashes}; one of "
        f"the two shadows the other depending on sys.path order. Rename ours (as kernels -> "
        f"piper_kernels) or keep that distribution out of the environment")


def test_our_packages_import_from_this_checkout_outside_it(tmp_path):
    """From a directory outside the repository (a script in benchmarks/, a user's cwd) the
    editable install must resolve every name to this checkout, not to site-packages."""
    try:
        importlib.metadata.distribution("piper-moe")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("piper-moe is not installed in this interpreter (make test installs it)")
    code = ("import importlib.util, json, sys; "
            "print(json.dumps({n: importlib.util.find_spec(n).origin for n in sys.argv[1:]}))")
    out = subprocess.run([sys.executable, "-c", code, *top_level_packages()], cwd=tmp_path,
                         capture_output=True, text=True, check=True)
    where = json.loads(out.stdout)
    for name, origin in where.items():
        assert origin and Path(origin).resolve().is_relative_to(ROOT), (
            f"outside the checkout `import {name}` finds {origin}, not {ROOT / name}")
