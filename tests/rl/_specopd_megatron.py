"""Per-rank body of the Megatron tree-scoring test (spawned ranks import this module by name).

The policy as the trainer builds it (megatron-core GPTModel from the Hugging Face checkpoint), one
forward over right-padded rows with the stem's keys/values captured, then the branch tokens through
``tree_branch_logits``. Returns what the test compares against plain Hugging Face forwards."""

from __future__ import annotations

import torch

LENS = (13, 6, 21)
WIDTH = 4  # scored tokens per branch (W - 1 of a block of 5)


def rows(vocab: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    S = -(-max(LENS) // 4) * 4
    inputs = torch.zeros(len(LENS), S, dtype=torch.int64)
    for i, n in enumerate(LENS):
        inputs[i, :n] = torch.randint(4, vocab, (n,), generator=g)
    lengths = torch.tensor(LENS)
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    keep = torch.cat([i * S + torch.arange(n) for i, n in enumerate(LENS)])
    # every position of a sequence's first and last token, neighbours, and a few inside
    anchors = torch.tensor([0, 3, 4, int(cu[1]) - 1, int(cu[1]), int(cu[2]) - 1, int(cu[2]), int(cu[2]) + 7,
                            int(cu[2]) + 8, int(cu[3]) - 1])
    tokens = torch.randint(4, vocab, (anchors.numel(), WIDTH), generator=g)
    return inputs, lengths, cu, keep, anchors, tokens


def tree_rank(rank: int, world: int, model_path: str, tensor: int = 1) -> dict:
    from cotrain.models.megatron_compat import apply_cpu_compat, model_parallel_manual_seed

    apply_cpu_compat()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel

    from cotrain.models.hf_io import load_hf_checkpoint
    from cotrain.models.megatron_model import build_gpt_model, load_hf_weights, transformer_config
    from cotrain.parallel import BranchLayout
    from cotrain.parallel.megatron_adapter import StemKV, tree_branch_logits

    ps.initialize_model_parallel(tensor_model_parallel_size=tensor)
    model_parallel_manual_seed(0)
    arch, _, hf_state = load_hf_checkpoint(model_path)
    gpt = build_gpt_model(arch, transformer_config(arch))
    load_hf_weights(gpt, hf_state, arch)
    gpt.eval()
    inputs, lengths, cu, keep, anchors, tokens = rows(arch.vocab_size)
    b, S = inputs.shape
    stem = StemKV(gpt)
    with torch.no_grad():
        stem.active = True
        stem_logits = gpt(inputs, torch.arange(S)[None].expand(b, S), None)
        stem.active = False
        seq = torch.searchsorted(cu, anchors, right=True) - 1
        layout = BranchLayout(cu, anchors, torch.full_like(anchors, WIDTH), context="inclusive", intra="causal")
        bpos = (anchors - cu[seq])[:, None] + 1 + torch.arange(WIDTH)[None]
        logits = tree_branch_logits(gpt, stem, keep, layout, tokens.reshape(-1), bpos.reshape(-1))
        if tensor > 1:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            stem_logits = tensor_parallel.gather_from_tensor_model_parallel_region(stem_logits)
        # the stem forward again without capture: what the policy computes is untouched
        plain = gpt(inputs, torch.arange(S)[None].expand(b, S), None)
        if tensor > 1:
            plain = tensor_parallel.gather_from_tensor_model_parallel_region(plain)
    stem.remove()
    ps.destroy_model_parallel()
    return {"stem_logits": stem_logits.reshape(b * S, -1)[keep], "branch_logits": logits,
            "plain_equal": bool(torch.equal(plain, stem_logits))}


def cp_rows(vocab: int, cp: int, only_rank0: bool = False, seed: int = 0):
    """Right-padded rows (S divisible by 2 * cp), anchors as (row, in-row position) -> packed over whole
    rows (the layout at CP > 1: padding included). ``only_rank0``: anchors all in rank 0's chunks
    (rank 1 then holds no branch and must still take part in the ring)."""
    inputs, lengths, _, _, _, _ = rows(vocab, seed)
    b, S = inputs.shape
    g = torch.Generator().manual_seed(seed + 1)
    if only_rank0:  # chunk 0 of every row: positions 0 .. S / (2 cp) - 1
        where = [(0, 0), (0, 2), (1, 1), (2, 0), (2, 5)]
    else:
        where = [(0, 0), (0, 3), (0, 4), (0, 12), (1, 0), (1, 5), (2, 0), (2, 7), (2, 8), (2, 13), (2, 20)]
    anchors = torch.tensor([i * S + p for i, p in where])
    tokens = torch.randint(4, vocab, (anchors.numel(), WIDTH), generator=g)
    return inputs, lengths, anchors, tokens, where


def tree_rank_cp(rank: int, world: int, model_path: str, only_rank0: bool = False) -> dict:
    from cotrain.models.megatron_compat import apply_cpu_compat, model_parallel_manual_seed

    apply_cpu_compat()
    from megatron.core import parallel_state as ps
    from megatron.core.utils import get_batch_on_this_cp_rank

    from cotrain.models.hf_io import load_hf_checkpoint
    from cotrain.models.megatron_model import build_gpt_model, gpt_layer_spec, load_hf_weights, transformer_config
    from cotrain.parallel import BranchLayout
    from cotrain.parallel.megatron_adapter import CPBranchCoreAttention, StemKV, tree_branch_logits

    ps.initialize_model_parallel(context_parallel_size=world)
    model_parallel_manual_seed(0)
    arch, _, hf_state = load_hf_checkpoint(model_path)
    gpt = build_gpt_model(arch, transformer_config(arch), layer_spec=gpt_layer_spec(arch, core_attention=CPBranchCoreAttention))
    load_hf_weights(gpt, hf_state, arch)
    gpt.eval()
    inputs, lengths, anchors, tokens, where = cp_rows(arch.vocab_size, world, only_rank0)
    b, S = inputs.shape
    local = get_batch_on_this_cp_rank({"tokens": inputs})["tokens"]
    group = ps.get_context_parallel_group()
    cu = torch.arange(0, b * S + 1, S)
    layout = BranchLayout(cu, anchors, torch.full_like(anchors, WIDTH), context="inclusive", intra="causal",
                          cp_size=world)
    mine = layout.local_branches(rank)
    stem = StemKV(gpt)
    with torch.no_grad():
        stem.active = True
        stem_logits = gpt(local, torch.arange(local.shape[1])[None].expand(b, -1), None)
        stem.active = False
        pos = torch.tensor([p for _, p in where])[mine][:, None] + 1 + torch.arange(WIDTH)[None]
        logits = tree_branch_logits(gpt, stem, torch.arange(local.numel()), layout, tokens[mine].reshape(-1),
                                    pos.reshape(-1), group)
    stem.remove()
    ps.destroy_model_parallel()
    return {"mine": mine, "branch_logits": logits, "stem_logits": stem_logits.reshape(local.numel(), -1),
            "index": layout.zigzag_index(rank)}


def tree_rank_pp(rank: int, world: int, model_path: str, tensor: int = 1, context: int = 1,
                 order: tuple = (2, 0, 1), skip: tuple = ()) -> dict:
    """PP = 2 (x TP / CP): the stem through Megatron's forward-only schedule, one row per microbatch,
    every stage capturing every microbatch's stem keys/values; after the schedule the last stage
    scores the microbatches of ``order`` (those in ``skip`` never) through TreePipeline, the first
    stage serves. Returns, on the last stage, each scored microbatch's branch logits (TP-gathered)
    and the branches of its rank (CP), and the schedule's stem logits."""
    from cotrain.models.megatron_compat import apply_cpu_compat, model_parallel_manual_seed

    apply_cpu_compat()
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel
    from megatron.core.pipeline_parallel import get_forward_backward_func
    from megatron.core.utils import get_batch_on_this_cp_rank

    from cotrain.models.hf_io import load_hf_checkpoint
    from cotrain.models.megatron_model import build_gpt_model, gpt_layer_spec, load_hf_weights, transformer_config
    from cotrain.parallel import BranchLayout
    from cotrain.parallel.megatron_adapter import CPBranchCoreAttention, StemKV, TreePipeline

    ps.initialize_model_parallel(tensor_model_parallel_size=tensor, pipeline_model_parallel_size=2,
                                 context_parallel_size=context)
    model_parallel_manual_seed(0)
    arch, _, hf_state = load_hf_checkpoint(model_path)
    spec = gpt_layer_spec(arch, core_attention=CPBranchCoreAttention) if context > 1 else None
    gpt = build_gpt_model(arch, transformer_config(arch), layer_spec=spec)
    load_hf_weights(gpt, hf_state, arch)
    gpt.eval()
    inputs, lengths, cu, _, anchors, tokens = rows(arch.vocab_size)
    b, S = inputs.shape
    micro = [inputs[i:i + 1] for i in range(b)]
    if context > 1:  # each rank's zigzag chunks of the row, as the trainer's batches
        micro = [get_batch_on_this_cp_rank({"tokens": m})["tokens"] for m in micro]
    stem = StemKV(gpt)
    last = ps.is_pipeline_last_stage()

    def forward_step(it, model):
        i, x = next(it)
        stem.microbatch = i  # what DraftStage.before_forward does on every stage
        out = model(x, torch.arange(x.shape[1])[None], None)
        return out, lambda o: (o.sum() * 0, {"logits": o.detach().clone()})

    stem.active = True
    with torch.no_grad():
        res = get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=iter(enumerate(micro)), model=[gpt], num_microbatches=b,
            seq_length=S, micro_batch_size=1, forward_only=True)  # the whole row: Megatron divides by CP
    stem.active = False
    captured = sorted(stem.kv)
    cp_rank = ps.get_context_parallel_rank()
    tree = TreePipeline(gpt, stem, cp_group=ps.get_context_parallel_group() if context > 1 else None)
    out = {"captured": captured, "branches": {}, "logits": {}}
    if not last:
        out["served"] = tree.serve()
    else:
        for i in order:
            if i in skip:
                continue
            sel = (anchors >= cu[i]) & (anchors < cu[i + 1])
            local = anchors[sel] - cu[i]  # in-row positions
            toks = tokens[sel]
            idx = torch.nonzero(sel)[:, 0]
            if context > 1:  # whole rows; this rank's branches are those whose anchors it holds
                layout = BranchLayout(torch.tensor([0, S]), local, torch.full_like(local, WIDTH), context="inclusive",
                                      intra="causal", cp_size=context)
                mine = layout.local_branches(cp_rank)
            else:
                layout = BranchLayout(torch.tensor([0, int(lengths[i])]), local, torch.full_like(local, WIDTH),
                                      context="inclusive", intra="causal")
                mine = torch.arange(local.numel())
            pos = local[mine][:, None] + 1 + torch.arange(WIDTH)[None]
            logits = tree.logits(i, layout, toks[mine].reshape(-1), pos.reshape(-1))
            if tensor > 1:
                logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            out["branches"][i] = idx[mine]
            out["logits"][i] = logits
            stem.clear(i)
        tree.finish()
        stem_logits = [r["logits"] for r in res]
        if tensor > 1:
            stem_logits = [tensor_parallel.gather_from_tensor_model_parallel_region(x) for x in stem_logits]
        out["stem_logits"] = torch.cat(stem_logits)
    stem.remove()
    ps.destroy_model_parallel()
    return out
