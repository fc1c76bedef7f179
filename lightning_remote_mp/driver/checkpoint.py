"""Sharded checkpoints: every worker writes its own stage, the driver writes only Lightning's state.

A sharded checkpoint is a directory (torchtitan's and Lightning's ``FSDPStrategy(state_dict_type=
"sharded")`` layout, in safetensors):

```text
epoch=0-step=100.ckpt/
  lrmp-checkpoint.json          the manifest: every file, which worker wrote it, every tensor's file
  lightning.ckpt                Lightning's own state (loops, callbacks, schedulers, the driver's layers)
  model-stage0.safetensors      stage 0's weights and its optimizer state, written by its worker
  model-stage1.safetensors      ...
```

Tensors are keyed by the LightningModule's ``state_dict`` keys (``model.model.layers.3.mlp.up_proj.weight``)
and optimizer state by ``optimizer.<index>.<key>.<state name>``, so a checkpoint loads onto any
layout: other workers, another ``balance``, another number of stages. Each worker reads only the
tensors of the stage it is given (`lightning_remote_mp.model.weights`).

**Complete or absent.** Everything is written into a hidden directory beside the target, and only
when every worker has written its file (each through a temporary name) and the manifest is in
place does the directory take the target's name; a checkpoint being replaced (``last.ckpt``) is
renamed aside first and removed after. A worker that fails or dies during a save leaves the
previous checkpoint as it was and raises.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
import shutil
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from lightning_remote_mp._version import __version__
from lightning_remote_mp.driver.pipeline import confirm_outstanding
from lightning_remote_mp.driver.placement import WeightSources, frozen_base, stage_weights, stream_files
from lightning_remote_mp.driver.progress import shown
from lightning_remote_mp.errors import WeightsError
from lightning_remote_mp.model.convert import ADAPTER_CONFIG, CONFIG
from lightning_remote_mp.model.meta import on_meta
from lightning_remote_mp.model.weights import PARTIAL, SHARDED_MANIFEST, TensorFiles
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.state import ReadOptim, Save, Saved
from lightning_remote_mp.wire.transport import Connection, request_all

log = logging.getLogger(__name__)

#: Lightning's own part of a sharded checkpoint, written by the strategy's ``checkpoint_io``.
LIGHTNING_STATE = "lightning.ckpt"
FORMAT = "lrmp-sharded"


def is_sharded(path: str | Path) -> bool:
    """Whether ``path`` is a sharded checkpoint directory."""
    return (Path(path) / SHARDED_MANIFEST).is_file()


def _file_name(key: str, stage: int) -> str:
    safe = re.sub(r"[^A-Za-z0-9_.-]", "_", key) or "root"
    return f"{safe}-stage{stage}.safetensors"


def _prefix(key: str) -> str:
    return "" if key == "<root>" else key + "."


def save(
    session: Any,
    lightning_module: torch.nn.Module,
    checkpoint: dict[str, Any],
    path: str | Path,
    write_lightning_state: Callable[[dict[str, Any], str], None],
    background: bool = False,
) -> PendingSave:
    """Start a sharded checkpoint of ``session``'s placed modules at ``path`` (see the module
    docstring); ``checkpoint`` is Lightning's dict, without the workers' tensors. The workers have
    written their files when this returns, or, with ``background``, copied their tensors to host
    memory and write them while training goes on; `PendingSave.finish` names the directory."""
    started = time.monotonic()
    if "://" in str(path):
        raise WeightsError(f"sharded checkpoints go to a file system path every worker sees, not {str(path)!r}")
    target = Path(path).absolute()  # the workers resolve it, from their own working directories
    target.parent.mkdir(parents=True, exist_ok=True)
    if target.parent not in _CLEANED:  # what a run that crashed left there, once per directory and process
        _CLEANED.add(target.parent)
        clean_leftovers(target.parent)
    partial = target.parent / f".{target.name}{PARTIAL}{uuid.uuid4().hex[:8]}"
    partial.mkdir()
    try:
        confirm_outstanding(session.conns)  # the last backward, which the driver did not wait for
        manifest, conns = _write_shards(
            session, lightning_module, partial, "optimizer_states" in checkpoint, background
        )
        write_lightning_state(checkpoint, str(partial / LIGHTNING_STATE))
        for key, pl in session.placements.items():
            _write_configs(pl.module.state_owner, key, partial)
    except BaseException:
        _remove(partial)
        raise
    return PendingSave(session, partial, target, manifest, conns, started, time.monotonic() - started)


@dataclasses.dataclass
class PendingSave:
    """A sharded checkpoint whose workers may still be writing their files: `finish` gives its
    directory the target's name, with the manifest, once every file is written."""

    session: Any
    partial: Path
    target: Path
    manifest: dict[str, Any]
    conns: list[Connection]
    started: float
    blocked: float  # seconds training waited for the save

    def finish(self, wait: bool = True) -> bool:
        """Whether the checkpoint is in place now; ``wait`` waits for the workers' files. A worker
        that fails or is lost raises, and the previous checkpoint stays."""
        files = self.manifest["files"]
        requests = [(conn, protocol.SAVED, Saved(f["file"], wait).body()) for conn, f in zip(self.conns, files)]
        try:
            heartbeat = self.session.heartbeat if wait else None  # no heartbeat: `shown` shows nothing
            with shown(heartbeat, self.conns, f"writing checkpoint {self.target.name}"):
                replies = request_all(requests, what="sharded checkpoint save", bounded=not wait)
            if not all(isinstance(r, dict) and r.get("done") for r in replies):
                return False
            for entry, reply in zip(files, replies):
                entry["bytes"] = int(reply.get("bytes", 0))
            (self.partial / SHARDED_MANIFEST).write_text(json.dumps(self.manifest, indent=1, sort_keys=True))
            _swap_in(self.partial, self.target)
        except BaseException:
            self.discard()
            raise
        log.info(
            "sharded checkpoint %s: %d files, %.1f MB written by the workers in %.1f s; training waited %.1f s",
            self.target,
            len(files),
            sum(f["bytes"] for f in files) / 1e6,
            time.monotonic() - self.started,
            self.blocked,
        )
        return True

    def discard(self) -> None:
        _remove(self.partial)


