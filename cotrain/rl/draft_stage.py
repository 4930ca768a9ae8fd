"""The co-trained drafter inside a Megatron trainer: taps through the TapChannel, the drafter on the last stage.

Built collectively at start-up:

    every rank    a TapChannel for its pipeline (read into the last stage), tap hooks on the tap layers
                  its stage runs, on only for the forward that feeds the drafter (the log-prob recompute)
    last stage    an OnlineDraftTrainer (``draft.init`` or from scratch), one replica per TP rank (same
                  rows, TP-gathered logits: identical replicas); gradients reduced over DP x CP

One step, called by :class:`~cotrain.rl.trainer.MegatronPolicyWorker`::

    stage.begin(step, num_microbatches)       # shared tensors of the current policy -> the drafter
    per microbatch i:  stage.before_forward(i, num_tokens)      (every stage, before its forward)
                       stage.after_logits(i, rows, logits)      (last stage, after the policy's logits)
    metrics = stage.end()                     # drafter optimizer step(s); tap statistics

What moves each step (vLLM serves the drafter with the served policy's embedding and LM head, so the
drafter borrows the current policy's before every step of its own):

    embedding  [V, H]      every family; first stage, gathered over TP, broadcast over PP when PP > 1
    LM head    [V, H]      DFlash / DSpark; last stage
    logits     [b, S, V]   per microbatch: the policy's vocab-parallel logits gathered over TP; at CP = 1
               [n, V]      only the n rows the drafter reads (its chains' targets: compact handoff,
                           OnlineDraftTrainer.logit_rows) where it knows them before the forward

``draft.branches: on_policy``: the log-prob forward also keeps every layer's stem keys and values
(:class:`~cotrain.parallel.megatron_adapter.StemKV`) and the drafter's scorer runs the policy over
the branch tokens on them (:class:`~cotrain.parallel.megatron_adapter.TreePipeline`;
docs/cotrain.md). At PP = 1 right after each microbatch's logits; at PP > 1 deferred (a collective
inside Megatron's schedule would deadlock): every stage keeps its microbatches' stem keys/values,
the last stage the drafter's microbatches, and :meth:`DraftStage.end` runs them one by one after the
schedule, the earlier stages serving the tree forward.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch
import torch.distributed as dist

from cotrain.draft.online import OnlineDraftTrainer, RolloutRows
from cotrain.tapchannel import PipelineLayout, TapChannel, attach_tap_hooks, tap_specs


def resolve_tap_transport(name: str, device: str, num_nodes: int = 1) -> str:
    """The channel's transport: a name as given; ``auto`` on one CPU node -> ``shm``; otherwise
    ``auto`` stays ``auto``: the TapChannel picks per source stage (:meth:`TapChannel.choose`: same
    node shm / cuda_ipc - nccl for a source that does not see the reader's GPU, as under Ray's
    one-GPU-per-actor - another node gloo / nccl)."""
    if name != "auto" or num_nodes > 1 or device == "cuda":
        return name
    return "shm"


def tap_metrics(channel: TapChannel) -> dict[str, float]:
    """``tap/transport/<layer>``: how each tap reached the drafter's stage (TRANSPORT_CODES: 0 local,
    1 shm, 2 cuda_ipc, 3 gloo, 4 nccl)."""
    from cotrain.tapchannel import TRANSPORT_CODES

    return {f"tap/transport/{layer}": float(TRANSPORT_CODES[name]) for layer, name in sorted(channel.routes.items())}


def build_drafter_for(cfg, target, path: Optional[str] = None):
    """The drafter of ``cfg.draft`` for ``target``: loaded from ``path`` (a drafter export) or from scratch."""
    from cotrain.draft.registry import build_drafter

    drafter = build_drafter(cfg.draft.kind, cfg.draft.settings, target, seed=cfg.run.seed)
    if path is not None:
        from cotrain.draft.export import read_export

        _, meta, state = read_export(path)
        saved = (meta.get("tap_layers") or [])
        if saved and list(saved) != drafter.tap_layers:
            raise ValueError(f"draft.init: {path} taps layers {saved}, draft.{cfg.draft.kind}.tap_layers resolves to "
                             f"{drafter.tap_layers}")
        drafter.load_vllm_state_dict(state)
    return drafter


class DraftStage:
    def __init__(self, cfg, model, dtype: torch.dtype, model_path: str, init_dir: Optional[str] = None,
                 name: str = "draft", device: torch.device | str = "cpu"):
        from megatron.core import parallel_state as ps

        from cotrain.draft.taps import TargetSpec

        self.cfg = cfg
        d = cfg.draft
        self.model = model
        #: the trainer rank's device: the drafter, its optimizer state and every tensor this stage sends
        #: over the pipeline live there (NCCL carries CUDA tensors only, gloo CPU ones)
        self.device = torch.device(device)
        self.cp = ps.get_context_parallel_world_size()
        self.tp = ps.get_tensor_model_parallel_world_size()
        self.pp = ps.get_pipeline_model_parallel_world_size()
        self.is_last = ps.is_pipeline_last_stage()
        self.is_first = ps.is_pipeline_first_stage()
        self.tap_layers = sorted(d.settings.tap_layers)
        hidden = model.module.config.hidden_size
        layout = PipelineLayout.from_megatron(model)
        specs = tap_specs(self.tap_layers, layout, width=hidden, dtype=dtype)
        mbs, S = cfg.policy.micro_batch_size, cfg.policy.max_seq_len
        if cfg.policy.packing:  # a packed row: at most the token budget (padded lengths), over C ranks
            from cotrain.config.derived import packing_budget

            max_tokens = -(-packing_budget(cfg) // self.cp)
        else:
            max_tokens = mbs * (-(-(S + 2 * self.cp) // self.cp))
        transport = resolve_tap_transport(d.tap_transport, cfg.cluster.device, cfg.cluster.num_nodes)
        device = self.device if self.device.type == "cuda" else None
        self.transport = transport
        from cotrain.placement import current_node_id

        # the link of each source is decided by Ray node ids (nodes of one machine in tests included)
        self.channel = TapChannel(specs, layout, transport, max_tokens=max_tokens, name=name,
                                  timeout_s=d.tap_timeout_s, device=device, node=current_node_id())
        self.hooks = attach_tap_hooks(model, self.channel)
        self.hooks.enabled = False
        self.trainer: Optional[OnlineDraftTrainer] = None
        # draft.branches: on_policy (SpecOPD): the stem's keys/values of the log-prob forward,
        # captured for the branch tokens' tree forward (every drafter kind); at PP > 1 the
        # drafter's microbatches wait for the end of the schedule (``_deferred``, last stage)
        self.on_policy = d.branches == "on_policy"
        self.stem = self.tree = None
        self._deferred: list = []
        if self.on_policy:
            from cotrain.parallel.megatron_adapter import StemKV, TreePipeline

            self.stem = StemKV(model.module)
            self.tree = TreePipeline(model.module, self.stem,
                                     cp_group=ps.get_context_parallel_group() if self.cp > 1 else None)
        if self.is_last:
            target = TargetSpec.from_checkpoint(model_path)
            drafter = build_drafter_for(cfg, target, init_dir).to(self.device)  # before its optimizer is made
            served = cfg.rollout.speculative
            k = served.num_speculative_tokens if served.method == drafter.vllm_method else None
            self.trainer = OnlineDraftTrainer(
                drafter, d, total_steps=cfg.grpo.num_steps, seed=cfg.run.seed, cp_size=self.cp,
                cp_group=ps.get_context_parallel_group() if self.cp > 1 else None,
                reduce_group=ps.get_data_parallel_group(with_context_parallel=True), k=k,
                eos_token_id=target.eos_token_id, compare_frozen=d.compare_frozen)
        self._active = False
        self._updates = 1  # the drafter's optimizer steps this GRPO step (begin)

    @property
    def _measuring(self) -> bool:
        """This step only scores the drafter (begin(updates=0), draft.budget.measure_idle)."""
        return self._updates == 0

    # ------------------------------------------------------------------ shared tensors
    def _tp_gather_rows(self, w: torch.Tensor) -> torch.Tensor:
        """[V/tp, H] vocab shards -> [V, H]."""
        from megatron.core import parallel_state as ps

        if self.tp == 1:
            return w.detach().float().clone()
        parts = [torch.empty_like(w) for _ in range(self.tp)]
        dist.all_gather(parts, w.detach().contiguous(), group=ps.get_tensor_model_parallel_group())
        return torch.cat(parts).float()

    def shared_tensors(self) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        """(embedding, LM head) of the current policy on the last stage (None elsewhere). Collective
        over the pipeline (and TP)."""
        from megatron.core import parallel_state as ps

        gpt = self.model.module
        embed = lm_head = None
        if self.is_first:
            embed = self._tp_gather_rows(gpt.embedding.word_embeddings.weight)
        if self.pp > 1:
            shape = torch.tensor(list(embed.shape) if embed is not None else [0, 0], dtype=torch.int64,
                                 device=self.device)
            group = ps.get_pipeline_model_parallel_group()
            src = ps.get_pipeline_model_parallel_first_rank()
            dist.broadcast(shape, src=src, group=group)
            if embed is None:
                embed = torch.empty(*shape.tolist(), dtype=torch.float32, device=self.device)
            dist.broadcast(embed, src=src, group=group)
        if self.is_last:
            lm_head = self._tp_gather_rows(gpt.shared_embedding_or_output_weight() if gpt.share_embeddings_and_output_weights
                                           else gpt.output_layer.weight)
        return (embed, lm_head) if self.is_last else (None, None)

    # ------------------------------------------------------------------ one step
    def begin(self, step: int, num_microbatches: int, updates: int = 1) -> None:
        """``updates``: the drafter's optimizer steps this GRPO step (draft.budget): its own, then
        ``updates - 1`` on the replay window, in :meth:`end`; 0 = a measure-only step
        (draft.budget.measure_idle: the drafter is scored on the step's chains, no step, no stem)."""
        self._updates = int(updates)
        self._clear_tree()
        embed, lm_head = self.shared_tensors()
        if self.trainer is not None:
            self.trainer.begin_step(step, embed=embed, lm_head=lm_head, measure_only=self._measuring)
        self.channel.begin_step(num_microbatches)
        self.hooks.enabled = True
        self._active = True

    def before_forward(self, microbatch: int, num_tokens: int, widths: Optional[torch.Tensor] = None) -> None:
        """``num_tokens``: this rank's positions to tap (a packed row's real sequences, without its
        filler); ``widths``: a packed row's per-sequence positions (RolloutRows.widths)."""
        if self._active:
            self.hooks.set_microbatch(microbatch, num_tokens)
            if self.stem is not None and not self._measuring:  # every stage: this microbatch's stem keys/values
                self.stem.microbatch = microbatch
                self.stem.active = True
                if widths is not None:
                    self.stem.widths[microbatch] = widths

    def logit_rows(self, rows: RolloutRows) -> Optional[torch.Tensor]:
        """The forward positions of ``rows`` whose logits the drafter reads this step
        (:meth:`OnlineDraftTrainer.logit_rows`; None = all, and on every stage but the last): the
        log-prob loop hands only those over."""
        return self.trainer.logit_rows(rows) if self._active and self.trainer is not None else None

    def after_logits(self, microbatch: int, rows: RolloutRows, logits: torch.Tensor,
                     logit_rows: Optional[torch.Tensor] = None) -> None:
        """Last stage: ``logits`` [b, S/cp, V/tp] of the microbatch (tempered, detached); with
        ``logit_rows`` (:meth:`logit_rows`) [n, V/tp], only those forward positions."""
        if not self._active:
            return
        from megatron.core import tensor_parallel

        if self.tp > 1:
            logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
        taps = self.channel.read(microbatch)
        taps = torch.cat([taps[layer] for layer in self.tap_layers], dim=-1)
        logits = logits.reshape(-1, logits.shape[-1]).float()
        if self.stem is None or self._measuring:  # (a measure-only step needs no tree forward)
            self.trainer.microbatch(rows, taps, logits, logit_rows=logit_rows)
            return
        if self.pp > 1:
            # deferred to end(): the earlier stages are inside the schedule now. The logits are
            # kept by copy (unfiltered at TP = 1 they can share storage with the log-prob loss's
            # input, which Megatron's cross-entropy overwrites in place)
            self._deferred.append((microbatch, rows, taps, logits.clone() if self.tp == 1 else logits))
            return
        self.stem.active = False
        try:
            self.trainer.microbatch(rows, taps, logits, scorer=self._tree_scorer(microbatch))
        finally:
            self.stem.clear()

    def _run_deferred(self) -> None:
        """PP > 1, after the schedule, on every stage: the last stage runs the drafter on each
        deferred microbatch (its scorer drives the tree forward through the pipeline) and then sends
        the earlier stages the sentinel; they serve the tree forwards until it. A microbatch the
        scorer is never called for (no anchor) costs the earlier stages nothing."""
        if not self.is_last:
            self.tree.serve()
            return
        try:
            while self._deferred:
                microbatch, rows, taps, logits = self._deferred.pop(0)
                self.trainer.microbatch(rows, taps, logits, scorer=self._tree_scorer(microbatch))
                self.stem.clear(microbatch)
        finally:
            if not self.tree.in_flight:  # else the earlier stages are mid-exchange (a failed link)
                self.tree.finish()

    def _clear_tree(self) -> None:
        self._deferred.clear()
        if self.stem is not None:
            self.stem.active = False
            self.stem.clear()
        if self.tree is not None:
            self.tree.in_flight = False

    def _tree_scorer(self, microbatch: int):
        """The policy's scorer of one microbatch's branch tokens (``draft.branches: on_policy``): a
        forward of the policy over the branch tokens only, attending to the stem's keys/values that
        the log-prob forward captured for ``microbatch`` (through the pipeline at PP > 1:
        cotrain.parallel.megatron_adapter.TreePipeline), its logits tempered and filtered as the
        log-prob forward's (the sampling distribution)."""
        from cotrain.rl.sampling_filter import sampling_logits

        s = self.cfg.rollout.sampling

        def score(layout, tokens: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
            enabled, self.hooks.enabled = self.hooks.enabled, False  # the tree forward writes no taps
            try:
                logits = self.tree.logits(microbatch, layout, tokens, positions)
            finally:
                self.hooks.enabled = enabled
            if self.tp > 1:  # vocab-parallel -> full vocabulary, as the stem's logits
                from megatron.core import tensor_parallel

                logits = tensor_parallel.gather_from_tensor_model_parallel_region(logits)
            logits, keep = sampling_logits(logits, s)
            return logits if keep is None else logits.masked_fill(~keep, float("-inf"))
        return score

    def end(self) -> Optional[dict]:
        """Close the step (every stage, after the schedule); on the last stage: the drafter's
        optimizer step and the step's metrics. At PP > 1 with on-policy branches first the deferred
        drafter microbatches and their tree forwards (every stage takes part)."""
        self.hooks.enabled = False  # also off for the deferred tree forwards
        was_active, self._active = self._active, False
        if self.stem is not None:
            self.stem.active = False
            try:
                if self.pp > 1 and was_active:
                    self._run_deferred()
            finally:
                self._clear_tree()
        tap = self.channel.end_step()
        if self.trainer is None:
            return None
        own = self.trainer.end_step()
        replayed = self.trainer.replay(self._updates - 1)
        if replayed:  # the extra steps are co-training's work too
            own["time_s"] += replayed.pop("replay_s")
            own.update(replayed)
        own["updates"] = float(self._updates)
        m = {f"draft/{k}": v for k, v in own.items()}
        m.update({"tap/wait_s": tap["reader_wait_s"], "tap/copy_s": tap["reader_copy_s"],
                  "tap/bytes": float(tap["bytes_read"]), "tap/moved_bytes": float(tap["moved_bytes"])})
        m.update(tap_metrics(self.channel))
        return m

    def abort(self) -> None:
        """Leave a failed step: hooks off, captured stem keys/values and deferred microbatches
        dropped (the channel's next begin_step starts over)."""
        self.hooks.enabled = False
        self._active = False
        self._clear_tree()

    # ------------------------------------------------------------------ weights and checkpoints
    def export_dir(self, path: str) -> None:
        from cotrain.draft.export import export_drafter

        export_drafter(self.trainer.drafter, Path(path))

    def close(self) -> None:
        self.hooks.remove()
        if self.stem is not None:
            self.stem.remove()
        self.channel.close()
