"""The residual model of the original DistributedTraining project, as an lrmp layer spec.

``examples/demo.py`` trains it; tests can reuse it with
``sys.path.insert(0, "<repo>/examples"); from residual_model import residual_spec``.

Every class here is one a worker may always build (``torch.nn`` and ``lightning_remote_mp.layers``),
so remote workers need no ``--allow-module`` for it.
"""

from __future__ import annotations

from typing import Any

from lightning_remote_mp.layers import WrappedLinear


def residual_spec(width: int = 512, batch: int = 32) -> list[tuple[Any, dict[str, Any], Any]]:
    """Linear(1->width), ReLU, a residual block whose skip ``res_1`` crosses two layers, then Linear(width->1), Sigmoid.

    ``batch`` only sets the example input shapes (used for checks and memory estimates), never the batch size.
    """
    w, b = width, batch
    return [
        ("torch.nn.Linear", {"in_features": 1, "out_features": w}, (b, 1)),
        ("torch.nn.ReLU", {}, (b, w)),
        (WrappedLinear, {"in_features": w, "out_features": w, "out_variables": ["res_1"]}, (b, w)),
        ("torch.nn.ReLU", {}, (b, w)),
        ("torch.nn.Linear", {"in_features": w, "out_features": w}, (b, w)),
        ("torch.nn.ReLU", {}, (b, w)),
        # The main input plus the residual it depends on: two input shapes.
        (WrappedLinear, {"in_features": w, "out_features": w, "dependencies": ["res_1"]}, [(b, w), (b, w)]),
        ("torch.nn.ReLU", {}, (b, w)),
        ("torch.nn.Linear", {"in_features": w, "out_features": 1}, (b, w)),
        ("torch.nn.Sigmoid", {}, (b, 1)),
    ]


#: The spec at the original sizes: width 512, example batch 32.
RESIDUAL_SPEC = residual_spec()
