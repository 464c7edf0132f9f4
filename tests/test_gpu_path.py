"""The GPU path, checked on the CPU: the local-process/GPU count check, the torch floor
against the APIs the code calls, bf16 stage boundaries, and the GPU check scripts.

bf16 boundaries: a pp=2 run of a small tiny-style model under CPU bf16 autocast (gloo, 1F1B,
M=4) against one process running the whole model under the same autocast. The two differ by
one bf16 rounding (2**-9 relative) of the residual stream at the boundary and of the gradient
coming back. Observed: per-micro-batch losses 2.2e-5 relative apart (bound 2e-4), gradients
at most 0.9 % apart in relative norm per parameter (bound 3 %); the same model's bf16 and
fp32 one-process gradients are up to 20 % apart, so the gradient bound does tell the two
precisions apart.
"""

from __future__ import annotations

import inspect
import json
import os
import re
import subprocess
import sys
import tarfile
import tomllib
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import pipeline
from comm import run_local

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from train import check_local_gpus  # noqa: E402

# -- item: more local processes than GPUs ------------------------------------------------------


def test_more_processes_than_gpus_is_a_clear_error() -> None:
    with pytest.raises(ValueError) as e:
        check_local_gpus(4, 2)
    msg = str(e.value)
    for part in ("4 local processes", "LOCAL_WORLD_SIZE", "2 visible GPU", "device_count",
                 "--nproc-per-node 2", "CUDA_VISIBLE_DEVICES=", 'CUDA_VISIBLE_DEVICES=""'):
        assert part in msg, (part, msg)
    check_local_gpus(2, 2)
    check_local_gpus(1, 8)
    check_local_gpus(4, 0)  # no CUDA: gloo on the CPU, nothing to check


@pytest.mark.slow
def test_train_py_refuses_before_any_work(tmp_path: Path) -> None:
    """The check runs in `main` before init_process_group: with LOCAL_WORLD_SIZE above the
    visible GPUs train.py exits 2 with the message. This machine has no GPU, so the
    subprocess makes torch.cuda answer as a 2-GPU machine would before train.main runs."""
    code = ("import sys, torch; torch.cuda.is_available = lambda: True; "
            "torch.cuda.device_count = lambda: 2; import train; "
            "sys.exit(train.main(['--config', 'configs/tiny.toml']))")
    env = dict(os.environ, WORLD_SIZE="4", RANK="0", LOCAL_WORLD_SIZE="4", LOCAL_RANK="0")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "4 local processes (LOCAL_WORLD_SIZE) but 2 visible GPU(s)" in r.stderr
    assert "--nproc-per-node 2" in r.stderr


# -- item: the torch floor --------------------------------------------------------------------

# API the code uses -> (pattern found in the sources, first torch with it, where that is stated)
TORCH_APIS = {
    "P2POp(group_peer=)": (r"P2POp\([^)]*group_peer=", (2, 6),
                           "pytorch/pytorch#141054, merged Nov 2024, first released in 2.6"),
    "scaled_dot_product_attention(enable_gqa=)": (r"enable_gqa=", (2, 5),
                                                  "SDPA's enable_gqa, new in 2.5"),
    "torch.get_autocast_dtype(device_type)": (r"torch\.get_autocast_dtype\(", (2, 4),
                                              "device-generic autocast API, new in 2.4"),
    "torch.is_autocast_enabled(device_type)": (r"torch\.is_autocast_enabled\(\w", (2, 4),
                                               "device-type argument, new in 2.4"),
    "dcp.save/load(checkpoint_id=)": (r"dcp\.(save|load)\([^)]*checkpoint_id=", (2, 3),
                                      "dcp.save/load take checkpoint_id from 2.3"),
}
SOURCES = ["model", "piper_kernels", "comm", "pipeline", "balance", "tuner", "trainer", "train.py"]


def _floor() -> tuple[int, int]:
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    spec = [d for d in deps if d.startswith("torch")]
    assert len(spec) == 1 and spec[0].startswith("torch>="), spec
    return tuple(int(x) for x in spec[0].split(">=")[1].split(".")[:2])


def _source_text() -> str:
    files = [p for s in SOURCES for p in ([ROOT / s] if s.endswith(".py")
                                          else sorted((ROOT / s).rglob("*.py")))]
    return "\n".join(p.read_text() for p in files)