def _write_shards(
    session: Any, lightning_module: torch.nn.Module, directory: Path, with_optimizers: bool, background: bool
) -> tuple[dict[str, Any], list[Connection]]:
    names = {id(p): n for n, p in lightning_module.named_parameters()}
    saved: dict[str, str] = {}  # state-dict key -> file
    aliases: dict[str, str] = {}  # another key of a tied weight -> the key it is saved under
    optim_files: dict[str, str] = {}  # state-dict key -> the file holding its optimizer state
    requests: list[tuple[Connection, str, Any]] = []
    files: list[dict[str, Any]] = []
    positions: dict[str, dict[str, int]] = {}
    bases: dict[str, Any] = {}
    for pl in session.placements.values():
        prefix = _prefix(pl.key)
        keys = pl.module.state_keys()
        base = frozen_base(pl.module)  # a QLoRA base: left to its files, or to the model
        if base:
            left = sorted(prefix + name for local in base for name in keys.get(local, []))
            bases[pl.key] = {"pretrained": pl.base, "tensors": left}
        for rs in pl.remote.replicas[0]:
            file = _file_name(pl.key, rs.stage.index)
            tensors: dict[str, str] = {}
            for i in rs.stage.layer_indices:
                for name in pl.module.layers[i].state_dict(keep_vars=True):
                    local = f"{i}.{name}"
                    full = prefix + keys[local][0] if local in keys else None
                    if full is not None and full not in saved and local not in base:
                        saved[full] = file
                        tensors[local] = full
                        aliases.update({prefix + other: full for other in keys[local][1:]})
            optim: dict[int, dict[str, str]] = {}
            for mirror in session.mirrors if with_optimizers else ():
                for pid, holders in mirror.remote.items():
                    first = holders[0]
                    if first.conns[0] is rs.conn and first.name.startswith(pl.key + "/") and pid in names:
                        optim.setdefault(mirror.index, {})[first.name] = names[pid]
                        optim_files[names[pid]] = file
            body = Save(str(directory), file, {pl.key: tensors}, optim, background).body()
            requests.append((rs.conn, protocol.SAVE, body))
            files.append({"file": file, "key": pl.key, "stage": rs.stage.index, "worker": rs.conn.address})
    for mirror in session.mirrors:
        positions[str(mirror.index)] = {names[pid]: k for pid, k in mirror.positions_by_id().items() if pid in names}
    name = directory.name[1:].partition(PARTIAL)[0].rstrip(".")  # .NAME.lrmp-partial-...: NAME
    what = f"copying checkpoint {name} to host memory" if background else f"writing checkpoint {name}"
    with shown(session.heartbeat, [conn for conn, _, _ in requests], what):
        request_all(requests, what="sharded checkpoint save", bounded=False)
    manifest = {
        "format": FORMAT,
        "version": 1,
        "lrmp": __version__,
        "wire_protocol": protocol.PROTOCOL_VERSION,
        "lightning_state": LIGHTNING_STATE,
        "files": files,
        "tensors": saved,
        "aliases": aliases,
        "optimizers": positions,
        "optimizer_files": optim_files,
        "bases": bases,
    }
    return manifest, [conn for conn, _, _ in requests]


