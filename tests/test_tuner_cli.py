"""`python -m tuner plan`: the plan file train.py reads, launch lines, and clear refusals."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path

import pytest

from model import presets
from trainer.config import parse_args
from tuner import load_platform
from tuner.cli import main


@pytest.mark.integration
def test_plan_writes_a_plan_train_py_accepts(tmp_path, capsys):
    rc = main(["plan", "--model", "mixtral-8x7b", "--platform", "frontier", "--gpus", "64",
               "--global-batch", "512", "--search", "tpe", "--trials", "10",
               "--out", str(tmp_path), "--storage", str(tmp_path / "study.db")])
    out = capsys.readouterr().out
    assert rc == 0
    plan_path = tmp_path / "mixtral-8x7b-frontier-64.toml"
    data = tomllib.loads(plan_path.read_text())
    run = parse_args(["--plan", str(plan_path)])  # what train.py does with --plan
    par = data["run"]["parallel"]
    assert (run.parallel.pp, run.parallel.ep, run.parallel.dp) == (par["pp"], par["ep"], par["dp"])
    assert run.parallel.pp * run.parallel.ep * run.parallel.dp == 64
    assert run.model.preset == "mixtral-8x7b" and run.train.global_batch == 512
    assert run.comm.alltoall == data["run"]["comm"]["alltoall"]
    comm = data["run"]["comm"]
    assert (run.comm.a2a_overlap, run.comm.a2a_chunks) == \
        (comm["a2a_overlap"], str(comm["a2a_chunks"]))
    assert comm["a2a_overlap"] in ("none", "layer", "fb")
    assert f"all-to-all overlap: {comm['a2a_overlap']}" in out
    assert run.parallel.zero == par["zero"] in (0, 1, 2, 3)
    assert f"ZeRO-{par['zero']}: " in out
    assert 0 < data["plan"]["predicted_mfu"] < 1
    assert data["plan"]["predicted_peak_memory_gb"] <= 64 * 0.9
    assert "torchrun --nnodes 8 --nproc-per-node 8" in out and f"--plan {plan_path}" in out
    sbatch = (tmp_path / "mixtral-8x7b-frontier-64.sbatch").read_text()
    assert "#SBATCH --nodes=8" in sbatch and "srun" in sbatch
    assert (tmp_path / "mixtral-8x7b-frontier-64.png").stat().st_size > 0
    assert (tmp_path / "study.db").is_file()


@pytest.mark.parametrize("args,message", [
    (["--model", "deepseek-v3", "--platform", "summit", "--gpus", "64"],
     "unknown platform 'summit'; valid: dgx-b200, dgx-h100, frontier, h200-node"),
    (["--model", "deepseek-v3", "--platform", "frontier", "--gpus", "12"],
     "use 8 or 16"),
    # the trainer's GPU default, bf16 weights + fp32 masters, costs 18 B per parameter where a
    # replica group has one rank (experts at pp=32 x ep=8 on 256 GPUs: edp = 1), fp32 16 B
    (["--model", "deepseek-v3", "--platform", "frontier", "--gpus", "64"],
     r"does not fit on 64 x frontier GPUs: .* It would fit on 256 GPUs \(pp=2, ep=32, ZeRO-3"),
    (["--model", "deepseek-v3", "--platform", "frontier", "--gpus", "64", "--zero", "0,1,2"],
     r"does not fit on 64 x frontier GPUs: .* It would fit on 512 GPUs \(pp=32, ep=16, ZeRO-1"),
    (["--model", "deepseek-v3", "--platform", "frontier", "--gpus", "64", "--param-dtype",
      "fp32", "--zero", "0,1,2"],
     r"does not fit on 64 x frontier GPUs: .* It would fit on 256 GPUs \(pp=32, ep=8, ZeRO-1"),
    (["--model", "deepseek-v3", "--platform", "frontier", "--gpus", "64", "--zero", "0"],
     r"does not fit on 64 x frontier GPUs: .* It would fit on 512 GPUs \(pp=32, ep=16, ZeRO-0"),
    (["--model", "tiny", "--platform", "local", "--gpus", "2", "--zero", "0,4"],
     r"--zero=4: the ZeRO level must be one of 0 \(replicated state\), 1 .*, 2 "),
    (["--model", "tiny", "--platform", "local", "--gpus", "1", "--seq", "64", "--zero", "1,2"],
     r"no layout of 1 GPUs can use ZeRO levels \[1, 2\]: ZeRO > 0 needs a replica group"),
    (["--model", "tiny", "--platform", "local", "--gpus", "2", "--zero", "one"],
     "--zero 'one': 'one' is not a ZeRO level; valid: 0, 1, 2"),
    (["--model", "tiny", "--platform", "local", "--gpus", "2", "--seq", "64", "--redundant", "-1"],
     r"--redundant -1: redundant expert slots per EP rank must be >= 0"),
    (["--model", "tiny", "--platform", "local", "--gpus", "2", "--seq", "64", "--redundant", "5"],
     r"--redundant 5: an EP rank does not hold more than E - E/ep = 4 of tiny's 8 experts "
     r"\(ep=2\); .* valid: 0\.\.4"),
    (["--model", "tiny", "--platform", "local", "--gpus", "1", "--seq", "64", "--redundant", "1"],
     r"--redundant 1: no EP degree > 1 fits these GPUs; .* valid: 0\.\.0"),
    (["--model", "tiny", "--platform", "local", "--gpus", "2", "--a2a-overlap", "none,lyer"],
     r"--a2a-overlap='lyer': the all-to-all overlap must be one of none \(every exchange "
     r"exposed\), layer \(.*\), fb \("),
    (["--model", "tiny", "--platform", "local", "--gpus", "2", "--a2a-overlap", "auto"],
     r"--a2a-overlap='auto' is not searched: it runs none, layer or fb, which the search "
     r"compares"),
    (["--model", "tiny", "--platform", "local", "--gpus", "1", "--seq", "64", "--a2a-overlap",
      "layer,fb"],
     r"no layout of 1 GPUs can run --a2a-overlap layer,fb: overlap needs an all-to-all "
     r"\(EP > 1\).*; add none to --a2a-overlap"),
    (["--model", "gpt-5", "--platform", "frontier", "--gpus", "64"],
     "unknown model preset 'gpt-5'; valid:"),
    (["--model", "tiny", "--platform", "frontier", "--gpus", "8", "--measure", "2"],
     "--measure runs the plans as CPU processes on this machine, but platform 'frontier' "
     "describes nccl GPUs: plan for --platform local"),
    (["--model", "tiny", "--platform", "local", "--gpus", "8", "--measure", "1"],
     "--measure with --gpus 8: this machine runs at most 4 training processes; use --gpus 2 or 4"),
    (["--model", "tiny", "--platform", "local", "--gpus", "2", "--measure", "-1"],
     "--measure -1: must be >= 1"),
    (["--model", "tiny", "--platform", "local", "--gpus", "2", "--search", "grid"],
     "--search 'grid'; valid: auto, tpe, exhaustive"),
    (["--model", "tiny", "--platform", "local", "--gpus", "2", "--seq", "64", "--search",
      "exhaustive", "--storage", "study.db"],
     r"--storage '.*study.db' resumes a TPE study; the search here is exhaustive \(--search "
     r"exhaustive\): add --search tpe, or drop --storage"),
])
def test_bad_requests_say_what_would_fit(args, message, capsys, tmp_path):
    rc = main(["plan", *args, "--global-batch", "512", "--trials", "5", "--out", str(tmp_path)])
    err = capsys.readouterr().err
    assert rc == 2
    assert err.startswith("error: ")
    assert re.search(message, err), err


@pytest.mark.multiproc
def test_measure_runs_the_best_plan_and_records_it(tmp_path, capsys):
    """`--measure 1` on the tiny model: one real 2-process run (~15 s), measured beside
    predicted in the printed table, the study and the re-written plan file."""
    import optuna

    db = tmp_path / "study.db"
    rc = main(["plan", "--model", "tiny", "--platform", "local", "--gpus", "2", "--seq", "64",
               "--global-batch", "4", "--search", "tpe", "--trials", "12", "--out", str(tmp_path),
               "--storage", str(db),
               "--measure", "1", "--measure-steps", "4"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "measured on this machine" in out
    study = optuna.load_study(study_name="tiny|local|2|s64|b4", storage=f"sqlite:///{db}")
    rec = study.user_attrs["measured/0"]
    assert rec["measured_step_time_s"] > 0 and rec["predicted_step_time_s"] > 0
    # On a gloo platform the plan is predicted for the CPU trainer (fp32 + AdamW): the held
    # state matches up to AdamW's 4-byte step counters (~100 tensors -> < 0.01 %).
    assert rec["measured_state_bytes"] == pytest.approx(rec["predicted_state_bytes"], rel=1e-4)
    data = tomllib.loads((tmp_path / "tiny-local-2.toml").read_text())
    assert data["plan"]["measured_step_time_s"] == pytest.approx(rec["measured_step_time_s"], abs=1e-3)
    run = parse_args(["--plan", str(tmp_path / "tiny-local-2.toml")])
    assert run.parallel.pp * run.parallel.ep * max(run.parallel.dp, 1) == 2


@pytest.mark.parametrize("zero", [0, 1, 2])
def test_plan_file_round_trip_carries_zero(zero, tmp_path):
    """Plan file -> train.py's config parser -> the same ZeRO level; measured runs pass it too."""
    from model import presets
    from tuner import ParallelPlan, estimate, load_platform
    from tuner.launch import train_args
    from tuner.report import plan_toml

    plan = ParallelPlan(pp=1, ep=2, dp=2, microbatches=2, global_batch=8, seq_len=64, zero=zero)
    e = estimate(presets.get("tiny"), plan, load_platform("local"))
    path = tmp_path / "plan.toml"
    path.write_text(plan_toml(e, "tiny", {"model": "tiny"}))
    assert tomllib.loads(path.read_text())["run"]["parallel"]["zero"] == zero
    run = parse_args(["--plan", str(path)])
    assert (run.parallel.zero, run.parallel.dp, run.parallel.ep) == (zero, 2, 2)
    assert f"--parallel.zero={zero}" in train_args(plan, "tiny", tmp_path, 4, None)


