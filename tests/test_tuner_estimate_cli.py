"""`python -m tuner estimate`: one layout, no search; the JSON contract other tools read."""

from __future__ import annotations

import json
import re

import pytest

from model import presets
from tuner import estimate, load_platform
from tuner.cli import main
from tuner.layout import ParallelPlan, fold_degrees, precision_policy

CONTRACT = ("step_time_s", "tokens_per_s_per_gpu", "model_tflops_per_gpu", "mfu",
            "peak_memory_gb", "stage_layers", "runnable", "not_runnable_because")


def _json(capsys, argv: list[str]) -> dict:
    assert main(["estimate", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out.strip().splitlines()[-1])


def test_json_is_the_estimate_of_the_folded_layout(capsys):
    """DeepSeek-V3 on 256 H100 at pp=8, ep=32: dp = 256 / 8 = 32, edp = 1; the JSON carries
    the contract keys with the values of the model called on the same plan by hand."""
    argv = ["--model", "deepseek-v3", "--platform", "dgx-h100", "--gpus", "256", "--seq", "4096",
            "--global-batch", "1024", "--pp", "8", "--ep", "32", "--recompute", "full",
            "--zero", "1"]
    s = _json(capsys, argv)
    assert set(CONTRACT) <= set(s)
    cfg, pf = presets.get("deepseek-v3"), load_platform("dgx-h100")
    plan = ParallelPlan(pp=8, ep=32, dp=1, microbatches=1024 // 32, global_batch=1024,
                        seq_len=4096, checkpointing="full", zero=1)
    from tuner.layout import Assumptions

    e = estimate(cfg, plan, pf, precision_policy("trainer", pf.backend),
                 Assumptions(zero_sharding="per-parameter"))
    assert s["step_time_s"] == e.step_time  # same function on the same plan: exact
    assert s["peak_memory_gb"] == e.peak_memory / 1e9
    assert s["tokens_per_s_per_gpu"] == pytest.approx(1024 * 4096 / e.step_time / 256, rel=1e-12)
    assert s["mfu"] == e.mfu and s["runnable"] is True and s["not_runnable_because"] == []
    assert [len(x) for x in s["stage_layers"]] == [7, 8, 8, 8, 8, 8, 7, 7]  # the trainer's split
    assert s["layout"]["dp"] == 32 and s["layout"]["edp"] == 1
    # the human report of the same layout says the same numbers
    assert main(["estimate", *argv]) == 0
    out = capsys.readouterr().out
    assert f"step time {s['step_time_s']:.4g} s" in out and "runnable: yes" in out


def test_layout_the_trainer_cannot_run_is_priced_and_says_why(capsys):
    s = _json(capsys, ["--model", "deepseek-v3", "--platform", "dgx-h100", "--gpus", "256",
                       "--global-batch", "1024", "--pp", "8", "--tp", "2", "--cp", "2",
                       "--ep", "16"])
    assert s["runnable"] is False and s["step_time_s"] > 0
    # tensor parallel runs (issue 31); context parallel does not
    assert [w for w in s["not_runnable_because"] if "parallel" in w] == [
        "context parallel (cp=2) is not built in the trainer yet"]
    assert s["layout"]["dp"] == 8 and s["layout"]["edp"] == 2  # 32 = 2 x 2 x 8 = 16 x 2


def test_zero3_step_gather_is_priced_not_runnable(capsys):
    """--zero3-gather step models FSDP2 under torch pipelining, not train.py's ZeRO-3: the
    layout is priced (fewer gather seconds than every micro-batch) and reported not runnable."""
    argv = ["--model", "mixtral-8x7b", "--platform", "dgx-h100", "--gpus", "64",
            "--global-batch", "64", "--pp", "2", "--ep", "8", "--zero", "3"]
    per_mb = _json(capsys, argv)
    step = _json(capsys, [*argv, "--zero3-gather", "step"])
    assert step["time_s"]["zero3"] < per_mb["time_s"]["zero3"]
    assert per_mb["runnable"] is True and step["runnable"] is False
    assert any("--zero3-gather step" in w for w in step["not_runnable_because"])


def test_fold_degrees():
    assert fold_degrees(64, 2, tp=2, cp=2, ep=8, etp=1) == (8, 4)
    assert fold_degrees(8, 1, ep=8) == (8, 1)
    with pytest.raises(ValueError, match=r"ep=3 x etp=1 = 3 does not divide the 32 ranks .* "
                                         r"one of \[1, 2, 4, 8, 16, 32\]"):
        fold_degrees(64, 2, ep=3)
    with pytest.raises(ValueError, match=r"pp=3 does not divide 64 GPUs; valid pp: \[1, 2, 4"):
        fold_degrees(64, 3)
    with pytest.raises(ValueError, match=r"tp=4 x cp=4 = 16 does not divide the 8 ranks"):
        fold_degrees(8, 1, tp=4, cp=4)


@pytest.mark.parametrize("argv,message", [
    (["--gpus", "64", "--pp", "3"], r"pp=3 does not divide 64 GPUs; valid pp"),
    (["--gpus", "64", "--ep", "5"], r"ep=5 x etp=1 = 5 does not divide the 64 ranks"),
    (["--gpus", "64", "--global-batch", "20"],
     r"--global-batch 20 is not divisible by dp=64 x mbs=1"),
    (["--gpus", "64", "--vpp", "2"], r"--vpp 2 needs --pp >= 2"),
    (["--gpus", "64", "--vpp", "2", "--pp", "2", "--schedule", "1f1b"],
     r"--vpp 2 needs --schedule interleaved-1f1b \(got '1f1b'\)"),
    (["--gpus", "64", "--mbs", "0"], r"--mbs 0 must be an int >= 1"),
    (["--gpus", "64", "--platform", "summit"], r"unknown platform 'summit'; valid:"),
    (["--gpus", "64", "--tp", "16"], r"tp=16 does not divide mixtral-8x7b's n_kv_heads=8; "
                                     r"valid tp: \[1, 2, 4, 8\]"),
    (["--gpus", "64", "--cp", "4", "--seq", "100"],
     r"cp=4 needs seq_len divisible by 2 x cp = 8"),
    (["--gpus", "64", "--zero3-runs", "0"], r"zero3_runs=0 must be an int >= 1"),
    (["--gpus", "64", "--zero", "3", "--zero3-gather", "step", "--zero3-runs", "2"],
     r"zero3_runs=2 schedule runs exceed the step's 1 micro-batches"),
])
def test_bad_flags_are_named(capsys, argv, message):
    base = {"--model": "mixtral-8x7b", "--platform": "dgx-h100", "--global-batch": "64"}
    for k, v in zip(argv[::2], argv[1::2], strict=True):
        base[k] = v
    args = [x for kv in base.items() for x in kv]
    assert main(["estimate", *args]) == 2
    assert re.search(message, capsys.readouterr().err)


@pytest.mark.parametrize("flag,value", [("--dispatch", "bogus"), ("--zero", "7"),
                                        ("--recompute", "some"), ("--a2a-overlap", "x"),
                                        ("--precision", "fp4"), ("--zero3-gather", "layer")])
def test_bad_choices_name_value_and_choices(capsys, flag, value):
    with pytest.raises(SystemExit):
        main(["estimate", "--model", "tiny", "--platform", "local", "--gpus", "2",
              "--global-batch", "4", flag, value])
    err = capsys.readouterr().err
    assert re.search(f"invalid choice: '?{value}'? \\(choose from", err)

