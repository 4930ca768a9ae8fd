"""Per-rank bodies for the Megatron tests (spawned processes import this module)."""

from functools import partial

import torch


def make_batch(num_micro: int, micro_batch: int, seq_len: int, seed: int = 0):
    """Arithmetic sequences, right-padded to seq_len: (input_ids, labels, loss_mask) per microbatch."""
    from cotrain.models.tokenizer import build_tokenizer
    from cotrain.tasks.data import arithmetic_dataset

    tok = build_tokenizer()
    probs = arithmetic_dataset(num_micro * micro_batch, seed=seed)
    micro = []
    for m in range(num_micro):
        rows = [tok.encode(p.prompt + p.answer) + [tok.eos_token_id] for p in probs[m * micro_batch:(m + 1) * micro_batch]]
        ids = torch.full((micro_batch, seq_len + 1), tok.pad_token_id)
        mask = torch.zeros(micro_batch, seq_len)
        for i, r in enumerate(rows):  # uneven lengths: each row ends where its text ends
            ids[i, : len(r)] = torch.tensor(r)
            mask[i, : len(r) - 1] = 1
        micro.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), mask))
    return micro


def pp_train_step(rank, world, model_path, pp, micro):
    """One forward/backward through Megatron's pipeline schedule; returns losses, grads, logits."""
    from cotrain.models.megatron_compat import seed_model_parallel
    from cotrain.models import convert
    from cotrain.models.megatron_model import build_gpt_model, layer_offset, load_hf_weights
    from cotrain.models.hf_io import load_hf_checkpoint
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
    seed_model_parallel(0, "cuda" if torch.cuda.is_available() else "cpu")
    arch, _, hf_state = load_hf_checkpoint(model_path)
    model = build_gpt_model(arch)
    load_hf_weights(model, hf_state, arch)
    dev = next(model.parameters()).device  # the batch goes where the model is (CPU here, a GPU there)
    micro = [tuple(t.to(dev) for t in mb) for mb in micro]
    b, s = micro[0][0].shape
    pos = torch.arange(s, device=dev)[None].expand(b, s)

    def loss_func(mask, per_token):
        loss = (per_token.float() * mask).sum() / mask.sum()
        return loss, {"loss": loss.detach()}

    def forward_step(it, model):
        ids, labels, mask = next(it)
        return model(ids, pos, None, labels=labels), partial(loss_func, mask)

    out = get_forward_backward_func()(
        forward_step_func=forward_step, data_iterator=iter(micro), model=[model], num_microbatches=len(micro),
        seq_length=s, micro_batch_size=b, forward_only=False,
    )
    grads = {n: p.grad.cpu().clone() for n, p in model.named_parameters() if p.grad is not None}
    global_grads = convert.from_local(grads, layer_offset(model))
    sq = torch.stack([g.float().pow(2).sum() for g in grads.values()]).sum()
    torch.distributed.all_reduce(sq, group=ps.get_pipeline_model_parallel_group())
    result = {"grad_norm": sq.sqrt().item(), "grads": global_grads, "losses": None, "logits": None}
    if ps.is_pipeline_last_stage():
        result["losses"] = [o["loss"].item() for o in out]
    if pp == 1:
        with torch.no_grad():
            result["logits"] = model(micro[0][0], pos, None).cpu()
    return result



def megatron_logits(rank, world, model_path, ids):
    """Logits of a HF checkpoint loaded into a single-stage Megatron GPTModel."""
    from cotrain.models.hf_io import load_hf_checkpoint
    from cotrain.models.megatron_compat import seed_model_parallel
    from cotrain.models.megatron_model import build_gpt_model, load_hf_weights
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel()
    seed_model_parallel(0, "cuda" if torch.cuda.is_available() else "cpu")
    arch, _, hf_state = load_hf_checkpoint(model_path)
    model = build_gpt_model(arch)
    load_hf_weights(model, hf_state, arch)
    dev = next(model.parameters()).device
    ids = ids.to(dev)
    pos = torch.arange(ids.shape[1], device=dev)[None].expand_as(ids)
    with torch.no_grad():
        return model(ids, pos, None).cpu()
