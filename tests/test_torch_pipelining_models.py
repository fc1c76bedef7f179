"""The models of PyTorch's own pipelining tests (issue #38), trained through lrmp as torch wrote them.

Re-created here, small, from the files of ``test/distributed/pipelining/`` in pytorch/pytorch (none of
torch's harness: only the models): ``model_registry.py`` (``ExampleCode``, ``ModelWithKwargs``,
``ModelWithParamAlias``, ``MLPModule``, ``MLPKWargModule``, ``MultiMLP``, ``MultiInterMediateModel``,
``MultiMLPKwargs``, ``MultiMLPWithDw``), ``test_unflatten.py`` (its nested ``M`` of ``Block``s),
``test_transformer.py`` (``TransformerLike``, eight MLP layers) and ``test_pipe.py`` (its
``ExampleCode`` and ``MultiMLP``). The older ``ExampleCode`` of ``model_registry.py`` comes from
``test_operators``. Each keeps its ``pipe_split()`` markers, its keyword arguments, its shared
parameters and its autograd Functions; a model with a ``split_spec`` is cut where it says.

Each is split as ``model`` of a LightningModule whose Linear head (on the driver) turns the model's
features into class logits (``ExampleCode`` of test_operators returns them itself), and trained on 2
and on 3 workers (fewer where the model has fewer units: ``ExampleCode`` and ``ModelWithParamAlias``
have 2, ``MultiInterMediateModel`` one), at 1 and at 4 micro-batches, with real Trainers: the losses
of every training and validation step and the weights after training equal those of the same model
trained locally (``remote_equals_local``). torch.export traces through the autograd Functions (their
forward's operators, differentiated by the workers), which is what their handwritten backwards
compute.
"""

from __future__ import annotations

import pytest
import torch
from lrmp_traced import Trained
from test_operators import CLASSES, DIM, ExampleCode, _flat
from test_zoo import remote_equals_local
from torch import nn
from torch.distributed.pipelining import SplitPoint, pipe_split

from lightning_remote_mp import RemoteModelParallelStrategy

BATCH = 8  # the batch the data loaders give
C, H, W = 2, 3, 4  # test_unflatten.py's images (16 channels of 256 x 256 there)


def _raw(*shape: int) -> nn.Parameter:
    """A raw parameter as torch's models make them (``torch.randn``), scaled so that a few products of
    them keep the logits small."""
    return nn.Parameter(torch.randn(*shape) * 0.3)


# model_registry.py


class ExampleCodeWithSplits(nn.Module):
    """``ExampleCode`` of model_registry.py as it is now: raw parameters multiplied in plain code, a
    buffer that crosses the first cut, and ``splits - 1`` ``pipe_split()`` markers, each before one
    more Linear."""

    def __init__(self, d: int = DIM, splits: int = 2) -> None:
        super().__init__()
        assert splits <= 8
        self.splits = splits
        self.mm_param0, self.mm_param1 = _raw(d, d), _raw(d, d)
        self.cval = nn.Buffer(torch.randn(d))
        self.lin0 = nn.Linear(d, d)
        self.lin1, self.lin2, self.lin3, self.lin4, self.lin5, self.lin6 = (nn.Linear(d, d) for _ in range(6))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = torch.relu(torch.mm(x, self.mm_param0))
        a_constant = self.cval.clone()  # no gradient, across the cut
        x = self.lin0(x)
        pipe_split()
        x = torch.relu(x) + a_constant
        x = torch.mm(x, self.mm_param1)
        for k, lin in enumerate([self.lin1, self.lin2, self.lin3, self.lin4, self.lin5, self.lin6], start=3):
            if self.splits >= k:
                pipe_split()
                x = torch.relu(lin(x))
        return x