def _write_configs(owner: torch.nn.Module, key: str, directory: Path) -> None:
    """A HuggingFace model's config and a peft model's adapter config beside the shards, for
    `lightning_remote_mp.model.convert.export_pretrained`."""
    config: Any = getattr(owner, "config", None)
    if hasattr(config, "to_json_file"):
        config.to_json_file(str(directory / CONFIG.format(key=key)))
    adapter = (getattr(owner, "peft_config", None) or {}).get("default")
    if adapter is not None and hasattr(adapter, "to_dict"):
        values = {k: sorted(v) if isinstance(v, set) else v for k, v in adapter.to_dict().items()}
        (directory / ADAPTER_CONFIG.format(key=key)).write_text(
            json.dumps(values, indent=2, sort_keys=True, default=str)
        )


#: The directories whose leftovers this process has cleaned (`clean_leftovers`).
_CLEANED: set[Path] = set()
#: What lrmp writes into a checkpoint's hidden directory: a leftover holding anything else is not ours.
_OURS = (".safetensors", ".partial", ".json", ".ckpt")
_OLD = ".lrmp-old-"


def _is_leftover(path: Path) -> bool:
    """A hidden directory lrmp made beside a checkpoint (`PARTIAL` while written, `_OLD` while
    replaced) holding only the files lrmp writes there."""
    name = path.name
    if not (name.startswith(".") and (PARTIAL in name or _OLD in name)) or path.is_symlink() or not path.is_dir():
        return False
    return all(f.is_file() and not f.is_symlink() and f.name.endswith(_OURS) for f in path.iterdir())


def clean_leftovers(directory: Path) -> list[Path]:
    """Remove the checkpoints half-written or half-replaced that a run which crashed (or whose
    worker was killed mid-save) left in ``directory``; never anything else (a directory holding a
    file lrmp does not write is left, with a warning). Returns what was removed."""
    removed = []
    for path in sorted(directory.iterdir()) if directory.is_dir() else ():
        if _is_leftover(path):
            _remove(path)
            removed.append(path)
        elif path.name.startswith(".") and (PARTIAL in path.name or _OLD in path.name):
            log.warning("%s looks like an unfinished lrmp checkpoint but holds other files: left as it is", path)
    if removed:
        log.info("removed %d unfinished checkpoint(s) an earlier run left in %s", len(removed), directory)
    return removed


