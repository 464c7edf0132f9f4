"""Document-masked attention kernels (model/attention.py DOC_ATTENTION): the flex block mask and
the per-document SDPA path equal the dense [B, 1, S, S] mask path (outputs and every input
gradient, atol 1e-5: the same softmax over the same keys, summed in another order, so fp32
rounding differs in the last bits only), for MHA, GQA and MLA-shaped heads (value dim !=
query dim); and at S = 4096 the per-document path's peak memory is below the dense path's
(measured in fresh processes by benchmarks/bench_doc_attention.py)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from conftest import ROOT

from model.attention import DocLayout, sdpa


def _layout(lengths_per_row: list[list[int]], kernel: str) -> DocLayout:
    rows = [torch.repeat_interleave(torch.arange(len(r)), torch.tensor(r)) for r in lengths_per_row]
    return DocLayout(torch.stack(rows), kernel)


CASES = {  # name: (H, G, qk dim, v dim)
    "mha": (4, 4, 16, 16),
    "gqa": (4, 2, 16, 16),
    "mla": (4, 4, 24, 16),
}


def _compare(kernel: str, case: str, device: str, backward: bool, S: int = 64) -> None:
    H, G, dqk, dv = CASES[case]
    lengths = [[1, 40, 7, 1, S - 49], [S], [S - 1, 1], [S // 2, S // 2]]  # size-1 docs, whole rows
    B = len(lengths)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, h, S, d, generator=g).to(device).requires_grad_(backward)
               for h, d in ((H, dqk), (G, dqk), (G, dv)))
    grad = torch.randn(B, H, S, dv, generator=g).to(device)
    outs = {}
    for kern in ("dense", kernel):
        doc = _layout(lengths, kern)
        doc = DocLayout(doc.doc_ids.to(device), kern)
        o = sdpa(q, k, v, dqk ** -0.5, doc, gqa=H != G)
        outs[kern] = [o.detach()]
        if backward:
            o.backward(grad)
            outs[kern] += [t.grad.clone() for t in (q, k, v)]
            for t in (q, k, v):
                t.grad = None
    for name, a, b in zip(("out", "dq", "dk", "dv"), outs["dense"], outs[kernel], strict=False):
        torch.testing.assert_close(b, a, atol=1e-5, rtol=1e-5, msg=name)


@pytest.mark.parametrize("case", sorted(CASES))
def test_varlen_equals_the_dense_mask(case):
    _compare("varlen", case, "cpu", backward=True)


@pytest.mark.parametrize("case", sorted(CASES))
def test_flex_forward_equals_the_dense_mask_on_cpu(case):
    # torch's flex_attention has no CPU backward (NotImplementedError): the forward only here,
    # gradients on a GPU (test_flex_equals_the_dense_mask_on_gpu, make gpu-check)
    _compare("flex", case, "cpu", backward=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("case", sorted(CASES))
def test_flex_equals_the_dense_mask_on_gpu(case):
    # fp32 inputs; compiled flex (128-token tiles) against SDPA with the dense mask
    torch.backends.cuda.matmul.allow_tf32 = False
    _compare("flex", case, "cuda", backward=True, S=256)


def test_layout_builds_no_dense_mask_unless_asked():
    doc = _layout([[3, 5], [8]], "varlen")
    assert doc._mask is None and doc.segments == [[(0, 3), (3, 8)], [(0, 8)]]
    assert doc.positions.tolist() == [[0, 1, 2, 0, 1, 2, 3, 4], list(range(8))]
    with pytest.raises(ValueError, match="doc attention kernel 'flash'; valid: auto, flex"):
        DocLayout(torch.zeros(1, 4, dtype=torch.long), "flash")


@pytest.mark.slow
def test_varlen_uses_less_memory_than_dense_at_4096(tmp_path):
    r = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "bench_doc_attention.py"),
                        "--seq", "4096", "--repeats", "1", "--out", str(tmp_path)],
                       capture_output=True, text=True, cwd=ROOT, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {x["kernel"]: x for x in map(json.loads,
                                       (tmp_path / "doc_attention.jsonl").read_text().splitlines())}
    assert rows["varlen"]["peak_bytes"] < rows["dense"]["peak_bytes"]
    assert rows["varlen"]["max_abs_diff_vs_dense"] < 1e-5
