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
(`lightning_remote_mp.wire.fields`): a malformed body raises `lightning_remote_mp.errors.ProtocolError`
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
lightning_remote_mp.errors.ProtocolError: optim_step message: field 'hparams' must be a list, got dict
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar, Literal

import torch

from lightning_remote_mp.flow import Routes, SplitBackward, is_split_backward
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.compression import COMPRESSIONS
from lightning_remote_mp.wire.fields import (
    BOOL,
    INT,
    LIST,
    STR,
    Body,
    anything,
    choice,
    count,
    each,
    field,
    is_int,
    is_int_list,
    is_scalar,
    is_str,
    is_str_keyed,
    is_tensor,
    lenient,
    list_of,
    map_of,
    must,
    number,
    refuse,
)
from lightning_remote_mp.wire.keys import is_z85_key
from lightning_remote_mp.wire.state import (
    is_file_source,
    is_tensor_map,
)


def _is_z85(value: Any) -> bool:
    return isinstance(value, str) and is_z85_key(value)


_INDEX = field(INT)  # the optimizer's position among the driver's optimizers, first in every optimizer request


# --- stages ---------------------------------------------------------------------------------


def _is_route(item: Any) -> bool:
    return (
        isinstance(item, list)
        and len(item) == 2
        and is_int(item[0])
        and isinstance(item[1], list)
        and all(map(is_str, item[1]))
    )


def _routes() -> Any:
    """A stage's routes: ``[[stage, [variable names]], ...]`` on the wire, `Routes` here."""
    return field(
        list_of(_is_route, "[stage, [variable names]] pairs", read=lambda v: tuple((s, tuple(n)) for s, n in v)),
        write=lambda routes: [[k, list(v)] for k, v in routes],
    )


def _split_backward(kind: str, name: str, value: Any) -> SplitBackward:
    if not is_split_backward(value):
        raise refuse(kind, f"field {name!r} must be a bool or 'auto', got {value!r:.40}")
    return value


def _seed(kind: str, name: str, value: Any) -> int:
    if not 0 <= INT(kind, name, value) < 2**63:
        raise refuse(kind, f"field {name!r} must be in [0, 2**63), got {value}")
    return value


_PEER_KEYS = "stages in 'peers' to 40-character Z85 keys"


def _is_name_group(value: Any) -> bool:
    return isinstance(value, list) and len(value) > 1 and all(map(is_str, value))


@dataclasses.dataclass(frozen=True)
class Setup(Body):
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

    key: str = field(STR)
    stage: int = field(INT)
    stages: int = field(count)
    start: int = field(INT)
    entries: Sequence[Any] = field(LIST, write=list)
    exports: Sequence[str] = field(list_of(is_str, "variable names"), write=list)
    sources: Routes = _routes()
    targets: Routes = _routes()
    peers: Mapping[int, str] = field(map_of(is_int, is_str, "stage numbers to addresses"), write=dict)
    peer_keys: Mapping[int, str] = field(map_of(is_int, _is_z85, _PEER_KEYS), default_factory=dict, write=dict)
    state: Mapping[str, torch.Tensor] | None = field(
        map_of(is_str, is_tensor, "names to tensors"), default=None, write=dict
    )
    init_seed: int | None = field(INT, default=None)
    files: Mapping[str, Sequence[Any]] = field(
        map_of(is_str, is_file_source, "names to [path, name] or [path, name, how]"), default_factory=dict, write=dict
    )
    split_backward: SplitBackward = field(_split_backward, default=False)
    code_digests: Mapping[str, str] = field(
        map_of(is_str, is_str, "module names to digests"), default_factory=dict, write=dict
    )
    seed: int | None = field(_seed, default=None)
    frozen: Sequence[str] = field(list_of(is_str, "parameter names"), default_factory=list, write=list)
    shared: Sequence[Sequence[str]] = field(
        list_of(_is_name_group, "lists of two or more tensor names"), default_factory=list, write=each(list)
    )
    deferred_batch_norm: bool = field(BOOL, default=False)
    compression: str | None = field(choice(COMPRESSIONS[1:]), default=None, omit_none=True)
    borrows: str | None = field(STR, default=None, omit_none=True)
    programs: Mapping[str, Any] | None = field(
        map_of(is_str, is_str_keyed, "digests to programs"), default=None, write=dict, omit_none=True
    )

    @classmethod
    def _check(cls, values: dict[str, Any]) -> None:
        if not 0 <= values["stage"] < values["stages"]:
            raise refuse(cls.KIND, f"field 'stage' must be in [0, stages={values['stages']}), got {values['stage']}")
        strangers = [k for k in values["peer_keys"] if k not in values["peers"]]
        if strangers:
            raise refuse(cls.KIND, f"field 'peer_keys' must map {_PEER_KEYS}; entry {strangers[0]!r:.40} does not")
        given = [values["state"] is not None or bool(values["files"]), values["init_seed"] is not None]
        if values["borrows"] is not None and any(given):
            raise refuse(cls.KIND, "borrows another stage's tensors: it takes no 'state', 'files' or 'init_seed'")
        if values["borrows"] is None and not any(given):
            raise refuse(cls.KIND, "needs the stage's 'state', 'files', an 'init_seed', or the stage it 'borrows'")


