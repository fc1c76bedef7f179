"""The driver's control requests, typed: what it asks of a worker besides running micro-batches.

`messages` holds the pipeline's data (`~lightning_remote_mp.wire.messages.Forward`,
`~lightning_remote_mp.wire.messages.Backward`), which stages also send each other; `state` the
requests that move a stage's tensors (`~lightning_remote_mp.wire.state.GetState` and the rest),
`grads` the optimizer's operations on gradients, and `carry` the quiet requests carried along the
pipeline (`~lightning_remote_mp.wire.carry.Carry`). This module holds every other request, which
only the driver sends: placing a stage (`Setup`), the optimizer mirror (`OptimCreate`,
`OptimStep`, `ZeroGrad`), the loss on the last stage (`Loss`, `LossGrad`), and the rest
(`Release`, `Fetch`, `Sync`, `Profile`, `Timeline`, `GroupInit`), and the session's own: `Hello`,
`Ping`, `Bye`. Each is built by the driver, becomes a body with ``body()``, and is checked once on
the worker by ``from_body``, both made from the fields each declares
(`lightning_remote_mp.wire.body`): a malformed body raises `lightning_remote_mp.errors.ProtocolError`
naming the kind and the field (except `Hello`'s, read leniently: see there). The worker reads
every kind through one table (`lightning_remote_mp.worker.request.REQUESTS`), and nowhere else.
Only the shape is checked here; what the fields mean (a layer entry, a class path, a weight's
shape) is checked by the code that uses them (`lightning_remote_mp.model.entries.normalize_entry`, the
stage, the optimizer).

>>> ZeroGrad.from_body(ZeroGrad(index=0).body())
ZeroGrad(index=0, set_to_none=True)
>>> OptimStep.from_body({"index": 0, "hparams": {"lr": 0.1}})
Traceback (most recent call last):
...
lightning_remote_mp.errors.ProtocolError: optim_step message: field 'hparams': expected a list, got a dict
"""

from __future__ import annotations

from typing import Annotated, Any, ClassVar, Literal

import msgspec
import torch

from lightning_remote_mp.flow import Routes
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.body import Body, Count, each, plain
from lightning_remote_mp.wire.compression import COMPRESSIONS
from lightning_remote_mp.wire.keys import is_z85_key
from lightning_remote_mp.wire.state import FileSource, check_file_sources

#: A stage's routes on the wire: ``[[stage, [variable names]], ...]`` (`Routes` once read).
_Routes = tuple[tuple[int, tuple[str, ...]], ...]
#: Two or more tensor names that are one tensor.
_NameGroup = Annotated[list[str], msgspec.Meta(min_length=2)]
_PEER_KEYS = "stages in 'peers' to 40-character Z85 keys"


def _routes_written(routes: Routes) -> list[list[Any]]:
    return [[k, list(v)] for k, v in routes]


# --- stages ---------------------------------------------------------------------------------


