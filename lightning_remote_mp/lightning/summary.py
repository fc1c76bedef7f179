"""ModelSummary that says where each layer lives: on the driver, or on which stage and worker."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary

if TYPE_CHECKING:
    from lightning_remote_mp.driver.session import DriverSession


def _where(session: DriverSession | None) -> dict[str, str]:
    """Where the placed modules' layers live, by qualified name (replica 0's workers)."""
    where: dict[str, str] = {}
    if session is None:
        return where
    for key in session.placements:
        stages = session.placed_stages(key)[0]
        name = "" if key == "<root>" else key  # the strategy's key for a LightningModule that is one
        where[name] = f"stages 0-{len(stages) - 1}" if len(stages) > 1 else "stage 0"
        prefix = f"{name}." if name else ""
        where[f"{prefix}layers"] = where[name]
        for rs in stages:
            for i in rs.stage.layer_indices:
                where[f"{prefix}layers.{i}"] = f"stage {rs.stage.index} @ {rs.address}"
    return where


class _RemoteSummary(Summary):
    def __init__(self, model: Any, max_depth: int = 1, session: DriverSession | None = None) -> None:
        self._session = session
        super().__init__(model, max_depth=max_depth)

    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        arrays = super()._get_summary_data()
        names = dict(arrays)["Name"]
        where = _where(self._session)
        column = []
        for name in names:
            hit = next((w for prefix, w in where.items() if name == prefix or name.startswith(prefix + ".")), None)
            column.append(where.get(name) or hit or ("driver" if name else ""))
        arrays.append(("Where", column))
        return arrays


class RemoteModelSummary(ModelSummary):
    """Lightning's ModelSummary plus a ``Where`` column (the strategy swaps it in for the default one).

    Parameter counts of remote layers are real: the driver keeps a copy of their parameters.
    """

    def _summary(self, trainer: Any, pl_module: Any) -> Summary:
        session = getattr(trainer.strategy, "session", None)
        return _RemoteSummary(pl_module, max_depth=self._max_depth, session=session)
