"""The one layout model (trainer/layout.py): the planner's stages and groups are the trainer's.

References: the rank formulas of trainer/distributed/mesh.py's docstring, written out here by hand; the
trainer's own stage builder (`trainer.distributed.pipe.build_stages`) and config parser (`train.py --plan`);
the layer splits the issue reports the trainer ran. No processes.
"""

from __future__ import annotations

import dataclasses
import itertools
import random
import tomllib

import pytest
from torch import nn

from trainer.config import parse_args
from trainer.distributed.mesh import Mesh
from trainer.distributed.pipe import build_stages, split_layers
from trainer.layout import (
    ALLTOALL_ALGORITHMS,
    EP_PLACEMENTS,
    GROUP_KINDS,
    RECOMPUTE,
    SCHEDULES,
    ZERO_LEVELS,
    Layout,
    LayoutError,
    check,
    layer_split_spec,
    layout_problems,
    not_runnable_because,
    rank_chunks,
    stage_layers,
)

SEED = 33


# ---- references --------------------------------------------------------------------------------

def ref_rank(placement: str, pp: int, dp: int, ep: int, p: int, d: int, e: int) -> int:
    """trainer/distributed/mesh.py's formulas (the trainer's rank layout since before trainer.layout)."""
    if placement == "local":
        return (p * dp + d) * ep + e
    return (e * pp + p) * dp + d


def ref_groups(placement: str, pp: int, dp: int, ep: int) -> dict[str, list[list[int]]]:
    """The group lists trainer/distributed/mesh.py's build_groups created, in its order."""
    r = lambda p, d, e: ref_rank(placement, pp, dp, ep, p, d, e)  # noqa: E731
    return {
        "ep": [[r(p, d, e) for e in range(ep)] for p in range(pp) for d in range(dp)],
        "dp": [[r(p, d, e) for d in range(dp)] for p in range(pp) for e in range(ep)],
        "stage": [[r(p, d, e) for d in range(dp) for e in range(ep)] for p in range(pp)],
        "pp": [[r(p, d, e) for p in range(pp)] for d in range(dp) for e in range(ep)],
    }


class _Layers(nn.Module):
    """What build_stages reads of a model: its layer list, embedding, final norm and head."""

    def __init__(self, n_layers: int) -> None:
        super().__init__()
        self.embed, self.norm, self.lm_head = nn.Identity(), nn.Identity(), nn.Identity()
        self.layers = nn.ModuleList(nn.Identity() for _ in range(n_layers))


def trainer_stages(n_layers: int, pp: int, vpp: int) -> dict[int, dict[int, list[int]]]:
    """{pp rank: {stage: layers}} as the trainer cuts them: split_layers + build_stages."""
    bounds = split_layers(n_layers, pp * vpp)
    out = {}
    for r in range(pp):
        m = _Layers(n_layers)
        originals = list(m.layers)
        stages = build_stages(m, pp, r, vpp, bounds)
        out[r] = {s: [originals.index(b) for b in st.blocks] for s, st in stages.items()}
    return out


def random_layouts(n: int, seed: int = SEED) -> list[tuple[int, int, int, int, str, int]]:
    """(pp, dp, ep, vpp, placement, n_layers) with pp * vpp <= n_layers <= 26 (above, only the
    sizes of the same split grow: the remainder rule is what varies)."""
    rng = random.Random(seed)
    out = []
    while len(out) < n:
        pp, dp, ep = rng.choice([1, 2, 3, 4, 8]), rng.choice([1, 2, 3]), rng.choice([1, 2, 4])
        vpp = rng.choice([1, 1, 2, 3]) if pp > 1 else 1
        n_layers = rng.randint(pp * vpp, 26)
        out.append((pp, dp, ep, vpp, rng.choice(["local", "spread"]), n_layers))
    return out


# ---- the splits the issue names -----------------------------------------------------------------