@pytest.mark.parametrize("r", [0, 2])
def test_plan_file_round_trip_carries_redundant(r, tmp_path):
    """[run.balance] redundant = r in the plan file (absent for r = 0) -> train.py's config
    parser -> the same r; measured runs pass it too."""
    from model import presets
    from tuner import ParallelPlan, estimate, load_platform
    from tuner.launch import train_args
    from tuner.report import plan_toml

    plan = ParallelPlan(pp=1, ep=2, dp=2, microbatches=2, global_batch=8, seq_len=64, zero=1,
                        redundant=r)
    e = estimate(presets.get("tiny"), plan, load_platform("local"))
    path = tmp_path / "plan.toml"
    path.write_text(plan_toml(e, "tiny", {"model": "tiny"}))
    data = tomllib.loads(path.read_text())
    assert data["run"].get("balance") == ({"redundant": r} if r else None)
    assert data["plan"].get("predicted_redundant_memory_gb") == \
        (round(e.redundant_memory / 1e9, 3) if r else None)
    run = parse_args(["--plan", str(path)])
    assert (run.balance.redundant, run.parallel.ep, run.parallel.zero) == (r, 2, 1)
    assert (f"--balance.redundant={r}" in train_args(plan, "tiny", tmp_path, 4, None)) == bool(r)