class ModelWithKwargs(nn.Module):
    """``ModelWithKwargs`` of model_registry.py: ``y`` is a keyword argument with a default of the
    batch's shape, added after the first product; ``splits - 1`` ``pipe_split()`` markers."""

    def __init__(self, d: int = DIM, splits: int = 2) -> None:
        super().__init__()
        assert splits <= 8
        self.splits = splits
        self.mm_param0, self.mm_param1 = _raw(d, d), _raw(d, d)
        self.lin0, self.lin1 = nn.Linear(d, d), nn.Linear(d, d)
        self.lin2, self.lin3, self.lin4, self.lin5, self.lin6, self.lin7 = (nn.Linear(d, d) for _ in range(6))

    def forward(self, x: torch.Tensor, y: torch.Tensor = torch.zeros(BATCH, DIM)) -> torch.Tensor:  # noqa: B008
        x = torch.mm(x, self.mm_param0) + y
        x = torch.relu(self.lin0(x))
        pipe_split()
        x = torch.relu(self.lin1(torch.mm(x, self.mm_param1)))
        for k, lin in enumerate([self.lin2, self.lin3, self.lin4, self.lin5, self.lin6, self.lin7], start=3):
            if self.splits >= k:
                pipe_split()
                x = torch.relu(lin(x))
        return x


class ModelWithParamAlias(nn.Module):
    """``ModelWithParamAlias`` of model_registry.py (test_pipe.py splits it too): one parameter under
    two names and one Linear under two names, each used on both sides of a ``pipe_split()``."""

    def __init__(self, d: int = DIM) -> None:
        super().__init__()
        self.mm_param1 = self.mm_param0 = _raw(d, d)
        self.lin1 = self.lin0 = nn.Linear(d, d)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = torch.mm(x, self.mm_param0) + y
        x = torch.relu(self.lin0(x))
        pipe_split()
        x = torch.mm(x, self.mm_param1)
        return torch.relu(self.lin1(x))


class MLPModule(nn.Module):
    """``MLPModule`` of model_registry.py (test_transformer.py has its own copy): Linear, ReLU, Linear."""

    def __init__(self, d: int = DIM) -> None:
        super().__init__()
        self.net1, self.relu, self.net2 = nn.Linear(d, d), nn.ReLU(), nn.Linear(d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net2(self.relu(self.net1(x)))


class MLPKWargModule(MLPModule):
    """``MLPKWargModule`` of model_registry.py: an ``MLPModule`` whose forward takes a tensor keyword
    argument it does not use."""

    def __init__(self, d: int = DIM, layer_num: int = 0) -> None:
        super().__init__(d)
        self.layer_num = layer_num

    def forward(self, x: torch.Tensor, unused_kwarg: torch.Tensor = torch.zeros(1)) -> torch.Tensor:  # noqa: B008
        return super().forward(x)


def _split_spec(n_layers: int) -> dict[str, SplitPoint]:
    """What model_registry.py's multi-layer models set: a stage begins at every layer but the first."""
    return {f"layers.{i}": SplitPoint.BEGINNING for i in range(1, n_layers)}


class MultiMLP(nn.Module):
    """``MultiMLP`` of model_registry.py: a ``ModuleList`` of ``MLPModule``s and a ``split_spec``."""

    def __init__(self, d: int = DIM, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MLPModule(d) for _ in range(n_layers)])
        self.split_spec = _split_spec(n_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


class MultiMLPKwargs(nn.Module):
    """``MultiMLPKwargs`` of model_registry.py: ``MLPKWargModule`` layers, a tensor keyword argument
    that nothing uses, and a ``split_spec``."""

    def __init__(self, d: int = DIM, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MLPKWargModule(d, i) for i in range(n_layers)])
        self.split_spec = _split_spec(n_layers)

    def forward(self, x: torch.Tensor, unused_kwarg: torch.Tensor = torch.zeros(1)) -> torch.Tensor:  # noqa: B008
        for layer in self.layers:
            x = layer(x)
        return x


