"""The published-runs data (benchmarks/data/published_runs.toml) and the pure parts of
benchmarks/bench_tuner_published.py: flag mapping, order agreement, Spearman's rho.

The data checks hold the file to its own conventions (documented at its top) and to the
arithmetic of its sources: where a source prints both a step time and tokens/s, they agree;
where it prints tokens/s and Megatron-formula TFLOP/s, this project's Megatron formula
(tuner.flops) turns the one into the other. No `tuner estimate` run here (the benchmark does
that); these are fast unit tests."""

from __future__ import annotations

import random
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import bench_tuner_published as b  # noqa: E402

from model import presets  # noqa: E402

RUNS = b.load_runs()
INT_KEYS = ("gpus", "seq", "global_batch", "mbs", "tp", "pp", "vp", "cp", "ep", "etp")
CHOICES = {"precision": {"bf16", "fp8"}, "dispatcher": {"alltoall", "deepep", "hybridep"},
           "a2a_overlap": {"none", "fb"}, "flops_convention": {"megatron", "automodel"},
           "rank_metric": {"tokens", "tflops"}, "framework": {"megatron-core", "automodel"}}


def test_enough_runs_and_unique_ids() -> None:
    assert len(RUNS) >= 12
    assert len({r["id"] for r in RUNS}) == len(RUNS)


@pytest.mark.parametrize("run", RUNS, ids=[r["id"] for r in RUNS])
def test_run_follows_the_file_conventions(run: dict) -> None:
    for k in INT_KEYS:
        v = run[k]
        assert v == b.UNKNOWN or (isinstance(v, int) and v >= 1), (k, v)
    for k, ok in CHOICES.items():
        assert run[k] == b.UNKNOWN or run[k] in ok, (k, run[k])
    rec = run["recompute"]
    assert rec in (b.UNKNOWN, "none", "full") or rec.startswith("selective:"), rec
    assert run["fsdp"] in (0, "on", b.UNKNOWN) or run["fsdp"] >= 1
    assert run["source"].startswith("https://"), run["source"]
    assert run["preset"] == (run["model"] in presets.names()), run["model"]
    platform_file = ROOT / "configs" / "platforms" / f"{run['platform']}.toml"
    if run["platform_exists"]:
        assert platform_file.is_file(), platform_file
    assert isinstance(run["measured_tflops_per_gpu"], float) or \
        isinstance(run["measured_tokens_per_s_per_gpu"], float) or \
        isinstance(run["measured_step_time_s"], float), "no measured figure"
    # tp x pp x cp divides the GPUs; a stated data-parallel degree and gradient accumulation
    # multiply back to the global batch
    tp, pp, cp = run["tp"], run["pp"], run["cp"]
    assert run["gpus"] % (tp * pp * cp) == 0
    dp = run["gpus"] // (tp * pp * cp)
    assert run.get("dp", dp) == dp
    if "grad_accum" in run:
        per_rank = run.get("local_batch", run["mbs"])
        assert dp * per_rank * run["grad_accum"] == run["global_batch"]
    # every assumption is for a field the source leaves unknown (or a degree it does not give)
    for k in run.get("assumed", {}):
        assert run.get(k, b.UNKNOWN) == b.UNKNOWN, f"{k} is stated, yet assumed"


@pytest.mark.parametrize("run", [r for r in RUNS if isinstance(r.get("measured_step_time_s"), float)
                                 and isinstance(r["measured_tokens_per_s_per_gpu"], float)],
                         ids=lambda r: r["id"])
def test_printed_tokens_agree_with_printed_step_time(run: dict) -> None:
    # tolerance: step times are printed to 3-4 significant digits, tokens/s to integers
    tok = run["global_batch"] * run["seq"] / run["measured_step_time_s"] / run["gpus"]
    assert tok == pytest.approx(run["measured_tokens_per_s_per_gpu"], rel=2e-3)


