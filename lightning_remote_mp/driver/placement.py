"""A module placed on workers keeps its ``state_dict()`` and ``load_state_dict()`` truthful.

While a `SpecSequential` (or a traced module) lives on workers, the driver's copy of its weights
goes stale as they train. `Placement` hooks the module's state-dict methods: taking a state dict
first refreshes the local copy from the workers (for a module on the meta device, the workers'
tensors go straight into the state dict), and loading one sends what was loaded to the workers.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import logging
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from lightning_remote_mp.driver.pipeline import RemoteSpec
from lightning_remote_mp.errors import SpecError, WeightsError
from lightning_remote_mp.model import partition
from lightning_remote_mp.model.four_bit import PACKED, Format
from lightning_remote_mp.model.spec import SpecSequential
from lightning_remote_mp.model.weights import QUANT_STATE, QUANTIZE, FileTensor, TensorFiles, iter_tensors
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.state import GetState, LoadState
from lightning_remote_mp.wire.transport import Connection, broadcast, request_all

log = logging.getLogger(__name__)


def meta_stage_state(module: SpecSequential, stage: partition.Stage) -> dict[str, torch.Tensor] | None:
    """Weights loaded into a meta module before placement (a checkpoint), or None: the workers then
    initialise the stage from the module's seed."""
    pending = module.pending_state
    if not pending:
        return None
    mine = {k: v for k, v in pending.items() if int(k.partition(".")[0]) in stage.layer_indices}
    expected = {f"{i}.{n}" for i in stage.layer_indices for n in module.layers[i].state_dict()}
    if set(mine) != expected:
        raise SpecError(f"the state loaded into meta module misses {sorted(expected - set(mine))[:5]}")
    return mine


@dataclasses.dataclass
class WeightSources:
    """Where the tensors of a module being placed come from; the first that has a tensor wins:

    - ``loaded``: values loaded into the module while it had no storage for them (a full checkpoint
      into a module on the meta device), by ``state_dict`` key;
    - ``checkpoint``: a sharded checkpoint's files, being resumed from;
    - ``pretrained``: a pretrained model's files: for every tensor they hold when ``pretrained_first``
      (the module's first placement, nothing loaded since), otherwise only for the tensors on the
      meta device, whose copy here has no value (later runs send the driver's trained values);
    - the driver's own tensor.
    """

    loaded: Mapping[str, torch.Tensor] = dataclasses.field(default_factory=dict)
    checkpoint: TensorFiles | None = None
    pretrained: TensorFiles | None = None
    pretrained_first: bool = True

    @classmethod
    def of(
        cls,
        key: str,
        module: SpecSequential,
        *,
        checkpoint: TensorFiles | None,
        loaded: Mapping[str, torch.Tensor],
        pretrained: str | None,
        loaded_full: bool,
        base: str | None = None,
    ) -> WeightSources:
        """The sources of the module placed as ``key``: values a full checkpoint ``loaded`` while it
        had no storage, a sharded ``checkpoint`` being resumed, its ``pretrained`` files (for a
        HuggingFace model on the meta device, its own local ``name_or_path``), which count for every
        tensor at its first placement (`mark_placed`) unless a full checkpoint was loaded since
        (``loaded_full``), or else the ``base`` a QLoRA checkpoint names. Refused for a module whose
        trained weights stayed with an earlier run (`mark_trained_elsewhere`) when neither checkpoint
        brings them."""
        owner = module.state_owner
        if vars(owner).get(_TRAINED_ELSEWHERE) and checkpoint is None and not loaded:
            raise WeightsError(
                f"module {key!r} was trained by an earlier run whose workers and checkpoints hold its trained weights "
                "(they did not come back here: it is larger than gather_limit, or on the meta device); pass "
                "ckpt_path= with a checkpoint of that run"
            )
        path = pretrained
        if path is None and module.is_meta:
            # A HuggingFace model built on the meta device from a local directory's config.
            name = getattr(owner, "name_or_path", None)
            if isinstance(name, str) and name and Path(name).is_dir():
                path = name
        if path is None:
            path = base  # the files a QLoRA checkpoint's frozen base came from (`ShardedCheckpoint.base_for`)
        first = not vars(owner).get(_PLACED) and not loaded_full
        return cls(
            loaded=loaded,
            checkpoint=checkpoint,
            pretrained=TensorFiles.of(path) if path is not None else None,
            pretrained_first=first,
        )

    def __bool__(self) -> bool:
        return bool(self.loaded) or self.checkpoint is not None or self.pretrained is not None

    def roots(self) -> str:
        roots = [f.root for f in (self.checkpoint, self.pretrained) if f is not None]
        return ", ".join(map(repr, roots)) or "no weights files (pretrained= names none)"