class TwoInputOutputOp(torch.autograd.Function):
    """model_registry.py's ``TwoInputOutputOp``: returns its two inputs, passes both gradients back."""

    @staticmethod
    def forward(ctx, a: torch.Tensor, weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return a, weight

    @staticmethod
    def backward(ctx, grad_a: torch.Tensor, grad_weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return grad_a, grad_weight


class MultiInterMediateModel(nn.Module):
    """``MultiInterMediateModel`` of model_registry.py: an input split in two, an autograd Function
    with two outputs (one of them the weight), their product times the other half."""

    def __init__(self, weight_shape: tuple[int, int] = (DIM // 2, DIM // 2)) -> None:
        super().__init__()
        self.shape = list(weight_shape)
        self.w = _raw(*weight_shape)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        a, b = torch.split(x, self.shape, dim=1)
        a, w = TwoInputOutputOp.apply(a, self.w)
        return torch.matmul(a, w) * b


class CustomLinearDxDw(torch.autograd.Function):
    """model_registry.py's ``CustomLinearDxDw``: a linear layer whose backward is written by hand."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        return x.mm(weight.t()) + bias

    @staticmethod
    def backward(ctx, grad_output: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        x, weight = ctx.saved_tensors
        return grad_output.mm(weight), grad_output.t().mm(x), grad_output.sum(0)


class MLPModuleWithDw(nn.Module):
    """``MLPModuleWithDw`` of model_registry.py, on its default path (``CustomLinearDxDw``, the hidden
    activation kept on the module); its manual-``compute_dW`` mode is a torch schedule's tool, not a
    model's, and is left out."""

    def __init__(self, d: int = DIM) -> None:
        super().__init__()
        self.fc1_weight, self.fc1_bias = nn.Parameter(torch.empty(d, d)), nn.Parameter(torch.empty(d))
        self.fc2_weight, self.fc2_bias = nn.Parameter(torch.empty(d, d)), nn.Parameter(torch.empty(d))
        for p in self.parameters():
            nn.init.uniform_(p, -0.3, 0.3)  # ±0.001 there: too small to learn from in a few steps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.hidden = torch.relu(CustomLinearDxDw.apply(x, self.fc1_weight, self.fc1_bias))
        return CustomLinearDxDw.apply(self.hidden, self.fc2_weight, self.fc2_bias)


class MultiMLPWithDw(nn.Module):
    """``MultiMLPWithDw`` of model_registry.py: ``MLPModuleWithDw`` layers and a ``split_spec``."""

    def __init__(self, d: int = DIM, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList([MLPModuleWithDw(d) for _ in range(n_layers)])
        self.split_spec = _split_spec(n_layers)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


# test_unflatten.py


class UnflattenBlock(nn.Module):
    """``Block`` of test_unflatten.py: a convolution, a Linear over the last dimension, a
    ``pipe_split()``, the ``constant`` keyword argument added in place, a Linear and a ReLU."""

    def __init__(self) -> None:
        super().__init__()
        self.conv = nn.Conv2d(C, C, kernel_size=3, padding=1)
        self.lin0, self.relu, self.lin1 = nn.Linear(W, W), nn.ReLU(), nn.Linear(W, W)

    def forward(self, x: torch.Tensor, constant: torch.Tensor | None = None) -> torch.Tensor:
        x = self.lin0(self.conv(x))
        pipe_split()
        x.add_(constant)
        return self.relu(self.lin1(x))


class UnflattenM(nn.Module):
    """``M`` of test_unflatten.py: two ``Block``s, a ``pipe_split()`` between them (torch cuts it in 4)."""

    def __init__(self) -> None:
        super().__init__()
        self.block0, self.block1 = UnflattenBlock(), UnflattenBlock()

    def forward(self, x: torch.Tensor, constant: torch.Tensor | None = None) -> torch.Tensor:
        x = self.block0(x, constant=constant)
        pipe_split()
        return self.block1(x, constant=constant)


# test_transformer.py


class TransformerLike(nn.Module):
    """``TransformerLike`` of test_transformer.py: eight ``MLPModule`` layers of width 16 in a
    ``Sequential``; torch cuts it where a ``split_spec`` says (at ``layers.4`` for 2 stages)."""

    def __init__(self, d: int = 16, n_layers: int = 8) -> None:
        super().__init__()
        self.layers = nn.Sequential(*[MLPModule(d) for _ in range(n_layers)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.layers(x)


# test_pipe.py


class PipeExampleCode(nn.Module):
    """``ExampleCode`` of test_pipe.py: one parameter used on two stages, a skip connection over a cut,
    a second input ``y``, three ``pipe_split()`` markers (4 stages there)."""

    def __init__(self, d: int = DIM) -> None:
        super().__init__()
        self.mm_param1, self.mm_param2 = _raw(d, d), _raw(d, d)
        self.lin1, self.lin2 = nn.Linear(d, d), nn.Linear(d, d)

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = torch.mm(x, self.mm_param1)  # the parameter used twice
        skip_connection = x
        x = torch.relu(x + y)
        pipe_split()
        x = self.lin1(torch.mm(x, self.mm_param1))
        pipe_split()
        x = torch.relu(x) + skip_connection
        x = torch.mm(x, self.mm_param2)
        pipe_split()
        return torch.relu(self.lin2(x))


class PipeMultiMLP(nn.Module):
    """``MultiMLP`` of test_pipe.py: four ``MLPModule``s with a ``pipe_split()`` between each two, and
    a second input subtracted from the output."""

    def __init__(self, d: int = DIM) -> None:
        super().__init__()
        self.mlp0, self.mlp1, self.mlp2, self.mlp3 = (MLPModule(d) for _ in range(4))

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        x = self.mlp0(x)
        pipe_split()
        x = self.mlp1(x)
        pipe_split()
        x = self.mlp2(x)
        pipe_split()
        return self.mlp3(x) - y


# The LightningModule and the data


class Headed(Trained):
    """``Trained`` over a torch model left as torch wrote it: a Linear head, on the driver, turns the
    features it returns into class logits. ``kwarg`` names a keyword argument the model is called
    with: the batch's second tensor (batches of input, ``kwarg``, target), or ``fixed`` where given."""

    def __init__(self, model: nn.Module, features: int = DIM, kwarg: str | None = None, fixed=None) -> None:
        super().__init__(model)
        self.head = nn.Linear(features, CLASSES)
        self.kwarg, self.fixed = kwarg, fixed

    def _loss(self, batch) -> torch.Tensor:
        x, *extra, target = batch
        kwargs = {self.kwarg: extra[0] if extra else self.fixed} if self.kwarg else {}
        logits = self.head(self.model(x, **kwargs).flatten(1))
        return nn.functional.cross_entropy(logits, target)


def _pairs(n: int = 24, batch: int = BATCH, seed: int = 0) -> torch.utils.data.DataLoader:
    """Batches of two inputs of DIM features (``x`` and the keyword argument ``y``) and a class."""
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(n, DIM, generator=g), torch.randn(n, DIM, generator=g)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, y, (x[:, 0] + y[:, 1] > 0).long()), batch_size=batch
    )


def _wide(n: int = 24, batch: int = BATCH, seed: int = 0) -> torch.utils.data.DataLoader:
    """``_flat`` with TransformerLike's 16 features."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, 16, generator=g)
    return torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, (x[:, 0] > 0).long()), batch_size=batch)


def _images(n: int = 24, batch: int = BATCH, seed: int = 0) -> torch.utils.data.DataLoader:
    """test_unflatten.py's inputs, small: C channels of H x W."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, C, H, W, generator=g)
    return torch.utils.data.DataLoader(
        torch.utils.data.TensorDataset(x, (x[:, 0].mean((1, 2)) > 0).long()), batch_size=batch
    )


def _cuts(spec: dict[str, SplitPoint]) -> dict[str, list[str]]:
    """A torch ``split_spec`` (every point at a stage's beginning) as lrmp's ``balance``."""
    assert set(spec.values()) == {SplitPoint.BEGINNING}
    return {"model": list(spec)}


# (make the LightningModule, given the number of stages; the data; the balance, given the model)
MODELS = {
    # model_registry.py
    "ExampleCode": (lambda stages: Trained(ExampleCode()), _flat, None),  # its own head: CLASSES logits
    "ExampleCode(splits)": (lambda stages: Headed(ExampleCodeWithSplits(splits=stages)), _flat, None),
    "ModelWithKwargs": (lambda stages: Headed(ModelWithKwargs(splits=stages), kwarg="y"), _pairs, None),
    "ModelWithParamAlias": (lambda stages: Headed(ModelWithParamAlias(), kwarg="y"), _pairs, None),
    "MLPModule": (lambda stages: Headed(MLPModule()), _flat, None),
    "MLPKWargModule": (
        lambda stages: Headed(MLPKWargModule(), kwarg="unused_kwarg", fixed=torch.zeros(1)),
        _flat,
        None,
    ),
    "MultiMLP": (lambda stages: Headed(MultiMLP(n_layers=stages)), _flat, "split_spec"),
    "MultiMLPKwargs": (
        lambda stages: Headed(MultiMLPKwargs(n_layers=stages), kwarg="unused_kwarg", fixed=torch.zeros(1)),
        _flat,
        "split_spec",
    ),
    "MultiInterMediateModel": (lambda stages: Headed(MultiInterMediateModel(), DIM // 2), _flat, None),
    "MultiMLPWithDw": (lambda stages: Headed(MultiMLPWithDw(n_layers=stages)), _flat, "split_spec"),
    # test_unflatten.py
    "M (test_unflatten)": (
        lambda stages: Headed(UnflattenM(), C * H * W, kwarg="constant", fixed=torch.ones(1, C, H, W)),
        _images,
        None,
    ),
    # test_transformer.py
    "TransformerLike": (lambda stages: Headed(TransformerLike(), 16), _wide, "layers"),
    # test_pipe.py
    "ExampleCode (test_pipe)": (lambda stages: Headed(PipeExampleCode(), kwarg="y"), _pairs, None),
    "MultiMLP (test_pipe)": (lambda stages: Headed(PipeMultiMLP(), kwarg="y"), _pairs, None),
}

# The most stages a model's units allow, where fewer than 3 (MultiInterMediateModel is plain code
# without a marker: one unit). The others train on 2 and on 3 stages.
FEW_UNITS = {"ExampleCode": 2, "ModelWithParamAlias": 2, "MultiInterMediateModel": 1}

CASES = [
    (name, stages, microbatches)
    for name in MODELS
    for stages in ([FEW_UNITS[name]] if name in FEW_UNITS else [2, 3])
    for microbatches in [1, 4]
]


def _balance(module: Trained, how: str | None, stages: int) -> dict[str, list[str]] | None:
    if how == "split_spec":
        return _cuts(module.model.split_spec)
    if how == "layers":  # test_transformer.py's split_spec, for any number of stages
        n = len(module.model.layers)
        return _cuts({f"layers.{i * n // stages}": SplitPoint.BEGINNING for i in range(1, stages)})
    return None


# MLPModuleWithDw keeps its hidden activation on the module, as torch wrote it; export warns about it.
@pytest.mark.filterwarnings("ignore:The tensor attributes .* were assigned during export")
@pytest.mark.parametrize(
    ("name", "stages", "microbatches"), CASES, ids=[f"{name}-{stages} stages-m{m}" for name, stages, m in CASES]
)
def test_torch_pipelining_model_trains_through_lrmp_as_locally(twin, pool, name, stages, microbatches):
    make, data, how = MODELS[name]
    balance = _balance(make(stages), how, stages)
    strategy = RemoteModelParallelStrategy(
        hosts=pool[:stages], microbatches=microbatches, split=["model"], balance=balance
    )
    remote_equals_local(lambda: make(stages), data, twin, strategy)
