"""Exact merge of partial attention results by log-sum-exp.

If a query's keys are split into disjoint sets A and B, with partial results
    out_X = sum_{k in X} exp(s_k - lse_X) v_k,   lse_X = log sum_{k in X} exp(s_k),
then attention over A u B is
    lse = log(exp(lse_A) + exp(lse_B))
    out = (exp(lse_A) out_A + exp(lse_B) out_B) / exp(lse)
        = out_A - sigmoid(lse_B - lse_A) * (out_A - out_B)
(ring-flash-attention's form; all of it in the accumulation dtype, fp32 or fp64). A set that
contains no visible key has lse = -inf and out = 0 and leaves the other side unchanged; two empty
sets stay empty.
"""

from __future__ import annotations

import torch


def merge_lse_(out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor) -> None:
    """In place: (out, lse) <- merge of (out, lse) and (block_out, block_lse).

    out, block_out: (..., D); lse, block_lse: (...), -inf where nothing was visible (fp32 or fp64).
    """
    # sigmoid(-inf - -inf) is nan: both sides empty, nothing to take from the block.
    weight = torch.nan_to_num(torch.sigmoid(block_lse - lse), nan=0.0)
    out.sub_(weight.unsqueeze(-1) * (out - block_out))
    lse.copy_(torch.logaddexp(lse, block_lse))


def merge_lse(
    out: torch.Tensor, lse: torch.Tensor, block_out: torch.Tensor, block_lse: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Out-of-place merge_lse_."""
    out, lse = out.clone(), lse.clone()
    merge_lse_(out, lse, block_out, block_lse)
    return out, lse