def test_torch_floor_covers_the_apis_used() -> None:
    text = _source_text()
    used = {api: v for api, (pat, v, _) in TORCH_APIS.items() if re.search(pat, text)}
    unused = sorted(set(TORCH_APIS) - set(used))
    assert not unused, f"no longer in the code, drop from the table: {unused}"
    need = max(used.values())
    assert _floor() >= need, f"pyproject says torch>={_floor()}, the code needs {need}: {used}"
    assert _floor() == need, f"floor {_floor()} is above every listed API ({need}): list the API"


def test_installed_torch_has_those_apis() -> None:
    assert "group_peer" in inspect.signature(dist.P2POp).parameters
    q = torch.randn(1, 4, 3, 8)
    kv = torch.randn(1, 2, 3, 8)
    out = F.scaled_dot_product_attention(q, kv, kv, enable_gqa=True)
    assert out.shape == q.shape
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.is_autocast_enabled("cpu") and torch.get_autocast_dtype("cpu") == torch.bfloat16


def _fake_venv(tmp_path: Path, version: str) -> Path:
    """A venv whose python sees a stand-in torch of `version` and whose pip does nothing."""
    fake = tmp_path / "fake" / "torch"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text(f"__version__ = {version!r}\n")
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    py = venv / "bin" / "python"
    py.write_text("#!/bin/bash\n"
                  'if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then echo "pip $*"; exit 0; fi\n'
                  f'PYTHONPATH={tmp_path / "fake"} exec {sys.executable} "$@"\n')
    py.chmod(0o755)
    return venv


@pytest.mark.parametrize("version,ok", [("2.5.1+rocm6.2", False), ("2.6.0a0+ecf3bae.nv25.01", True),
                                        ("2.13.0+cpu", True)])
def test_makefile_refuses_a_kept_torch_below_the_floor(tmp_path: Path, version: str, ok: bool) -> None:
    venv = _fake_venv(tmp_path, version)
    r = subprocess.run(["make", "--no-print-directory", f"VENV={venv}", f"{venv}/.installed"],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)
    floor = ".".join(map(str, _floor()))
    if ok:
        assert r.returncode == 0, r.stderr
        assert "pip -m pip install -q --no-compile -e .[dev]" in r.stdout
    else:
        assert r.returncode != 0
        assert f"torch {version}" in r.stderr and f"torch>={floor}" in r.stderr, r.stderr
        assert "pip -m pip install" not in r.stdout  # refused before pip could replace it
    assert (venv / ".installed").exists() == ok


# -- item: bf16 stage boundaries ---------------------------------------------------------------

M, MB, SEQ = 4, 2, 16


def _model():
    from model import ModelConfig, MoETransformer

    cfg = ModelConfig(name="t", vocab_size=64, d_model=32, n_layers=4, n_heads=2, n_kv_heads=1,
                      head_dim=16, max_seq_len=SEQ, n_routed_experts=4, top_k=2, moe_ffn_dim=32,
                      router="softmax", norm_topk_prob=True, aux_loss_coef=0.01)
    torch.manual_seed(0)
    return MoETransformer(cfg)


def _data() -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    toks = torch.randint(0, 64, (M, MB, SEQ + 1), generator=g)
    return [t[:, :-1] for t in toks], [t[:, 1:] for t in toks]


def _bf16_worker(rank: int, world: int, group: dist.ProcessGroup) -> dict:
    from model import cross_entropy
    from trainer.distributed.pipe import build_stages, moe_aux, split_layers

    model = _model()
    stages = build_stages(model, world, rank, 1, split_layers(4, world), autocast=True)
    sched = pipeline.build("1f1b", world, M)
    rt = pipeline.PipelineRuntime(sched, stages, cross_entropy, (MB, SEQ, 32), aux_fn=moe_aux)
    sent: list[tuple[str, torch.dtype]] = []
    real = dist.batch_isend_irecv

    def record(ops):
        sent.extend(("send" if o.op is dist.isend else "recv", o.tensor.dtype) for o in ops)
        return real(ops)

    dist.batch_isend_irecv = record
    try:
        xs, ys = _data()
        losses = rt.step(xs, ys)
    finally:
        dist.batch_isend_irecv = real
    grads = {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}
    return {"dtype": rt.dtype, "sent": sent, "losses": losses, "grads": grads}