def _remove(path: Path, attempts: int = 20) -> None:
    """``rmtree`` that outlasts a worker still writing its file into the directory (its last
    write can land between the listing and the removal): tried again for up to a second."""
    for _ in range(attempts):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.05)
    log.warning("could not remove %s (a worker still writing there?); the next run in this directory will", path)


def _swap_in(partial: Path, target: Path) -> None:
    """Give ``partial`` the name ``target``; a previous checkpoint there is moved aside, then removed."""
    old = None
    if target.is_dir() and not is_sharded(target):
        raise WeightsError(
            f"{target} is a directory but no lrmp checkpoint: a checkpoint never replaces it; choose another path"
        )
    if target.exists() or target.is_symlink():
        old = target.parent / f".{target.name}{_OLD}{uuid.uuid4().hex[:8]}"
        target.rename(old)
    partial.rename(target)
    if old is not None:
        if old.is_dir() and not old.is_symlink():
            _remove(old)
        else:
            old.unlink()


def check_savable(modules: dict[str, torch.nn.Module], session: Any) -> None:
    """Refuse a checkpoint that would hold no weights of a split module on the meta device that is
    not placed yet (a traced module is placed at its first call)."""
    placed = session.placements if session is not None else {}
    for key, module in modules.items():
        if on_meta(module) and key not in placed:
            raise WeightsError(
                f"a checkpoint now would hold no weights of {key!r}: it is on the meta device and not placed on "
                "the workers yet (a traced module is placed at its first call). Save after the first step; the "
                "Tuner (lr_find, scale_batch_size), which saves before it, needs the model built with weights "
                "(from_pretrained) instead"
            )


class ShardedCheckpoint:
    """A sharded checkpoint directory being loaded: its manifest, and its tensors by name."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        try:
            self.manifest = json.loads((self.path / SHARDED_MANIFEST).read_text())
        except (OSError, ValueError) as err:
            raise WeightsError(f"{self.path}: unreadable checkpoint manifest {SHARDED_MANIFEST}: {err}") from None
        if not isinstance(self.manifest, dict) or self.manifest.get("format") != FORMAT:
            raise WeightsError(f"{self.path / SHARDED_MANIFEST} is not an lrmp sharded checkpoint manifest")
        files = [f["file"] for f in self.manifest.get("files", [])]
        missing = [f for f in files if not (self.path / f).is_file()]
        if missing:
            raise WeightsError(
                f"sharded checkpoint {self.path} misses {missing[:3]} (written by "
                f"{[f['worker'] for f in self.manifest['files'] if f['file'] in missing][:3]}): copy them from those "
                "workers' disks into the directory, or use a shared path"
            )
        every = TensorFiles.of(self.path, files)
        saved = self.manifest.get("tensors", {})
        #: The weights alone (the files also hold optimizer state, as ``optimizer.<index>.<key>.<name>``).
        self.weights = TensorFiles(every.root, {k: v for k, v in every.tensors.items() if k in saved})
        self.loaded_optimizers: set[str] = set()

    def load_into_placed(self, session: Any) -> None:
        """Send the weights of the modules placed already (the Tuner restoring its checkpoint
        mid-run) to every worker holding them, from the files through this driver, a window at a
        time; a resume with ``fit(ckpt_path=...)`` has the workers read them as they are set up."""
        for key, pl in session.placements.items():
            sources = WeightSources(checkpoint=self.weights_for(key), pretrained_first=False)
            for replica in pl.remote.replicas:
                for rs in replica:
                    what = f"sharded checkpoint {self.path}, {key!r} stage {rs.stage.index}"
                    _, files = stage_weights(pl.module, rs.stage, sources, what)
                    stream_files(rs.conn, key, files)

    def holds(self, key: str) -> bool:
        """Whether the checkpoint's files hold the weight ``key`` (or the tied weight it names), or
        leave it, a frozen weight of a QLoRA base, to the base's files (`base_for`)."""
        if any(key in base.get("tensors", ()) for base in (self.manifest.get("bases") or {}).values()):
            return True
        return self.weights.find(self.manifest.get("aliases", {}).get(key, key)) is not None

    def base_for(self, key: str) -> str | None:
        """The pretrained files the frozen 4-bit base of the module placed as ``key`` was read from
        (a QLoRA checkpoint holds no base: `lightning_remote_mp.driver.placement.frozen_base`)."""
        return (self.manifest.get("bases") or {}).get(key, {}).get("pretrained")

    def lightning_state_path(self) -> Path:
        return self.path / self.manifest.get("lightning_state", LIGHTNING_STATE)

    def weights_for(self, key: str) -> TensorFiles:
        """The checkpoint's tensors of the module placed as ``key``, named as in its state dict."""
        return self.weights.under(_prefix(key))

    def load_optimizers(self, session: Any, lightning_module: torch.nn.Module, key: str) -> None:
        """Send each worker of the module placed as ``key`` its parameters' optimizer state."""
        if key in self.loaded_optimizers or key not in session.placements:
            return
        names = {id(p): n for n, p in lightning_module.named_parameters()}
        requests = []
        for mirror in session.mirrors:
            per_conn: dict[int, tuple[Connection, dict[str, list[str]]]] = {}
            for pid, holders in mirror.remote.items():
                full = names.get(pid)
                if full is None:
                    continue
                saved = self.manifest.get("optimizer_files", {}).get(full)
                if saved is None:
                    continue  # never stepped, or saved without its optimizer state
                path = str(self.path / saved)
                for h in holders:
                    if not h.name.startswith(key + "/"):
                        continue
                    for conn in h.conns:
                        per_conn.setdefault(id(conn), (conn, {}))[1][h.name] = [path, full]
            for conn, params in per_conn.values():
                requests.append((conn, protocol.READ_OPTIM, ReadOptim(mirror.index, params).body()))
        if requests:
            request_all(requests, what="optimizer state from a sharded checkpoint", bounded=False)
        self.loaded_optimizers.add(key)


