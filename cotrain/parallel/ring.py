"""RingComm: batched point-to-point exchange around a CP group's ring.

Rank r sends to r+1 and receives from r-1 (mod C), with torch.distributed.batch_isend_irecv so
the transfer overlaps the compute issued between commit() and wait(). It works on gloo (CPU) and
NCCL (GPU). Each RingComm uses its own tag, so two rings in flight at once (K/V and dK/dV in the
backward) never match each other's messages on gloo; NCCL ignores tags but keeps per-peer order.
`bytes_sent` counts the payload this rank has sent.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.distributed as dist


def group_rank_and_size(group: Optional[dist.ProcessGroup]) -> tuple[int, int]:
    """(rank, size) in `group`; (0, 1) when torch.distributed is not initialised and group is None."""
    if group is None and not (dist.is_available() and dist.is_initialized()):
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


class RingComm:
    def __init__(self, group: Optional[dist.ProcessGroup], tag: int = 0) -> None:
        self.group = group
        self.tag = tag
        self.rank, self.world_size = group_rank_and_size(group)
        handle = group if group is not None else dist.group.WORLD
        self.send_peer = dist.get_global_rank(handle, (self.rank + 1) % self.world_size)
        self.recv_peer = dist.get_global_rank(handle, (self.rank - 1) % self.world_size)
        self.bytes_sent = 0
        self._ops: list[dist.P2POp] = []
        self._reqs = None

    def send_recv(self, to_send: torch.Tensor, recv_buffer: Optional[torch.Tensor] = None) -> torch.Tensor:
        """Queue sending `to_send` to the next rank and receiving a same-shaped tensor from the previous."""
        to_send = to_send.contiguous()
        recv = torch.empty_like(to_send) if recv_buffer is None else recv_buffer
        self._ops.append(dist.P2POp(dist.isend, to_send, self.send_peer, self.group, self.tag))
        self._ops.append(dist.P2POp(dist.irecv, recv, self.recv_peer, self.group, self.tag))
        self.bytes_sent += to_send.numel() * to_send.element_size()
        return recv

    def commit(self) -> None:
        if self._reqs is not None:
            raise RuntimeError("commit() called twice without wait()")
        self._reqs = dist.batch_isend_irecv(self._ops)

    def wait(self) -> None:
        if self._reqs is None:
            raise RuntimeError("wait() called without commit()")
        for req in self._reqs:
            req.wait()
        self._reqs = None
        self._ops = []
