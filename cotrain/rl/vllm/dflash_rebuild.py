"""DFlash's fused context-K/V buffers, rebuilt after a drafter push.

vLLM builds them at the end of ``load_weights``; during a layerwise reload that moment sees RoPE's
cache on the meta device and (on CPU) ``qkv_proj.weight`` already emptied by the oneDNN prepack,
from which vLLM would rebuild them. The transfer backend (:mod:`cotrain.rl.vllm.transfer_backend`)
calls :func:`rebuild_dflash_context_kv` once a drafter push has finished loading.
"""

from __future__ import annotations

import re

import torch

from cotrain.weights.checks import WeightPushError

KV_NAME = re.compile(r"(?:^|\.)(?:layers\.(\d+)|midlayer)\.self_attn\.([kv])_proj\.(weight|bias)$")


def rebuild_dflash_context_kv(draft: torch.nn.Module, pushed: dict[str, torch.Tensor]) -> bool:
    """Rebuild a DFlash drafter's fused context-K/V buffers after a reload; False if not DFlash.

    vLLM builds them at the end of ``load_weights``; during a layerwise reload that moment sees
    RoPE's cache on the meta device and (on CPU) ``qkv_proj.weight`` already emptied by the
    oneDNN prepack. Here, after the reload finished, every buffer is rebuilt from the live
    modules, and the fused K/V weight from the pushed ``k_proj`` / ``v_proj`` tensors where the
    live weight is not readable (layers the push did not carry keep their previous rows).
    """
    inner = getattr(draft, "model", None)
    if inner is None or not hasattr(inner, "_build_fused_kv_buffers"):
        return False
    old_w = getattr(inner, "_fused_kv_weight", None)
    old_b = getattr(inner, "_fused_kv_bias", None)
    inner._build_fused_kv_buffers()  # RoPE cache, k_norm stack, hidden_norm alias, layer metadata
    attns = [layer.self_attn for layer in inner.layers]
    readable = all(a.qkv_proj.weight.dim() == 2 and not a.qkv_proj.weight.is_meta
                   and a.qkv_proj.weight.shape[0] == a.q_size + 2 * a.kv_size for a in attns)
    if readable or getattr(inner, "_fused_kv_weight", None) is None and old_w is None:
        return True
    start = _draft_start_layer(inner)
    found: dict[tuple[int, str, str], torch.Tensor] = {}
    for name, t in pushed.items():
        m = KV_NAME.search(name)
        if m:
            idx = 0 if m.group(1) is None else int(m.group(1))
            if idx >= len(attns) and start and idx - start < len(attns):
                idx -= start
            found[(idx, m.group(2), m.group(3))] = t
    kv = attns[0].kv_size
    dtype, device = attns[0].o_proj.weight.dtype, inner.hidden_norm.weight.device

    def fused(kind: str, old: torch.Tensor | None) -> torch.Tensor | None:
        rows = []
        for i in range(len(attns)):
            k, v = found.get((i, "k", kind)), found.get((i, "v", kind))
            if k is None or v is None:
                if old is None or old.shape[0] != 2 * kv * len(attns):
                    raise WeightPushError(f"DFlash rebuild: layer {i} {kind} of k_proj/v_proj missing from the push "
                                          "and no previous fused buffer to keep it from")
                rows.append(old[i * 2 * kv:(i + 1) * 2 * kv])
            else:
                rows += [k, v]
        return torch.cat([r.to(device=device, dtype=dtype) for r in rows], dim=0).contiguous()

    inner._fused_kv_weight = fused("weight", old_w)
    if attns[0].qkv_proj.bias is not None:
        inner._fused_kv_bias = fused("bias", old_b)
    return True


def _draft_start_layer(inner: torch.nn.Module) -> int:
    try:
        first = inner.layers[0].self_attn.attn.layer_name
        return int(re.search(r"layers\.(\d+)", first).group(1))
    except Exception:
        return 0