def test_issue_examples_plan_what_runs():
    from model import presets
    from tuner.counts import chunk_layers

    dsv3 = presets.get("deepseek-v3").n_layers
    for (L, pp), counts in {(10, 4): [2, 3, 3, 2], (dsv3, 8): [7, 8, 8, 8, 8, 8, 7, 7]}.items():
        assert [len(s) for s in stage_layers(L, pp)] == counts  # what the trainer ran
        assert [len(s) for s in chunk_layers(L, pp, 1)] == counts  # what the planner plans
        assert split_layers(L, pp) == [0, *itertools.accumulate(counts)]
        assert layer_split_spec(stage_layers(L, pp)) == ",".join(map(str, counts))


# ---- rank arithmetic ----------------------------------------------------------------------------

def test_rank_layout_equals_the_trainer_formulas():
    """Several hundred PP x DP x EP layouts: coordinates, every group (members and creation
    order) and data shards equal the hand-written formulas, for both placements."""
    for pp, dp, ep, vpp, placement, _ in random_layouts(300):
        world = pp * dp * ep
        lay = Layout.infer(world, pp=pp, ep=ep, vpp=vpp, placement=placement)
        assert (lay.dp, lay.n_data_shards) == (dp, dp * ep)
        ref = ref_groups(placement, pp, dp, ep)
        for kind, lists in ref.items():
            assert lay.groups(kind) == lists, (kind, lay)
        for p in range(pp):
            for d in range(dp):
                for e in range(ep):
                    r = ref_rank(placement, pp, dp, ep, p, d, e)
                    m = Mesh.plan(world, r, pp=pp, ep=ep, dp=dp, placement=placement)
                    assert m.coords(r) == (p, d, e) and m.rank_of(p, d, e) == r
                    assert m.data_idx == d * ep + e
                    mine = {k: next(g for g in v if r in g) for k, v in ref.items()}
                    assert (m.ep_ranks(), m.dp_ranks(), m.stage_ranks(), m.pp_ranks()) == \
                        (mine["ep"], mine["dp"], mine["stage"], mine["pp"])


