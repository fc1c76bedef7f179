"""Copies of a weight on several workers stay identical by summing their gradients with torch.distributed.

Two kinds of copies: the workers holding the same stage in different replicas (each saw a share of
the batch), and the stages of one pipeline that each hold a copy of a tied weight (each computed
its uses' share of the gradient: DeepSpeed's ``ReduceTiedGrads``). Each set forms a process group
(gloo, or NCCL when they all hold it on CUDA GPUs of their own) through a TCPStore the driver hosts.
A group is this session's own object, not torch.distributed's global default group, so sessions come
and go.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

from lightning_remote_mp.errors import GroupError


class GradGroup:
    def __init__(self, host: str, port: int, prefix: str, rank: int, world: int, backend: str, timeout: float) -> None:
        if not 0 <= rank < world:
            raise ValueError(f"rank {rank} outside a group of {world}")
        delta = datetime.timedelta(seconds=timeout)
        store = dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False, timeout=delta))
        if backend == "nccl":
            self.pg = dist.ProcessGroupNCCL(store, rank, world)
            self.device = torch.device("cuda", torch.cuda.current_device())
        elif backend == "gloo":
            self.pg = dist.ProcessGroupGloo(store, rank, world, delta)
            self.device = torch.device("cpu")
        else:
            raise ValueError(f"unknown backend {backend!r}; use 'gloo' or 'nccl'")
        self.rank, self.world, self.backend = rank, world, backend

    def _allreduce(self, tensor: torch.Tensor, op: dist.ReduceOp = dist.ReduceOp.SUM) -> None:
        opts = dist.AllreduceOptions()
        opts.reduceOp = op
        try:
            self.pg.allreduce([tensor], opts).wait()
        except RuntimeError as err:
            raise GroupError(
                f"summing gradients over a group of {self.world} workers ({self.backend}, this one rank {self.rank}) "
                f"failed: {err}"
            ) from err

    def allreduce_grads(self, params: Sequence[torch.nn.Parameter]) -> int:
        """Sum the gradients of ``params`` over the group; returns the bytes reduced.

        A member without a gradient for a parameter (a replica whose share of the batch was empty)
        contributes zeros, while a parameter no member has a gradient for keeps none (as it would in
        a single pipeline).
        """
        present = torch.tensor([p.grad is not None for p in params], dtype=torch.int32, device=self.device)
        self._allreduce(present, dist.ReduceOp.MAX)
        grads: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
        for p, flag in zip(params, present.tolist()):
            if flag:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                grads.setdefault((p.grad.dtype, p.grad.device), []).append(p.grad)
        reduced = 0
        for tensors in grads.values():
            flat = torch.cat([g.reshape(-1) for g in tensors]).to(self.device)
            self._allreduce(flat)
            reduced += flat.numel() * flat.element_size()
            offset = 0
            for g in tensors:
                g.copy_(flat[offset : offset + g.numel()].view_as(g))
                offset += g.numel()
        return reduced