@dataclasses.dataclass(frozen=True)
class Release(Body):
    """RELEASE: forget what the stages hold for these forward calls (the driver is done with them, or
    gave up on them); answered only if it fails (`protocol.QUIET_KINDS`). ``calls``: the calls, by
    SpecSequential key; ``outputs``: calls whose kept outputs alone the driver no longer reads
    (their backward may still come); ``generations``: generations whose caches the stages of those
    keys free (``generate()`` returned or failed)."""

    KIND: ClassVar[str] = protocol.RELEASE

    calls: Mapping[str, Sequence[int]] = field(map_of(is_str, is_int_list, "keys to lists of calls"), write=each(list))
    outputs: Mapping[str, Sequence[int]] = field(
        map_of(is_str, is_int_list, "keys to lists of calls"), default_factory=dict, write=each(list)
    )
    generations: Mapping[str, Sequence[int]] = field(
        map_of(is_str, is_int_list, "keys to lists of generations"), default_factory=dict, write=each(list)
    )


@dataclasses.dataclass(frozen=True)
class Fetch(Body):
    """FETCH: the outputs the last stage kept of call ``call`` of ``key`` (`messages.Forward.keep`), by
    micro-batch: what the driver reads of a model's outputs that did not travel with the result."""

    KIND: ClassVar[str] = protocol.FETCH

    key: str = field(STR)
    call: int = field(INT)


@dataclasses.dataclass(frozen=True)
class Loss(Body):
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

    key: str = field(STR)
    call: int = field(INT)
    position: int = field(INT)
    program: int = field(INT)
    inputs: Sequence[int] = field(list_of(is_int, "argument numbers"), write=list)
    targets: Mapping[int, torch.Tensor] = field(map_of(is_int, is_tensor, "micro-batches to tensors"), write=dict)
    whole: Sequence[torch.Tensor] = field(list_of(is_tensor, "tensors"), default_factory=list, write=list)
    entries: Sequence[Any] | None = field(LIST, default=None, omit_none=True, write=list)
    state: Sequence[Mapping[str, torch.Tensor]] | None = field(
        list_of(is_tensor_map, "dicts of names to tensors"), default=None, omit_none=True, write=list
    )
    grad: bool = field(BOOL, default=False)
    training: bool = field(BOOL, default=True)
    differentiate: int = field(INT, default=0)

    @classmethod
    def _check(cls, values: dict[str, Any]) -> None:
        if (values["entries"] is None) != (values["state"] is None) or (
            values["entries"] is not None and len(values["entries"]) != len(values["state"])
        ):
            raise refuse(cls.KIND, "'entries' and 'state' come together, one state per entry")


@dataclasses.dataclass(frozen=True)
class Sync(Body):
    """SYNC: answered once every request sent before it has run, those answered only when they fail
    (`protocol.QUIET_KINDS`) included. It carries nothing."""

    KIND: ClassVar[str] = protocol.SYNC


@dataclasses.dataclass(frozen=True)
class Profile(Body):
    """PROFILE: time the forward plus backward of each layer of ``entries`` on the worker's device
    (``balance="time"``). ``repeats``: runs per layer (1 to 50), ``None`` for the worker's default."""

    KIND: ClassVar[str] = protocol.PROFILE

    entries: Sequence[Any] = field(LIST, write=list)
    repeats: int | None = field(INT, default=None, omit_none=True)


# --- the optimizer mirror -------------------------------------------------------------------


def _is_group(value: Any) -> bool:
    return is_str_keyed(value) and isinstance(value.get("params"), list) and all(map(is_str, value["params"]))


@dataclasses.dataclass(frozen=True)
class OptimCreate(Body):
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

    index: int = _INDEX
    class_path: str = field(STR, wire="cls")
    defaults: Mapping[str, Any] = field(map_of(is_str, anything, "hyperparameter names to values"), write=dict)
    groups: Sequence[Mapping[str, Any]] = field(
        list_of(_is_group, "hyperparameter dicts with a 'params' list of names"), write=each(dict)
    )
    copies: Sequence[str] = field(list_of(is_str, "parameter names"), default_factory=list, write=list)


@dataclasses.dataclass(frozen=True)
class OptimStep(Body):
    """OPTIM_STEP: step optimizer ``index``, first setting each group's ``hparams`` (the driver's,
    as schedulers left them; one dict per group, without ``"params"``)."""

    KIND: ClassVar[str] = protocol.OPTIM_STEP

    index: int = _INDEX
    hparams: Sequence[Mapping[str, Any]] = field(list_of(is_str_keyed, "hyperparameter dicts"), write=each(dict))
    #: First sum the gradients over the stage's replicas and the copies of tied weights (as
    #: `GradAllreduce` does): they changed since they were last summed.
    sync: bool = field(BOOL, default=False)