MEGATRON_ROWS = [r for r in RUNS if r["flops_convention"] == "megatron" and r["preset"]
                 and b.measured(r)["tokens"] is not None and b.measured(r)["tflops"] is not None]


@pytest.mark.parametrize("run", MEGATRON_ROWS, ids=lambda r: r["id"])
def test_megatron_formula_reproduces_printed_tflops(run: dict) -> None:
    pytest.importorskip("tuner.flops")
    # the sources' own TFLOP/s are the reference; tolerance 1 %: printed TFLOP/s have three
    # significant digits and ModelZoo's step times one decimal (17.6 s: 0.3 %)
    ratio = b._megatron_check(run, b.measured(run))
    assert ratio == pytest.approx(1.0, abs=0.01)


def _run(**kw: object) -> dict:
    base = {"id": "t", "model": "qwen3-30b-a3b", "platform": "dgx-h100", "gpus": 16,
            "seq": 4096, "global_batch": 64, "mbs": 1, "tp": 1, "pp": 2, "vp": 2, "cp": 1,
            "ep": 8, "etp": 1, "precision": "bf16", "dispatcher": "deepep", "a2a_overlap": "fb",
            "recompute": "selective:mla_up_proj,mlp", "fsdp": 0, "distributed_optimizer": True,
            "framework": "automodel"}
    base.update(kw)
    return base


def _flag(flags: list[str], name: str) -> str:
    return flags[flags.index(name) + 1]


def test_flags_map_the_published_vocabulary() -> None:
    flags, assumed = b.estimate_flags(_run())
    assert assumed == []
    assert [_flag(flags, f) for f in ("--vpp", "--zero", "--recompute", "--dispatch",
                                      "--a2a-overlap", "--precision")] == \
        ["2", "1", "selective", "dedup", "fb", "bf16"]
    assert _flag(b.estimate_flags(_run(fsdp="on"))[0], "--zero") == "3"
    assert _flag(b.estimate_flags(_run(fsdp=64))[0], "--zero") == "3"
    assert _flag(b.estimate_flags(_run(distributed_optimizer=False))[0], "--zero") == "0"
    assert _flag(b.estimate_flags(_run(dispatcher="alltoall"))[0], "--dispatch") == "flat"


def test_unknown_fields_use_the_runs_assumption_then_the_default() -> None:
    flags, assumed = b.estimate_flags(_run(recompute="unknown", etp="unknown",
                                           assumed={"recompute": "full"}))
    assert _flag(flags, "--recompute") == "full" and _flag(flags, "--etp") == "1"
    assert assumed == ["recompute=full", "etp=1 (bench default)"]


def test_bad_values_are_named() -> None:
    with pytest.raises(ValueError, match="dispatcher='nccl'"):
        b.estimate_flags(_run(dispatcher="nccl"))
    with pytest.raises(ValueError, match="seq is unknown"):
        b.estimate_flags(_run(seq="unknown"))
    with pytest.raises(ValueError, match="fsdp=-1"):
        b.estimate_flags(_run(fsdp=-1))
    with pytest.raises(ValueError, match="framework='deepspeed'; valid: megatron-core"):
        b.estimate_flags(_run(framework="deepspeed"))


def test_megatron_rows_get_the_host_floor() -> None:
    """Megatron-Core rows are priced with the measured host floor, AutoModel rows without."""
    flags = b.estimate_flags(_run(framework="megatron-core"))[0]
    host = float(_flag(flags, "--host-floor-ms"))
    assert _flag(flags, "--host-floor-scope") == "forward"
    assert "--host-floor-ms" not in b.estimate_flags(_run())[0]
    # the forward's share: the measured layer time minus the estimate's own backward device
    # time of the source row (2/3 of its compute + exchange per layer and micro-batch)
    est = b.run_estimate(b.FLOOR_SOURCE_FLAGS, timeout=300.0)
    back = 1e3 * (est["time_s"]["compute"] + est["time_s"]["alltoall"]) * 2 / 3 / (48 * 64)
    assert 0 < back < 9.18
    assert host == pytest.approx(9.18 - back, rel=1e-3)  # rel 1e-3: printed to 4 digits
    # the floor is the measured step of the B200 row it comes from: GBS 512 x 4096 tokens at
    # 9299 tokens/s/GPU on 8 GPUs, over 64 micro-batches x 48 layers (rel 1e-3: 3 digits)
    step = 512 * 4096 / 9299 / 8
    assert b.HOST_FLOOR_MS["megatron-core"] == pytest.approx(1e3 * step / (64 * 48), rel=1e-3)