def test_stage_boundaries_carry_bf16_and_the_loss_stays_fp32() -> None:
    from trainer.distributed.pipe import build_stages, split_layers

    xs, _ = _data()
    first, last = build_stages(_model(), 1, 0, 2, split_layers(4, 2), autocast=True).values()
    h = first(xs[0])
    assert h.dtype == first.boundary_dtype == torch.bfloat16
    logits = last(h.detach().requires_grad_())
    assert logits.dtype == torch.float32
    plain = build_stages(_model(), 1, 0, 2, split_layers(4, 2)).values()
    assert [s.boundary_dtype for s in plain] == [torch.float32] * 2
    assert next(iter(plain))(xs[0]).dtype == torch.float32


@pytest.mark.multiproc
def test_pp2_bf16_matches_one_process_bf16() -> None:
    res = run_local(_bf16_worker, 2, timeout_s=240)
    xs, ys = _data()
    model = _model()
    from model import cross_entropy

    ref = []
    for x, y in zip(xs, ys, strict=True):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            logits = model(x)
        ce = cross_entropy(logits, y)
        ((ce + model.aux_loss()) / M).backward()
        ref.append(ce.detach())
    for r in res:
        assert r["dtype"] == torch.bfloat16
        assert r["sent"] and {d for _, d in r["sent"]} == {torch.bfloat16}, r["sent"]
        assert {k for k, _ in r["sent"]} == {"send", "recv"}
    losses = torch.stack(res[1]["losses"])
    assert losses.dtype == torch.float32
    torch.testing.assert_close(losses, torch.stack(ref), rtol=2e-4, atol=0)
    # gradients, parameter by parameter (held on one rank each): bf16 backward, so per
    # parameter the relative norm of the difference, not elementwise.
    merged = {**res[0]["grads"], **res[1]["grads"]}
    for n, p in model.named_parameters():
        if p.grad is None:
            continue
        g = merged[n]
        rel = float((g - p.grad).norm() / p.grad.norm().clamp_min(1e-12))
        assert rel < 3e-2, (n, rel)


def test_planner_p2p_bytes_are_the_boundary_dtype() -> None:
    """The planner prices a pipeline hop at the bytes the trainer's stages send: bf16 under
    autocast (GPUs; trainer/distributed/pipe.py's Stage.boundary_dtype), fp32 on CPU; and the hop time
    it adds to a PP=2 step scales with those bytes."""
    from trainer.distributed.pipe import build_stages, split_layers
    from tuner import ParallelPlan, estimate, load_platform
    from tuner.layout import precision_policy

    for backend, autocast in (("nccl", True), ("gloo", False)):
        stage = build_stages(_model(), 2, 0, 1, split_layers(4, 2), autocast=autocast)[0]
        pb = precision_policy("trainer", backend)
        assert pb.p2p_bytes == stage.boundary_dtype.itemsize, (backend, pb.p2p_bytes)
    from model import presets
    cfg = presets.get("tiny")
    plan = ParallelPlan(pp=2, ep=1, dp=1, microbatches=4, global_batch=16, seq_len=256)
    pf = load_platform("dgx-h100")
    p2p = {b: estimate(cfg, plan, pf, precision_policy("trainer", b)).time["p2p"]
           for b in ("nccl", "gloo")}
    assert p2p["nccl"] < p2p["gloo"], p2p


# -- item: the GPU check scripts ---------------------------------------------------------------

SCRIPTS = ["benchmarks/gpu_check.sh",
           pytest.param("benchmarks/gpu_check_multi.sh", marks=pytest.mark.slow)]


