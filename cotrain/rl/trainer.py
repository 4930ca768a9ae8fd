"""One rank of the Megatron policy trainer (what runs inside each training worker).

A world of TP x PP x CP x DP ranks holds the policy as megatron-core GPTModel stages (wrapped in
Megatron's DistributedDataParallel, stepped by Megatron's optimizer). Every method is called on
*all* ranks with the same arguments (SPMD); each rank takes the slice of the batch that belongs to
its data-parallel rank, and results come back from the ranks that hold them (the last pipeline
stage for per-token quantities, global rank 0 for exported weights).

Loss scaling: the GRPO loss is a mean over *all* response tokens of the step (``token_mean``) or
over all sequences (``seq_mean``). A micro-batch contributes ``local_sum / global_count``; since
Megatron's schedule divides each micro-batch loss by the number of micro-batches and its DDP
averages gradients over DP ranks, the loss handed to Megatron is multiplied by both, so that the
gradient is exactly that of the global mean whatever the layout (tested: PP/DP layouts agree).
"""

from __future__ import annotations

import os
import random
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist

from cotrain.config.derived import packing_budget, total_optimizer_steps
from cotrain.draft.optim import apply_config
from cotrain.models import convert
from cotrain.models.hf_io import load_hf_checkpoint
from cotrain.models.megatron_compat import seed_model_parallel
from cotrain.models.megatron_model import (build_gpt_model, gpt_layer_spec, layer_offset, load_hf_weights,
                                           load_tensor_state, resolve_layer_spec, tensor_state, transformer_config)
from cotrain.parallel.zigzag import zigzag_merge
from cotrain.rl.batch import TrainBatch
from cotrain.rl.packing import PackedMicro, rank_micro_batches
from cotrain.rl.grpo import aggregate, grpo_token_losses
from cotrain.rl.sampling_filter import sampling_logits
from cotrain.seeding import mix

from megatron.core import parallel_state as ps  # noqa: E402  (after the compat layer)
from megatron.core import tensor_parallel  # noqa: E402
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads  # noqa: E402
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer  # noqa: E402
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler, get_canonical_lr_for_logging  # noqa: E402
from megatron.core.pipeline_parallel import get_forward_backward_func  # noqa: E402


#: train_step metrics every rank computes whole (the others are per-rank parts, reduced over DP x CP)
GLOBAL_METRICS = ("grad_norm", "optimizer_steps", "lr")


def rank_device(kind: str, visible: int | None = None, local_rank: int | None = None) -> torch.device:
    """The rank's device for ``cluster.device`` = ``kind``: cuda -> ``cuda:0`` of the GPUs this process sees (Ray
    gives each training actor its own through CUDA_VISIBLE_DEVICES) unless it sees several, then ``cuda:LOCAL_RANK``.

    ``visible`` (default ``torch.cuda.device_count()``) and ``local_rank`` (default ``$LOCAL_RANK``, else 0)
    are parameters for tests."""
    if kind == "cpu":
        return torch.device("cpu")
    if kind != "cuda":
        raise ValueError(f"cluster.device={kind!r}: a trainer rank runs on cpu or cuda (auto is resolved when "
                         "the config is loaded)")
    visible = torch.cuda.device_count() if visible is None else visible
    if visible < 1:
        raise RuntimeError("cluster.device=cuda, but this process sees no GPU (CUDA_VISIBLE_DEVICES="
                           f"{os.environ.get('CUDA_VISIBLE_DEVICES')!r})")
    if visible == 1:
        return torch.device("cuda", 0)
    index = int(os.environ.get("LOCAL_RANK", 0)) if local_rank is None else int(local_rank)
    if not 0 <= index < visible:
        raise RuntimeError(f"LOCAL_RANK={index}, but this process sees {visible} GPUs")
    return torch.device("cuda", index)


def policy_layer_spec(cfg, arch, device: torch.device):
    """The policy's layer spec: ``policy.layer_spec`` (local or transformer-engine's fused layers), its attention
    core by ``policy.context_parallel_impl``: megatron_te -> TE's attention (Megatron's own CP); cotrain under
    CP > 1 -> cotrain's ring (:class:`~cotrain.parallel.megatron_adapter.CPBranchCoreAttention`, which takes the
    spec's q / k / v whatever the linears around it); the same ring at CP = 1 for packed rows (policy.packing)
    with the local spec; else the spec's own."""
    kind = resolve_layer_spec(cfg.policy.layer_spec, device)
    core = None
    if cfg.policy.context_parallel_impl == "megatron_te":
        from megatron.core.extensions.transformer_engine import HAVE_TE, TEDotProductAttention

        if not HAVE_TE:  # megatron then defines placeholders instead of failing its import
            raise RuntimeError("policy.context_parallel_impl=megatron_te needs transformer-engine, which does not "
                               "import here (allowed without it: cotrain)")
        core = TEDotProductAttention
    elif cfg.policy.parallel.context > 1 or (cfg.policy.packing and kind == "local"):
        # Megatron's local DotProductAttention runs neither CP nor packed (THD) rows: cotrain's ring
        # kernel does both (TE's attention takes THD itself)
        from cotrain.parallel.megatron_adapter import CPBranchCoreAttention

        core = CPBranchCoreAttention
    return gpt_layer_spec(arch, core_attention=core, kind=kind)