class Setup(Body, frozen=True):
    """SETUP: build one stage of a SpecSequential on the worker, wire it to its peers, and give it
    its weights (``state``) or the seed to initialise them (``init_seed``).

    Attributes:
        key: the SpecSequential's name; ``stage``: the stage's number; ``start``: its first layer's index.
        stages: how many stages the pipeline has: each stage builds its list of actions for a call
            from it (`lightning_remote_mp.schedule.actions`), whatever the schedule.
        entries: its layer entries as `lightning_remote_mp.model.entries.LayerEntry.to_wire` writes them.
        exports: the residual variables it produces for later stages.
        sources, targets: its forward routes (`lightning_remote_mp.model.partition.Stage`).
        peers: the worker address of every other stage on its routes (the driver is no peer).
        peer_keys: with CURVE, those peers' public keys (Z85), by stage.
        state: its weights and buffers, named ``"<layer index>.<name>"``; or ``None``, with ``init_seed``.
        files: the weights and buffers the worker reads itself from safetensors files (a pretrained
            model's, a sharded checkpoint's), by name: ``{"<layer index>.<name>": [path, name in the
            file]}``, or ``[path, name, how]`` for a part of a 4-bit weight the worker quantizes as it reads
            it (`lightning_remote_mp.model.weights.QUANTIZE`); ``state`` then holds the rest.
        init_seed: layer ``i`` starts from seed ``init_seed + i`` (`lightning_remote_mp.model.build.build_layer`).
        split_backward: defer the weight gradients of linear layers: ``True``, ``False``, or ``"auto"``
            for the calls whose product is large enough (`lightning_remote_mp.worker.deferred_grads`).
        code_digests: the driver's source digest of each user module the entries import.
        seed: the stage's random stream (dropout); ``None`` leaves the worker's.
        frozen: the names of parameters that take no gradient.
        shared: groups of names of this stage's tensors that are one tensor (a tied weight used by
            several of its layers); the stage holds one, under the first name of each group.
        deferred_batch_norm: update batch norms' running statistics once per mini-batch, from the
            whole mini-batch (`lightning_remote_mp.worker.deferred_bn`).
        compression: how the stage's pipelined messages carry floating tensors (`wire.compression.COMPRESSIONS`).
        borrows: the key of a stage on this worker whose tensors this one holds, by the same names
            and as the same tensors (``state`` and ``files`` are then empty): another call signature
            of a traced module (`lightning_remote_mp.model.calls.TracedForward`), training its weights.
        programs: the traced units' programs, each once, by digest: an entry names one with its
            tensors' names and key/value-cache positions (`lightning_remote_mp.model.program_table`).
    """

    KIND: ClassVar[str] = protocol.SETUP
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"compression", "borrows", "programs"})
    WRITE: ClassVar[dict[str, Any]] = {
        "entries": plain,
        "exports": plain,
        "sources": _routes_written,
        "targets": _routes_written,
        "peers": plain,
        "peer_keys": plain,
        "state": plain,
        "files": plain,
        "code_digests": plain,
        "frozen": plain,
        "shared": each(plain),
        "programs": plain,
    }

    key: str
    stage: int
    stages: Count
    start: int
    entries: list[Any]
    exports: list[str]
    sources: _Routes
    targets: _Routes
    peers: dict[int, str]
    peer_keys: dict[int, str] = {}
    state: dict[str, torch.Tensor] | None = None
    init_seed: int | None = None
    files: dict[str, FileSource] = {}
    split_backward: bool | Literal["auto"] = False
    code_digests: dict[str, str] = {}
    seed: Annotated[int, msgspec.Meta(ge=0, le=2**63 - 1)] | None = None
    frozen: list[str] = []
    shared: list[_NameGroup] = []
    deferred_batch_norm: bool = False
    compression: Literal[COMPRESSIONS[1:]] | None = None  # type: ignore[valid-type]
    borrows: str | None = None
    programs: dict[str, dict[str, Any]] | None = None

    def __post_init__(self) -> None:
        if not 0 <= self.stage < self.stages:
            raise ValueError(f"field 'stage' must be in [0, stages={self.stages}), got {self.stage}")
        strangers = [k for k, v in self.peer_keys.items() if k not in self.peers or not is_z85_key(v)]
        if strangers:
            raise ValueError(f"field 'peer_keys' must map {_PEER_KEYS}; entry {strangers[0]!r:.40} does not")
        check_file_sources(self.files)
        given = [self.state is not None or bool(self.files), self.init_seed is not None]
        if self.borrows is not None and any(given):
            raise ValueError("borrows another stage's tensors: it takes no 'state', 'files' or 'init_seed'")
        if self.borrows is None and not any(given):
            raise ValueError("needs the stage's 'state', 'files', an 'init_seed', or the stage it 'borrows'")


