"""The driver's control requests, typed: what it asks of a worker besides running micro-batches.

`messages` holds the pipeline's data (`~lightning_remote_mp.wire.messages.Forward`,
`~lightning_remote_mp.wire.messages.Backward`), which stages also send each other; this module holds
every other request, which only the driver sends: placing a stage (`Setup`), moving weights
(`GetState`, `LoadState`), the optimizer mirror (`OptimCreate`, `OptimStep`, `ZeroGrad`,
`GetOptimState`, `LoadOptimState`, and the `Grads` operations), and the rest (`Release`,
`Profile`, `Timeline`, `GroupInit`), and the session's first request, `Hello`. Each is built by the
driver, becomes a body with ``body()``, and is checked once on the worker by ``from_body``: a
malformed body raises `lightning_remote_mp.errors.ProtocolError` naming the kind and the field
(except `Hello`'s, read leniently: see there). Only the shape is
checked here; what the fields mean (a layer entry, a class path, a weight's shape) is checked by
the code that uses them (`lightning_remote_mp.model.spec.normalize_entry`, the stage, the optimizer).

>>> ZeroGrad.from_body(ZeroGrad(index=0).body())
ZeroGrad(index=0, set_to_none=True)
>>> Grads.from_body({"index": 0, "op": "clamp", "value": 1})
GradClamp(index=0, value=1.0)
>>> OptimStep.from_body({"index": 0, "hparams": {"lr": 0.1}})
Traceback (most recent call last):
...
lightning_remote_mp.errors.ProtocolError: optim_step message: field 'hparams' must be a list, got dict
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal, TypeVar, get_args

import torch

from lightning_remote_mp.errors import ProtocolError
from lightning_remote_mp.flow import Routes, SplitBackward, is_split_backward
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.keys import is_z85_key
from lightning_remote_mp.wire.messages import _dict_body, _field


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_str(value: Any) -> bool:
    return isinstance(value, str)


def _is_tensor(value: Any) -> bool:
    return isinstance(value, torch.Tensor)


def _is_anything(value: Any) -> bool:
    return True


def _is_call_list(value: Any) -> bool:
    return isinstance(value, list) and all(map(_is_int, value))


def _is_str_keyed(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) for k in value)


def _is_tensor_map(value: Any) -> bool:
    return isinstance(value, dict) and all(isinstance(k, str) and _is_tensor(v) for k, v in value.items())


def _list_of(
    what: str, body: dict[str, Any], name: str, check: Callable[[Any], bool], means: str, default: Any = ...
) -> Any:
    """A list field whose every item passes ``check`` (``means`` says what they must be)."""
    value = _field(what, body, name, list, default)
    for i, item in enumerate(value):
        if not check(item):
            raise ProtocolError(f"{what} message: field {name!r} must be a list of {means}; item {i} is not")
    return value


def _mapping(
    what: str,
    body: dict[str, Any],
    name: str,
    key: Callable[[Any], bool],
    value: Callable[[Any], bool],
    means: str,
    default: Any = ...,
) -> Any:
    """A dict field whose every entry passes ``key`` and ``value`` (``means``: "keys to values")."""
    got = _field(what, body, name, dict, default)
    for k, v in (got or {}).items():
        if not (key(k) and value(v)):
            raise ProtocolError(f"{what} message: field {name!r} must map {means}; entry {k!r:.40} does not")
    return got


def _number(what: str, body: dict[str, Any], name: str) -> float:
    value = _field(what, body, name, (int, float))
    if isinstance(value, bool):
        raise ProtocolError(f"{what} message: field {name!r} must be a number, got bool")
    return float(value)


def _choice(what: str, body: dict[str, Any], name: str, choices: Sequence[str]) -> Any:
    value = _field(what, body, name, str)
    if value not in choices:
        raise ProtocolError(
            f"{what} message: field {name!r} must be one of {', '.join(map(repr, choices))}, got {value!r:.40}"
        )
    return value


def _index(what: str, body: Any) -> int:
    """The optimizer index every optimizer request starts with (the driver's optimizer position)."""
    return _field(what, _dict_body(what, body), "index", int)


# --- stages ---------------------------------------------------------------------------------


def _routes(what: str, body: dict[str, Any], name: str) -> Routes:
    def is_route(item: Any) -> bool:
        return (
            isinstance(item, list)
            and len(item) == 2
            and _is_int(item[0])
            and isinstance(item[1], list)
            and all(map(_is_str, item[1]))
        )

    value = _list_of(what, body, name, is_route, "[stage, [variable names]] pairs")
    return tuple((stage, tuple(names)) for stage, names in value)


@dataclasses.dataclass(frozen=True)
class Setup:
    """SETUP: build one stage of a SpecSequential on the worker, wire it to its peers, and give it
    its weights (``state``) or the seed to initialise them (``init_seed``).

    Attributes:
        key: the SpecSequential's name; ``stage``: the stage's number; ``start``: its first layer's index.
        entries: its layer entries as `lightning_remote_mp.model.spec.LayerEntry.to_wire` writes them.
        exports: the residual variables it produces for later stages.
        sources, targets: its forward routes (`lightning_remote_mp.model.partition.Stage`).
        peers: the worker address of every other stage on its routes (the driver is no peer).
        peer_keys: with CURVE, those peers' public keys (Z85), by stage.
        state: its weights and buffers, named ``"<layer index>.<name>"``; or ``None``, with ``init_seed``.
        init_seed: layer ``i`` starts from seed ``init_seed + i`` (`lightning_remote_mp.model.spec.build_layer`).
        split_backward: defer the weight gradients of linear layers: ``True``, ``False``, or ``"auto"``
            for the calls whose product is large enough (`lightning_remote_mp.worker.deferred_grads`).
        code_digests: the driver's source digest of each user module the entries import.
        seed: the stage's random stream (dropout); ``None`` leaves the worker's.
        frozen: the names of parameters that take no gradient.
    """

    KIND: ClassVar[str] = protocol.SETUP

    key: str
    stage: int
    start: int
    entries: Sequence[Any]
    exports: Sequence[str]
    sources: Routes
    targets: Routes
    peers: Mapping[int, str]
    peer_keys: Mapping[int, str] = dataclasses.field(default_factory=dict)
    state: Mapping[str, torch.Tensor] | None = None
    init_seed: int | None = None
    split_backward: SplitBackward = False
    code_digests: Mapping[str, str] = dataclasses.field(default_factory=dict)
    seed: int | None = None
    frozen: Sequence[str] = ()

    def body(self) -> dict[str, Any]:
        """The message body, as `protocol.encode` sends it."""
        return {
            "key": self.key,
            "stage": self.stage,
            "start": self.start,
            "entries": list(self.entries),
            "exports": list(self.exports),
            "sources": [[k, list(v)] for k, v in self.sources],
            "targets": [[k, list(v)] for k, v in self.targets],
            "peers": dict(self.peers),
            "peer_keys": dict(self.peer_keys),
            "state": None if self.state is None else dict(self.state),
            "init_seed": self.init_seed,
            "split_backward": self.split_backward,
            "code_digests": dict(self.code_digests),
            "seed": self.seed,
            "frozen": list(self.frozen),
        }

    @classmethod
    def from_body(cls, body: Any) -> Setup:
        """A received body, checked; raises `ProtocolError` if it is malformed."""
        what = cls.KIND
        body = _dict_body(what, body)
        key = _field(what, body, "key", str)
        stage = _field(what, body, "stage", int)
        start = _field(what, body, "start", int)
        entries = _field(what, body, "entries", list)
        exports = _list_of(what, body, "exports", _is_str, "variable names")
        sources = _routes(what, body, "sources")
        targets = _routes(what, body, "targets")
        peers = _mapping(what, body, "peers", _is_int, _is_str, "stage numbers to addresses")
        peer_keys = _mapping(
            what, body, "peer_keys", peers.__contains__, _is_z85, "stages in 'peers' to 40-character Z85 keys", {}
        )
        state = _mapping(what, body, "state", _is_str, _is_tensor, "names to tensors", None)
        init_seed = _field(what, body, "init_seed", int, None)
        if state is None and init_seed is None:
            raise ProtocolError(f"{what} message: needs the stage's 'state' or an 'init_seed'")
        seed = _field(what, body, "seed", int, None)
        if seed is not None and not 0 <= seed < 2**63:
            raise ProtocolError(f"{what} message: field 'seed' must be in [0, 2**63), got {seed}")
        return cls(
            key=key,
            stage=stage,
            start=start,
            entries=entries,
            exports=exports,
            sources=sources,
            targets=targets,
            peers=peers,
            peer_keys=peer_keys,
            state=state,
            init_seed=init_seed,
            split_backward=_split_backward(what, body),
            code_digests=_mapping(what, body, "code_digests", _is_str, _is_str, "module names to digests", {}),
            seed=seed,
            frozen=_list_of(what, body, "frozen", _is_str, "parameter names", []),
        )


def _split_backward(what: str, body: dict[str, Any]) -> SplitBackward:
    value = body.get("split_backward")
    if value is None:
        return False
    if not is_split_backward(value):
        raise ProtocolError(f"{what} message: field 'split_backward' must be a bool or 'auto', got {value!r:.40}")
    return value


def _is_z85(value: Any) -> bool:
    return isinstance(value, str) and is_z85_key(value)


@dataclasses.dataclass(frozen=True)
class Release:
    """RELEASE: forget what the stages hold for these forward calls (the driver is done with them, or
    gave up on them). ``calls``: the calls, by SpecSequential key."""

    KIND: ClassVar[str] = protocol.RELEASE

    calls: Mapping[str, Sequence[int]]

    def body(self) -> dict[str, Any]:
        """The message body, as `protocol.encode` sends it."""
        return {"calls": {k: list(v) for k, v in self.calls.items()}}

    @classmethod
    def from_body(cls, body: Any) -> Release:
        """A received body, checked; raises `ProtocolError` if it is malformed."""
        what = cls.KIND
        return cls(_mapping(what, _dict_body(what, body), "calls", _is_str, _is_call_list, "keys to lists of calls"))


_Bodiless = TypeVar("_Bodiless", bound="_NoBody")


class _NoBody:
    """A request that carries nothing: its body is ``None`` (a dict is accepted and ignored; anything
    else is malformed)."""

    KIND: ClassVar[str]

    def body(self) -> dict[str, Any] | None:
        """The message body, as `protocol.encode` sends it: none (typed as the others' for callers)."""
        return None

    @classmethod
    def from_body(cls: type[_Bodiless], body: Any) -> _Bodiless:
        """A received body, checked; raises `ProtocolError` if it is malformed."""
        if body is not None:
            _dict_body(cls.KIND, body)
        return cls()


@dataclasses.dataclass(frozen=True)
class GetState(_NoBody):
    """GET_STATE: the weights and buffers of every stage on the worker. It carries nothing."""

    KIND: ClassVar[str] = protocol.GET_STATE


@dataclasses.dataclass(frozen=True)
class Sync(_NoBody):
    """SYNC: answered once every request sent before it has run, those answered only when they fail
    (`protocol.QUIET_KINDS`) included. It carries nothing."""

    KIND: ClassVar[str] = protocol.SYNC


@dataclasses.dataclass(frozen=True)
class LoadState:
    """LOAD_STATE: copy weights and buffers into stages. ``state``: by SpecSequential key, tensors
    named ``"<layer index>.<name>"``."""

    KIND: ClassVar[str] = protocol.LOAD_STATE

    state: Mapping[str, Mapping[str, torch.Tensor]]

    def body(self) -> dict[str, Any]:
        """The message body, as `protocol.encode` sends it."""
        return {"state": {k: dict(v) for k, v in self.state.items()}}

    @classmethod
    def from_body(cls, body: Any) -> LoadState:
        """A received body, checked; raises `ProtocolError` if it is malformed."""
        what = cls.KIND
        body = _dict_body(what, body)
        return cls(_mapping(what, body, "state", _is_str, _is_tensor_map, "keys to {name: tensor} dicts"))


@dataclasses.dataclass(frozen=True)
class Profile:
    """PROFILE: time the forward plus backward of each layer of ``entries`` on the worker's device
    (``balance="time"``). ``repeats``: runs per layer (1 to 50), ``None`` for the worker's default."""

    KIND: ClassVar[str] = protocol.PROFILE

    entries: Sequence[Any]
    repeats: int | None = None

    def body(self) -> dict[str, Any]:
        """The message body, as `protocol.encode` sends it."""
        body: dict[str, Any] = {"entries": list(self.entries)}
        if self.repeats is not None:
            body["repeats"] = self.repeats
        return body

    @classmethod
    def from_body(cls, body: Any) -> Profile:
        """A received body, checked; raises `ProtocolError` if it is malformed."""
        what = cls.KIND
        body = _dict_body(what, body)
        return cls(_field(what, body, "entries", list), _field(what, body, "repeats", int, None))


# --- the optimizer mirror -------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class OptimCreate:
    """OPTIM_CREATE: build the driver's optimizer ``index`` over the parameters this worker holds.

    Attributes:
        index: the optimizer's position among the driver's optimizers (its name on the workers).
        class_path: the optimizer class's dotted path (sent as ``cls``).
        defaults: the optimizer's ``defaults``.
        groups: one per driver parameter group: its hyperparameters, and under ``"params"`` the
            names (``"<key>/<layer index>.<name>"``) of its parameters this worker holds.
    """

    KIND: ClassVar[str] = protocol.OPTIM_CREATE

    index: int
    class_path: str
    defaults: Mapping[str, Any]
    groups: Sequence[Mapping[str, Any]]

    def body(self) -> dict[str, Any]:
        """The message body, as `protocol.encode` sends it."""
        return {
            "index": self.index,
            "cls": self.class_path,
            "defaults": dict(self.defaults),
            "groups": [dict(g) for g in self.groups],
        }

    @classmethod
    def from_body(cls, body: Any) -> OptimCreate:
        """A received body, checked; raises `ProtocolError` if it is malformed."""
        what = cls.KIND
        index = _index(what, body)
        path = _field(what, body, "cls", str)
        defaults = _mapping(what, body, "defaults", _is_str, _is_anything, "hyperparameter names to values")

        def is_group(g: Any) -> bool:
            return _is_str_keyed(g) and isinstance(g.get("params"), list) and all(map(_is_str, g["params"]))

        groups = _list_of(what, body, "groups", is_group, "hyperparameter dicts with a 'params' list of names")
        return cls(index, path, defaults, groups)


@dataclasses.dataclass(frozen=True)
class OptimStep:
    """OPTIM_STEP: step optimizer ``index``, first setting each group's ``hparams`` (the driver's,
    as schedulers left them; one dict per group, without ``"params"``)."""

    KIND: ClassVar[str] = protocol.OPTIM_STEP

    index: int
    hparams: Sequence[Mapping[str, Any]]

    def body(self) -> dict[str, Any]:
        """The message body, as `protocol.encode` sends it."""
        return {"index": self.index, "hparams": [dict(h) for h in self.hparams]}

    @classmethod
    def from_body(cls, body: Any) -> OptimStep:
        """A received body, checked; raises `ProtocolError` if it is malformed."""
        what = cls.KIND
        index = _index(what, body)
        return cls(index, _list_of(what, body, "hparams", _is_str_keyed, "hyperparameter dicts"))


@dataclasses.dataclass(frozen=True)
class ZeroGrad:
    """ZERO_GRAD: zero (or, with ``set_to_none``, drop) the gradients of optimizer ``index``'s parameters."""

    KIND: ClassVar[str] = protocol.ZERO_GRAD

    index: int
    set_to_none: bool = True

    def body(self) -> dict[str, Any]:
        """The message body, as `protocol.encode` sends it."""
        return {"index": self.index, "set_to_none": self.set_to_none}

    @classmethod
    def from_body(cls, body: Any) -> ZeroGrad:
        """A received body, checked; raises `ProtocolError` if it is malformed."""
        what = cls.KIND
        index = _index(what, body)
        return cls(index, _field(what, body, "set_to_none", bool, True))


@dataclasses.dataclass(frozen=True)
class GetOptimState:
    """GET_OPTIM_STATE: optimizer ``index``'s per-parameter state, by parameter name."""

    KIND: ClassVar[str] = protocol.GET_OPTIM_STATE

    index: int

    def body(self) -> dict[str, Any]:
        """The message body, as `protocol.encode` sends it."""
        return {"index": self.index}

    @classmethod
    def from_body(cls, body: Any) -> GetOptimState:
        """A received body, checked; raises `ProtocolError` if it is malformed."""
        return cls(_index(cls.KIND, body))


@dataclasses.dataclass(frozen=True)
class LoadOptimState:
    """LOAD_OPTIM_STATE: set optimizer ``index``'s per-parameter ``state`` (by parameter name; each
    a dict such as ``{"step": ..., "exp_avg": ...}``)."""

    KIND: ClassVar[str] = protocol.LOAD_OPTIM_STATE

    index: int
    state: Mapping[str, Mapping[str, Any]]

    def body(self) -> dict[str, Any]:
        """The message body, as `protocol.encode` sends it."""
        return {"index": self.index, "state": {k: dict(v) for k, v in self.state.items()}}

    @classmethod
    def from_body(cls, body: Any) -> LoadOptimState:
        """A received body, checked; raises `ProtocolError` if it is malformed."""
        what = cls.KIND
        index = _index(what, body)
        return cls(index, _mapping(what, body, "state", _is_str, _is_str_keyed, "parameter names to state dicts"))


@dataclasses.dataclass(frozen=True)
class Grads:
    """GRADS: one operation on the gradients of optimizer ``index``'s parameters, for clipping and
    replicas across workers. The operations are its subclasses (`GradNorms`, `GradScale`,
    `GradClamp`, `GradAllreduce`); `from_body` returns the one a body's ``op`` names."""

    KIND: ClassVar[str] = protocol.GRADS
    OP: ClassVar[str] = ""

    index: int

    def body(self) -> dict[str, Any]:
        """The message body, as `protocol.encode` sends it."""
        return {"index": self.index, "op": self.OP, **self._arguments()}

    def _arguments(self) -> dict[str, Any]:
        return {}

    @classmethod
    def from_body(cls, body: Any) -> Grads:
        """A received body, checked, as the operation it names; raises `ProtocolError` if it is malformed."""
        what = Grads.KIND
        index = _index(what, body)
        op = _choice(what, body, "op", list(_GRAD_OPS))
        return _GRAD_OPS[op]._checked(index, body)

    @classmethod
    def _checked(cls, index: int, body: dict[str, Any]) -> Grads:
        return cls(index)


@dataclasses.dataclass(frozen=True)
class GradNorms(Grads):
    """``op="norms"``: each gradient's ``norm_type`` norm (for ``clip_grad_norm_`` across stages)."""

    OP: ClassVar[str] = "norms"

    norm_type: float

    def _arguments(self) -> dict[str, Any]:
        return {"norm_type": self.norm_type}

    @classmethod
    def _checked(cls, index: int, body: dict[str, Any]) -> Grads:
        return cls(index, _number(cls.KIND, body, "norm_type"))


@dataclasses.dataclass(frozen=True)
class GradScale(Grads):
    """``op="scale"``: multiply every gradient by ``coef``, a scalar tensor (the clipping coefficient)."""

    OP: ClassVar[str] = "scale"

    coef: torch.Tensor

    def _arguments(self) -> dict[str, Any]:
        return {"coef": self.coef}

    @classmethod
    def _checked(cls, index: int, body: dict[str, Any]) -> Grads:
        coef = _field(cls.KIND, body, "coef", torch.Tensor)
        if coef.dim() != 0 or not coef.is_floating_point():
            raise ProtocolError(f"{cls.KIND} message: field 'coef' must be a floating-point scalar tensor")
        return cls(index, coef)


@dataclasses.dataclass(frozen=True)
class GradClamp(Grads):
    """``op="clamp"``: clamp every gradient to ``[-value, value]`` (``clip_grad_value_``)."""

    OP: ClassVar[str] = "clamp"

    value: float

    def _arguments(self) -> dict[str, Any]:
        return {"value": self.value}

    @classmethod
    def _checked(cls, index: int, body: dict[str, Any]) -> Grads:
        return cls(index, _number(cls.KIND, body, "value"))


@dataclasses.dataclass(frozen=True)
class GradAllreduce(Grads):
    """``op="allreduce"``: sum the gradients over the stage's replicas (`GroupInit` joined them)."""

    OP: ClassVar[str] = "allreduce"


_GRAD_OPS: dict[str, type[Grads]] = {c.OP: c for c in (GradNorms, GradScale, GradClamp, GradAllreduce)}


# --- observing and replicas -----------------------------------------------------------------

TimelineOp = Literal["start", "stop", "fetch", "clock"]


@dataclasses.dataclass(frozen=True)
class Timeline:
    """TIMELINE: ``start`` or ``stop`` recording the stages' events, ``fetch`` (and clear) them, or
    read the worker's ``clock``."""

    KIND: ClassVar[str] = protocol.TIMELINE
    OPS: ClassVar[tuple[str, ...]] = get_args(TimelineOp)

    op: TimelineOp

    def body(self) -> dict[str, Any]:
        """The message body, as `protocol.encode` sends it."""
        return {"op": self.op}

    @classmethod
    def from_body(cls, body: Any) -> Timeline:
        """A received body, checked; raises `ProtocolError` if it is malformed."""
        return cls(_choice(cls.KIND, _dict_body(cls.KIND, body), "op", cls.OPS))


@dataclasses.dataclass(frozen=True)
class GroupInit:
    """GROUP with ``op="init"``: join the torch.distributed process group of this stage's replicas
    through the driver's TCPStore at ``host:port`` (`lightning_remote_mp.worker.collective.ReplicaGroup`).

    Attributes:
        prefix: the group's key prefix in the store; ``rank``, ``world``: this replica's rank and the
            number of replicas; ``backend``: ``"gloo"`` or ``"nccl"``; ``timeout``: seconds.
    """

    KIND: ClassVar[str] = protocol.GROUP

    host: str
    port: int
    prefix: str
    rank: int
    world: int
    backend: str
    timeout: float

    def body(self) -> dict[str, Any]:
        """The message body, as `protocol.encode` sends it."""
        return {
            "op": "init",
            "host": self.host,
            "port": self.port,
            "prefix": self.prefix,
            "rank": self.rank,
            "world": self.world,
            "backend": self.backend,
            "timeout": self.timeout,
        }

    @classmethod
    def from_body(cls, body: Any) -> GroupInit:
        """A received body, checked; raises `ProtocolError` if it is malformed."""
        what = cls.KIND
        body = _dict_body(what, body)
        _choice(what, body, "op", ("init",))
        return cls(
            host=_field(what, body, "host", str),
            port=_field(what, body, "port", int),
            prefix=_field(what, body, "prefix", str),
            rank=_field(what, body, "rank", int),
            world=_field(what, body, "world", int),
            backend=_field(what, body, "backend", str),
            timeout=_number(what, body, "timeout"),
        )


# --- the session -----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Hello:
    """HELLO: a driver opens its session (or asks again, while another one is being dropped).

    Read leniently, on purpose: a driver of another lrmp version may send another body, and it must
    still hear which versions differ; so only ``protocol`` (the wire version) decides, and the other
    fields, informative, are shortened or dropped when malformed rather than refused. PING and BYE
    carry no body: the session id in the header says it all.

    >>> Hello.from_body({"protocol": 7, "driver": 3}).driver
    '?'
    """

    KIND: ClassVar[str] = protocol.HELLO

    driver: str  # who: "host pid N", for logs and the busy message
    protocol_version: Any  # what the driver speaks (``protocol`` on the wire); compared, never trusted
    lrmp: str
    torch: str
    heartbeat_timeout: float | None = None  # the driver's: how long this worker's peers may keep it waiting
    #: What the driver accepts (`protocol.Limits.as_dict`): the worker's bundles of answers stay within it.
    limits: protocol.Limits = protocol.DEFAULT_LIMITS

    def body(self) -> dict[str, Any]:
        """The message body, as `protocol.encode` sends it."""
        return {
            "driver": self.driver,
            "protocol": self.protocol_version,
            "lrmp": self.lrmp,
            "torch": self.torch,
            "heartbeat_timeout": self.heartbeat_timeout,
            "limits": self.limits.as_dict(),
        }

    @classmethod
    def from_body(cls, body: Any) -> Hello:
        """A received body, read leniently (see the class); never raises."""
        body = body if isinstance(body, dict) else {}
        timeout = body.get("heartbeat_timeout")
        sane = isinstance(timeout, (int, float)) and not isinstance(timeout, bool) and 0 < timeout < 3600
        return cls(
            driver=_text(body.get("driver"), 200),
            protocol_version=body.get("protocol", protocol.PROTOCOL_VERSION),
            lrmp=_text(body.get("lrmp"), 100),
            torch=_text(body.get("torch"), 100),
            heartbeat_timeout=float(timeout) if sane else None,
            limits=protocol.Limits.from_dict(body.get("limits")),
        )


def _text(value: Any, limit: int) -> str:
    """A received string, shortened; anything else as ``"?"`` (never ``str()`` of what anyone sent)."""
    return value[:limit] if isinstance(value, str) else "?"


#: The type of every request but the pipeline's, by kind (FORWARD and BACKWARD:
#: `lightning_remote_mp.wire.messages`; PING and BYE carry no body).
REQUESTS: dict[str, type[Any]] = {
    c.KIND: c
    for c in (
        Setup,
        Release,
        GetState,
        LoadState,
        Profile,
        OptimCreate,
        OptimStep,
        ZeroGrad,
        GetOptimState,
        LoadOptimState,
        Grads,
        Timeline,
        GroupInit,
        Sync,
        Hello,
    )
}