def test_a_run_with_its_own_host_floor_takes_it_from_its_recipes_measured_step() -> None:
    """PR 5094's rows take the floor from their recipe's overlap-off step measured a week
    before (25.118 s): per MoE layer and micro-batch of that layout (48 layers x 1024 / 16
    micro-batches), its forward share by the same subtraction as the framework's floor."""
    by_id = {r["id"]: r for r in RUNS}
    off, on = by_id["mb5094-qwen3-30b-h100-bf16-ep16-graphs"], \
        by_id["mb5094-qwen3-30b-h100-bf16-ep16-graphs-overlap"]
    assert off["floor_layout"] and "floor_layout" not in on
    assert on["host_floor"] == off["host_floor"] and off["host_floor"]["layout"] == off["id"]
    flags_off, flags_on = b.estimate_flags(off)[0], b.estimate_flags(on)[0]
    floor = float(_flag(flags_on, "--host-floor-ms"))
    assert _flag(flags_off, "--host-floor-ms") == _flag(flags_on, "--host-floor-ms")
    # by hand: the off layout's estimate without a floor, its backward = 2/3 of compute +
    # exchange per layer and micro-batch
    plain = list(flags_off)
    i = plain.index("--host-floor-ms")
    del plain[i:i + 4]
    est = b.run_estimate(plain, timeout=300.0)
    per = 48 * (1024 // 16)
    back = 1e3 * (est["time_s"]["compute"] + est["time_s"]["alltoall"]) * 2 / 3 / per
    assert floor == pytest.approx(1e3 * 25.118 / per - back, rel=1e-3)  # printed to 4 digits
    # the run's own floor replaces the framework's (without it: Megatron-Core's eager one)
    framework_floor = _flag(b.estimate_flags({k: v for k, v in on.items()
                                              if k != "host_floor"})[0], "--host-floor-ms")
    assert flags_on.count("--host-floor-ms") == 1
    assert floor != pytest.approx(float(framework_floor), rel=1e-2)


def test_megatron_fb_rows_pair_layer_by_layer() -> None:
    """Megatron-Core's combined 1F1B holds one layer more than the plain schedule, not a
    second micro-batch (Assumptions.fb_pairing "layer"); other rows keep the default."""
    assert _flag(b.estimate_flags(_run(framework="megatron-core"))[0], "--fb-pairing") == "layer"
    assert "--fb-pairing" not in b.estimate_flags(_run())[0]  # AutoModel
    assert "--fb-pairing" not in b.estimate_flags(_run(framework="megatron-core",
                                                        a2a_overlap="none"))[0]


def test_bad_host_floor_tables_are_refused() -> None:
    runs = {"src": _run(id="src", pp=1, vp=1)}
    hf = {"step_time_s": 10.0, "layout": "src", "source": "https://x"}
    for bad, match in (({**hf, "extra": 1}, "must be a table of step_time_s, layout and source"),
                       ({**hf, "step_time_s": 0}, "step_time_s=0 must be seconds > 0"),
                       ({**hf, "layout": "nope"}, "layout='nope' is no run id"),
                       ({**hf, "layout": "pp2"}, "pp=2, vp=2; the floor is derived from a "
                                                 "one-stage layout only")):
        with pytest.raises(ValueError, match=match):
            b.estimate_flags(_run(host_floor=bad), {**runs, "pp2": _run(id="pp2")})


def test_floor_layout_rows_are_ranked_but_not_summarised() -> None:
    rows = [{"id": "a", "error": 0.10, "rank_group": "g", "rank_metric": "tokens",
             "meas_tokens": 100.0, "pred_tokens": 110.0, "meas_tflops": None},
            {"id": "b", "error": None, "floor_layout_error": -0.5, "rank_group": "g",
             "rank_metric": "tokens", "meas_tokens": 80.0, "pred_tokens": 40.0,
             "meas_tflops": None}]
    s = b.summarise(rows)
    assert s["compared"] == 1 and s["median_abs_error"] == pytest.approx(0.10)
    assert s["groups"]["g"]["pairs"] == 1 and s["groups"]["g"]["pairs_agree"] == 1


def test_order_agreement_counts_pairs() -> None:
    meas = [3.0, 2.0, 1.0]
    assert b.order_agreement(meas, [30.0, 20.0, 10.0]) == (3, 3)
    assert b.order_agreement(meas, [10.0, 20.0, 30.0]) == (0, 3)
    assert b.order_agreement(meas, [30.0, 10.0, 20.0]) == (2, 3)
    # measured ties are not compared; a predicted tie is a disagreement
    assert b.order_agreement([2.0, 2.0, 1.0], [1.0, 5.0, 0.0]) == (2, 2)
    assert b.order_agreement([2.0, 1.0], [1.0, 1.0]) == (0, 1)


def test_spearman_matches_the_closed_form_without_ties() -> None:
    rng = random.Random(0)
    for n in (3, 5, 9):
        a = rng.sample(range(100), n)
        c = rng.sample(range(100), n)
        ra = {v: i for i, v in enumerate(sorted(a))}
        rc = {v: i for i, v in enumerate(sorted(c))}
        d2 = sum((ra[x] - rc[y]) ** 2 for x, y in zip(a, c, strict=True))
        ref = 1 - 6 * d2 / (n * (n * n - 1))
        assert b.spearman([float(x) for x in a], [float(y) for y in c]) == \
            pytest.approx(ref, abs=1e-12)  # same value, different float operations


def test_spearman_ties_and_degenerate_cases() -> None:
    # ranks of [1, 2, 2, 3] are [1, 2.5, 2.5, 4]; Pearson's r with [1, 2, 3, 4] by hand:
    # deviations (-1.5, 0, 0, 1.5) and (-1.5, -0.5, 0.5, 1.5): 4.5 / sqrt(4.5 * 5)
    assert b.spearman([1.0, 2.0, 2.0, 3.0], [1.0, 2.0, 3.0, 4.0]) == \
        pytest.approx(4.5 / (4.5 * 5) ** 0.5, abs=1e-12)
    assert b.spearman([1.0], [2.0]) != b.spearman([1.0], [2.0])  # nan
    with pytest.raises(ValueError, match="lengths"):
        b.spearman([1.0, 2.0], [1.0])


def test_summary_of_rows() -> None:
    rows = [{"id": "a", "error": 0.10, "rank_group": "g", "rank_metric": "tokens",
             "meas_tokens": 3.0, "pred_tokens": 2.0, "meas_tflops": None},
            {"id": "b", "error": -0.30, "rank_group": "g", "rank_metric": "tokens",
             "meas_tokens": 1.0, "pred_tokens": 1.5, "meas_tflops": None},
            {"id": "c", "error": None, "rank_group": "", "rank_metric": "tokens",
             "meas_tokens": None, "meas_tflops": None}]
    s = b.summarise(rows)
    assert s["compared"] == 2 and s["median_abs_error"] == pytest.approx(0.20)
    assert s["within_25"] == 0.5 and s["within_15"] == 0.5
    g = s["groups"]["g"]
    assert (g["pairs_agree"], g["pairs"], g["order_equal"]) == (1, 1, True)
    assert g["measured_order"] == ["a", "b"] and g["predicted_order"] == ["a", "b"]
