"""ModelSummary that says where each layer lives: on the driver, or on which stage and worker."""

from __future__ import annotations

from typing import Any

from lightning.pytorch.callbacks import ModelSummary
from lightning.pytorch.utilities.model_summary import ModelSummary as Summary

from lightning_remote_mp.spec import SpecSequential


def _where(pl_module: Any) -> dict[str, str]:
    where: dict[str, str] = {}
    for name, module in pl_module.named_modules():
        remote = getattr(module, "_remote", None) if isinstance(module, SpecSequential) else None
        if remote is None:
            continue
        where[name] = f"stages 0-{len(remote.stages) - 1}" if len(remote.stages) > 1 else "stage 0"
        where[f"{name}.layers"] = where[name]
        for rs in remote.stages:
            for i in rs.stage.layer_indices:
                where[f"{name}.layers.{i}"] = f"stage {rs.stage.index} @ {rs.address}"
    return where


class _RemoteSummary(Summary):
    def _get_summary_data(self) -> list[tuple[str, list[str]]]:
        arrays = super()._get_summary_data()
        names = dict(arrays)["Name"]
        where = _where(self._model)
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
        return _RemoteSummary(pl_module, max_depth=self._max_depth)