@pytest.mark.parametrize("mode", ["none", "layer", "fb"])
def test_plan_file_round_trip_carries_overlap(mode, tmp_path):
    """[run.comm] a2a_overlap and a2a_chunks in the plan file -> train.py's config parser and
    its validation (`prepare`) -> the mode and chunks the EP dispatcher runs
    (`trainer.build.resolve_a2a`): the ones the planner priced (layer and fb with 2 chunks,
    where an explicit fb would otherwise run 1); measured runs pass them too."""
    from model import presets
    from trainer import prepare
    from trainer.build import resolve_a2a
    from tuner import ParallelPlan, estimate, load_platform
    from tuner.launch import train_args
    from tuner.report import plan_toml

    plan = ParallelPlan(pp=1, ep=2, dp=2, microbatches=2, global_batch=8, seq_len=64,
                        a2a_overlap=mode)
    e = estimate(presets.get("tiny"), plan, load_platform("local"))
    path = tmp_path / "plan.toml"
    path.write_text(plan_toml(e, "tiny", {"model": "tiny"}))
    chunks = {"none": "auto", "layer": 2, "fb": 2}[mode]
    assert tomllib.loads(path.read_text())["run"]["comm"] == \
        {"alltoall": "flat", "a2a_overlap": mode, "a2a_chunks": chunks}
    data = tmp_path / "text.txt"
    data.write_bytes(b"def f(x):\n    return x + 1\n" * 2000)
    run = parse_args(["--plan", str(path), f"--data={data}"])
    assert (run.comm.a2a_overlap, run.comm.a2a_chunks) == (mode, str(chunks))
    got = prepare(run, 4, 0)  # every check train.py makes before it starts (fb's included)
    assert resolve_a2a(run, got.mcfg, got.mesh, None) == \
        ("flat", mode, 2 if mode != "none" else 1)
    args = train_args(plan, "tiny", tmp_path, 4, None)
    assert f"--comm.a2a_overlap={mode}" in args and f"--comm.a2a_chunks={chunks}" in args


