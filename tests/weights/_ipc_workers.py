"""Per-rank body of the cuda_ipc handle-set test (spawned processes import this module)."""

from __future__ import annotations

import torch

#: each trainer rank's "GPU" (rank r sits on GPU-r): the test picks which of them host engines
RANK_GPUS = ["GPU-0", "GPU-1", "GPU-2"]


def state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {"w": torch.randn(3, 4, generator=g), "b": torch.arange(5, dtype=torch.int64),
            "h": torch.randn(2, 2, generator=g).to(torch.bfloat16)}


def export(rank: int, world: int, engine_gpus: list[str], empty: bool = False):
    """One ``send_collective`` on a gloo group; torch's CUDA export is replaced by one that names the
    rank and carries the values it exported (so the test sees whose copy backs which GPU)."""
    from cotrain.weights import WeightPushError
    from cotrain.weights.transports.cuda_ipc import CudaIpcTransport, restore_update_info

    def share(t: torch.Tensor):
        return ("rank", rank, t.float().flatten().tolist())

    tx = CudaIpcTransport("cpu", engine_gpus=engine_gpus, share=share, uuid=RANK_GPUS[rank])
    try:
        h = tx.send_collective(({} if empty else state()) if rank == 0 else None, 3)
    except WeightPushError as e:
        return {"error": str(e)}
    held = tx.held()
    if h is not None:
        h = dict(h, update_info=restore_update_info(h["update_info"]))
    tx.release(h if h is not None else {"seq": 1})
    return {"handle": h, "held": held, "held_after": tx.held()}