#: Marks a split module whose trained weights stayed with the workers and checkpoints of a run.
_TRAINED_ELSEWHERE = "_lrmp_trained_elsewhere"
#: Marks a module placed before: its values here are the trained ones, not the pretrained files'.
_PLACED = "_lrmp_placed"


def mark_placed(module: SpecSequential) -> None:
    """``module`` is placed: its values here are the trained ones from now on (`WeightSources.of`)."""
    vars(module.state_owner).pop(_TRAINED_ELSEWHERE, None)
    vars(module.state_owner)[_PLACED] = True


def mark_trained_elsewhere(owner: torch.nn.Module) -> None:
    """``owner``'s trained weights stayed with the workers and checkpoints of a run (`WeightSources.of`)."""
    vars(owner)[_TRAINED_ELSEWHERE] = True


def _find(files: TensorFiles | None, names: Sequence[str]) -> FileTensor | None:
    """Where ``files`` hold a tensor of one of ``names`` (a tied weight has several)."""
    if files is None:
        return None
    return next((found for found in map(files.find, names) if found is not None), None)


def frozen_base(module: SpecSequential) -> set[str]:
    """The tensors of a module with a 4-bit base (QLoRA) that training never changes, by ``"<layer
    index>.<name>"``: every part of its 4-bit weights and every parameter that takes no gradient. A
    sharded checkpoint leaves them to the files they came from (`Placement.base`) or to the model."""
    if not module.quantized:
        return set()
    frozen = {
        f"{i}.{n}" for i, layer in enumerate(module.layers) for n, p in layer.named_parameters() if not p.requires_grad
    }
    return frozen | set(module.quantized)


def _four_bit_source(files: TensorFiles | None, key: str, part: str, fmt: Format) -> list[Any] | None:
    """Where ``files`` hold part ``part`` of the 4-bit weight ``key`` (`Setup.files`' entry): as it
    is, from a pre-quantized model's files (the offset from bitsandbytes' JSON beside the weight), or
    as what quantizing the full-precision weight gives, which the worker computes as it reads it."""
    weight = _find(files, [key])
    if weight is None:
        return None
    if weight.shape == fmt.shape and weight.dtype.is_floating_point:
        return [weight.path, weight.name, {QUANTIZE: fmt.describe(), "part": part}]
    if part == PACKED:
        return [weight.path, weight.name]
    if part == "offset":
        blob = _find(files, [f"{key}.quant_state.bitsandbytes__{fmt.quant_type}"])
        return None if blob is None else [blob.path, blob.name, {QUANT_STATE: "offset"}]
    found = _find(files, [f"{key}.{part}"])
    return None if found is None else [found.path, found.name]


def stage_weights(
    module: SpecSequential, stage: partition.Stage, sources: WeightSources, what: str
) -> tuple[dict[str, torch.Tensor], dict[str, list[Any]]]:
    """A stage's tensors split by where its worker gets them (`WeightSources`): the files it reads
    by name, and what this driver sends (a LoRA adapter, a new head, trained values). A tensor on
    the meta device must be in the files. The parts of a 4-bit weight come from the files together
    (pre-quantized, or quantized by the worker as it reads the full-precision weight) or from here."""
    keys = module.state_keys()
    pending = module.pending_state  # a spec's: loaded while on meta, by "<layer index>.<name>"
    state: dict[str, torch.Tensor] = {}
    files: dict[str, list[Any]] = {}
    for i in stage.layer_indices:
        for name, t in module.layers[i].state_dict(keep_vars=True).items():
            local = f"{i}.{name}"
            names = keys.get(local, [])
            given = pending.get(local, next((sources.loaded[n] for n in names if n in sources.loaded), None))
            if given is not None:
                state[local] = given
                continue
            if local in module.quantized:
                entry = _four_bit_entry(module.quantized[local], t, sources, what)
                if entry is not None:
                    files[local] = entry
                else:
                    state[local] = t.detach()
                continue
            found = _find(sources.checkpoint, names)
            if found is None and (t.is_meta or sources.pretrained_first):
                found = _find(sources.pretrained, names)
            if found is not None and tuple(found.shape) != tuple(t.shape):
                resized = len(found.shape) == t.dim() and tuple(found.shape[1:]) == tuple(t.shape[1:])
                in_checkpoint = sources.checkpoint is not None and found.path.startswith(sources.checkpoint.root)
                if t.is_meta or not resized or in_checkpoint:
                    raise WeightsError(
                        f"{what}: tensor {found.name!r} in {found.path} has shape {found.shape}, but the model's "
                        f"{names[0]} has {tuple(t.shape)}: the files hold another model or configuration"
                    )
                log.info("%s: %s has other rows than in %s (resized): sent from here", what, names[0], found.path)
                found = None
            if found is not None:
                files[local] = [found.path, found.name]
            elif t.is_meta:
                raise WeightsError(
                    f"{what}: {names[0] if names else local} is on the meta device and not in {sources.roots()}; "
                    "give pretrained= the model's save_pretrained directory, or build that tensor with a value"
                )
            else:
                state[local] = t.detach()
    return state, files