class Saves:
    """A strategy's sharded checkpoint being written in the background (at most one, as with
    Lightning's ``AsyncCheckpointIO``), and the checkpoint removals that wait for it: a
    ``ModelCheckpoint`` removes the checkpoint a new one replaces only once the new one is whole."""

    def __init__(self) -> None:
        self.pending: PendingSave | None = None
        self.removals: list[Callable[[], None]] = []
        self.whole: Callable[[], None] | None = None  # told when the pending save is whole

    def start(self, pending: PendingSave, background: bool, whole: Callable[[], None] | None = None) -> None:
        """A save begun: the last one is finished first (at most one is written at a time);
        ``whole`` is called once its checkpoint is whole."""
        self.wait()
        if background:
            self.pending, self.whole = pending, whole
            return
        pending.finish()
        if whole is not None:
            whole()

    def poll(self) -> None:
        """Between steps: name the checkpoint if its files are written (one short request per worker)."""
        self._finish(wait=False)

    def wait(self) -> None:
        """Wait for the checkpoint being written (before another save, a load, the end of a run)."""
        self._finish(wait=True)

    def _finish(self, wait: bool) -> None:
        pending = self.pending
        if pending is None:
            return
        try:
            done = pending.finish(wait)
        except BaseException:
            self.pending = self.whole = None
            self.removals.clear()  # the checkpoints it was to replace are all that is left
            raise
        if done or wait:
            whole, self.pending, self.whole = self.whole, None, None
            if whole is not None:
                whole()
            self._done()

    def remove(self, remove: Callable[[], None]) -> None:
        if self.pending is None:
            remove()
        else:
            self.removals.append(remove)

    def _done(self) -> None:
        removals, self.removals = self.removals, []
        for remove in removals:
            remove()
