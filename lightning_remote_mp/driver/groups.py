"""The process groups in which workers sum gradients, and the store where they meet.

Two kinds of group (`lightning_remote_mp.worker.collective.GradGroup`): the replicas of each stage,
formed when a session with replicas starts, and, per replica, the stages that hold copies of tied
weights (`lightning_remote_mp.driver.ties`), formed when a module with such weights is placed. Both
are torch.distributed process groups (gloo, or NCCL where every member holds its share on a GPU of
its own) that rendezvous through a TCPStore this process hosts. CURVE does not cover them.
"""

from __future__ import annotations

import datetime
import logging
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from lightning_remote_mp.driver import ties
from lightning_remote_mp.errors import ConfigurationError
from lightning_remote_mp.wire import protocol
from lightning_remote_mp.wire.addresses import address_towards, dial_name
from lightning_remote_mp.wire.requests import GroupInit
from lightning_remote_mp.wire.transport import request_all

if TYPE_CHECKING:
    from lightning_remote_mp.driver.links import WorkerLinks

log = logging.getLogger(__name__)


class Groups:
    """A session's process groups and the store where they meet (created with the first group).

    Args:
        links: the session's links to its workers, whose groups these are.
        store_host: the address the workers reach this process at for the store (default: this
            machine's address towards the first worker).
        allow_plaintext_allreduce: with CURVE, let gradients be summed through torch.distributed,
            which CURVE does not cover.
    """

    def __init__(
        self, links: WorkerLinks, store_host: str | None = None, allow_plaintext_allreduce: bool = False
    ) -> None:
        self.links = links
        self.store_host = store_host
        self.allow_plaintext_allreduce = allow_plaintext_allreduce
        self.store: Any = None
        self.store_address = ""

    def rendezvous(self) -> tuple[str, int]:
        """The address and port of the store where the workers' process groups meet (this process
        hosts it, from the first group on)."""
        dialed = [n for a in self.links.addresses if (n := dial_name(a))]
        if dialed:
            raise ConfigurationError(
                f"the workers {', '.join(dialed)} dial in, but this model needs them to sum gradients through "
                "torch.distributed (weights tied across stages), whose workers must accept connections from each "
                "other, which a worker that dials in cannot. Keep the tied weights on one stage (balance=...), or "
                "start those workers with --bind where they can accept connections"
            )
        if self.store is None:
            import torch.distributed as dist

            self.store_address = self.store_host or address_towards(self.links.grid[0][0].address)
            self.store = dist.TCPStore(
                self.store_address,
                0,
                is_master=True,
                wait_for_workers=False,
                timeout=datetime.timedelta(seconds=self.links.connect_timeout),
            )
        return self.store_address, self.store.port

    def check_plaintext(self, what: str, tied: Sequence[ties.Tie]) -> None:
        if tied and self.links.keys is not None and not self.allow_plaintext_allreduce:
            raise ConfigurationError(
                f"{what} has weights that several stages hold copies of (tied weights: layer "
                f"{', '.join(sorted({n for t in tied for n in t.names.values()})[:4])}); their gradients are summed "
                "through torch.distributed (gloo or NCCL), which CURVE does not cover: anyone on the network between "
                "the workers could read and alter them. Set curve.allow_plaintext_allreduce=True if every host on "
                "that network is trusted, or untie the weights (HuggingFace: tie_word_embeddings=False)."
            )

    def form_tie_groups(self, key: str, tied: Sequence[ties.Tie]) -> None:
        """A gradient group per set of stages that hold copies of tied weights, in every replica."""
        host, port = self.rendezvous()
        infos = dict(zip(self.links.addresses, self.links.workers))
        requests = []
        for r, row in enumerate(self.links.grid):
            for stages, members in ties.groups(tied):
                backend = replica_backend([infos[row[s].address] for s in stages])
                for rank, s in enumerate(stages):
                    join = GroupInit(
                        host=host,
                        port=port,
                        prefix=f"{self.links.id}/{key}/replica{r}/tie{'-'.join(map(str, stages))}",
                        rank=rank,
                        world=len(stages),
                        backend=backend,
                        timeout=float(self.links.connect_timeout),
                        params=[f"{key}/{tie.names[s]}" for tie in members],
                    )
                    requests.append((row[s], protocol.GROUP, join.body()))
        request_all(requests, what="tied weights' gradient groups")
        log.info(
            "%r: %d tied weight(s) held by several stages sum their gradients before each step",
            key,
            len(tied),
        )

    def form_replica_groups(self) -> None:
        """A torch.distributed process group per stage, among that stage's replicas (gloo; NCCL where
        every replica of the stage has CUDA), rendezvousing through a store this process hosts."""
        host, port = self.rendezvous()
        infos = dict(zip(self.links.addresses, self.links.workers))
        requests = []
        for s in range(self.links.topology.stages):
            column = [row[s] for row in self.links.grid]
            backend = replica_backend([infos[c.address] for c in column])
            if backend == "gloo" and all(str(infos[c.address].get("device")).startswith("cuda") for c in column):
                log.info("stage %d: replicas share a GPU, so their gradients are summed through gloo", s)
            for r, conn in enumerate(column):
                join = GroupInit(
                    host=host,
                    port=port,
                    prefix=f"{self.links.id}/stage{s}",
                    rank=r,
                    world=self.links.topology.replicas,
                    backend=backend,
                    timeout=float(self.links.connect_timeout),
                )
                requests.append((conn, protocol.GROUP, join.body()))
        request_all(requests, what="replica group set-up")
        log.info(
            "%d replicas of %d stages: gradients are all-reduced per stage through torch.distributed",
            self.links.topology.replicas,
            self.links.topology.stages,
        )


def replica_backend(workers: Sequence[Mapping[str, Any]]) -> str:
    """The torch.distributed backend for one stage's replicas, from what their workers said of their
    devices: NCCL where each has a GPU of its own, else gloo (NCCL refuses two ranks on one GPU,
    which is how the zero-config default places replicas on a one-GPU machine).

    >>> gpu = lambda uuid: {"device": "cuda:0", "device_uuid": uuid}
    >>> replica_backend([gpu("GPU-a"), gpu("GPU-b")]), replica_backend([gpu("GPU-a"), gpu("GPU-a")])
    ('nccl', 'gloo')
    >>> replica_backend([gpu("GPU-a"), {"device": "cpu"}])
    'gloo'
    """
    if not all(str(w.get("device", "cpu")).startswith("cuda") for w in workers):
        return "gloo"
    gpus = [w.get("device_uuid") for w in workers]
    if all(isinstance(g, str) for g in gpus) and len(set(gpus)) < len(gpus):
        return "gloo"
    return "nccl"