def _four_bit_entry(
    quantized: tuple[str, str, Format], t: torch.Tensor, sources: WeightSources, what: str
) -> list[Any] | None:
    """The files' entry of a part of a 4-bit weight, or ``None``: this driver sends its own."""
    key, part, fmt = quantized
    if not (t.is_meta or sources.pretrained_first):
        return None
    entry = _four_bit_source(sources.pretrained, key, part, fmt)
    if entry is None and t.is_meta:
        raise WeightsError(
            f"{what}: the 4-bit weight {key} is on the meta device and {sources.roots()} hold neither it in full "
            f"precision (shape {fmt.shape}) nor its 4-bit {part or 'packed values'}; give pretrained= the model's "
            "save_pretrained directory"
        )
    return entry


#: The most bytes of weights this driver reads from its files and has on the way to a worker that
#: cannot see them (`send_unread`): the next window is read once the worker has the last.
STREAM_WINDOW = 64 * 2**20


def send_unread(conn: Connection, key: str, reply: Any, files: Mapping[str, Sequence[str]], what: str) -> None:
    """Send the worker of ``conn`` the tensors its SETUP ``reply`` says it could not read, because
    it does not see their files (not on its machine, no shared file system): read here from the
    memory-mapped files, `STREAM_WINDOW` bytes at a time, each window acknowledged before the next."""
    unread = [n for n in (reply.get("unread") or []) if n in files] if isinstance(reply, dict) else []
    if not unread:
        return
    paths = sorted({files[n][0] for n in unread})
    log.warning(
        "%s, %s: does not see %s%s; this driver sends its %d tensors from those files, %d MB at a time. Give the "
        "worker the files at the same path (a shared file system, or a copy) to load faster",
        what,
        conn.where(),
        paths[0],
        f" and {len(paths) - 1} other files" if len(paths) > 1 else "",
        len(unread),
        STREAM_WINDOW >> 20,
    )
    stream_files(conn, key, {n: files[n] for n in unread})


def stream_files(conn: Connection, key: str, files: Mapping[str, Sequence[str]]) -> None:
    """Send the worker of ``conn`` the tensors ``files`` names (its stage's name to a file and the
    tensor's name there) as its module ``key``'s state: read here from the memory-mapped files,
    `STREAM_WINDOW` bytes at a time, each window acknowledged before the next is read."""
    window: dict[str, torch.Tensor] = {}
    size = 0
    for i, (name, tensor) in enumerate(iter_tensors(files), 1):
        window[name], size = tensor, size + tensor.nbytes
        if size >= STREAM_WINDOW or i == len(files):  # the worker casts to its dtypes as it copies them in
            conn.recv(conn.send(protocol.LOAD_STATE, LoadState({key: window}).body()), bounded=False)
            window, size = {}, 0


def placed_bytes(placements: Iterable[Placement]) -> int:
    """The bytes of every weight and buffer of ``placements`` (one copy of each)."""
    seen: dict[int, int] = {}
    for pl in placements:
        for layer in pl.module.layers:
            for t in layer.state_dict(keep_vars=True).values():
                seen[id(t)] = t.numel() * t.element_size()
    return sum(seen.values())