class Release(Body, frozen=True):
    """RELEASE: forget what the stages hold for these forward calls (the driver is done with them, or
    gave up on them); answered only if it fails (`protocol.QUIET_KINDS`). ``calls``: the calls, by
    SpecSequential key; ``outputs``: calls whose kept outputs alone the driver no longer reads
    (their backward may still come); ``generations``: generations whose caches the stages of those
    keys free (``generate()`` returned or failed)."""

    KIND: ClassVar[str] = protocol.RELEASE
    WRITE: ClassVar[dict[str, Any]] = {"calls": each(plain), "outputs": each(plain), "generations": each(plain)}

    calls: dict[str, list[int]]
    outputs: dict[str, list[int]] = {}
    generations: dict[str, list[int]] = {}


class Fetch(Body, frozen=True):
    """FETCH: the outputs the last stage kept of call ``call`` of ``key`` (`messages.Forward.keep`), by
    micro-batch: what the driver reads of a model's outputs that did not travel with the result."""

    KIND: ClassVar[str] = protocol.FETCH

    key: str
    call: int


class Loss(Body, frozen=True):
    """LOSS: a loss over an output the last stage kept (`Fetch`), computed there, micro-batch by
    micro-batch, so that the output (a language model's logits) never travels. The loss is a
    traced program like any traced layer's (`lightning_remote_mp.driver.losses`): the driver sends
    it once per worker, under a number, and then only that number.

    Attributes:
        key, call: the model and the forward call whose kept output the loss reads.
        position: which of the model's outputs it reads.
        program: the loss program's number on this worker; ``entries`` (its layer entries, as
            `lightning_remote_mp.model.entries.LayerEntry.to_wire` writes them) and ``state`` (each
            entry's tensors) come with the first use.
        inputs: for each of the program's inputs, the argument it takes: 0 the kept output, 1 the
            target, ``2 + i`` the ``i``-th of ``whole``.
        targets: each micro-batch's part of the target, by micro-batch.
        whole: the other tensor arguments (class weights, say), the same for every micro-batch.
        grad: keep what backward needs: `messages.Backward.loss_grads` brings the gradient of the
            program's output ``differentiate``.
        training: run the program's train or eval form.
    """

    KIND: ClassVar[str] = protocol.LOSS
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"entries", "state"})
    WRITE: ClassVar[dict[str, Any]] = {
        "inputs": plain,
        "targets": plain,
        "whole": plain,
        "entries": plain,
        "state": plain,
    }

    key: str
    call: int
    position: int
    program: int
    inputs: list[int]
    targets: dict[int, torch.Tensor]
    whole: list[torch.Tensor] = []
    entries: list[Any] | None = None
    state: list[dict[str, torch.Tensor]] | None = None
    grad: bool = False
    training: bool = True
    differentiate: int = 0

    def __post_init__(self) -> None:
        if (self.entries is None) != (self.state is None) or (
            self.entries is not None and self.state is not None and len(self.entries) != len(self.state)
        ):
            raise ValueError("'entries' and 'state' come together, one state per entry")


class Sync(Body, frozen=True):
    """SYNC: answered once every request sent before it has run, those answered only when they fail
    (`protocol.QUIET_KINDS`) included. It carries nothing."""

    KIND: ClassVar[str] = protocol.SYNC


class Profile(Body, frozen=True):
    """PROFILE: time the forward plus backward of each layer of ``entries`` on the worker's device
    (``balance="time"``). ``repeats``: runs per layer (1 to 50), ``None`` for the worker's default."""

    KIND: ClassVar[str] = protocol.PROFILE
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"repeats"})
    WRITE: ClassVar[dict[str, Any]] = {"entries": plain}

    entries: list[Any]
    repeats: int | None = None


# --- the optimizer mirror -------------------------------------------------------------------


def _is_group(value: dict[str, Any]) -> bool:
    params = value.get("params")
    return isinstance(params, list) and all(isinstance(p, str) for p in params)


