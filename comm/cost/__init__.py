"""comm.cost: the all-to-all cost model that `algorithm="auto"` decides with.

    CostModel                    the parameters (comm/cost/model.py)
    predict(S, row_bytes, topo, model, method="auto") -> Prediction(flat, halo, busiest)
                                 the one flat/HALO cost path, its implementations behind
                                 `method` (comm/cost/predict.py)
    choose_algorithm             the decision on a call's split matrix
    row_summary, summary_width, summary_bracket, decide_from_summaries
                                 the same decision from O(R) numbers per rank (summary.py)
    reference_predict_flat / _halo, predict_flat / predict_halo, busiest_nic_bytes
                                 single terms (loops; vectorised)
    layout                       the per-topology facts the fast implementations use
"""

from __future__ import annotations

from comm.cost.layout import Layout, layout
from comm.cost.model import CostModel
from comm.cost.predict import (
    METHODS,
    SMALL_GROUP,
    busiest_nic_bytes,
    choose_algorithm,
    predict,
    predict_flat,
    predict_halo,
)
from comm.cost.reference import (
    Prediction,
    decide,
    reference_busiest_nic_bytes,
    reference_predict,
    reference_predict_flat,
    reference_predict_halo,
)
from comm.cost.summary import decide_from_summaries, row_summary, summary_bracket, summary_width
from comm.topology.platform import PLATFORM_DIR

__all__ = [
    "METHODS",
    "PLATFORM_DIR",
    "SMALL_GROUP",
    "CostModel",
    "Layout",
    "Prediction",
    "busiest_nic_bytes",
    "choose_algorithm",
    "decide",
    "decide_from_summaries",
    "layout",
    "predict",
    "predict_flat",
    "predict_halo",
    "reference_busiest_nic_bytes",
    "reference_predict",
    "reference_predict_flat",
    "reference_predict_halo",
    "row_summary",
    "summary_bracket",
    "summary_width",
]
