#!/usr/bin/env python
"""Mutation testing, curated: plant one plausible bug at a time in a scratch copy of the repository,
run the tests meant to catch it, and report which bugs went unnoticed.

    make mutants                                  # every mutant (minutes; not part of `make test` / CI)
    python scripts/mutants.py --list              # the mutants, their files and focused tests
    python scripts/mutants.py --only rl.clip_swap,draft.forward_kl_dispatch
    python scripts/mutants.py --check             # only check that every mutation still applies
    python scripts/mutants.py --baseline          # first run each focused test set unmutated

Each mutant is an exact text substitution in one file (``old`` must occur exactly once: a mutation
whose code has moved on is reported ``stale``, not silently skipped). The scratch copy is the
committed tree (``git archive HEAD``; ``--worktree``: the tracked and untracked files as they are
in the working tree) under a temporary directory; the checkout's own files are never touched. The
focused tests run from the scratch copy with ``PYTHONPATH`` pointing at it (the editable install
would otherwise import the real package; a canary checks this), one at a time, ``pytest -x``, each
under ``--timeout`` seconds (the whole process group is killed on expiry).

Outcomes: ``killed`` (a test failed), ``timeout`` (the mutant hung a test: counted as killed),
``survived`` (every focused test passed: a missing test, or an equivalent mutant - then it carries
``equivalent`` with the reason and leaves the denominator), ``stale`` / ``error`` (the mutation no
longer applies, or pytest could not run: neither counts). Kill rate = (killed + timeout) /
(killed + timeout + survived). JSON: ``--json`` (default runs/mutants.json).

A new mechanism comes with its mutants here: the bugs one would expect to make in it, each with the
tests that should notice.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclass
class Mutant:
    id: str
    path: str
    old: str
    new: str
    tests: list[str]
    why: str
    timeout: int | None = None  # seconds; None = --timeout
    equivalent: str | None = None  # the reason, when the mutant cannot change behaviour


M = Mutant
MUTANTS: list[Mutant] = [
    # ----- cotrain/rl: GRPO maths, trainer, checkpoints, batches, sampling filter ------------------------
    M("rl.clip_swap_in_loss", "cotrain/rl/grpo.py",
      "torch.clamp(ratio, 1 - clip_low, 1 + clip_high)", "torch.clamp(ratio, 1 - clip_high, 1 + clip_low)",
      ["tests/rl/test_grpo_math.py", "tests/rl/test_grpo_clip.py"], "clip bounds swapped in the surrogate"),
    M("rl.clip_swap_in_trainer", "cotrain/rl/trainer.py",
      "mb.old_logprobs, adv, g.clip_eps_low, g.clip_eps_high,", "mb.old_logprobs, adv, g.clip_eps_high, g.clip_eps_low,",
      ["tests/rl/test_trainer.py", "-k", "first_principles"], "the trainer passes the clip bounds swapped",
      timeout=400),
    M("rl.logprobs_at_temperature_1", "cotrain/rl/trainer.py",
      "logits, keep = sampling_logits(logits, self.cfg.rollout.sampling,",
      "logits, keep = sampling_logits(logits, self.cfg.rollout.sampling.model_copy(update={'temperature': 1.0}),",
      ["tests/rl/test_trainer.py", "-k", "reference_model_stays"],
      "trainer log-probs at temperature 1 whatever the sampling temperature", timeout=400),
    M("rl.k3_sign", "cotrain/rl/grpo.py",
      "d = ref_logp.double() - logp.double()", "d = logp.double() - ref_logp.double()",
      ["tests/rl/test_grpo_math.py", "tests/rl/test_grpo_clip.py"], "k3 estimates KL(ref || pi) instead of KL(pi || ref)"),
    M("rl.dual_clip_on_positive", "cotrain/rl/grpo.py",
      "dual = (advantages < 0) & (objective < floor)", "dual = (advantages > 0) & (objective < floor)",
      ["tests/rl/test_grpo_math.py", "tests/rl/test_grpo_clip.py"], "dual clip applied to positive advantages"),
    M("rl.kl_clamp_ignored", "cotrain/rl/grpo.py",
      "loss = loss + kl_coef * (kl.clamp(max=kl_clamp) if kl_clamp is not None else kl)",
      "loss = loss + kl_coef * kl", ["tests/rl/test_grpo_math.py", "tests/rl/test_grpo_clip.py"], "the per-token KL penalty is not clamped"),
    M("rl.loo_baseline_divisor", "cotrain/rl/grpo.py",
      "base = (rewards.sum(dim=1, keepdim=True) - rewards) / (G - 1)", "base = (rewards.sum(dim=1, keepdim=True) - rewards) / G",
      ["tests/rl/test_grpo_math.py", "tests/rl/test_grpo_clip.py"], "leave-one-out baseline divides by G"),
    M("rl.seq_mean_padded_length", "cotrain/rl/grpo.py",
      "counts = mask.sum(dim=1) if seq_tokens is None else seq_tokens.to(token_losses.dtype)",
      "counts = torch.full((mask.shape[0],), float(mask.shape[1])) if seq_tokens is None else "
      "seq_tokens.to(token_losses.dtype)",
      ["tests/rl/test_grpo_math.py", "tests/rl/test_grpo_clip.py"], "seq_mean divides by the padded length"),
    M("rl.std_population", "cotrain/rl/grpo.py",
      "adv = adv / (rewards.std(dim=1, keepdim=True) + eps)", "adv = adv / (rewards.std(dim=1, keepdim=True, unbiased=False) + eps)",
      ["tests/rl/test_grpo_math.py", "tests/rl/test_grpo_clip.py"], "advantages normalised by the biased std"),
    M("rl.checkpoint_marker_first", "cotrain/checkpoint.py",
      "        write_manifest(d)\n        atomic_write_bytes(d / COMPLETE, b\"\")\n",
      "        atomic_write_bytes(d / COMPLETE, b\"\")\n        write_manifest(d)\n",
      ["tests/test_checkpoint.py"], "the completion marker is written before the files"),
    M("rl.prune_counts_abandoned_checkpoints", "cotrain/checkpoint.py",
      " if p.parent.name <= f\"step_{step:06d}\")", ")",
      ["tests/rl/test_runfolder.py", "-k", "prune"],
      "pruning counts the newer checkpoints a resume from an older one abandoned (and deletes the new one)"),
    M("rl.checkpoint_loads_pickled_objects", "cotrain/checkpoint.py",
      "return torch.load(path, weights_only=True, **kwargs)", "return torch.load(path, weights_only=False, **kwargs)",
      ["tests/rl/test_runfolder.py", "-k", "pickled"], "checkpoint files unpickled whole (a crafted one runs code)"),
    M("run.fresh_run_mixes_with_the_old_one", "cotrain/runfolder.py",
      "    if not files:\n        return None\n", "    if True:\n        return None\n",
      ["tests/rl/test_runfolder.py", "-k", "used_folder or refuses_the_folder"],
      "a fresh run into a folder holding another run is not refused"),
    M("config.resume_applies_a_data_change", "cotrain/config/resume.py",
      "    \"data.\": \"the prompt stream's position", "    \"data.nothing.\": \"the prompt stream's position",
      ["tests/rl/test_runfolder.py", "-k", "cannot_follow"],
      "a resume with other training data is applied (the stream position means other prompts)"),
    M("rl.resume_keeps_the_saved_lr", "cotrain/rl/trainer.py",
      "        apply_config(self.optimizer.param_groups, opt, max_lr=opt.lr, min_lr=min(opt.min_lr, opt.lr))\n", "",
      ["tests/rl/test_trainer_updates.py", "-k", "changed_learning_rate"],
      "a resume runs on the checkpoint's learning rate, not the config's"),
    M("rl.driver_no_finiteness_check", "cotrain/rl/driver.py",
      "        check_finite(step, train_metrics)  # before the policy is pushed, logged or saved\n", "",
      ["tests/rl/test_runfolder.py", "-k", "non_finite_update"],
      "a NaN update is pushed, logged and checkpointed"),
    M("rl.async_draw_waited_before_the_update", "cotrain/rl/driver.py",
      "            self.ahead.launch(step, g.num_steps, lambda s: self.draw_groups(s, version))\n",
      "            self.ahead.launch(step, g.num_steps, lambda s: self.draw_groups(s, version))\n"
      "            self.ahead._future and self.ahead._future.result()\n",
      ["tests/rl/test_driver_contract.py", "-k", "staleness_one"],
      "asynchronous GRPO draws the next step but waits for it before updating (no overlap)"),
    M("rl.async_pending_not_checkpointed", "cotrain/rl/inflight.py",
      "        return {str(s): groups_state(g) for s, g in sorted(self.pending.items())}",
      "        return {}",
      ["tests/rl/test_driver_contract.py", "-k", "resumes_exactly"],
      "the samples in flight are left out of the checkpoint (a resume redraws them on the wrong policy)"),
    M("rl.async_version_unchecked", "cotrain/rl/inflight.py",
      "        if not 0 <= lag <= self.k:", "        if False:",
      ["tests/rl/test_driver_contract.py", "-k", "another_version"],
      "samples more than max_staleness versions old are trained on"),
    M("rl.tis_not_truncated", "cotrain/rl/grpo.py",
      "        weights, keep = w.clamp(max=cap), mask", "        weights, keep = w, mask",
      ["tests/rl/test_grpo_math.py", "-k", "importance"], "TIS weights are not truncated at the cap"),
    M("rl.checkpoint_latest_before_complete", "cotrain/checkpoint.py",
      "        atomic_write_bytes(d / COMPLETE, b\"\")\n        atomic_write_bytes(self.dir / \"latest\", d.name.encode())\n",
      "        atomic_write_bytes(self.dir / \"latest\", d.name.encode())\n        atomic_write_bytes(d / COMPLETE, b\"\")\n",
      ["tests/test_checkpoint.py"], "`latest` moves before the step is complete"),
    M("rl.checkpoint_no_size_check", "cotrain/checkpoint.py",
      "if size != meta[\"size\"]:", "if False:",
      ["tests/test_checkpoint.py"], "a truncated file passes verification"),
    M("rl.checkpoint_no_hash", "cotrain/checkpoint.py",
      "elif hashes and sha256_file(p) != meta[\"sha256\"]:", "elif False:",
      ["tests/test_checkpoint.py"], "a same-size corruption passes verification"),
    M("rl.checkpoint_stale_partial_kept", "cotrain/checkpoint.py",
      "        if d.exists():  # a stale partial write of the same step: start it over\n            shutil.rmtree(d)\n"
      "        d.mkdir(parents=True)",
      "        d.mkdir(parents=True, exist_ok=True)",
      ["tests/test_checkpoint.py"], "a stale partial step directory is written into, not restarted"),
    M("rl.batch_mask_skips_first_response_token", "cotrain/rl/batch.py",
      "start, end = len(s.prompt_token_ids) - 1, len(seq) - 1", "start, end = len(s.prompt_token_ids), len(seq) - 1",
      ["tests/rl/test_batch.py"], "the first response token is not trained on"),
    M("rl.top_k_off_by_one", "cotrain/rl/sampling_filter.py",
      "kth = srt[:, V - top_k:V - top_k + 1]", "kth = srt[:, V - top_k - 1:V - top_k]",
      ["tests/rl/test_sampling_filter.py", "-k", "kept_set"], "top-k keeps k + 1 tokens"),
    M("rl.plot_trend_window", "cotrain/rl/plot.py",
      "ax.plot(xs, moving_average(ys, 10),", "ax.plot(xs, moving_average(ys, 9),",
      ["tests/rl/test_plot.py"], "the curves' trend is a 9-step mean labelled 10-step"),
    M("rl.plot_drops_first_point", "cotrain/rl/plot.py",
      "xs, ys = [p[0] for p in pts], [p[1] for p in pts]", "xs, ys = [p[0] for p in pts][1:], [p[1] for p in pts][1:]",
      ["tests/rl/test_plot.py"], "each curve loses its first logged step"),
    # ----- cotrain/rl/driver.py: the contract with the workers (tests on in-process fakes, seconds) -----------
    M("rl.driver_release_only_on_success", "cotrain/rl/driver.py",
      "        try:\n            self.rollout.push(kind, handle, version)\n        finally:\n"
      "            self.trainer.release_export(handle)",
      "        self.rollout.push(kind, handle, version)\n        self.trainer.release_export(handle)",
      ["tests/rl/test_driver_contract.py"], "a failed push leaks its export (the handle is never released)"),
    M("rl.driver_draft_push_every_step", "cotrain/rl/driver.py",
      "if self.serves_cotrained_drafter and step % cfg.draft.push_every == 0:", "if self.serves_cotrained_drafter:",
      ["tests/rl/test_driver_contract.py"], "the drafter is pushed every step, whatever draft.push_every says"),
    M("rl.driver_push_labels_previous_step", "cotrain/rl/driver.py",
      '            self.push("policy", version=step)\n', '            self.push("policy", version=step - 1)\n',
      ["tests/rl/test_driver_contract.py"], "the updated policy is pushed with the previous step's version"),
    M("rl.driver_colocated_engines_stay_awake", "cotrain/rl/driver.py",
      "        if not self.cfg.rollout.colocate:\n", "        if True:\n",
      ["tests/rl/test_driver_contract.py"], "colocated engines keep the GPU while the trainers run"),
    # ----- cotrain/weights: the push's check and the cuda_ipc handle set -----------------------------------
    M("weights.ipc_rank_zero_only", "cotrain/weights/transports/cuda_ipc.py",
      "part = self._export(tensors) if rank in exporters else None", "part = self._export(tensors) if rank == 0 else None",
      ["tests/weights/test_cuda_ipc.py"], "only trainer rank 0's GPU is in the cuda_ipc handle set"),
    M("weights.ipc_copy_not_sent", "cotrain/weights/transports/cuda_ipc.py",
      "                        dist.send(t, dst=r)", "                        pass",
      ["tests/weights/test_cuda_ipc.py"], "rank 0 never sends its copy to the other engine GPUs (their rank waits)"),
    M("weights.draft_may_carry_borrowed_names", "cotrain/weights/checks.py",
      "    forbidden = shared_name_reasons([row[0] for row in handle[\"manifest\"]], shared)\n",
      "    forbidden = {}\n",
      ["tests/weights/test_checks.py"], "a draft push may overwrite the target's lm_head / embed_tokens"),
    # ----- cotrain/tapchannel: stamps, slots, release ----------------------------------------------------
    M("tap.stale_stamp_accepted", "cotrain/tapchannel/mailbox.py",
      "        if before != seq + 1:\n            raise self._err(TapLappedError if before > seq + 1",
      "        if before > seq + 1:\n            raise self._err(TapLappedError if before > seq + 1",
      ["tests/tapchannel/test_mailbox.py", "tests/tapchannel/test_mailbox_stamps.py"],
      "read() accepts a slot holding an older stamp"),
    M("tap.release_before_copy", "cotrain/tapchannel/channel.py",
      "                x = tr.read(t, seq, copy)\n                if copy:\n                    tr.release(t, seq)\n"
      "                else:\n                    views.append(spec.layer)\n",
      "                if copy:\n                    tr.release(t, seq)\n                x = tr.read(t, seq, copy)\n"
      "                if not copy:\n                    views.append(spec.layer)\n",
      ["tests/tapchannel/test_mailbox_stamps.py"], "a TapChannel slot is released before its copy is taken"),
    M("tap.copy_is_a_view", "cotrain/tapchannel/mailbox.py",
      "        if copy:\n            rows = rows.clone()\n", "",
      ["tests/tapchannel/test_mailbox.py", "tests/tapchannel/test_mailbox_stamps.py"],
      "read(copy=True) returns a view of the slot"),
    M("tap.backpressure_off_by_one", "cotrain/tapchannel/mailbox.py",
      "need = seq + 1 - self.slots", "need = seq - self.slots",
      ["tests/tapchannel/test_mailbox.py"], "a writer overwrites a slot the reader has not released"),
    M("tap.release_stamp_off_by_one", "cotrain/tapchannel/mailbox.py",
      "        words[RELEASED] = seq + 1\n", "        words[RELEASED] = seq\n",
      ["tests/tapchannel/test_mailbox.py"], "a release frees the slot one microbatch too late"),
    M("tap.lap_not_detected", "cotrain/tapchannel/mailbox.py",
      "        if seq > head:\n", "        if seq > head + 1:\n",
      ["tests/tapchannel/test_mailbox.py", "tests/tapchannel/test_mailbox_stamps.py"],
      "a writer that skipped a microbatch is not caught at its claim"),
    M("tap.gpu_release_not_deferred", "cotrain/tapchannel/transports/release.py",
      "            if event.query():  # the GPU is already past the read: no hand-off\n",
      "            if True:  # the GPU is already past the read: no hand-off\n",
      ["tests/tapchannel/test_release.py"], "a cuda_ipc slot is released before the GPU copy finished"),
    M("tap.slots_below_pipeline_depth", "cotrain/tapchannel/channel.py",
      "if self.slots < need:", "if self.slots < need - 1:",
      ["tests/tapchannel/test_spec.py"], "too few slots for the 1F1B depth are accepted"),
    # ----- cotrain/draft: losses, export, acceptance -----------------------------------------------------
    M("draft.target_probs_no_detach", "cotrain/draft/losses.py",
      "x = self.source.detach().index_select(", "x = self.source.index_select(",
      ["tests/draft/test_losses.py"], "target_probs keeps the target's graph"),
    M("draft.forward_kl_dispatch", "cotrain/draft/losses.py",
      "        loss = _wmean(s[..., CE] + s[..., PLOGP], _weights(ce_valid, w))",
      "        loss = _wmean(s[..., CE], _weights(ce_valid, w))",
      ["tests/draft/test_losses.py"], "draft_loss('forward_kl') computes soft CE"),
    M("draft.e2e_invalid_breaks_chain", "cotrain/draft/losses.py",
      "a = torch.where(valid, a, torch.ones_like(a))", "a = torch.where(valid, a, torch.zeros_like(a))",
      ["tests/draft/test_losses.py"], "an invalid position breaks the E2E-TV chain"),
    M("draft.dspark_label_not_detached", "cotrain/draft/losses.py",
      "label = (1.0 - 0.5 * s[..., L1]).detach().clamp(0.0, 1.0)", "label = (1.0 - 0.5 * s[..., L1]).clamp(0.0, 1.0)",
      ["tests/draft/test_losses.py"], "the confidence label backpropagates into the drafter"),
    M("draft.eagle3_norms_swapped_in_vllm_map", "cotrain/draft/eagle3.py",
      "                m[prefix + name] = f\"layers.{i}.{name}\"\n        return m\n",
      "                m[prefix + name] = f\"layers.{i}.{name}\"\n"
      "            a, b = prefix + \"input_layernorm.weight\", prefix + \"hidden_norm.weight\"\n"
      "            m[a], m[b] = m[b], m[a]\n        return m\n",
      ["tests/draft/test_export.py", "-m", "not slow"], "EAGLE-3's input_layernorm and hidden_norm swapped in the vLLM name map"),
    M("draft.dflash_norms_swapped_in_vllm_map", "cotrain/draft/dflash.py",
      "m = {\"fc.weight\": \"fc.weight\", \"hidden_norm.weight\": \"hidden_norm.weight\", \"norm.weight\": \"norm.weight\"}",
      "m = {\"fc.weight\": \"fc.weight\", \"hidden_norm.weight\": \"norm.weight\", \"norm.weight\": \"hidden_norm.weight\"}",
      ["tests/draft/test_export.py", "-m", "not slow"], "DFlash's hidden_norm and norm swapped in the vLLM name map"),
    # the same name-map bug, and forwards that drift from vLLM's, against vLLM's own classes' logits (slow)
    M("draft.eagle3_norms_swapped_vllm_logits", "cotrain/draft/eagle3.py",
      "                m[prefix + name] = f\"layers.{i}.{name}\"\n        return m\n",
      "                m[prefix + name] = f\"layers.{i}.{name}\"\n"
      "            a, b = prefix + \"input_layernorm.weight\", prefix + \"hidden_norm.weight\"\n"
      "            m[a], m[b] = m[b], m[a]\n        return m\n",
      ["tests/draft/test_export.py", "-k", "reproduces_our_logits and eagle3"],
      "EAGLE-3's input_layernorm and hidden_norm swapped in the vLLM name map (seen by vLLM's Eagle3LlamaForCausalLM)"),
    M("draft.dflash_norms_swapped_vllm_logits", "cotrain/draft/dflash.py",
      "m = {\"fc.weight\": \"fc.weight\", \"hidden_norm.weight\": \"hidden_norm.weight\", \"norm.weight\": \"norm.weight\"}",
      "m = {\"fc.weight\": \"fc.weight\", \"hidden_norm.weight\": \"norm.weight\", \"norm.weight\": \"hidden_norm.weight\"}",
      ["tests/draft/test_export.py", "-k", "reproduces_our_logits and dflash"],
      "DFlash's hidden_norm and norm swapped in the vLLM name map (seen by vLLM's DFlashQwen3ForCausalLM)"),
    M("draft.dspark_markov_swapped_vllm_logits", "cotrain/draft/dspark.py",
      "        m[\"markov_head.markov_w1.weight\"] = \"markov_head.markov_w1.weight\"\n"
      "        m[\"markov_head.markov_w2.weight\"] = \"markov_head.markov_w2.weight\"\n",
      "        m[\"markov_head.markov_w1.weight\"] = \"markov_head.markov_w2.weight\"\n"
      "        m[\"markov_head.markov_w2.weight\"] = \"markov_head.markov_w1.weight\"\n",
      ["tests/draft/test_export.py", "-k", "reproduces_our_logits and dspark"],
      "DSpark's Markov embedding and output (both V x r) swapped in the vLLM name map (seen by vLLM's "
      "Qwen3DSparkForCausalLM)"),
    M("draft.eagle3_attn_input_order", "cotrain/draft/eagle3.py",
      "return torch.cat([self.input_layernorm(emb), self.hidden_norm(resid)], dim=-1)",
      "return torch.cat([self.hidden_norm(resid), self.input_layernorm(emb)], dim=-1)",
      ["tests/draft/test_export.py", "-k", "reproduces_our_logits and eagle3"],
      "EAGLE-3 trains with [hidden, embedding] where vLLM serves [embedding, hidden]"),
    M("draft.eagle3_ttt_rope_position", "cotrain/draft/eagle3.py",
      "cos, sin = rope_cos_sin((apos + t).to(dev), D, a.rope_theta)",
      "cos, sin = rope_cos_sin((apos + t + 1).to(dev), D, a.rope_theta)",
      ["tests/draft/test_export.py", "-k", "reproduces_our_logits and eagle3"],
      "EAGLE-3's TTT pass t at RoPE position p+t+1, where vLLM drafts step t at p+t"),
    M("draft.dflash_context_without_hidden_norm", "cotrain/draft/dflash.py",
      "ctx = self.hidden_norm(self.fc(taps))", "ctx = self.fc(taps)",
      ["tests/draft/test_export.py", "-k", "reproduces_our_logits and dflash"],
      "the block drafters' context K/V without hidden_norm (vLLM normalises before the fused K/V projection)"),
    M("draft.vllm_tap_ids_not_shifted", "cotrain/draft/taps.py",
      "return [int(i) + 1 for i in tap_layers]", "return [int(i) for i in tap_layers]",
      ["tests/draft/test_export.py", "-m", "not slow"], "EAGLE-3 aux layer ids in cotrain's convention, not vLLM's"),
    M("draft.accept_lengths_not_leading", "cotrain/draft/acceptance.py",
      "return 1 + torch.cumprod(m, dim=1).sum(dim=1)", "return 1 + m.sum(dim=1)",
      ["tests/draft/test_acceptance.py", "-m", "not slow"], "acceptance counts every match, not the leading run"),
    M("draft.online_acceptance_unmapped", "cotrain/draft/online.py",
      "            drafted = vocab.to_target(drafted)\n", "            drafted = drafted\n",
      ["tests/draft/test_draft_vocab.py", "-k", "online_step_equals"],
      "the online trainer's offline acceptance compares draft ids with target tokens (reduced vocabulary)"),
    M("draft.compare_frozen_scores_the_trained_drafter", "cotrain/draft/online.py",
      "out = self.frozen(batch, layout", "out = self.drafter(batch, layout",
      ["tests/draft/test_online.py", "-k", "compare_frozen"],
      "draft.compare_frozen scores the co-trained drafter instead of its frozen copy"),
    # the chunked losses (derivatives written in the forward) and the training path's attention
    M("draft.loss_chunk_boundary", "cotrain/draft/losses.py",
      "n1 = min(n0 + chunk, N)", "n1 = min(n0 + chunk - 1, N)",
      ["tests/draft/test_losses.py", "-k", "chunk"], "a chunk's last chain is skipped at every boundary"),
    M("draft.loss_ce_derivative_sign", "cotrain/draft/losses.py",
      "torch.mul(q, p.sum(-1, keepdim=True), out=out).sub_(p)", "torch.mul(q, p.sum(-1, keepdim=True), out=out).add_(p)",
      ["tests/draft/test_losses.py"], "the cross-entropy's derivative q sum(p) + p instead of - p"),
    M("draft.loss_softmax_jacobian_uncentred", "cotrain/draft/losses.py",
      "out.sub_(_rowdot(out, q)[:, None]).mul_(q)", "out.mul_(q)",
      ["tests/draft/test_losses.py"], "L1 / overlap derivative through the softmax without the - <g, q> term"),
    M("draft.training_path_dense_oracle", "cotrain/draft/common.py",
      "            out, _, bout, blse = local_branch_attention(q, k, v, bq, bk, bv, self.layout)",
      "            from cotrain.parallel import dense_branch_attention as d\n"
      "            out, _, bout, blse = d(q, k, v, bq, bk, bv, self.layout) if q is not None else "
      "local_branch_attention(q, k, v, bq, bk, bv, self.layout)",
      ["tests/draft/test_drafters.py", "-k", "main_queries"],
      "CP = 1 with main queries trains through the dense oracle again"),
    # ----- bench/: what the benchmarks report follows from what they measured --------------------------------
    M("bench.draft_vocab_ratio_inverted", "bench/draft_vocab.py",
      "per_round = [b / a for a, b in zip(full.round_ms, red.round_ms)]",
      "per_round = [a / b for a, b in zip(full.round_ms, red.round_ms)]",
      ["tests/draft/test_draft_vocab_bench.py"], "the reduced / full step-time ratio reported upside down"),
    M("bench.e2e_rollout_speedup_inverted", "bench/cotrain_e2e.py",
      "\"rollout_speedup\": tot(\"plain\", \"time/rollout\") / tot(arm, \"time/rollout\"),",
      "\"rollout_speedup\": tot(arm, \"time/rollout\") / tot(\"plain\", \"time/rollout\"),",
      ["tests/bench/test_bench_smoke.py", "-k", "cotrain_e2e"], "the co-training headline's rollout speed-up inverted",
      timeout=600),
    M("bench.e2e_arms_not_rotated", "bench/cotrain_e2e.py",
      "            order = names[step % len(names):] + names[: step % len(names)]\n",
      "            order = names\n",
      ["tests/bench/test_bench_smoke.py", "-k", "cotrain_e2e"], "the arms run in the same order every step (load drift "
      "lands on the same arms)", timeout=600),
    M("draft.eagle3_live_slot_merge_weight", "cotrain/draft/eagle3.py",
      "o_b * torch.exp(l_b - lse)[..., None]", "o_b * torch.exp(l_a - lse)[..., None]",
      ["tests/draft/test_drafters.py", "-k", "live_slot"],
      "EAGLE-3's live slot merges the earlier pass keys' attention with the trunk part's weight"),
    M("draft.eagle3_live_slot_own_key_twice", "cotrain/draft/eagle3.py",
      "ek = torch.stack([kv[0] for kv in kvs[:-1]], dim=1)", "ek = torch.stack([kv[0] for kv in kvs[1:]], dim=1)",
      ["tests/draft/test_drafters.py", "-k", "live_slot"],
      "EAGLE-3's pass t attends to its own key twice and never to pass 1's"),
    # ----- cotrain/parallel: LSE merge, zigzag --------------------------------------------------------------
    M("parallel.lse_weight_sign", "cotrain/parallel/lse.py",
      "torch.sigmoid(block_lse - lse)", "torch.sigmoid(lse - block_lse)",
      ["tests/parallel/test_layout_zigzag.py"], "the LSE merge weighs the wrong side"),
    M("parallel.lse_empty_nan", "cotrain/parallel/lse.py",
      "nan=0.0)", "nan=1.0)", ["tests/parallel/test_layout_zigzag.py"], "two empty sides merge into garbage",
      equivalent="both sides empty (lse -inf) means both outputs are the zeros every producer writes for rows that "
                 "see nothing (the running output starts at zeros, the kernels and the oracle write 0), so taking "
                 "the block's output or keeping the running one gives the same zeros"),
    M("parallel.zigzag_mirror_chunk", "cotrain/parallel/zigzag.py",
      "for i in (rank, 2 * cp_size - 1 - rank):", "for i in (rank, 2 * cp_size - 2 - rank):",
      ["tests/parallel/test_layout_zigzag.py"], "zigzag pairs chunk r with 2C-2-r"),
    M("parallel.branch_only_rows_after_main", "cotrain/parallel/branch_attention.py",
      "base = T if main_queries else 0", "base = T",
      ["tests/parallel/test_no_wasted_work.py"], "q=None plans place the branch query rows after absent main rows"),
    M("parallel.ring_dkv_buffer_not_zeroed", "cotrain/parallel/branch_attention.py",
      "dkv_bufs[step % 2].zero_()", "dkv_bufs[step % 2]",
      ["tests/parallel/test_cp_branch_attention.py"],
      "a travelling dK/dV buffer allocated once per backward is reused without zeroing"),
    M("parallel.ring_dkv_allocated_per_step", "cotrain/parallel/branch_attention.py",
      "acc = own_dkv if step == 0 else dkv_bufs[step % 2].zero_()",
      "acc = own_dkv if step == 0 else torch.zeros_like(own_dkv)",
      ["tests/parallel/test_ring_allocations.py"], "the travelling dK/dV accumulator allocated at every ring step"),
    M("parallel.zigzag_pad_unit", "cotrain/parallel/zigzag.py",
      "    unit = 2 * cp_size\n    return (seqlens + unit - 1) // unit * unit",
      "    unit = cp_size\n    return (seqlens + unit - 1) // unit * unit",
      ["tests/parallel/test_layout_zigzag.py"], "sequences padded to C instead of 2C"),
    # ----- SpecOPD in the GRPO step: the Megatron policy's tree forward (megatron_adapter.tree_branch_logits) --
    M("specopd.tree_rotary_packed_order", "cotrain/parallel/megatron_adapter.py",
      "        return rope.get_emb(n)[pos]", "        return rope.get_emb(pos.numel())",
      ["tests/rl/test_cotrain_specopd.py::test_megatron_tree_forward_equals_plain_hf_forward_on_every_branch_prefix"],
      "the branch tokens' rotary positions by packed order (0..Nb-1) instead of anchor + j"),
    M("specopd.tree_branches_see_each_other", "cotrain/parallel/megatron_adapter.py",
      "local_branch_attention(None, k, v, bq, bk, bv, layout,",
      "local_branch_attention(None, k, v, bq, bk, bv, BranchLayout(layout.cu_seqlens, layout.anchors[:1], "
      "layout.branch_lens.sum()[None], context='inclusive', intra='causal'),",
      ["tests/rl/test_cotrain_specopd.py::test_megatron_tree_forward_equals_plain_hf_forward_on_every_branch_prefix"],
      "the branch tokens attend as one causal chain: each sees every earlier branch (and the stem up to the "
      "first anchor) instead of only its own ancestors"),
    M("specopd.branch_logits_untempered", "cotrain/rl/draft_stage.py",
      "logits, keep = sampling_logits(logits, s)",
      "logits, keep = sampling_logits(logits, s.model_copy(update={'temperature': 1.0}))",
      ["tests/rl/test_cotrain_specopd.py::test_drafter_on_policy_step_equals_the_offline_specopd_computation"],
      "the policy's branch-token logits not tempered (p_2.. at T = 1 while p_1, from the stem, is at the "
      "sampling temperature)"),
    # ----- cotrain/config ---------------------------------------------------------------------------------------
    M("config.shallow_merge", "cotrain/config/loader.py",
      "if isinstance(value, dict) and isinstance(out.get(key), dict):", "if False:",
      ["tests/config/test_config.py"], "defaults / overrides replace whole sections instead of merging"),
    M("config.kl_without_reference_accepted", "cotrain/config/validate.py",
      "if g.kl_coef > 0 and not pol.reference_model:", "if g.kl_coef > 0 and pol.reference_model:",
      ["tests/config/test_config_errors.py", "-k", "kl"], "kl_coef > 0 without a reference model passes validation"),
    M("config.optimizer_steps_ignore_epochs", "cotrain/config/derived.py",
      "return g.num_steps * (B // gbs) * g.epochs", "return g.num_steps * (B // gbs)",
      ["tests/config/test_config.py", "tests/config/test_config_steps.py"], "the LR schedule's length ignores grpo.epochs"),
    # ----- cotrain/tasks ----------------------------------------------------------------------------------------
    M("tasks.first_marker", "cotrain/tasks/rewards.py",
      "response = response.rsplit(MARKER, 1)[1]", "response = response.split(MARKER, 1)[1]",
      ["tests/tasks/test_task_and_tiny.py", "tests/tasks/test_gcd_and_small.py", "-m", "not slow", "-k", "not partly_right"],
      "the answer is read after the first `=>`, not the last"),
    M("tasks.format_error_never", "cotrain/tasks/rewards.py",
      "if not got or (is_number(want) and not is_number(got)):", "if not got:",
      ["tests/tasks/test_task_and_tiny.py", "-m", "not slow", "-k", "not partly_right"], "a non-numeric answer to a numeric question is not a format error"),
    M("tasks.resume_wrong_epoch_order", "cotrain/tasks/data.py",
      "int(state[\"pos\"])\n        self._order = self._permutation(self.epoch)\n",
      "int(state[\"pos\"])\n        self._order = self._permutation(0)\n",
      ["tests/tasks/test_task_and_tiny.py", "-m", "not slow", "-k", "not partly_right"], "a resumed prompt stream uses epoch 0's order"),
]


def by_id() -> dict[str, Mutant]:
    out = {m.id: m for m in MUTANTS}
    assert len(out) == len(MUTANTS), "duplicate mutant ids"
    return out


# ----- scratch copy -------------------------------------------------------------------------------------
def make_scratch(worktree: bool) -> Path:
    root = Path(tempfile.mkdtemp(prefix="cotrain-mutants-"))
    if worktree:
        files = subprocess.run(["git", "ls-files", "-co", "--exclude-standard", "-z"], cwd=REPO, check=True,
                               capture_output=True).stdout.decode().split("\0")
        for f in filter(None, files):
            src = REPO / f
            if src.is_file():
                (root / f).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(src, root / f)
    else:
        archive = subprocess.run(["git", "archive", "HEAD"], cwd=REPO, check=True, capture_output=True).stdout
        subprocess.run(["tar", "-x", "-C", str(root)], input=archive, check=True)
    return root


def env_for(scratch: Path) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(scratch) + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    env["PYTHONDONTWRITEBYTECODE"] = "1"  # a mutant's .pyc can never outlive it
    return env


def canary(scratch: Path) -> None:
    out = subprocess.run([sys.executable, "-c", "import cotrain; print(cotrain.__file__)"], cwd=scratch,
                         env=env_for(scratch), capture_output=True, text=True, check=True).stdout.strip()
    if not Path(out).resolve().is_relative_to(scratch.resolve()):
        raise SystemExit(f"canary: the scratch copy imports cotrain from {out}, not from {scratch}")


# ----- running ------------------------------------------------------------------------------------------
def run_tests(scratch: Path, tests: list[str], timeout: int) -> tuple[str, float, str]:
    """(outcome of pytest: passed / failed / timeout / error, seconds, output tail)."""
    cmd = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=scratch, env=env_for(scratch), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, _ = proc.communicate()
        return "timeout", time.monotonic() - t0, (out or "")[-2000:]
    dt = time.monotonic() - t0
    status = {0: "passed", 1: "failed"}.get(proc.returncode, "error")
    return status, dt, (out or "")[-2000:]


def apply(scratch: Path, m: Mutant) -> str | None:
    """The file's original text after writing the mutant, or None when the mutation is stale."""
    path = scratch / m.path
    if not path.exists():
        return None
    text = path.read_text()
    if text.count(m.old) != 1:
        return None
    path.write_text(text.replace(m.old, m.new))
    return text


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--only", help="comma-separated mutant ids (or id prefixes: 'tap.', 'rl.')")
    ap.add_argument("--list", action="store_true", help="list the mutants and exit")
    ap.add_argument("--check", action="store_true", help="only check that every mutation applies")
    ap.add_argument("--baseline", action="store_true", help="run each focused test set unmutated first")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per mutant (default 240)")
    ap.add_argument("--worktree", action="store_true", help="copy the working tree instead of HEAD")
    ap.add_argument("--keep", action="store_true", help="keep the scratch copy")
    ap.add_argument("--json", default=str(REPO / "runs" / "mutants.json"), help="where to write the results")
    args = ap.parse_args(argv)

    mutants = MUTANTS
    by_id()
    if args.only:
        keys = [k.strip() for k in args.only.split(",") if k.strip()]
        mutants = [m for m in MUTANTS if any(m.id == k or (k.endswith(".") and m.id.startswith(k)) for k in keys)]
        if not mutants:
            raise SystemExit(f"no mutant matches {args.only!r}")
    if args.list:
        for m in mutants:
            print(f"{m.id:42s} {m.path:42s} {' '.join(m.tests)}\n    {m.why}")
        print(f"{len(mutants)} mutants")
        return 0

    scratch = make_scratch(args.worktree)
    results = []
    try:
        canary(scratch)
        if args.baseline:
            for tests in sorted({tuple(m.tests) for m in mutants}):
                status, dt, tail = run_tests(scratch, list(tests), max(args.timeout, 600))
                print(f"baseline {status:7s} {dt:6.1f}s  {' '.join(tests)}", flush=True)
                if status != "passed":
                    print(tail)
                    raise SystemExit("the focused tests fail without any mutation: fix that first")
        for i, m in enumerate(mutants, 1):
            original = apply(scratch, m)
            if original is None:
                status, dt, tail = "stale", 0.0, f"{m.path}: the text to mutate is not there exactly once"
            else:
                try:
                    if args.check:
                        status, dt, tail = "applies", 0.0, ""
                    else:
                        ran, dt, tail = run_tests(scratch, m.tests, m.timeout or args.timeout)
                        status = {"failed": "killed", "passed": "survived"}.get(ran, ran)
                finally:
                    (scratch / m.path).write_text(original)
            if status == "survived" and m.equivalent:
                status = "equivalent"
            results.append({**asdict(m), "status": status, "seconds": round(dt, 1),
                            "output_tail": tail if status not in ("killed", "applies") else tail[-600:]})
            print(f"[{i:2d}/{len(mutants)}] {status:10s} {dt:6.1f}s  {m.id}  ({m.why})", flush=True)
    finally:
        if args.keep:
            print(f"scratch copy kept: {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)

    counts = {s: sum(r["status"] == s for r in results) for s in
              ("killed", "timeout", "survived", "equivalent", "stale", "error", "applies")}
    scored = counts["killed"] + counts["timeout"] + counts["survived"]
    rate = (counts["killed"] + counts["timeout"]) / scored if scored else None
    summary = {"mutants": len(results), **counts, "kill_rate": rate,
               "survivors": [r["id"] for r in results if r["status"] == "survived"],
               "equivalent_reasons": {r["id"]: r["equivalent"] for r in results if r["status"] == "equivalent"},
               "not_scored": [r["id"] for r in results if r["status"] in ("stale", "error")],
               "commit": subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True,
                                        text=True).stdout.strip(),
               "worktree": args.worktree}
    if args.check:
        print(f"{counts['applies']} of {len(results)} mutations apply; stale: {summary['not_scored'] or 'none'}")
        return 0 if counts["stale"] == 0 else 1
    out = Path(args.json)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"summary": summary, "results": results}, indent=1))
    print(f"\nkill rate {rate:.0%} ({counts['killed'] + counts['timeout']} of {scored}; {counts['timeout']} by timeout)"
          if rate is not None else "\nnothing scored")
    for r in results:
        if r["status"] in ("survived", "stale", "error"):
            print(f"  {r['status']:9s} {r['id']}: {r['why']}")
        elif r["status"] == "equivalent":
            print(f"  equivalent {r['id']}: {r['equivalent']}")
    print(f"JSON: {out}")
    return 0 if not summary["survivors"] and not summary["not_scored"] else 1


if __name__ == "__main__":
    sys.exit(main())