class OptimCreate(Body, frozen=True):
    """OPTIM_CREATE: build the driver's optimizer ``index`` over the parameters this worker holds.

    Attributes:
        index: the optimizer's position among the driver's optimizers (its name on the workers).
        class_path: the optimizer class's dotted path (sent as ``cls``).
        defaults: the optimizer's ``defaults``.
        groups: one per driver parameter group: its hyperparameters, and under ``"params"`` the
            names (``"<key>/<layer index>.<name>"``) of its parameters this worker holds.
        copies: of those, the copies of a tied weight whose first copy another stage holds: they
            step like it, but their gradient norms and state are that copy's, so they are not reported.
    """

    KIND: ClassVar[str] = protocol.OPTIM_CREATE
    WRITE: ClassVar[dict[str, Any]] = {"defaults": plain, "groups": each(plain), "copies": plain}

    index: int
    class_path: str = msgspec.field(name="cls")
    defaults: dict[str, Any]
    groups: list[dict[str, Any]]
    copies: list[str] = []

    def __post_init__(self) -> None:
        if not all(map(_is_group, self.groups)):
            raise ValueError("field 'groups' must be a list of hyperparameter dicts with a 'params' list of names")


class OptimStep(Body, frozen=True):
    """OPTIM_STEP: step optimizer ``index``, first setting each group's ``hparams`` (the driver's,
    as schedulers left them; one dict per group, without ``"params"``)."""

    KIND: ClassVar[str] = protocol.OPTIM_STEP
    WRITE: ClassVar[dict[str, Any]] = {"hparams": each(plain)}

    index: int
    hparams: list[dict[str, Any]]
    #: First sum the gradients over the stage's replicas and the copies of tied weights (as
    #: `GradAllreduce` does): they changed since they were last summed.
    sync: bool = False


class ZeroGrad(Body, frozen=True):
    """ZERO_GRAD: zero (or, with ``set_to_none``, drop) the gradients of optimizer ``index``'s parameters."""

    KIND: ClassVar[str] = protocol.ZERO_GRAD

    index: int
    set_to_none: bool = True


class LossGrad(Body, frozen=True):
    """LOSS_GRAD: the driver's gradient of the loss of call ``call`` of ``key``, whose backward the
    stages started on their own (`messages.Forward.loss_output`), the input of each stage's S action
    (`lightning_remote_mp.schedule`): each adds its weight gradients times ``grad`` to ``.grad`` once
    its part of the call has run, and runs none of the driver's later requests before (``None``: the
    step did not differentiate the loss; nothing is added). With ``answer``, the stage fed by the
    driver then sends it each micro-batch's DONE (`messages.Backward`): the gradients of its
    inputs, times ``grad``."""

    KIND: ClassVar[str] = protocol.LOSS_GRAD
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"grad"})

    key: str
    call: int
    grad: torch.Tensor | None = None
    answer: bool = False

    def __post_init__(self) -> None:
        if self.grad is not None and not (self.grad.numel() == 1 and self.grad.is_floating_point()):
            raise ValueError("field 'grad' must be a floating tensor of one value")


# --- observing and replicas -----------------------------------------------------------------


class Timeline(Body, frozen=True):
    """TIMELINE: ``start`` or ``stop`` recording the stages' events, ``fetch`` (and clear) them, or
    read the worker's ``clock``."""

    KIND: ClassVar[str] = protocol.TIMELINE

    op: Literal["start", "stop", "fetch", "clock"]


class GroupInit(Body, frozen=True, tag_field="op", tag="init"):
    """GROUP with ``op="init"``: join a torch.distributed process group through the driver's
    TCPStore at ``host:port`` (`lightning_remote_mp.worker.collective.GradGroup`): the group of this
    stage's replicas, which sum all its gradients, or with ``params``, the group of the stages that
    hold copies of tied weights, which sum those weights' gradients.

    Attributes:
        prefix: the group's key prefix in the store; ``rank``, ``world``: this member's rank and the
            group's size; ``backend``: ``"gloo"`` or ``"nccl"``; ``timeout``: seconds.
        params: for a group of tied weights, this stage's names of them, in the group's order.
    """

    KIND: ClassVar[str] = protocol.GROUP
    OMIT_NONE: ClassVar[frozenset[str]] = frozenset({"params"})
    WRITE: ClassVar[dict[str, Any]] = {"params": plain}

    host: str
    port: int
    prefix: str
    rank: int
    world: int
    backend: str
    timeout: float
    params: list[str] | None = None

    def body(self) -> dict[str, Any] | None:
        return {"op": self.__struct_config__.tag, **(super().body() or {})}