def _small_platform(tmp_path: Path, hbm_gb: float) -> Path:
    """configs/platforms/local.toml with another memory size (a platform file may be a path)."""
    src = (Path(__file__).resolve().parents[1] / "configs/platforms/local.toml").read_text()
    src = re.sub(r"(?m)^hbm_gb = .*$", f"hbm_gb = {hbm_gb}", src)
    path = tmp_path / "small.toml"
    path.write_text(re.sub(r"(?m)^name = .*$", 'name = "small"', src))
    return path


def test_redundant_slots_that_do_not_fit_say_what_they_need(tmp_path, capsys):
    """tiny on 2 CPU processes of 63 MB usable each: the 4 slots cost 4 x 4 MoE layers x one
    expert's parameters x 16 B (fp32 weight, gradient, 2 Adam moments; ZeRO-1 shards nothing
    with DP = 1), computed here from the model built on the meta device."""
    import torch

    from model import MoETransformer, presets
    from model.moe import GroupedExperts

    with torch.device("meta"):
        m = MoETransformer(presets.get("tiny"))
    mods = [g for g in m.modules() if isinstance(g, GroupedExperts)]
    slot = sum(g.w1.numel() + g.w2.numel() + g.w3.numel() for g in mods) // mods[0].num_experts
    need = 4 * slot * 16
    pf = _small_platform(tmp_path, 0.07)
    argv = ["plan", "--model", "tiny", "--platform", str(pf), "--gpus", "2", "--seq", "64",
            "--global-batch", "4", "--search", "tpe", "--trials", "5", "--out", str(tmp_path)]
    assert main([*argv, "--redundant", "4"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: --redundant 4: the 4 redundant expert slots per MoE layer "
                          f"need {need / 1e9:.3g} GB per GPU"), err
    assert re.search(r"available: [0-9.]+ GB of the 0\.063 GB usable HBM .* at most --redundant "
                     r"1 fits on 2 x small GPUs \(valid: 0\.\.1", err), err
    # One slot fits: the plan carries it, and the report prints what it costs.
    assert main([*argv, "--redundant", "1"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"redundant expert slots: 1 per MoE layer on each EP rank .* "
                     rf"{slot * 16 / 1e9:.2f} GB per GPU at the peak", out), out
    plan = tomllib.loads((tmp_path / "tiny-small-2.toml").read_text())
    assert plan["run"]["balance"]["redundant"] == 1 and plan["run"]["parallel"]["ep"] == 2


@pytest.mark.slow
@pytest.mark.multiproc
def test_redundant_slots_state_matches_a_real_run(tmp_path):
    """tiny, EP 2 x DP 2, ZeRO-1 (whole-parameter owners), r = 1, 4 CPU processes (~20 s): the
    training state train.py holds with its redundant slot equals the prediction up to AdamW's
    4-byte step counters (measured once for r = 0, 1, 3 at ZeRO-0 and ZeRO-1: within 172 B)."""
    from model import presets
    from tuner import Assumptions, ParallelPlan, load_platform, stage_memory
    from tuner.launch import run_plan_locally
    from tuner.layout import FP32_TRAINER_PRECISION

    plan = ParallelPlan(pp=1, ep=2, dp=2, microbatches=1, global_batch=16, seq_len=64, zero=1,
                        redundant=1)
    asm = Assumptions(activation_set="trainer", zero_sharding="per-parameter")
    st = stage_memory(presets.get("tiny"), plan, load_platform("local"), FP32_TRAINER_PRECISION,
                      asm)[0]
    m = run_plan_locally(plan, "tiny", tmp_path / "run", steps=4, warmup=2)
    assert st.redundant_bytes > 0
    assert m.state_bytes == pytest.approx(st.state, rel=1e-4)


def test_reproduce_paper_writes_under_runs_unless_recording():
    """The benchmarks' convention (benchmarks/_common.py): by default `reproduce-paper` leaves
    the tracked table alone; --record writes it; --out and --record exclude each other."""
    from tuner.cli import parser, reproduce_path

    root = Path(__file__).resolve().parents[1]
    p = parser()
    assert reproduce_path(p.parse_args(["reproduce-paper"])) == \
        root / "runs" / "bench" / "reproduce_paper" / "reproduce_paper.md"
    assert reproduce_path(p.parse_args(["reproduce-paper", "--record"])) == \
        root / "benchmarks" / "results" / "reproduce_paper.md"
    assert reproduce_path(p.parse_args(["reproduce-paper", "--out", "x.md"])) == Path("x.md")
    with pytest.raises(SystemExit):
        p.parse_args(["reproduce-paper", "--out", "x.md", "--record"])


def test_plan_search_exhaustive_writes_the_models_optimum(tmp_path, capsys):
    """--search exhaustive: every point by branch and bound; the plan file is the best
    runnable layout of `tuner.search.exhaustive` over the same space (TPE may stop short of
    it: benchmarks/bench_tuner.py), and it says how many points it looked at."""
    from tuner.layout import Assumptions, precision_policy
    from tuner.search import Evaluator, exhaustive
    from tuner.space import SearchSpace

    rc = main(["plan", "--model", "mixtral-8x7b", "--platform", "frontier", "--gpus", "16",
               "--global-batch", "64", "--zero", "0,1,2,3", "--search", "exhaustive",
               "--out", str(tmp_path)])
    out = capsys.readouterr().out
    assert rc == 0
    cfg, pf = presets.get("mixtral-8x7b"), load_platform("frontier")
    space = SearchSpace.default(cfg, pf, 16, 64, 4096, zero=(0, 1, 2, 3))
    assert f"every one of the {space.size} points of the space" in out
    ref = exhaustive(Evaluator(space, cfg, pf, precision_policy("trainer", pf.backend),
                               Assumptions(activation_set="published")))
    plan = tomllib.loads((tmp_path / "mixtral-8x7b-frontier-16.toml").read_text())
    assert plan["plan"]["predicted_step_time_s"] == pytest.approx(ref.best_runnable.step_time,
                                                                rel=1e-3)
    assert plan["run"]["parallel"]["zero"] == ref.best_runnable.point["zero"]


def test_zero3_summary_names_its_per_layer_collectives():
    """The report's ZeRO line for ZeRO-3 says what it shards (parameters too) and prices its
    per-layer gathers and reduce-scatters (the estimate's zero3 part), never an empty sync."""
    from tuner import estimate
    from tuner.layout import ParallelPlan, precision_policy
    from tuner.report import zero_summary

    pf, cfg = load_platform("frontier"), presets.get("mixtral-8x7b")
    plan = ParallelPlan(pp=1, ep=8, dp=8, microbatches=4, global_batch=256, seq_len=4096,
                        zero=3)
    e = estimate(cfg, plan, pf, precision_policy("trainer", pf.backend))
    line = zero_summary(e)
    assert line.startswith("ZeRO-3: parameters + gradients + optimizer state sharded")
    assert f"per-layer weight gathers and gradient reduce-scatters, " \
           f"{e.time['zero3']:.2f} s exposed" in line
    assert not line.endswith("gradient sync: ")