@dataclasses.dataclass(frozen=True)
class ZeroGrad(Body):
    """ZERO_GRAD: zero (or, with ``set_to_none``, drop) the gradients of optimizer ``index``'s parameters."""

    KIND: ClassVar[str] = protocol.ZERO_GRAD

    index: int = _INDEX
    set_to_none: bool = field(BOOL, default=True)


@dataclasses.dataclass(frozen=True)
class LossGrad(Body):
    """LOSS_GRAD: the driver's gradient of the loss of call ``call`` of ``key``, whose backward the
    stages started on their own (`messages.Forward.loss_output`): each adds its weight gradients times
    ``grad`` to ``.grad`` once its part of the call has run, and runs none of the driver's later
    requests before (``None``: the step did not differentiate the loss; nothing is added)."""

    KIND: ClassVar[str] = protocol.LOSS_GRAD

    key: str = field(STR)
    call: int = field(INT)
    grad: torch.Tensor | None = field(
        must(is_scalar, "'grad' must be a floating tensor of one value"), default=None, omit_none=True
    )


# --- observing and replicas -----------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Timeline(Body):
    """TIMELINE: ``start`` or ``stop`` recording the stages' events, ``fetch`` (and clear) them, or
    read the worker's ``clock``."""

    KIND: ClassVar[str] = protocol.TIMELINE
    op: Literal["start", "stop", "fetch", "clock"] = field(choice(("start", "stop", "fetch", "clock")))


@dataclasses.dataclass(frozen=True)
class GroupInit(Body):
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

    op: str = field(choice(("init",)), default="init", init=False, repr=False)
    host: str = field(STR)
    port: int = field(INT)
    prefix: str = field(STR)
    rank: int = field(INT)
    world: int = field(INT)
    backend: str = field(STR)
    timeout: float = field(number)
    params: Sequence[str] | None = field(list_of(is_str, "parameter names"), default=None, write=list, omit_none=True)


#: Bytes of the key that seals the requests the driver sends a worker along the pipeline
#: (`lightning_remote_mp.wire.carry.Carried`): each worker's own, given in the driver's `Hello`.
SEAL_KEY_BYTES = 32


# --- the session -----------------------------------------------------------------------------


def _text(limit: int) -> Any:
    """A received string, shortened; anything else as ``"?"`` (never ``str()`` of what anyone sent)."""
    return lenient(lambda value: value[:limit] if isinstance(value, str) else "?")


def _sane_timeout(value: Any) -> float | None:
    sane = isinstance(value, (int, float)) and not isinstance(value, bool) and 0 < value < 3600
    return float(value) if sane else None


@dataclasses.dataclass(frozen=True)
class Hello(Body):
    """HELLO: a driver opens its session (or asks again, while another one is being dropped).

    Read leniently, on purpose: a driver of another lrmp version may send another body, and it must
    still hear which versions differ; so only ``protocol`` (the wire version) decides, and the other
    fields, informative, are shortened or dropped when malformed rather than refused.

    >>> Hello.from_body({"protocol": 7, "driver": 3}).driver
    '?'
    """

    KIND: ClassVar[str] = protocol.HELLO

    driver: str = field(_text(200), default="?")  # who: "host pid N", for logs and the busy message
    #: What the driver speaks (``protocol`` on the wire); compared, never trusted.
    protocol_version: Any = field(lenient(lambda v: v), wire="protocol", default=protocol.PROTOCOL_VERSION)
    lrmp: str = field(_text(100), default="?")
    torch: str = field(_text(100), default="?")
    #: The driver's: how long this worker's peers may keep it waiting.
    heartbeat_timeout: float | None = field(lenient(_sane_timeout), default=None)
    #: What the driver accepts (`protocol.Limits.as_dict`): the worker's bundles of answers stay within it.
    limits: protocol.Limits = field(
        lenient(protocol.Limits.from_dict), default=protocol.DEFAULT_LIMITS, write=protocol.Limits.as_dict
    )
    #: This worker's key for the session: the driver seals with it what it sends the worker along the
    #: pipeline (`carry.Carried`), so that no other worker can forge or alter it. ``None``: none may come.
    seal_key: bytes | None = field(
        lenient(lambda v: v if isinstance(v, bytes) and len(v) == SEAL_KEY_BYTES else None), default=None
    )

    @classmethod
    def from_body(cls, body: Any) -> Hello:  # type: ignore[override]
        """A received body, read leniently (see the class); never raises."""
        return super().from_body(body if isinstance(body, dict) else {})


@dataclasses.dataclass(frozen=True)
class Ping(Body):
    """PING: the driver's heartbeat. The session id in the header says it all; it carries nothing."""

    KIND: ClassVar[str] = protocol.PING


@dataclasses.dataclass(frozen=True)
class Bye(Body):
    """BYE: the driver ends its session. It carries nothing."""

    KIND: ClassVar[str] = protocol.BYE