@pytest.mark.parametrize("script", SCRIPTS)
def test_gpu_scripts_parse(script: str) -> None:
    r = subprocess.run(["bash", "-n", script], cwd=ROOT, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


@pytest.mark.integration
@pytest.mark.parametrize("script", SCRIPTS)
def test_gpu_scripts_exit_2_without_a_gpu(tmp_path: Path, script: str) -> None:
    """No GPU: exit 2 with the reason, and GPU_CHECK_ARCHIVE still packs what there is (the
    summary beside the archive), as a lent machine's $OUT would bring it back."""
    archive = tmp_path / "back" / "gpu-check.tar.gz"
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", PY=sys.executable,
               GPU_CHECK_ARCHIVE=str(archive))
    r = subprocess.run(["bash", script, str(tmp_path / "out")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "GPU" in r.stderr
    summary = (tmp_path / "out" / "summary.txt").read_text()
    assert "GPU" in summary
    assert (tmp_path / "back" / "summary.txt").read_text() == summary
    with tarfile.open(archive) as t:
        names = set(t.getnames())
    assert {"out/summary.txt", "out/env.txt"} <= names, names


def _python_without_site(tmp_path: Path) -> Path:
    """An interpreter that imports nothing from site-packages (no torch): python -S."""
    wrapper = tmp_path / "bare-python"
    wrapper.write_text(f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    wrapper.chmod(0o755)
    return wrapper


@pytest.mark.integration
@pytest.mark.parametrize("script", SCRIPTS)
def test_gpu_scripts_name_missing_modules_before_any_step(tmp_path: Path, script: str) -> None:
    """A Python without the packages the steps import (a lent machine's image has no registry)
    stops with exit 3 naming them, before any step runs."""
    env = dict(os.environ, PY=str(_python_without_site(tmp_path)))
    r = subprocess.run(["bash", script, str(tmp_path / "out")], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 3, r.stdout + r.stderr
    assert "cannot import: torch (ModuleNotFoundError" in r.stderr, r.stderr
    assert "== " not in r.stdout  # no step started
    assert "cannot import" in (tmp_path / "out" / "summary.txt").read_text()


def _budget_driver(tmp_path: Path, budget: str, steps: str, **env_extra: str
                   ) -> subprocess.CompletedProcess:
    """gpu_env.sh's `step` as the scripts use it, with GPU_CHECK_BUDGET_S set."""
    driver = tmp_path / "driver.sh"
    driver.write_text(f'ROOT="{ROOT}"; OUT="{tmp_path / "out"}"\n'
                      'source "$ROOT/benchmarks/gpu_env.sh"\n' + steps + "\nexit $status\n")
    env = dict(os.environ, PY=sys.executable, GPU_CHECK_BUDGET_S=budget, **env_extra)
    return subprocess.run(["bash", str(driver)], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=120)


@pytest.mark.integration
def test_gpu_check_archive_leaves_out_caches_and_checkpoints(tmp_path: Path) -> None:
    """The archive keeps the logs and the runs' metrics, not the Triton cache or the trainings'
    checkpoints (40 MB each: past what one file brought back from a lent machine may be)."""
    steps = ('mkdir -p "$OUT/train-bf16/checkpoints/step_1" "$OUT/triton-cache/ab"\n'
             'echo x > "$OUT/train-bf16/checkpoints/step_1/model.safetensors"\n'
             'echo x > "$OUT/triton-cache/ab/k.cubin"\n'
             'step run 30 sh -c "echo {} > $OUT/train-bf16/metrics.jsonl"')
    archive = tmp_path / "back" / "gc.tgz"
    r = _budget_driver(tmp_path, "0", steps, GPU_CHECK_ARCHIVE=str(archive))
    assert r.returncode == 0, r.stdout + r.stderr
    with tarfile.open(archive) as t:
        names = set(t.getnames())
    assert {"out/summary.txt", "out/run.log", "out/train-bf16/metrics.jsonl"} <= names, names
    assert not [n for n in names if "checkpoints" in n or "triton-cache" in n], names


@pytest.mark.integration
def test_gpu_check_budget_bounds_the_steps(tmp_path: Path) -> None:
    """GPU_CHECK_BUDGET_S=55: the first step's 100 s limit is cut to what the budget leaves
    (55 - 20 s of grace = 35 s, 34 s if a second ticked); once under 30 s are left the next
    step is not started, its row says so, and the check fails."""
    r = _budget_driver(tmp_path, "55", "step first 100 sleep 1\nstep second 100 sleep 6\n"
                                       "step third 100 true")
    assert r.returncode == 1, r.stdout + r.stderr
    # bash's SECONDS counts whole seconds: the source and the first step may straddle one
    assert re.search(r"== first \(limit 3[45]s\)", r.stdout), r.stdout
    assert re.search(r"== second \(limit 3[0-5]s\)", r.stdout), r.stdout
    rows = (tmp_path / "out" / "summary.txt").read_text().splitlines()
    assert [row.split()[0] for row in rows] == ["first", "second", "third"], rows
    assert "rc=0" in rows[0] and "rc=0" in rows[1]
    assert "skipped: 55s budget spent" in rows[2], rows


@pytest.mark.integration
def test_gpu_check_bad_settings_are_refused(tmp_path: Path) -> None:
    r = _budget_driver(tmp_path, "9 minutes", "step first 10 true")
    assert r.returncode == 64 and "GPU_CHECK_BUDGET_S=9 minutes" in r.stderr, r.stderr
    env = dict(os.environ, PY=sys.executable, GPU_CHECK_ARCHIVE=str(tmp_path / "gc.zip"))
    r = subprocess.run(["bash", "benchmarks/gpu_check.sh", str(tmp_path / "o")], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 64 and ".tar.gz or .tgz" in r.stderr, r.stderr
    env["GPU_CHECK_ARCHIVE"] = str(tmp_path / "o" / "gc.tar.gz")
    r = subprocess.run(["bash", "benchmarks/gpu_check.sh", str(tmp_path / "o")], cwd=ROOT,
                       env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode == 64 and "lies inside OUT" in r.stderr, r.stderr


def test_gpu_check_fits_one_device_call() -> None:
    """A lent machine runs one command for at most 10 minutes: the single-GPU check's default
    budget leaves room for the machine's start and the transfers, and the tests run first."""
    text = (ROOT / "benchmarks/gpu_check.sh").read_text()
    budget = int(re.search(r'GPU_CHECK_BUDGET_S="\$\{GPU_CHECK_BUDGET_S:-(\d+)\}"', text)[1])
    assert 0 < budget <= 570, budget
    steps = re.findall(r"^(?:SHOW=\d+ )?step ([a-z0-9-]+) (\d+) ", text, re.M)
    assert steps[0][0] == "gpu-tests" and steps[1][0] == "train-bf16", steps
    total = sum(int(limit) for _, limit in steps)
    assert f"The step limits add up to {total} s" in text.replace("\n# ", " "), total


def _metrics(path: Path, losses: list[float], tok_s: float = 1000.0) -> Path:
    path.mkdir(parents=True)
    rows = [{"step": i + 1, "loss": v, "tokens_per_s": tok_s} for i, v in enumerate(losses)]
    rows.insert(1, {"event": "migration", "step": 1})  # event rows are skipped
    (path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _losses_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "benchmarks/gpu_check_losses.py", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)


def test_loss_curve_summary(tmp_path: Path) -> None:
    good = _metrics(tmp_path / "good", [5.5, 5.0, 4.6, 4.2, 3.9, 3.7], 1200.0)
    r = _losses_cli("curve", str(good))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "3.7" in r.stdout and "tokens/s" in r.stdout and "1200" in r.stdout
    flat = _metrics(tmp_path / "flat", [5.5, 5.6, 5.5, 5.6, 5.5, 5.6])
    assert _losses_cli("curve", str(flat)).returncode == 1
    nan = _metrics(tmp_path / "nan", [5.5, float("nan"), 4.0, 3.0, 2.0, 1.0])
    assert _losses_cli("curve", str(nan)).returncode == 1


def test_loss_comparison(tmp_path: Path) -> None:
    ref = _metrics(tmp_path / "ref", [5.0, 4.5, 4.0])
    close = _metrics(tmp_path / "close", [5.0 * (1 + 4e-3), 4.5, 4.0 * (1 - 4e-3)])
    far = _metrics(tmp_path / "far", [5.0, 4.5, 4.0 * 1.03])
    short = _metrics(tmp_path / "short", [5.0, 4.5])
    assert _losses_cli("compare", str(ref), str(close), "--rtol", "5e-3").returncode == 0
    r = _losses_cli("compare", str(ref), str(far), "--rtol", "2e-2")
    assert r.returncode == 1 and "step 3" in r.stdout, r.stdout
    assert _losses_cli("compare", str(ref), str(short), "--rtol", "1").returncode == 1


@pytest.mark.slow
@pytest.mark.multiproc
def test_loss_comparison_on_real_cpu_runs(tmp_path: Path) -> None:
    """The comparison on the runs it is made for: PP=2 (gloo, 2 processes) against one
    process, 4 steps of a small tiny-model config (fp32 on CPU: agree to rel 2e-4)."""
    from conftest import run_train, stdlib_corpus

    data = stdlib_corpus(tmp_path / "corpus.txt", 5, 100_000)
    common = ["--config", "configs/tiny.toml", "--data", data, "--train.seq_len=32",
              "--train.global_batch=8", "--model.d_model=32", "--model.moe_ffn_dim=32",
              "--model.n_heads=2", "--model.n_kv_heads=1", "--model.head_dim=16",
              "--train.eval_every=0", "--train.plot=false", "--train.steps=4",
              "--optim.warmup_steps=2", "--comm.alltoall=flat", "--parallel.ep=1"]
    for name, nproc, extra in [("ref", 1, ["--parallel.pp=1"]), ("pp2", 2, ["--parallel.pp=2"])]:
        r = run_train([*common, f"--train.out_dir={tmp_path / name}", *extra], nproc=nproc)
        assert r.returncode == 0, r.stderr[-3000:]
    r = _losses_cli("compare", str(tmp_path / "ref"), str(tmp_path / "pp2"), "--rtol", "2e-4")
    assert r.returncode == 0, r.stdout + r.stderr
    assert _losses_cli("curve", str(tmp_path / "pp2"), "--min-drop", "0").returncode == 0


# -- GPU tier (make gpu-check): the runtime's CUDA-event spans on one GPU ----------------------


def _spans_on(device: torch.device, init_file: Path) -> tuple[list, list, list, float, float]:
    """Every stage on one rank (interleaved, v=3, M=4): local hand-offs only, so one process
    runs the runtime's timing path on `device`."""
    import time

    from torch import nn

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=0, world_size=1)
    try:
        torch.manual_seed(0)
        stages = {s: nn.Sequential(nn.Linear(64, 64), nn.Tanh()).to(device) for s in range(3)}
        sched = pipeline.build("interleaved-1f1b", 1, 4, n_virtual=3)
        rt = pipeline.PipelineRuntime(sched, stages, F.mse_loss, (8, 64), device=device)
        xs = [torch.randn(8, 64, device=device) for _ in range(4)]
        ys = [torch.randn(8, 64, device=device) for _ in range(4)]
        t0 = time.perf_counter()
        losses = rt.step(xs, ys)
        t1 = time.perf_counter()
        with torch.no_grad():
            ref = [F.mse_loss(stages[2](stages[1](stages[0](x))), y) for x, y in zip(xs, ys, strict=True)]
        return rt.spans, losses, ref, t0, t1
    finally:
        dist.destroy_process_group()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_cuda_event_spans(tmp_path: Path) -> None:
    spans, losses, ref, t0, t1 = _spans_on(torch.device("cuda", 0), tmp_path / "rdzv")
    torch.testing.assert_close(torch.stack(losses), torch.stack(ref), rtol=1e-5, atol=1e-6)
    assert len(spans) == 3 * 4 * 2
    spans = sorted(spans, key=lambda s: s.start)
    for s in spans:
        assert t0 <= s.start <= s.end <= t1 + 1e-3, (s, t0, t1)
    for a, b in zip(spans, spans[1:], strict=False):  # one stream: spans do not overlap
        assert b.start >= a.end - 1e-6, (a, b)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA/ROCm GPU")
def test_fb_budget_reads_the_device() -> None:
    """--comm.a2a_overlap=auto's memory budget on a GPU (trainer.build.fb_budget): a share of
    the device's free memory as torch reports it, so between 0 and the device's total; more
    allocated leaves less (CPU runs take the host's MemAvailable instead)."""
    from trainer.build import FB_BUDGET_SHARE, fb_budget

    free, total = torch.cuda.mem_get_info()
    before = fb_budget()
    assert 0 < before <= FB_BUDGET_SHARE * total
    assert before == pytest.approx(FB_BUDGET_SHARE * free, rel=0.05)
    block = torch.empty(2**30, dtype=torch.uint8, device="cuda")  # 1 GiB held
    try:
        assert fb_budget() <= before - FB_BUDGET_SHARE * 2**30 * 0.9
    finally:
        del block
        torch.cuda.empty_cache()