#: Bytes of the key that seals the requests the driver sends a worker along the pipeline
#: (`lightning_remote_mp.wire.carry.Carried`): each worker's own, given in the driver's `Hello`.
SEAL_KEY_BYTES = 32


# --- the session -----------------------------------------------------------------------------


def _text(value: Any, limit: int) -> str:
    """A received string, shortened; anything else as ``"?"`` (never ``str()`` of what anyone sent)."""
    return value[:limit] if isinstance(value, str) else "?"


def _sane_timeout(value: Any) -> float | None:
    sane = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 3600
    return float(value) if sane else None


def _limits(value: Any) -> protocol.Limits:
    return protocol.Limits.from_dict(value) if value is not None else protocol.DEFAULT_LIMITS


class Hello(Body, frozen=True):
    """HELLO: a driver opens its session (or asks again, while another one is being dropped).

    Read leniently, on purpose: a driver of another lrmp version may send another body, and it must
    still hear which versions differ; so only ``protocol`` (the wire version) decides, and the other
    fields, informative, are shortened or dropped when malformed rather than refused.

    >>> Hello.from_body({"protocol": 7, "driver": 3}).driver
    '?'
    """

    KIND: ClassVar[str] = protocol.HELLO
    WRITE: ClassVar[dict[str, Any]] = {"limits": protocol.Limits.as_dict}

    driver: str = "?"  # who: "host pid N", for logs and the busy message
    #: What the driver speaks (``protocol`` on the wire); compared, never trusted.
    protocol_version: Any = msgspec.field(name="protocol", default=protocol.PROTOCOL_VERSION)
    lrmp: str = "?"
    torch: str = "?"
    #: The driver's: how long this worker's peers may keep it waiting.
    heartbeat_timeout: float | None = None
    #: What the driver accepts (`protocol.Limits.as_dict`): the worker's bundles of answers stay within it.
    limits: Any = protocol.DEFAULT_LIMITS
    #: This worker's key for the session: the driver seals with it what it sends the worker along the
    #: pipeline (`carry.Carried`), so that no other worker can forge or alter it. ``None``: none may come.
    seal_key: bytes | None = None

    @classmethod
    def from_body(cls, body: Any) -> Hello:  # type: ignore[override]
        """A received body, read leniently (see the class); never raises."""
        got = body if isinstance(body, dict) else {}
        key = got.get("seal_key")
        try:
            limits = _limits(got.get("limits"))
        except Exception:  # another version's limits, or none that make sense: the defaults
            limits = protocol.DEFAULT_LIMITS
        return cls(
            driver=_text(got.get("driver", "?"), 200),
            protocol_version=protocol.PROTOCOL_VERSION if got.get("protocol") is None else got["protocol"],
            lrmp=_text(got.get("lrmp", "?"), 100),
            torch=_text(got.get("torch", "?"), 100),
            heartbeat_timeout=_sane_timeout(got.get("heartbeat_timeout")),
            limits=limits,
            seal_key=key if isinstance(key, bytes) and len(key) == SEAL_KEY_BYTES else None,
        )


class Ping(Body, frozen=True):
    """PING: the driver's heartbeat. The session id in the header says it all; it carries nothing."""

    KIND: ClassVar[str] = protocol.PING


class Bye(Body, frozen=True):
    """BYE: the driver ends its session. It carries nothing."""

    KIND: ClassVar[str] = protocol.BYE
