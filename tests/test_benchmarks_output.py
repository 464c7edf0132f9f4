"""Benchmarks leave the tree clean (issue 29): with its defaults every benchmark writes under a
folder git ignores, and only `--record` points at the tracked records in benchmarks/results/.

Each script is imported, not run: its own `parser()` is parsed and the folder it would write to
asked from `_common.output_dir`, the call every script makes before writing. git itself
(`check-ignore`, `ls-files`) judges "ignored" and "tracked", so a .gitignore edit or a record
committed under runs/ fails here. A static pass over each script's code (docstrings aside)
checks that no script builds its own path into benchmarks/results/, the way all of them did
before. Running the quick benchmarks with their defaults and checking `git status` is in
docs/benchmarks.md (not here: each takes seconds to minutes)."""

from __future__ import annotations

import argparse
import ast
import importlib
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "benchmarks"
sys.path.insert(0, str(BENCH))  # the scripts import `_common` and each other by name

import _common  # noqa: E402

SCRIPTS = sorted(p.name for p in BENCH.glob("*.py") if not p.name.startswith("_"))
# Writes no file: it reads runs' metrics.jsonl and prints (checked below, not assumed).
WRITES_NOTHING = {"gpu_check_losses.py"}
# Scripts that may name the records, and why: reading them, never writing.
READS_RECORDS = {"bench_netsim.py": "validates against the recorded alltoall.jsonl rows",
                 "repredict_tuner_records.py": "re-predicts the recorded validation rows, "
                                               "platforms from their git history"}


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def _ignored(path: Path) -> bool:
    """git would not show a new file at `path` (ignored), and nothing below it is tracked."""
    probe = path / "rows.jsonl"
    ignored = _git("check-ignore", "-q", "--no-index", str(probe)).returncode == 0
    return ignored and _git("ls-files", "--", str(path)).stdout == ""


def _parser(script: str) -> argparse.ArgumentParser:
    module = importlib.import_module(script.removesuffix(".py"))
    assert hasattr(module, "parser"), f"{script}: no parser() (add_output_args goes there)"
    return module.parser()


@pytest.fixture(scope="module", autouse=True)
def _git_checkout() -> None:
    if _git("rev-parse", "--is-inside-work-tree").stdout.strip() != "true":
        pytest.skip("not a git checkout: nothing to compare against")


@pytest.mark.parametrize("script", sorted(set(SCRIPTS) - WRITES_NOTHING))
def test_default_output_is_ignored_and_record_is_tracked(script: str, tmp_path: Path) -> None:
    p = _parser(script)
    args = p.parse_args([])
    assert args.bench_name == script.removesuffix(".py").removeprefix("bench_")
    default = _common.output_dir(args, create=False)
    assert default.is_relative_to(ROOT) and not default.is_relative_to(_common.RECORDS), default
    assert _ignored(default), f"{script} writes to {default} by default, which git would show"

    record = _common.output_dir(p.parse_args(["--record"]), create=False)
    assert record == _common.RECORDS
    assert not _ignored(record) and _git("ls-files", "--", str(record)).stdout, \
        "benchmarks/results/ should hold the tracked records"
    assert _common.output_dir(p.parse_args(["--out", str(tmp_path / "o")])) == tmp_path / "o"
    assert (tmp_path / "o").is_dir()
    with pytest.raises(SystemExit):  # --out and --record are exclusive: argparse's error
        p.parse_args(["--record", "--out", str(tmp_path)])


def _code_strings(tree: ast.Module) -> list[str]:
    """String constants of a module's code, docstrings left out."""
    docs = {id(n.body[0].value) for n in ast.walk(tree)
            if isinstance(n, ast.Module | ast.FunctionDef | ast.ClassDef) and n.body
            and isinstance(n.body[0], ast.Expr) and isinstance(n.body[0].value, ast.Constant)}
    return [n.value for n in ast.walk(tree)
            if isinstance(n, ast.Constant) and isinstance(n.value, str) and id(n) not in docs]


@pytest.mark.parametrize("script", SCRIPTS)
def test_no_script_builds_its_own_path_into_the_records(script: str) -> None:
    tree = ast.parse((BENCH / script).read_text())
    strings = _code_strings(tree)
    assert not [s for s in strings if s == "results" or "benchmarks/results" in s], \
        f"{script} names benchmarks/results itself: ask _common.output_dir instead"
    names = {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}
    names |= {a.name for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
              for a in n.names}
    if "RECORDS" in names:
        assert script in READS_RECORDS, f"{script} uses _common.RECORDS; writes go to output_dir"
    if script in WRITES_NOTHING:
        calls = {n.func.attr if isinstance(n.func, ast.Attribute) else getattr(n.func, "id", "")
                 for n in ast.walk(tree) if isinstance(n, ast.Call)}
        assert not calls & {"open", "write_text", "write_bytes", "mkdir", "savefig"}, script
    else:
        assert "output_dir" in names, f"{script} never asks _common.output_dir where to write"


def test_record_reader_falls_back_to_the_record(tmp_path: Path) -> None:
    """`previous`: an output folder's own rows first, else the tracked record of that name."""
    name = next(p.name for p in sorted(_common.RECORDS.glob("*.jsonl")))
    assert _common.previous(tmp_path, name) == _common.RECORDS / name
    (tmp_path / name).write_text("{}\n")
    assert _common.previous(tmp_path, name) == tmp_path / name
    with pytest.raises(ValueError, match="add_output_args"):
        _common.output_dir(argparse.Namespace(out=None, record=False))


@pytest.mark.parametrize("script", sorted(p.name for p in BENCH.glob("gpu_check*.sh")))
def test_gpu_check_default_folder_is_ignored(script: str) -> None:
    """The GPU check scripts' default OUT_DIR (`make gpu-check` without OUT_DIR=)."""
    text = (BENCH / script).read_text()
    m = re.search(r'^OUT="\$\{1:-\$ROOT/([^"$]+)\$\(date [^)]*\)\}"$', text, re.M)
    assert m, f"{script}: no default OUT=\"${{1:-$ROOT/...$(date ...)}}\" line"
    assert _ignored(ROOT / (m.group(1) + "20260101-000000")), m.group(1)
