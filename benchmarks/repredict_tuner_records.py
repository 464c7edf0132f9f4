"""Re-predict the stored local validation records with the current model: each layout's bias.

One record of `bench_tuner_validate.py --record` is 19 rows measured in ~35 minutes on this
shared VM, and a row's error moves by 4-8 points from record to record (the VM's drift, the
platform measured at another moment). A model change judged on one new record is judged on
that noise. This script asks the stored records instead: for each of the last `--records`
records in tuner_validate.jsonl it takes the commit that recorded it, that commit's platform
files (the median platform of every world size; where the record kept its separate
measurements and their raw inputs, `tuner.measure.median_platform` builds the median again
with the current code, so the fields fitted against the rest of the platform are fitted as
the current model would fit them), and runs `bench_tuner_validate.py --repredict` on the
record's measured rows. Per layout it prints the error in every record, their mean (the
model's bias on that layout) and standard deviation (the noise), and per record how many rows
fall within 15 %.

    .venv/bin/python benchmarks/repredict_tuner_records.py                 # the last 10 records
    .venv/bin/python benchmarks/repredict_tuner_records.py --records 4 --record

Needs the git history of benchmarks/results/ (a full clone; a shallow one holds fewer
records). Rows measured by older trainers are compared as they were measured; platform fields
a record predates are absent from its files and take their defaults (e.g. no per-action
pipeline work before 9b6555b), which the table's notes name.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _common import RECORDS, ROOT, add_output_args, output_dir, print_written

from tuner.measure import median_platform

RESULTS = RECORDS.relative_to(ROOT).as_posix()  # the records' folder, as git names it
WORLDS = (2, 4)
TOL = 0.15  # bench_tuner_validate's step-time target
PLATFORM = "tuner_validate_platform_w{w}{m}.toml"
MAX_MEASUREMENTS = 9  # separate platform measurements looked for per record and world size


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--records", type=int, default=10,
                    help="how many of the latest records to re-predict (default 10)")
    add_output_args(ap, "repredict_tuner_records")
    return ap


def _run_git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)


def _git(*args: str) -> str:
    p = _run_git(*args)
    if p.returncode != 0:
        raise RuntimeError(f"git {' '.join(args)}: {p.stderr.strip()}")
    return p.stdout


def _show(commit: str, name: str) -> str | None:
    """The file `benchmarks/results/<name>` at `commit`, or None where it did not exist."""
    p = _run_git("show", f"{commit}:{RESULTS}/{name}")
    return p.stdout if p.returncode == 0 else None


def records(n: int) -> list[tuple[str, str]]:
    """(commit, measured sha) of the latest `n` records, newest first: the commits that wrote
    the 4-process median platform, each with the sha its newest row was measured at."""
    if n < 1:
        raise ValueError(f"--records {n}: must be >= 1")
    commits = _git("log", "--format=%H", "--", f"{RESULTS}/{PLATFORM.format(w=4, m='')}").split()
    if not commits:
        raise SystemExit(f"no record of {RESULTS}/{PLATFORM.format(w=4, m='')} in the git history "
                         f"of {ROOT} (a git clone is needed)")
    out: list[tuple[str, str]] = []
    for c in commits:
        rows = _show(c, "tuner_validate.jsonl")
        if not rows or not rows.strip():
            continue
        sha = json.loads(rows.strip().splitlines()[-1])["sha"]
        if sha not in {s for _, s in out}:
            out.append((c, sha))
        if len(out) == n:
            break
    return out


def measurements_of(commit: str, world: int) -> int:
    """How many separate measurements `commit`'s median platform of `world` processes was
    built from: the `of` list of its probe file, which names them (a record of fewer passes
    than the one before it could find the earlier record's later .m<k> files beside its own
    until bench_tuner_validate.py removed them); MAX_MEASUREMENTS where the record predates
    that list (then the .m<k> files found, in order, are its own)."""
    probe = _show(commit, PLATFORM.format(w=world, m="").replace(".toml", ".probe.json"))
    of = json.loads(probe).get("of") if probe else None
    return len(of) if of else MAX_MEASUREMENTS


def platforms_of(commit: str, where: Path) -> dict[int, str]:
    """Write `commit`'s median platform of every world into `where`; rebuilt from its separate
    measurements and raw inputs with the current code where the record kept them. Returns
    {world: how} ("refitted from k measurements" or "as recorded")."""
    how: dict[int, str] = {}
    for w in WORLDS:
        median = _show(commit, PLATFORM.format(w=w, m=""))
        if median is None:
            raise SystemExit(f"record {commit[:7]}: no {PLATFORM.format(w=w, m='')}")
        target = where / PLATFORM.format(w=w, m="")
        paths, raws = [], []
        for k in range(1, measurements_of(commit, w) + 1):
            toml = _show(commit, PLATFORM.format(w=w, m=f".m{k}"))
            raw = _show(commit, PLATFORM.format(w=w, m=f".m{k}").replace(".toml", ".raw.json"))
            if toml is None or raw is None:
                break
            p = where / PLATFORM.format(w=w, m=f".m{k}")
            p.write_text(toml)
            r = p.with_suffix(".raw.json")
            r.write_text(raw)
            paths.append(p)
            raws.append(r)
        if paths:
            median_platform(paths, target, raws)
            how[w] = f"refitted from {len(paths)} measurements"
        else:
            target.write_text(median)
            how[w] = "as recorded"
    return how


def repredict(commit: str, sha: str, rows: list[dict]) -> tuple[list[dict], dict[int, str]]:
    """The record's rows re-predicted on its own (refitted) platforms by
    bench_tuner_validate.py --repredict, in a scratch folder."""
    with tempfile.TemporaryDirectory(prefix=f"tuner-records-{sha}-") as tmp:
        d = Path(tmp)
        how = platforms_of(commit, d)
        (d / "tuner_validate.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
        env = {**os.environ, "PYTHONPATH": str(ROOT)}
        p = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_tuner_validate.py"),
                            "--repredict", "--out", str(d)], cwd=ROOT, env=env,
                           capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"record {sha}: --repredict failed:\n{p.stdout[-1500:]}"
                               f"{p.stderr[-1500:]}")
        lines = (d / "tuner_validate.jsonl").read_text().splitlines()
        return [json.loads(x) for x in lines[len(rows):]], how


def table(results: list[tuple[str, str, list[dict], dict[int, str]]]) -> str:
    """Markdown: one row per layout, one column per record (newest first), mean and sd."""
    shas = [sha for _, sha, _, _ in results]
    names: list[str] = []
    err: dict[str, dict[str, float]] = {}
    for _, sha, rows, _ in results:
        for r in rows:
            if r["config"] not in err:
                names.append(r["config"])
                err[r["config"]] = {}
            err[r["config"]][sha] = r["step_err"]
    head = ("| layout | " + " | ".join(shas) + " | mean | sd |\n|---|"
            + "---|" * (len(shas) + 2) + "\n")
    body = ""
    for n in names:
        vals = [err[n][s] for s in shas if s in err[n]]
        cells = " | ".join(f"{100 * err[n][s]:+.1f}" if s in err[n] else "" for s in shas)
        sd = statistics.pstdev(vals) if len(vals) > 1 else 0.0
        body += f"| {n} | {cells} | **{100 * statistics.mean(vals):+.1f}** | {100 * sd:.1f} |\n"
    within = [sum(abs(r["step_err"]) <= TOL for r in rows) for _, _, rows, _ in results]
    counts = [len(rows) for _, _, rows, _ in results]
    body += ("| rows within 15 % | " + " | ".join(f"{a} of {b}" for a, b in zip(within, counts,
                                                                             strict=True))
             + " | | |\n")
    return head + body


def main(argv: list[str] | None = None) -> None:
    args = parser().parse_args(argv)
    out = output_dir(args)
    measured = [json.loads(x) for x in (RECORDS / "tuner_validate.jsonl").read_text().splitlines()]
    results = []
    for commit, sha in records(args.records):
        rows = [r for r in measured if r["sha"] == sha and "meas_step_s" in r]
        # a record's rows: the last row of each config measured at that sha
        last = {r["config"]: r for r in rows}
        t0 = time.perf_counter()
        new, how = repredict(commit, sha, list(last.values()))
        results.append((commit, sha, new, how))
        errs = [abs(r["step_err"]) for r in new]
        print(f"record {sha} (commit {commit[:7]}; platforms: "
              + ", ".join(f"{w} processes {h}" for w, h in how.items())
              + f"): {sum(e <= TOL for e in errs)} of {len(errs)} within 15 %, median |error| "
              f"{100 * statistics.median(errs):.1f} % ({time.perf_counter() - t0:.0f} s)",
              flush=True)
    md = table(results)
    model = _git("rev-parse", "--short", "HEAD").strip() + (
        "+changes" if _git("status", "--porcelain", "--untracked-files=no").strip() else "")
    allerr = [abs(r["step_err"]) for _, _, rows, _ in results for r in rows]
    head = (f"<!-- written by benchmarks/repredict_tuner_records.py -->\n"
            f"The last {len(results)} local validation records re-predicted with the model of "
            f"{model} ({time.strftime('%Y-%m-%dT%H:%M')}): "
            f"step-time error per layout and record (%), newest first; mean = the model's bias "
            f"on the layout, sd = the spread between records. Over all rows: median |error| "
            f"{100 * statistics.median(allerr):.1f} %, {sum(e <= TOL for e in allerr)} of "
            f"{len(allerr)} within 15 %.\n\n")
    print("\n" + head + md)
    (out / "tuner_records.md").write_text(head + md)
    with open(out / "tuner_records.jsonl", "a") as f:
        for commit, sha, rows, how in results:
            for r in rows:
                f.write(json.dumps({"bench": "tuner_records", "model_sha": model, "record_sha": sha,
                    "record_commit": commit[:7], "platforms": {str(k): v for k, v in how.items()},
                    "config": r["config"], "step_err": r["step_err"],
                    "pred_step_s": r["pred_step_s"], "meas_step_s": r["meas_step_s"]}) + "\n")
    print_written(out / "tuner_records.md", out / "tuner_records.jsonl")


if __name__ == "__main__":
    main()