@contextlib.contextmanager
def gathering(holders: Sequence[Any], gather: bool) -> Iterator[None]:
    """Set ``gather`` on placements and optimizer mirrors while inside (see `Placement.gather`)."""
    flags = [(x, x.gather) for x in holders]
    for x, _ in flags:
        x.gather = gather
    try:
        yield
    finally:
        for x, g in flags:
            x.gather = g


class Placement:
    """A placed SpecSequential (see the module docstring), by its key, module and pipeline front end."""

    def __init__(self, key: str, module: SpecSequential, remote: RemoteSpec) -> None:
        self.key = key
        self.module = module
        self.remote = remote
        #: Other call signatures of a traced module, placed on this one's stages and tensors (`DriverSession.place`).
        self.views: list[RemoteSpec] = []
        self.meta = module.is_meta
        #: The pretrained files its frozen weights were read from (``pretrained=``), if any.
        self.base: str | None = None
        #: Whether a ``state_dict()`` brings the workers' tensors here (a full checkpoint); while
        #: False (a sharded one, `lightning_remote_mp.driver.checkpoint`), it leaves them out.
        self.gather = True
        self._loaded: dict[str, torch.Tensor] = {}
        owner = module.state_owner  # whose state_dict keys hold the layers' tensors
        self.hooks = [
            owner.register_state_dict_pre_hook(self._before_state_dict),
            owner.register_state_dict_post_hook(functools.partial(Placement._after_state_dict, self)),
            owner._register_load_state_dict_pre_hook(self._before_load_state_dict, with_module=True),
            owner.register_load_state_dict_post_hook(self._after_load_state_dict),
        ]

    def _before_state_dict(self, module: Any, prefix: str, keep_vars: bool) -> None:
        if not self.meta and self.gather:
            self.pull()

    def _after_state_dict(self, module: Any, state_dict: dict[str, Any], prefix: str, local_metadata: Any) -> None:
        if not self.gather:
            for names in self.module.state_keys().values():
                for name in names:
                    state_dict.pop(prefix + name, None)
            return
        if self.meta:
            keys = self.module.state_keys()
            for local, t in self.fetch().items():
                for name in keys.get(local, ()):
                    state_dict[prefix + name] = t

    def _before_load_state_dict(self, module: Any, state_dict: Any, prefix: str, *args: Any) -> None:
        self._loaded = self.module.layer_state(state_dict, prefix)

    def _after_load_state_dict(self, module: Any, incompatible: Any) -> None:
        loaded, self._loaded = self._loaded, {}
        self.push(loaded)

    def _states(self, conns: list[Any]) -> list[dict[str, torch.Tensor]]:
        """The weights and buffers of the stages behind ``conns``, named ``"<layer index>.<name>"``."""
        replies = broadcast(conns, protocol.GET_STATE, GetState().body(), bounded=False)
        return [reply.get(self.key, {}) for reply in replies]

    def fetch(self) -> dict[str, torch.Tensor]:
        """The workers' weights and buffers, named ``"<layer index>.<name>"``, every stage's at once."""
        out: dict[str, torch.Tensor] = {}
        for state in self._states([rs.conn for rs in self.remote.stages]):  # replica 0
            out.update(state)
        return out

    def pull(self) -> None:
        """Copy the workers' weights and buffers into the local module, a stage at a time: the
        driver holds one stage's received copy at most (the whole model's doubled the driver's
        memory for a full checkpoint)."""
        with torch.no_grad():
            for rs in self.remote.stages:  # replica 0
                (state,) = self._states([rs.conn])
                for name, t in state.items():
                    index, _, rest = name.partition(".")
                    local = self.module.layers[int(index)].state_dict(keep_vars=True)[rest]
                    if not local.is_meta:  # a tensor on meta keeps no value here (its files or checkpoints do)
                        local.copy_(t)
                del state  # before the next stage's arrives

    def push(self, state: dict[str, torch.Tensor]) -> None:
        """Send weights and buffers (named ``"<layer index>.<name>"``) to the workers holding them."""
        requests = []
        for rs in (rs for row in self.remote.replicas for rs in row):
            mine = {k: v for k, v in state.items() if int(k.partition(".")[0]) in rs.stage.layer_indices}
            if mine:
                requests.append((rs.conn, protocol.LOAD_STATE, LoadState({self.key: mine}).body()))
        request_all(requests, bounded=False)

    def detach(self) -> None:
        for h in self.hooks:
            h.remove()
        self.module.detach()