def _return_freed_memory() -> None:
    """Hand the heap the update freed back to the system (glibc's ``malloc_trim``): a CPU worker would
    otherwise keep its update's peak (the activations of its micro batches) between updates, away from
    the rollout engines on the same machine; bench/update.py measured ~3 GiB returned in ~0.2 s on
    bench_small's padded layout. Nothing where the C library is not glibc."""
    import ctypes

    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _as_tuple(x):
    """Python's random state as ``random.setstate`` wants it: tuples all the way down (a checkpoint may
    hand back lists)."""
    return tuple(_as_tuple(v) for v in x) if isinstance(x, (list, tuple)) else x


class MegatronPolicyWorker:
    def __init__(self, cfg, model_path: str, rank: int, world_size: int, master_addr: str, master_port: int,
                 draft_init: str | None = None):
        self.cfg, self.rank, self.world_size = cfg, rank, world_size
        par = cfg.policy.parallel
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = master_addr, str(master_port)
        #: this rank's device: every batch is moved here once (TrainBatch.to), results leave on the CPU
        self.device = rank_device(cfg.cluster.device)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # before NCCL's process group: it binds the current device
        dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", rank=rank, world_size=world_size)
        ps.initialize_model_parallel(tensor_model_parallel_size=par.tensor, pipeline_model_parallel_size=par.pipeline,
                                     context_parallel_size=par.context)
        seed_model_parallel(cfg.run.seed, self.device)
        self.arch, _, hf_state = load_hf_checkpoint(model_path)
        self.dtype = torch.bfloat16 if cfg.policy.dtype == "bfloat16" else torch.float32
        mcfg = transformer_config(self.arch, dtype=self.dtype)
        mcfg.finalize_model_grads_func = finalize_model_grads
        # the layer spec (local or transformer-engine's) and its attention core (TE's, cotrain's CP ring or its own)
        self.layer_spec = policy_layer_spec(cfg, self.arch, self.device)
        model = build_gpt_model(self.arch, mcfg, layer_spec=self.layer_spec)
        load_hf_weights(model, hf_state, self.arch)
        self.model = DistributedDataParallel(
            mcfg, DistributedDataParallelConfig(grad_reduce_in_fp32=True, overlap_grad_reduce=False,
                                                use_distributed_optimizer=False), model)
        opt = cfg.policy.optimizer
        min_lr = min(opt.min_lr, opt.lr)  # only the cosine schedule reaches it (validation: min_lr <= lr)
        # clip_grad=0 here: Megatron's clipping asserts CUDA tensors; we clip in step() (same maths)
        self.optimizer = get_megatron_optimizer(
            OptimizerConfig(optimizer="adam", lr=opt.lr, min_lr=min_lr, adam_beta1=opt.betas[0],
                            adam_beta2=opt.betas[1], adam_eps=opt.eps, weight_decay=opt.weight_decay, clip_grad=0.0,
                            bf16=self.dtype == torch.bfloat16, params_dtype=self.dtype),
            [self.model])
        # The LR schedule over the run's optimizer steps, Megatron's scheduler stepped *before* each
        # optimizer step: the k-th step (from 1) runs at lr(k), so warm-up's first step is not at 0 and
        # the last one is at min_lr. Config values win over a checkpoint's (override); the step count
        # comes from the checkpoint. Weight decay: Megatron's groups (none on biases and norms).
        total = max(total_optimizer_steps(cfg) or 1, opt.warmup_steps + 1)
        self.scheduler = OptimizerParamScheduler(
            self.optimizer, init_lr=0.0, max_lr=opt.lr, min_lr=min_lr, lr_warmup_steps=opt.warmup_steps,
            lr_decay_steps=total, lr_decay_style=opt.schedule, start_wd=opt.weight_decay, end_wd=opt.weight_decay,
            wd_incr_steps=total, wd_incr_style="constant", use_checkpoint_opt_param_scheduler=False,
            override_opt_param_scheduler=True)
        self.ref_model = None
        if cfg.policy.reference_model:
            self.ref_model = build_gpt_model(self.arch, transformer_config(self.arch, dtype=self.dtype),
                                             layer_spec=self.layer_spec)
            load_hf_weights(self.ref_model, hf_state, self.arch)
            self.ref_model.requires_grad_(False).eval()
        self.steps_done = 0  # optimizer steps
        self.updates_done = 0  # train_step calls (rollout batches)
        # the co-trained drafter: taps on every stage, the drafter on the last (collective to build)
        self.draft = None
        if cfg.draft.kind is not None and cfg.draft.cotrain:
            from cotrain.rl.draft_stage import DraftStage

            self.draft = DraftStage(cfg, self.model, self.dtype, model_path, init_dir=draft_init,
                                    name=f"draft{master_port}", device=self.device)

    # ------------------------------------------------------------------ layout
    def info(self) -> dict:
        return {"rank": self.rank, "dp_rank": ps.get_data_parallel_rank(), "dp_size": ps.get_data_parallel_world_size(),
                "pp_rank": ps.get_pipeline_model_parallel_rank(), "tp_rank": ps.get_tensor_model_parallel_rank(),
                "holds_outputs": self._holds_outputs(), "draft_holder": self._draft_holder()}

    def _holds_outputs(self) -> bool:
        return (ps.is_pipeline_last_stage() and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_context_parallel_rank() == 0)

    def _my_shard(self, batch: TrainBatch) -> TrainBatch:
        """This rank's sequences (DP) and, under CP, its two zigzag chunks of every sequence, on the rank's
        device (the one move of the batch: everything the step computes from it stays there)."""
        shard = batch.split(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
        cp = ps.get_context_parallel_world_size()
        if cp > 1:
            shard = shard.zigzag(ps.get_context_parallel_rank(), cp)
        return shard.to(self.device)

    def _micro_batches(self, batch: TrainBatch) -> list:
        """This rank's micro batches of ``batch`` on its device: with policy.packing its share of the
        token-balanced plan (:mod:`cotrain.rl.packing`: PackedMicro rows, at PP > 1 all of one width),
        else padded rows (its DP shard, CP zigzag chunks, micro_batch_size rows each)."""
        if not self.cfg.policy.packing:
            return self._micro(self._my_shard(batch))
        micro = rank_micro_batches(batch, packing_budget(self.cfg), ps.get_data_parallel_world_size(),
                                   ps.get_data_parallel_rank(), ps.get_context_parallel_world_size(),
                                   ps.get_context_parallel_rank(),
                                   same_width=ps.get_pipeline_model_parallel_world_size() > 1)
        return [mb.to(self.device) for mb in micro]

    def _rows_of(self, batch: TrainBatch, micro: list, parts: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
        """(rows, values [len(rows), S]): per-position results of this rank's micro batches (last stage) as the
        batch's rows this DP rank holds, whole (gathered over CP), on the CPU."""
        if not self.cfg.policy.packing:
            n = len(batch) // ps.get_data_parallel_world_size()
            rows = torch.arange(ps.get_data_parallel_rank() * n, (ps.get_data_parallel_rank() + 1) * n)
            return rows, self._gather_cp(torch.cat(parts)).cpu()
        grid = torch.zeros(len(batch), batch.seq_len, device=self.device)
        for mb, values in zip(micro, parts):
            mb.scatter(values, grid)
        if ps.get_context_parallel_world_size() > 1:  # each CP rank wrote its own positions
            dist.all_reduce(grid, group=ps.get_context_parallel_group())
        rows = torch.sort(torch.cat([mb.rows for mb in micro])).values
        return rows, grid[rows.to(self.device)].cpu()

    def _gather_cp(self, local: torch.Tensor) -> torch.Tensor:
        """[n, S/cp] zigzag chunks from every CP rank -> [n, S] in sequence order."""
        cp = ps.get_context_parallel_world_size()
        if cp == 1:
            return local
        parts = [torch.empty_like(local) for _ in range(cp)]
        dist.all_gather(parts, local.contiguous(), group=ps.get_context_parallel_group())
        return zigzag_merge(parts, dim=1)

    # ------------------------------------------------------------------ forward machinery
    def _token_logprobs(self, model, mb, on_logits=None, logit_rows=None) -> torch.Tensor:
        """log pi(target) for every position, [b, S] (vocab-parallel safe), pi the distribution the
        engines sample from: the tempered logits with vLLM's top-k / top-p filter of
        rollout.sampling (:mod:`cotrain.rl.sampling_filter`: -inf outside the kept set). On the last
        stage ``on_logits`` receives those filtered tempered logits [b, S, V/tp] (detached) first;
        with ``logit_rows`` (sorted positions of the flattened [b * S]) only those rows, [n, V/tp]:
        a copy of what the drafter reads, not of the whole micro batch.
        ``mb``: padded rows (TrainBatch) or a packed row (PackedMicro: Megatron's THD path).

        Chunked (policy.logprob_chunk_tokens): the last stage runs the output layer over chunks of
        the positions, each chunk's logits -> log-probs under activation checkpointing, so the
        backward recomputes one chunk's [tokens, V/tp] logits at a time instead of keeping them all."""
        kwargs = {}
        if isinstance(mb, PackedMicro):
            pos, kwargs["packed_seq_params"] = mb.positions(), mb.packed_seq_params
        else:
            pos = torch.arange(mb.seq_len, device=mb.inputs.device)[None].expand(len(mb), -1)
        if not ps.is_pipeline_last_stage():
            return model(mb.inputs, pos, None, **kwargs)  # hidden states travelling to the next stage
        gpt = getattr(model, "module", model)
        weight = gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights else None
        head = gpt.output_layer
        b, s = mb.inputs.shape
        chunk = self._chunk_positions(b, (weight if weight is not None else head.weight).shape[0])
        if chunk >= s:
            if on_logits is not None and logit_rows is not None:  # only the rows asked for (a copy)
                hand = on_logits
                on_logits = lambda x: hand(x.reshape(-1, x.shape[-1])[logit_rows])  # noqa: E731
            return self._logprobs_from_logits(model(mb.inputs, pos, None, **kwargs), mb.targets, on_logits)
        head.forward = lambda h, weight=None, runtime_gather_output=None: (h, None)  # the model returns [b, s, h]
        try:
            hidden = model(mb.inputs, pos, None, **kwargs)
        finally:
            del head.forward
        # on_logits' copy [b, s, V/tp] (or [n, V/tp] of logit_rows), filled chunk by chunk in the
        # forward (one buffer: no list of chunks to concatenate); the backward's recomputation of a
        # chunk writes nothing
        seen: dict = {"buf": None, "recording": on_logits is not None}
        if logit_rows is not None:
            hand, col = on_logits, logit_rows % s  # each row's column: the chunks cut along S

        def piece(h: torch.Tensor, targets: torch.Tensor, a: int) -> torch.Tensor:
            logits = head(h.transpose(0, 1), weight=weight)[0].transpose(0, 1)  # [b, c, V/tp]

            def keep(x: torch.Tensor) -> None:  # a copy: Megatron's cross-entropy overwrites its input in place
                c = x.shape[1]
                if seen["buf"] is None:
                    n = (b * s) if logit_rows is None else logit_rows.numel()
                    seen["buf"] = x.new_empty(n, x.shape[-1])
                if logit_rows is None:
                    seen["buf"].view(b, s, -1)[:, a:a + c].copy_(x)
                    return
                sel = torch.nonzero((col >= a) & (col < a + c)).squeeze(1)  # slots of this chunk's rows
                r = logit_rows[sel]
                if b == 1 and sel.numel():  # a packed row: the chunk's rows are one run of slots, written in place
                    lo = int(sel[0])
                    torch.index_select(x[0], 0, r - a, out=seen["buf"][lo:lo + sel.numel()])
                else:
                    seen["buf"][sel] = x[r // s, r % s - a]

            return self._logprobs_from_logits(logits, targets, keep if seen["recording"] else None)

        out = []
        for a in range(0, s, chunk):
            h, t = hidden[:, a:a + chunk], mb.targets[:, a:a + chunk]
            if torch.is_grad_enabled():
                out.append(torch.utils.checkpoint.checkpoint(piece, h, t, a, use_reentrant=False))
            else:
                out.append(piece(h, t, a))
        if seen["recording"]:
            seen["recording"] = False
            buf = seen.pop("buf")
            if logit_rows is None:
                on_logits(buf.view(b, s, -1))
            else:
                hand(buf)
        return torch.cat(out, dim=1)

    def _chunk_positions(self, rows: int, vocab_local: int) -> int:
        """Positions (along S) per log-prob chunk: policy.logprob_chunk_tokens over ``rows`` rows; null =
        chunks of at most 256 MiB of fp32 logits; 0 = no chunking."""
        n = self.cfg.policy.logprob_chunk_tokens
        if n is None:
            n = (256 << 20) // (4 * vocab_local)
        return 1 << 62 if n == 0 else max(1, n // rows)

    def _logprobs_from_logits(self, logits: torch.Tensor, targets: torch.Tensor, on_logits=None) -> torch.Tensor:
        """[b, s, V/tp] logits -> log pi(targets) [b, s] (see :meth:`_token_logprobs`)."""
        tp = ps.get_tensor_model_parallel_world_size()
        start = ps.get_tensor_model_parallel_rank() * logits.shape[-1]
        logits, keep = sampling_logits(logits, self.cfg.rollout.sampling,
                                       group=ps.get_tensor_model_parallel_group() if tp > 1 else None, vocab_start=start)
        if keep is not None:
            if on_logits is not None:
                on_logits(logits.detach().masked_fill(~keep, float("-inf")))
            # the target always counts, so every log-prob is finite: a prompt token outside the set
            # (masked out of the loss), or a sampled token the trainer's set misses by a rounding
            # difference at its edge (then its log-prob is over the set plus itself)
            local = targets - start
            mine = (local >= 0) & (local < logits.shape[-1])
            keep |= torch.zeros_like(keep).scatter_(-1, local.clamp(0, logits.shape[-1] - 1)[..., None], mine[..., None])
            logits = logits.masked_fill(~keep, float("-inf"))
        elif on_logits is not None:
            on_logits(logits.detach())
        # [b, S, V/tp] -> -log p(target): Megatron's vocab-parallel cross-entropy handles TP
        return -tensor_parallel.vocab_parallel_cross_entropy(logits.transpose(0, 1).contiguous(),
                                                             targets.transpose(0, 1).contiguous()).transpose(0, 1)

    def _run(self, model, micro: list[TrainBatch], loss_fn, forward_only: bool, draft_rows=None) -> list[dict]:
        """Megatron's schedule over ``micro``; with ``draft_rows`` (one RolloutRows per microbatch)
        the co-trained drafter rides on this forward (taps written, logits handed over)."""
        it = iter(enumerate(micro))

        def forward_step(data_iterator, model_chunk):
            i, mb = next(data_iterator)
            on_logits = logit_rows = None
            if draft_rows is not None:  # the taps: this rank's positions of the real sequences (no filler)
                packed = isinstance(mb, PackedMicro)
                self.draft.before_forward(i, mb.num_real if packed else mb.inputs.numel(),
                                          widths=mb.widths if packed else None)
                logit_rows = self.draft.logit_rows(draft_rows[i])  # the rows the drafter reads (None: all)
                if logit_rows is not None:
                    logit_rows = logit_rows.to(mb.inputs.device)
                on_logits = partial(self.draft.after_logits, i, draft_rows[i], logit_rows=logit_rows)
            return self._token_logprobs(model_chunk, mb, on_logits, logit_rows), partial(loss_fn, mb)

        # seq_length: the whole row (a CP rank's microbatch holds S / cp of it; Megatron's schedule
        # divides by the CP size for the shapes it sends between stages); a packed micro batch is one
        # row of its width (every micro batch of a rank alike at PP > 1)
        packed = isinstance(micro[0], PackedMicro)
        return get_forward_backward_func()(
            forward_step_func=forward_step, data_iterator=it, model=[model], num_microbatches=len(micro),
            seq_length=micro[0].width if packed else micro[0].seq_len * ps.get_context_parallel_world_size(),
            micro_batch_size=1 if packed else len(micro[0]), forward_only=forward_only)

    def _micro(self, shard: TrainBatch) -> list[TrainBatch]:
        return shard.split(max(1, len(shard) // self.cfg.policy.micro_batch_size))

    # ------------------------------------------------------------------ public API
    def _draft_rows(self, batch: TrainBatch, micro: list) -> list:
        """The drafter's view of each microbatch: whole rows (every position, also under CP), the
        rows' indices in the rollout batch and, packed, the positions each row takes in the packed
        row; on the host (the drafter's index space: its taps and logits come on the device)."""
        from cotrain.draft.online import RolloutRows

        if self.cfg.policy.packing:
            return [RolloutRows(batch.inputs[mb.rows], batch.mask[mb.rows], batch.lengths[mb.rows], mb.rows,
                                widths=mb.widths) for mb in micro]
        full = batch.split(ps.get_data_parallel_world_size())[ps.get_data_parallel_rank()]
        offset = ps.get_data_parallel_rank() * len(full)
        rows = []
        for mb in self._micro(full):
            rows.append(RolloutRows(mb.inputs, mb.mask, mb.lengths, torch.arange(offset, offset + len(mb))))
            offset += len(mb)
        return rows

    @torch.no_grad()
    def logprobs(self, batch: TrainBatch, draft_step: int | None = None, draft_updates: int = 1) -> dict | None:
        """Current (and reference) policy log-probs of the rows this rank's DP shard holds (``rows``: their
        indices in ``batch``), on the output ranks.

        With ``draft_step`` the co-trained drafter takes a step on this forward (the log-prob
        recomputation of the policy that generated the rollouts; see docs/cotrain.md), and
        ``draft_updates - 1`` more on its replay window (draft.budget); 0 = scored only, no step."""
        micro = self._micro_batches(batch)
        collect = lambda mb, lp: (lp.sum() * 0, {"lp": lp.detach().float() * mb.mask})  # noqa: E731
        self.model.eval()
        out = {"dp_rank": ps.get_data_parallel_rank()}
        last = ps.is_pipeline_last_stage()
        drafting = draft_step is not None and self.draft is not None
        rows = None
        if drafting:
            rows = self._draft_rows(batch, micro)
            self.draft.begin(draft_step, len(micro), updates=draft_updates)
        try:
            res = self._run(self.model, micro, collect, forward_only=True, draft_rows=rows)
            if drafting:
                out["draft_metrics"] = self.draft.end()
        except BaseException:
            if drafting:
                self.draft.abort()
            raise
        if last:  # results leave on the CPU (the driver and Ray expect host tensors)
            out["rows"], out["logprobs"] = self._rows_of(batch, micro, [r["lp"] for r in res])
        if self.ref_model is not None:
            res = self._run(self.ref_model, micro, collect, forward_only=True)
            if last:
                out["ref_logprobs"] = self._rows_of(batch, micro, [r["lp"] for r in res])[1]
        self.model.train()
        return out if self._holds_outputs() else None

    def train_step(self, batch: TrainBatch) -> dict | None:
        """The GRPO update on one rollout batch (old/ref log-probs filled in by the driver).

        PPO-style: ``grpo.epochs`` passes over the batch in mini-batches of ``grpo.global_batch_size``
        consecutive sequences (groups stay whole when it is a multiple of group_size), one optimizer
        step per mini-batch, the mini-batches of each pass in a seeded random order (run.seed and the
        number of updates so far, so a resumed run takes the same order). The old log-probs stay those
        of the policy before the first step, so from the second step on the ratio leaves 1 and the
        clipped surrogate acts. Each mini-batch's loss is its own token (sequence) mean: normalised
        by the mini-batch's global response-token (sequence) count. A batch of at most
        global_batch_size sequences is one mini-batch.

        Metrics:

            loss, grad_norm, clip_frac   means over the optimizer steps (grad_norm before clipping)
            ratio_max                    the largest ratio of any step
            kl_ref                       token mean of the k3 KL to the reference over the first pass
                                         (each sequence once, each mini-batch on the weights
                                         before its own step)
            optimizer_steps              optimizer steps since the start of the run
            lr                           the learning rate of the last of them
        """
        g = self.cfg.grpo
        gbs = min(g.global_batch_size or len(batch), len(batch))  # a smaller batch: one mini-batch
        if len(batch) % gbs:
            raise ValueError(f"grpo.global_batch_size={gbs} does not divide the rollout batch of {len(batch)} sequences")
        n_mini = len(batch) // gbs
        order = torch.Generator().manual_seed(mix(self.cfg.run.seed, self.updates_done))
        total_tokens = max(batch.mask.sum().item(), 1.0)
        sums: dict[str, float] = {}
        grad_norms = []
        self.model.train()
        for epoch in range(g.epochs):
            for j in torch.randperm(n_mini, generator=order).tolist():
                stats, grad_norm = self._optimizer_step(batch.select(slice(j * gbs, (j + 1) * gbs)))
                grad_norms.append(grad_norm)
                for k, v in stats.items():
                    if k == "kl_sum":
                        if epoch == 0:
                            sums[k] = sums.get(k, 0.0) + v
                    elif k.endswith("_max"):
                        sums[k] = max(sums.get(k, v), v)
                    else:
                        sums[k] = sums.get(k, 0.0) + v
        self.updates_done += 1
        n = len(grad_norms)
        metrics = {"grad_norm": sum(grad_norms) / n, "optimizer_steps": float(self.steps_done),
                   "lr": float(get_canonical_lr_for_logging(self.optimizer.param_groups))}
        for k, v in sums.items():
            if k == "kl_sum":
                metrics["kl_ref"] = v / total_tokens
            else:
                metrics[k] = v if k.endswith("_max") else v / n
        metrics = self._reduce_over_batch_ranks(metrics)
        if self.device.type == "cpu":
            _return_freed_memory()
        return metrics if self._holds_outputs() and ps.get_data_parallel_rank() == 0 else None

    def _optimizer_step(self, mini: TrainBatch) -> tuple[dict[str, float], float]:
        """One optimizer step on the mini-batch ``mini`` (all of it: every rank takes its part).
        Returns this rank's parts of the step's statistics (last stage; summed over ranks they are
        the mini-batch's) and the global gradient norm."""
        g = self.cfg.grpo
        num_tokens = max(mini.mask.sum().item(), 1.0)
        num_seqs = float(len(mini))
        dp = ps.get_data_parallel_world_size()
        micro = self._micro_batches(mini)
        # undo Megatron's per-microbatch and DP averaging: Megatron divides each micro batch's loss by
        # this rank's count of them (packed: ranks may hold different counts) and DDP averages over DP
        scale = len(micro) * dp
        # each sequence's response tokens over the whole row: under CP a rank holds two zigzag chunks
        # of every row, and seq_mean divides by the sequence's count, not the chunks'
        # (packed micro batches carry their own: PackedMicro.seq_tokens)
        seq_tokens = {}
        if not self.cfg.policy.packing:
            full = mini.split(dp)[ps.get_data_parallel_rank()].to(self.device)
            seq_tokens = {id(mb): rows.mask.sum(dim=1) for mb, rows in zip(micro, self._micro(full))}

        def loss_fn(mb, logp):
            packed = isinstance(mb, PackedMicro)  # per-position advantages; seq_mean sums per sequence
            adv = mb.advantages if packed else mb.advantages[:, None].expand_as(logp)
            tok_loss, info = grpo_token_losses(logp, mb.old_logprobs, adv, g.clip_eps_low, g.clip_eps_high,
                                               ref_logp=mb.ref_logprobs, kl_coef=g.kl_coef,
                                               log_ratio_clamp=g.log_ratio_clamp, clip_ratio_c=g.clip_ratio_c,
                                               kl_clamp=g.kl_clamp, is_weights=mb.is_weights)
            loss = aggregate(tok_loss, mb.mask, g.loss_agg, num_tokens=num_tokens, num_seqs=num_seqs,
                             seq_tokens=mb.seq_tokens if packed else seq_tokens[id(mb)],
                             seq_index=mb.seq if packed else None)
            m = mb.mask
            stats = {"loss": loss.detach() * 1.0, "clip_frac": (info["clipped"] * m).sum() / num_tokens,
                     "ratio_max": (info["ratio"] * m).max()}
            if "kl_ref" in info:
                stats["kl_sum"] = (info["kl_ref"] * m).sum()
            return loss * scale, stats

        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        res = self._run(self.model, micro, loss_fn, forward_only=False)
        self.scheduler.step(1)  # this optimizer step's learning rate: lr(steps_done + 1)
        grad_norm = self._clip_and_step(self.cfg.policy.optimizer.clip_grad)
        self.steps_done += 1
        stats = {}
        if ps.is_pipeline_last_stage():
            for k in res[0]:
                vals = torch.stack([r[k] for r in res])
                stats[k] = (vals.max() if k.endswith("_max") else vals.sum()).item()
        return stats, grad_norm

    def _reduce_over_batch_ranks(self, metrics: dict) -> dict:
        """Sum (or max) the per-rank metric parts over every rank that holds part of the batch."""
        group = ps.get_data_parallel_group(with_context_parallel=True)
        if dist.get_world_size(group) == 1 or not ps.is_pipeline_last_stage():
            return metrics
        keys = sorted(k for k in metrics if k not in GLOBAL_METRICS)
        t = torch.tensor([metrics[k] for k in keys], dtype=torch.float64, device=self.device)  # NCCL: device tensors
        sums = t.clone()
        dist.all_reduce(sums, group=group)
        maxs = t.clone()
        dist.all_reduce(maxs, op=dist.ReduceOp.MAX, group=group)
        for i, k in enumerate(keys):
            metrics[k] = (maxs if k.endswith("_max") else sums)[i].item()
        return metrics

    def _clip_and_step(self, max_norm: float) -> float:
        """Global-norm clipping on CPU (Megatron's own asserts CUDA), then Megatron's optimizer step."""
        opt = self.optimizer
        opt.prepare_grads()
        grad_norm = float(opt.get_grad_norm())
        if max_norm > 0 and grad_norm > max_norm:
            coef = max_norm / (grad_norm + 1e-6)
            for p in opt.get_parameters():
                if p.grad is not None:
                    p.grad.mul_(coef)
        if not opt.step_with_ready_grads():
            raise RuntimeError("Megatron optimizer step failed")
        return grad_norm

    # ------------------------------------------------------------------ memory (colocated engines)
    def offload(self) -> None:
        """Free the device memory the optimizers hold while colocated engines are awake: on CUDA their state
        (the policy's and the drafter's Adam moments) and, under bf16, the fp32 main parameters move to the CPU, then
        ``torch.cuda.empty_cache()``; :meth:`onload` brings them back. The weights and gradient buffers stay
        (the engines' weight push reads them). On CPU both do nothing."""
        if self.device.type == "cuda":
            self._move_optimizer(torch.device("cpu"))
            torch.cuda.empty_cache()

    def onload(self) -> None:
        """Undo :meth:`offload` (before the next step)."""
        if self.device.type == "cuda":
            self._move_optimizer(None)

    def _move_optimizer(self, device: torch.device | None) -> None:
        """Copy the optimizer's device tensors (every state tensor, and parameters that are not the
        model's: bf16's fp32 main copies) onto ``device``, remembering where each was; ``None`` copies
        them back there. In place of the tensors: every holder (the optimizer's state, Megatron's
        main-parameter groups) keeps the same objects."""
        model = {id(p) for m in (self.model, self._drafter_module()) for p in m.parameters()}
        home = getattr(self, "_optimizer_home", {})
        subs = getattr(self.optimizer, "chained_optimizers", [self.optimizer])
        optimizers = [sub.optimizer for sub in subs]
        if self.draft is not None and self.draft.trainer is not None:
            optimizers.append(self.draft.trainer.optimizer)  # the drafter's AdamW: its moments too
        for inner in optimizers:
            for group in inner.param_groups:
                for p in group["params"]:
                    holders = [] if id(p) in model else [p]
                    holders += [t for t in inner.state.get(p, {}).values() if isinstance(t, torch.Tensor)]
                    for t in holders:
                        if device is None:
                            if id(t) in home:
                                t.data = t.data.to(home.pop(id(t)), copy=True)
                        else:
                            home.setdefault(id(t), t.device)
                            t.data = t.data.to(device, copy=True)
        self._optimizer_home = home

    def _drafter_module(self) -> torch.nn.Module:
        """The co-trained drafter on this rank (an empty module where there is none)."""
        if self.draft is not None and self.draft.trainer is not None:
            return self.draft.trainer.drafter
        return torch.nn.Module()

    # ------------------------------------------------------------------ weights and checkpoints
    def full_policy_state(self) -> dict[str, torch.Tensor] | None:
        """The whole policy in Hugging Face names, assembled on global rank 0 (None elsewhere)."""
        if ps.get_data_parallel_rank() != 0 or ps.get_context_parallel_rank() != 0:
            return None
        local = tensor_state(self.model.module)
        tp_group, tp = ps.get_tensor_model_parallel_group(), ps.get_tensor_model_parallel_world_size()
        if tp > 1:
            gathered = [None] * tp
            dist.all_gather_object(gathered, local, group=tp_group)
            local = {k: convert.tp_gather(k, [g[k] for g in gathered]) for k in local}
        stage = convert.from_local(local, layer_offset(self.model.module))
        if ps.get_tensor_model_parallel_rank() != 0:
            return None
        pp_group, pp = ps.get_pipeline_model_parallel_group(), ps.get_pipeline_model_parallel_world_size()
        if pp > 1:
            parts = [None] * pp
            dist.all_gather_object(parts, stage, group=pp_group)
            stage = {k: v for part in parts for k, v in part.items()}
        if self.arch.tie_word_embeddings:
            stage.pop("output_layer.weight", None)
        return convert.megatron_to_hf(stage, self.arch) if self.rank == 0 else None

    def _draft_holder(self) -> bool:
        """The rank whose drafter replica is exported: last stage, TP / CP / DP rank 0."""
        return (self.draft is not None and self.draft.trainer is not None and ps.get_tensor_model_parallel_rank() == 0
                and ps.get_context_parallel_rank() == 0 and ps.get_data_parallel_rank() == 0)

    def full_draft_state(self) -> dict[str, torch.Tensor] | None:
        """The drafter's push tensors (vLLM names) on global rank 0 (None elsewhere). Rank 0's
        pipeline ends at the holder, which sends them over when PP > 1."""
        if self.draft is None:
            raise RuntimeError("no co-trained drafter (draft.kind is null or draft.cotrain is false)")
        state = self.draft.trainer.push_state() if self._draft_holder() else None
        if ps.get_pipeline_model_parallel_world_size() > 1:
            if self._draft_holder():
                dist.send_object_list([state], dst=ps.get_pipeline_model_parallel_first_rank())
                state = None
            elif self.rank == 0:
                box = [None]
                dist.recv_object_list(box, src=ps.get_pipeline_model_parallel_last_rank())
                state = box[0]
        return state if self.rank == 0 else None

    def draft_shared_tensors(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(embedding, LM head) the drafter borrows right now, on its holder (for tests and checks)."""
        if not self._draft_holder():
            return None
        d = self.draft.trainer.drafter
        return d.embed_weight.detach().cpu().clone(), d.target_lm_head.detach().cpu().clone()

    def export(self, kind: str, version: int, transport_name: str) -> dict | None:
        """Publish the full policy or the drafter through a weight transport; the handle on rank 0.
        Every rank calls it; ``cuda_ipc`` takes every rank (a copy on each engine GPU from the trainer
        rank there: :meth:`~cotrain.weights.transports.cuda_ipc.CudaIpcTransport.send_collective`)."""
        state = self.full_policy_state() if kind == "policy" else self.full_draft_state()
        if getattr(self, "_transport", None) is None and (state is not None or transport_name == "cuda_ipc"):
            from cotrain.weights import make_transport

            # kept for the run: CUDA IPC exports stay valid only while the sender holds the tensors
            extra = {"engine_gpus": getattr(self, "_engine_gpus", None)} if transport_name == "cuda_ipc" else {}
            self._transport = make_transport(transport_name, **extra)
        if transport_name == "cuda_ipc":
            return self._transport.send_collective(state, version)
        return None if state is None else self._transport.send(state, version)

    def export_draft_dir(self, path: str) -> str | None:
        """Write the drafter in vLLM's format to ``path`` (the engines' initial drafter); the holder writes."""
        if self._draft_holder():
            self.draft.export_dir(path)
            return str(path)
        return None

    def connect_weight_broadcast(self, master_addr: str, master_port: int, world_size: int) -> None:
        """Rank 0 joins the dedicated broadcast group of the ``nccl`` weight transport (the engines
        join concurrently through ``RolloutGroup.init_broadcast_group``)."""
        if self.rank != 0:
            return
        from cotrain.weights.transports.nccl import NcclBroadcastTransport

        self._transport = NcclBroadcastTransport(master_addr, master_port, 0, world_size)
        self._transport.connect()

    def connect_engine_gpus(self, gpus: list[str]) -> None:
        """Every rank: the GPU UUIDs of every engine worker (``RolloutGroup.gpus``), which each
        ``cuda_ipc`` export must cover: a GPU no trainer rank sits on fails here, naming it."""
        from cotrain.weights import make_transport

        self._engine_gpus = list(gpus) or None
        self._transport = make_transport("cuda_ipc", engine_gpus=self._engine_gpus)
        self._transport.plan()  # collective: every rank's GPU

    def release_export(self, handle: dict) -> None:
        """Free an exported handle once every engine has loaded it (every rank may hold a copy)."""
        if getattr(self, "_transport", None) is not None:
            self._transport.release(handle)

    def _rng_state(self) -> dict:
        """Every RNG stream the step draws from: torch's CPU generator, Python's (a plain tuple), the
        model-parallel tracker's named streams (Megatron's CUDA tracker on CUDA, the CPU stand-in on CPU)
        and on CUDA this device's generator; tensors and plain containers only (weights_only loads)."""
        from megatron.core.tensor_parallel import random as mrandom

        state = {"torch_rng": torch.get_rng_state(), "py_rng": random.getstate(),
                 "rng_tracker": {k: v.clone() for k, v in mrandom.get_cuda_rng_tracker().get_states().items()}}
        if self.device.type == "cuda":
            state["cuda_rng"] = torch.cuda.get_rng_state(self.device)
        return state

    def _set_rng_state(self, state: dict, path: Path) -> None:
        from megatron.core.tensor_parallel import random as mrandom

        torch.set_rng_state(state["torch_rng"])
        random.setstate(_as_tuple(state["py_rng"]))
        if "rng_tracker" in state:  # older checkpoints: the tracker as seeded at start-up
            mrandom.get_cuda_rng_tracker().set_states({k: v.clone() for k, v in state["rng_tracker"].items()})
        if self.device.type == "cuda":
            if "cuda_rng" not in state:
                raise RuntimeError(f"{path} holds no CUDA RNG state (saved on CPU); an exact resume on CUDA needs one "
                                   "saved on CUDA")
            torch.cuda.set_rng_state(state["cuda_rng"], self.device)

    def layout(self) -> dict[str, int]:
        """Where this rank's shard sits (read back by ``python -m cotrain.export``, which merges the
        shards of any layout): its TP / PP / CP / DP coordinates and sizes, and the global index of
        its stage's first decoder layer."""
        return {"rank": self.rank, "world_size": self.world_size,
                "tp_rank": ps.get_tensor_model_parallel_rank(), "tp": ps.get_tensor_model_parallel_world_size(),
                "pp_rank": ps.get_pipeline_model_parallel_rank(), "pp": ps.get_pipeline_model_parallel_world_size(),
                "cp_rank": ps.get_context_parallel_rank(), "cp": ps.get_context_parallel_world_size(),
                "dp_rank": ps.get_data_parallel_rank(), "dp": ps.get_data_parallel_world_size(),
                "layer_offset": layer_offset(self.model.module)}

    def save_checkpoint(self, directory: str) -> None:
        from cotrain.checkpoint import atomic_torch_save

        state = {"model": tensor_state(self.model.module), "optimizer": self.optimizer.state_dict(),
                 "steps_done": self.steps_done, "updates_done": self.updates_done,
                 "scheduler": self.scheduler.state_dict(), **self._rng_state(), "layout": self.layout()}
        if self.draft is not None and self.draft.trainer is not None:
            state["draft"] = self.draft.trainer.state_dict()
        atomic_torch_save(state, Path(directory) / f"trainer_rank{self.rank:04d}.pt")

    def load_checkpoint(self, directory: str) -> None:
        from cotrain.checkpoint import load_plain

        path = Path(directory) / f"trainer_rank{self.rank:04d}.pt"
        # tensors and plain containers only (a pickled object is refused, naming the file); read onto the
        # CPU (RNG states must be CPU tensors), the load_state_dicts copy onto the parameters' device
        state = load_plain(path, map_location="cpu")
        missing, unexpected = load_tensor_state(self.model.module, state["model"])
        missing = [m for m in missing if not m.endswith("_extra_state")]
        if missing or unexpected:
            raise RuntimeError(f"checkpoint {directory} does not match the model: missing={missing} "
                               f"unexpected={unexpected}")
        self.optimizer.load_state_dict(state["optimizer"])
        # the restored param groups carry the saved max_lr / min_lr (which Megatron's scheduler reads
        # before its own values), betas and eps: the config's win (weight decay is the scheduler's)
        opt = self.cfg.policy.optimizer
        apply_config(self.optimizer.param_groups, opt, max_lr=opt.lr, min_lr=min(opt.min_lr, opt.lr))
        self.steps_done = state["steps_done"]
        self.updates_done = state.get("updates_done", self.steps_done)  # older checkpoints: one step per update
        self.scheduler.num_steps = 0  # load_state_dict steps it forward from here
        self.scheduler.load_state_dict(state.get("scheduler", {**self.scheduler.state_dict(), "num_steps": self.steps_done}))
        self._set_rng_state(state, path)
        if self.draft is not None and self.draft.trainer is not None:
            if "draft" not in state:
                raise RuntimeError(f"{path} holds no drafter state (saved without draft.cotrain); resume with the "
                                   "same draft settings it was saved with")
            self.draft.trainer.load_state_dict(state["draft"])

    def shutdown(self) -> None:
        if self.draft is not None:
            self.draft.close()
        if dist.is_initialized():
            dist.destroy_process_group()