def test_folded_layouts_are_consistent():
    """With TP, CP and ETP (planned layouts): every group kind partitions the world, the
    coordinates invert, TP groups are consecutive ranks (with "spread", where a stage's blocks
    of dp x etp ranks are that long), EP/TP groups stay in one stage, the
    stage group is the ranks of a stage with the same TP index."""
    rng = random.Random(SEED)
    for _ in range(120):
        pp, dp, ep, etp = (rng.choice([1, 2, 4]) for _ in range(4))
        S = dp * ep * etp
        tp = rng.choice([t for t in (1, 2, 4, 8) if S % t == 0])
        cp = rng.choice([c for c in (1, 2, 4) if (S // tp) % c == 0])
        lay = Layout(pp * S, pp=pp, dp=dp, ep=ep, etp=etp, tp=tp, cp=cp,
                     placement=rng.choice(["local", "spread"]))
        for kind in GROUP_KINDS:
            groups = lay.groups(kind)
            assert sorted(r for g in groups for r in g) == list(range(lay.world)), kind
            size = {"stage": S // tp, "attn_dp": lay.attn_dp}.get(kind, getattr(lay, kind, 0))
            assert all(len(g) == size for g in groups), (kind, lay)
        for r in range(lay.world):
            c = lay.coords(r)
            assert lay.rank_of(c.pp, c.dp, c.ep, c.etp) == r
            assert lay.dense_rank_of(c.pp, c.attn_dp, c.cp, c.tp) == r
            tpg, ranks = lay.group("tp", r), lay.stage_ranks(c.pp)
            i = ranks.index(tpg[0])  # consecutive in the stage (ranks, when they are adjacent)
            assert tpg == ranks[i:i + tp]
            if lay.placement == "local" or (dp * etp) % tp == 0:
                assert tpg == list(range(tpg[0], tpg[0] + tp))
            stage = set(ranks)
            assert set(lay.group("ep", r)) <= stage and set(tpg) <= stage
            assert set(lay.group("stage", r)) == {q for q in stage if lay.coords(q).tp == c.tp}


# ---- stage split: planner = trainer -------------------------------------------------------------

def test_planner_stages_equal_the_trainers():
    """Several hundred (pp, vpp, layers): the planner's chunks (tuner.counts.chunk_layers) and
    the layers it prices on each pipeline rank (tuner.estimate.stage_memory) are the stages
    the trainer builds (split_layers + build_stages on a model of that many layers)."""
    from model import presets
    from tuner import load_platform
    from tuner.counts import chunk_layers
    from tuner.estimate import stage_memory
    from tuner.layout import ParallelPlan

    base, pf = presets.get("tiny"), load_platform("local")
    for pp, dp, ep, vpp, placement, n_layers in random_layouts(300):
        built = trainer_stages(n_layers, pp, vpp)
        chunks = chunk_layers(n_layers, pp, vpp)
        assert {r: {s: chunks[s] for s in stages} for r, stages in built.items()} == built
        assert rank_chunks(n_layers, pp, vpp) == [list(built[r].values()) for r in range(pp)]
        M = pp if vpp > 1 else 1
        plan = ParallelPlan(pp=pp, ep=ep, dp=dp, microbatches=M, global_batch=dp * ep * M,
                            seq_len=8, n_virtual=vpp, ep_placement=placement,
                            schedule="interleaved-1f1b" if vpp > 1 else "1f1b")
        cfg = dataclasses.replace(base, n_layers=n_layers)
        priced = [list(s.layers) for s in stage_memory(cfg, plan, pf)]
        assert priced == [[i for s in built[r].values() for i in s] for r in range(pp)]


def test_real_model_is_cut_like_the_layer_list():
    """The trainer's stages of a real MoETransformer (tiny, 4 layers, pp 2 x 2 virtual) hold
    the layers stage_layers names (and the reference builder above cuts alike)."""
    import torch

    from model import MoETransformer, presets

    with torch.device("meta"):
        model = MoETransformer(presets.get("tiny"))
    layers = list(model.layers)
    stages = build_stages(model, 2, 1, 2, split_layers(4, 4))
    got = {s: [layers.index(b) for b in st.blocks] for s, st in stages.items()}
    want = {s: lay for s, lay in enumerate(stage_layers(4, 2, 2)) if s % 2 == 1}
    assert got == want == trainer_stages(4, 2, 2)[1]


# ---- groups: planner = trainer ------------------------------------------------------------------

def _planner_groups(pp: int, dp: int, ep: int, placement: str, gpn: int, tp: int = 1,
                    cp: int = 1, etp: int = 1):
    """The groups the estimate prices (tuner.costs.place_groups) and the plan's Layout."""
    from tuner.costs import place_groups
    from tuner.layout import ParallelPlan, trainer_layout

    S = dp * ep * etp
    plan = ParallelPlan(pp=pp, ep=ep, dp=dp, microbatches=1, global_batch=4 * S, seq_len=64,
                        ep_placement=placement, tp=tp, cp=cp, etp=etp)
    lay = trainer_layout(plan)
    assert lay == Layout(pp * S, pp=pp, dp=dp, ep=ep, tp=tp, cp=cp, etp=etp, placement=placement)
    return place_groups(plan, gpn, "sharded"), lay


def _power_of_two_layouts(n: int, folded: bool = False):
    rng = random.Random(SEED)
    for _ in range(n):
        pp, dp, ep = rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 8]), rng.choice([1, 2, 4, 16])
        etp = rng.choice([1, 2]) if folded else 1
        S = dp * ep * etp
        tp = rng.choice([t for t in (1, 2, 4, 8) if S % t == 0]) if folded else 1
        cp = rng.choice([c for c in (1, 2) if (S // tp) % c == 0]) if folded else 1
        yield pp, dp, ep, rng.choice(["local", "spread"]), rng.choice([4, 8]), tp, cp, etp


def _same(g, lay: Layout, mine: str, theirs: str, gpn: int) -> None:
    per_node, nodes = lay.node_span(theirs, gpn)
    assert (g[mine].size, g[mine].per_node, g[mine].nodes) == \
        (len(lay.group(theirs, 0)), per_node, nodes), (mine, lay, gpn)


def test_planner_groups_equal_the_trainers():
    """300 power-of-two layouts: the groups the planner prices (size, members per
    node, nodes spanned: tuner.comms.placement in tuner.costs) are the layout's groups (the
    trainer's, where it runs them): EP and expert DP for both placements, every group (TP, CP,
    ETP and the stage group too, folded layouts included) for the local one; a pipeline hop
    crosses nodes in the planner exactly when some pp group spans nodes."""
    kinds = {"ep": "ep", "dp": "dp", "rep": "stage", "tp": "tp", "cp": "cp", "etp": "etp"}
    for folded in (False, True):
        for pp, dp, ep, placement, gpn, tp, cp, etp in _power_of_two_layouts(150, folded):
            (g, crosses), lay = _planner_groups(pp, dp, ep, placement, gpn, tp, cp, etp)
            for mine, theirs in kinds.items():
                if placement == "local" or mine in ("ep", "dp", "etp"):
                    _same(g, lay, mine, theirs, gpn)
            if pp > 1:
                assert crosses == (lay.node_span("pp", gpn)[1] > 1), (lay, gpn)


def test_planner_spread_stage_group_equals_the_trainers():
    """The spread placement's stage group (the non-expert gradients' reduce) as the layout
    has it, also where pp x dp x etp < GPUs per node puts several EP indices' blocks on one
    node (pp 4, dp 1, ep 2 on 8 GPUs: ranks 0 and 4, one node)."""
    for pp, dp, ep, placement, gpn, *_ in _power_of_two_layouts(400):
        if placement == "spread":
            (g, _), lay = _planner_groups(pp, dp, ep, placement, gpn)
            _same(g, lay, "rep", "stage", gpn)


# ---- feasibility --------------------------------------------------------------------------------

def test_check_names_the_numbers_and_the_choices():
    with pytest.raises(LayoutError, match=r"ep=3 does not divide 8 experts; valid ep: \[1, 2, 4, 8\]"):
        check(Layout(6, dp=2, ep=3), 4, 8)
    with pytest.raises(LayoutError, match=r"8 pipeline stages \(pp x n_virtual\) exceed the "
                                          r"model's 4 layers; use pp x n_virtual <= 4"):
        check(Layout(4, pp=4, vpp=2), 4, 8)
    with pytest.raises(LayoutError, match=r"world size 8 does not match the mesh pp=2 x dp=1 x "
                                          r"ep=2 = 4"):
        Layout(8, pp=2, ep=2)
    with pytest.raises(LayoutError, match=r"tp=4 x cp=1 = 4 does not divide the 2 ranks"):
        Layout(4, pp=2, ep=2, tp=4)
    with pytest.raises(LayoutError, match=r"ep_placement='near'; valid: local, spread"):
        Layout(1, placement="near")
    probs = layout_problems(Layout(4, pp=2, ep=2), 4, 8, schedule="1f1b", microbatches=2,
                            global_batch=6, seq_len=7)
    assert probs == ["microbatches=2 must divide the 3 sequences each data shard gets "
                     "(global_batch=6 / 2 shards); valid: [1, 3]"]
    assert any("vpp=2 virtual stages per rank need schedule 'interleaved-1f1b'" in p
               for p in layout_problems(Layout(2, pp=2, vpp=2), 8, 8, schedule="1f1b"))
    assert any("cp=2 needs seq_len divisible by 2 x cp = 4" in p
               for p in layout_problems(Layout(2, dp=2, cp=2), 8, 8, seq_len=6))
    assert layout_problems(Layout(8, pp=2, dp=2, ep=2, vpp=2), 8, 8, schedule="interleaved-1f1b",
                           microbatches=4, global_batch=16) == []


def test_not_runnable_says_what_is_missing():
    assert not_runnable_because(Layout(8, pp=2, dp=2, ep=2), zero=2, alltoall="auto") == []
    assert not_runnable_because(Layout(8, pp=2, dp=2, ep=2, tp=2)) == []  # issue 31: built
    why = not_runnable_because(Layout(8, ep=4, etp=2, cp=2, tp=2), zero=3, alltoall="dedup",
                               a2a_overlap="fb", precision="fp8")
    # ZeRO-3, dedup, fb overlap and TP each run; cp, etp, fp8 and TP beside dedup / fb do not
    assert len(why) == 4 and "context parallel" in why[0] and "etp=2" in why[1], why
    assert "tp=2 with alltoall 'dedup' / overlap 'fb'" in why[2] and "fp8" in why[3], why
    tp_why = not_runnable_because(Layout(8, pp=2, dp=2, ep=2, tp=2), alltoall="dedup",
                                  a2a_overlap="fb")
    assert tp_why == [why[2]], tp_why
    assert not_runnable_because(Layout(8, pp=2, dp=2, ep=2), alltoall="dedup",
                                a2a_overlap="fb") == []
    assert not_runnable_because(Layout(8, pp=2, dp=2, ep=2), zero=3) == []
    assert not_runnable_because(Layout(4, ep=4), alltoall="dedup", a2a_overlap="layer") == []
    with pytest.raises(LayoutError, match=r"recompute='some'; valid: none, selective, full"):
        not_runnable_because(Layout(1), recompute="some")
    assert RECOMPUTE == ("none", "selective", "full") and 3 in ZERO_LEVELS
    assert "dedup" in ALLTOALL_ALGORITHMS


def test_the_planner_searches_the_vocabularies():
    """The search space's choices are words of the layout model's vocabularies."""
    from model import presets
    from tuner import load_platform
    from tuner.space import SearchSpace

    sp = SearchSpace.default(presets.get("tiny"), load_platform("local"), 4, 16, 64)
    assert {c.partition(":")[0] for c in sp.choices["schedule"]} == set(SCHEDULES)
    assert set(sp.choices["alltoall"]) <= set(ALLTOALL_ALGORITHMS)
    assert set(sp.choices["zero"]) <= set(ZERO_LEVELS)
    assert set(sp.choices["checkpointing"]) == set(RECOMPUTE)
    assert set(sp.choices["placement"]) == set(EP_PLACEMENTS)


# ---- plan files carry the split -----------------------------------------------------------------

@pytest.mark.parametrize("model,platform,plan_kw", [
    ("tiny", "local", dict(pp=3, ep=1, dp=1, microbatches=3, global_batch=3, seq_len=64)),
    ("tiny", "local", dict(pp=2, ep=2, dp=1, microbatches=2, global_batch=4, seq_len=64,
                           schedule="interleaved-1f1b", n_virtual=2)),
    ("deepseek-v3", "frontier", dict(pp=8, ep=16, dp=8, microbatches=16, global_batch=2048,
                                     seq_len=4096)),
])
def test_plan_file_round_trip_carries_the_split(model, platform, plan_kw, tmp_path):
    """plan_toml -> train.py's config parser -> the trainer's split: the stages the estimate
    priced, layer for layer."""
    from model import presets
    from tuner import ParallelPlan, estimate, load_platform
    from tuner.report import plan_toml

    cfg = presets.get(model)
    plan = ParallelPlan(**plan_kw)
    e = estimate(cfg, plan, load_platform(platform))
    path = tmp_path / "plan.toml"
    path.write_text(plan_toml(e, model, {"model": model}))
    spec = tomllib.loads(path.read_text())["run"]["parallel"]["layer_split"]
    run = parse_args(["--plan", str(path)])
    assert run.parallel.layer_split == spec
    S = run.parallel.pp * run.parallel.n_virtual
    b = split_layers(cfg.n_layers, S, run.parallel.layer_split)
    run_stages = [list(range(b[s], b[s + 1])) for s in range(S)]
    assert run_stages == stage_layers(cfg.n_layers, plan.pp, plan.n_virtual)
    assert [list(s.layers) for s in e.stages] == \
        [[i for s in range(S) if s % plan.pp == r for i in run_stages[s]] for r in range(plan.pp)]
