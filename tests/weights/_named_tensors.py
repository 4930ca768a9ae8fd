"""The named tensors the weight-path tests push: three dtypes and a tied pair."""

from __future__ import annotations

import torch


def sample_weights() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    w = {"a.weight": torch.randn(3, 4, generator=g), "b.bias": torch.arange(5),
         "c.weight": torch.randn(2, 2, generator=g).to(torch.bfloat16)}
    w["tied.weight"] = w["a.weight"]  # shares storage: safetensors would refuse it as is
    return w
