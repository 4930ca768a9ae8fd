"""The GRPO driver: the algorithm, one step at a time.

    for each step:
        prompts   <- the next prompts_per_step problems
        rollouts  <- group_size samples per prompt from the engines (current weights; with
                     grpo.max_staleness = k, drawn k steps ahead while earlier steps update)
        rewards   <- verifiable reward of each response; groups whose rewards are all equal carry no
                     learning signal (grpo.resample_rounds: more prompts drawn in their place, DAPO)
        advantages<- group-normalised rewards
        log-probs <- the policy's recomputation on the rollout batch; the co-trained drafter
                     trains on this very forward (its taps, the policy's detached logits);
                     grpo.importance_correction weighs the loss by trainer / engine ratios
        update    <- GRPO optimizer step on the trainers (none - the policy stays bit-identical -
                     when fewer than grpo.min_groups_with_signal groups carry a signal)
        push      <- new policy (and drafter) weights into the engines (versioned)
        metrics   -> JSONL / TensorBoard / W&B / MLflow;  checkpoint every N steps

The workers are reached only through their interfaces (:mod:`cotrain.rl.interfaces`), built by a
:class:`~cotrain.rl.interfaces.WorkerFactory`: by default :class:`cotrain.rl.ray_workers.RayWorkers`
(Megatron trainers and vLLM engines as Ray actors).
"""

from __future__ import annotations

import math
import time
import warnings
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from cotrain import runfolder
from cotrain.config import ConfigError
from cotrain.config.resume import describe as describe_changes
from cotrain.config.resume import diff_against
from cotrain.rl.batch import TrainBatch, build_batch
from cotrain.checkpoint import CheckpointError, CheckpointManager, unsafe_files
from cotrain.rl.grpo import group_advantages, groups_with_signal, importance_weights, k3_kl, select_groups
from cotrain.rl.inflight import DrawAhead, StepGroups
from cotrain.rl.interfaces import GenerationResult, Sample, SamplingSpec, WorkerFactory
from cotrain.rl.metrics import MetricsLogger
from cotrain.seeding import mix
from cotrain.tasks.data import Problem, PromptStream
from cotrain.tasks.rewards import CORRECT, exact_match_reward


# ---------------------------------------------------------------------------------------- pieces
def load_problems(cfg, tokenizer=None) -> tuple[list[Problem], list[Problem]]:
    """Training problems and held-out evaluation problems, which share no prompt
    (:func:`cotrain.tasks.data.load_task`, the same loading config validation does). Prompts longer
    than policy.max_seq_len - rollout.sampling.max_tokens tokens are refused here, before any engine
    sees them (``tokenizer``: the policy's; None = load it from policy.model_path)."""
    from cotrain.config import ConfigError
    from cotrain.config.validate import check_prompt_lengths
    from cotrain.tasks.data import load_task

    try:
        train, evals = load_task(cfg.data, min_train=cfg.grpo.prompts_per_step)
    except ValueError as e:
        raise ConfigError([("data.eval.path" if cfg.data.eval.path and str(e).startswith(str(cfg.data.eval.path))
                            else "data.jsonl.path", str(e))]) from None
    issues = check_prompt_lengths(cfg, train + evals, tokenizer)
    if issues:
        raise ConfigError(issues)
    return train, evals


def score(cfg, samples, problems: list[Problem]) -> torch.Tensor:
    """Rewards [prompts, group]: reward.correct / incorrect / format_error (cotrain.tasks.rewards)."""
    r = cfg.reward
    return torch.tensor([[s.reward if s.reward is not None else  # multi-turn: the environment's reward
                          exact_match_reward(s.text, p.answer, r.correct, r.incorrect, r.format_error) for s in row]
                         for row, p in zip(samples, problems)])


def reward_metrics(samples, problems: list[Problem]) -> dict[str, float]:
    """``reward/format_error``: the fraction of responses without a well-formed answer
    (cotrain.tasks.rewards.grade), whatever reward.format_error pays for them."""
    from cotrain.tasks.rewards import FORMAT_ERROR, grade

    outcomes = [grade(s.text, p.answer) for row, p in zip(samples, problems) for s in row]
    return {"reward/format_error": sum(o == FORMAT_ERROR for o in outcomes) / max(1, len(outcomes))}


def accuracy(cfg, samples: list, rewards: torch.Tensor) -> float:
    """``reward/accuracy``: the fraction of right final answers. Single-turn: reward == reward.correct;
    multi-turn: the environment's grading of the last turn (``outcome`` of its last record), which a
    call cost (env.calculator.call_cost) does not shift."""
    if samples and samples[0].turns is not None:
        return sum(s.turns[-1].get("outcome") == CORRECT for s in samples) / len(samples)
    return (rewards == cfg.reward.correct).float().mean().item()


def response_metrics(samples: list) -> dict[str, float]:
    """``response/length``: the policy's tokens per response (a multi-turn sample's loss-mask ones:
    never the environment's replies, which ``response/env_tokens`` counts), ``response/truncated``."""
    policy = [sum(s.loss_mask) if s.loss_mask is not None else len(s.token_ids) for s in samples]
    m = {"response/length": sum(policy) / len(samples),
         "response/truncated": sum(s.finish_reason == "length" for s in samples) / len(samples)}
    if samples[0].loss_mask is not None:
        m["response/env_tokens"] = sum(len(s.token_ids) for s in samples) / len(samples) - m["response/length"]
    return m


def train_inference_kl(batch: TrainBatch) -> dict[str, float]:
    """How far the engines' sampling log-probs are from the trainer's on the same weights: the k3
    estimate of KL(engine || trainer) per response token, in float64 (>= 0; see grpo.k3_kl)."""
    m = batch.mask.bool()
    rollout, train = batch.rollout_logprobs[m].double(), batch.old_logprobs[m].double()
    return {"kl/train_infer": k3_kl(rollout, train).mean().item(),
            "kl/train_infer_max_abs_diff": (rollout - train).abs().max().item()}


def rollout_metrics(gm: dict[str, float]) -> dict[str, float]:
    m = {"rollout/tokens_per_s": gm["tokens_per_s"]}
    if "env_s" in gm:  # multi-turn: the environment's seconds (tool execution, latency) inside the rollout
        m["time/env"] = gm["env_s"]
        m.update({k: v for k, v in gm.items() if k.startswith("env/")})
        m["env/turns_mean"] = gm["turns_mean"]
        # vLLM's acceptance per policy turn (turn<t>/mean_acceptance_length of the turn loop)
        m.update({f"spec/acceptance_length_turn{k[len('turn'):-len('/mean_acceptance_length')]}": v
                  for k, v in gm.items() if k.startswith("turn") and k.endswith("/mean_acceptance_length")})
    if "mean_acceptance_length" in gm:
        m["spec/acceptance_length"] = gm["mean_acceptance_length"]
        m["spec/draft_acceptance_rate"] = gm["draft_acceptance_rate"]
    return m


def draft_step_metrics(dm: dict[str, float], update_s: float) -> dict[str, float]:
    """The drafter's metrics from the trainer, plus its update-time overhead: the drafter's time over
    the rest of the update phase (the paper's "update-time overhead")."""
    m = dict(dm)
    draft_s = m.pop("draft/time_s", 0.0)
    m["time/draft"] = draft_s
    rest = update_s - draft_s
    m["draft/update_overhead"] = draft_s / rest if rest > 0 else float("nan")
    return m


def resolve_draft_init(cfg) -> str | None:
    """The directory of the co-trained drafter's initial weights (``draft.init``), building the cached
    offline distillation first for ``distill:<yaml>``; None = from scratch."""
    init = cfg.draft.init
    if init is None:
        return None
    if init.startswith("distill:"):
        from cotrain.draft.cache import ensure_distilled

        print(f"drafter init: the offline distillation of {init[len('distill:'):]} (cached after the first run)")
        return str(ensure_distilled(init[len("distill:"):], progress=cfg.logging.progress_bar) / "drafter")
    return init


@contextmanager
def timed(metrics: dict, key: str):
    t = time.perf_counter()
    yield
    metrics[key] = time.perf_counter() - t


class NonFiniteError(RuntimeError):
    """The update produced a non-finite loss or gradient norm (named with the step): the run stops
    before the step is logged, pushed or checkpointed."""


def check_finite(step: int, train_metrics: dict[str, float]) -> None:
    bad = {k: train_metrics[k] for k in ("loss", "grad_norm") if not math.isfinite(train_metrics[k])}
    if bad:
        shown = ", ".join(f"train/{k}={v}" for k, v in bad.items())
        raise NonFiniteError(f"step {step}: {shown}; the policy's weights are no longer finite, so the run stops "
                             "here and nothing of this step is saved (the last checkpoint is intact). Usual causes: "
                             "too high a policy.optimizer.lr, no policy.optimizer.clip_grad, bfloat16 overflow")


@dataclass
class DriverState:
    """What the driver itself needs to resume exactly (the workers checkpoint their own state)."""

    step: int = 0
    data: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------- the run
class GrpoRun:
    """One GRPO run. ``workers`` builds the trainer and the engines (default: Ray actors,
    :class:`~cotrain.rl.ray_workers.RayWorkers`)."""

    def __init__(self, cfg, workers: WorkerFactory | None = None):
        if workers is None:
            from cotrain.rl.ray_workers import RayWorkers

            workers = RayWorkers(cfg)
        self.cfg = cfg
        self.workers = workers
        self.ckpt = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.keep_last)
        self.trainer = self.rollout = self.logger = None
        self.rejected_draft_pushes = 0
        self.ahead = DrawAhead(cfg.grpo.max_staleness)  # the steps drawn ahead (cotrain.rl.inflight)
        self.served_policy = 0  # the policy version the engines serve (the last policy push)
        self.resume_changes: list = []  # config keys changed since the resumed checkpoint (applied)

    def setup(self, resume) -> None:
        from transformers import AutoTokenizer

        from cotrain.models.build_tiny import resolve_model_path

        cfg = self.cfg
        self.model_path = str(resolve_model_path(cfg.policy.model_path))
        tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self.pad_id = tokenizer.pad_token_id
        train, self.eval_problems = load_problems(cfg, tokenizer=tokenizer)
        self.stream = PromptStream(train, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        self.state = DriverState()
        # everything that can fail without workers fails before they start
        resume_dir = self.ckpt.resolve(resume) if resume else None  # verified; a damaged one is skipped
        if resume_dir is not None and (unsafe := unsafe_files(resume_dir)):
            raise CheckpointError(f"checkpoint.resume: {resume_dir} is refused: {'; '.join(unsafe)}")
        saved = self.ckpt.load_driver_state(resume_dir) if resume_dir is not None else None
        if saved is not None:
            runfolder.check_resume(cfg, saved.get("run_id"), resume_dir)
            self.resume_changes = self._resume_changes(resume_dir)
            if saved["step"] > cfg.grpo.num_steps:
                raise runfolder.RunFolderError(f"grpo.num_steps={cfg.grpo.num_steps} is below the step of checkpoint "
                                     f"{resume_dir} ({saved['step']}): nothing to continue (allowed: >= "
                                     f"{saved['step']}, or a fresh run)")
        self.run_id = runfolder.claim(cfg, saved.get("run_id") if saved else None, resume=resume or False)
        from cotrain.draft.budget import DraftBudget
        from cotrain.models.hf_io import param_count

        self.budget = DraftBudget(cfg.draft.budget, served=self.serves_cotrained_drafter) if self.cotrain else None
        if self.budget is not None and saved is not None and saved.get("draft_budget"):
            self.budget.load_state_dict(saved["draft_budget"])
        # (the budget's FLOP estimate of an update; headers only)
        self.policy_params = param_count(self.model_path) if self.budget is not None else 0
        draft_init = resolve_draft_init(cfg) if self.cotrain else None
        self.workers.start()
        self.trainer = self.workers.trainer(self.model_path, draft_init)
        served_draft = None
        if self.serves_cotrained_drafter:  # the engines start with the trainer's initial drafter
            served_draft = self.trainer.export_draft_dir(str(Path(cfg.run.output_dir) / "drafter_init"))
        if cfg.rollout.colocate:  # colocated engines start (and roll out) beside offloaded trainers
            self.trainer.offload()
        self.rollout = self.workers.rollout(self.model_path, served_draft)
        self.trainer.connect(self.rollout)
        if resume_dir is not None:
            with self.engines_asleep():
                self.trainer.load_checkpoint(str(resume_dir))
            self.state = DriverState(step=saved["step"], data=saved["data"])
            self.stream.load_state(self.state.data)
            self.ahead.load_state_dict(saved.get("ahead", {}))  # samples in flight (grpo.max_staleness)
            self.push("policy", version=self.state.step)  # engines serve exactly the checkpointed policy
            if self.serves_cotrained_drafter:
                self.push("draft", version=self.state.step)  # ... and drafter
            print(f"resumed from {resume_dir} at step {self.state.step}")
            if self.resume_changes:
                print(f"changed since that checkpoint, applied from step {self.state.step + 1} on: "
                      f"{describe_changes(self.resume_changes)}")
        self.logger = MetricsLogger(cfg, resume_step=self.state.step)

    def _resume_changes(self, resume_dir: Path) -> list:
        """The config keys changed since ``resume_dir`` was written: those a resume cannot follow
        raise :class:`ConfigError` (before any worker starts), the others are returned (applied)."""
        applied, refused = diff_against(resume_dir, self.cfg.to_dict())
        if refused:
            raise ConfigError(refused)
        return applied

    @property
    def cotrain(self) -> bool:
        """The drafter is trained online inside the step."""
        return self.cfg.draft.kind is not None and self.cfg.draft.cotrain

    @property
    def serves_cotrained_drafter(self) -> bool:
        """The engines draft with the co-trained drafter (else it trains, measured offline only)."""
        d, spec = self.cfg.draft, self.cfg.rollout.speculative
        return self.cotrain and spec.method is not None and spec.method == d.record.vllm_method

    # ------------------------------------------------------------------ one step
    def sampling(self, step: int, round: int = 0) -> SamplingSpec:
        s = self.cfg.rollout.sampling
        # a per-step (and per-round: grpo.resample_rounds) seed makes every step's rollouts
        # reproducible, which is what resume relies on
        return SamplingSpec(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
                            seed=mix(self.cfg.run.seed, step) + round * 2**32)

    def generate_groups(self, problems: list[Problem], sampling: SamplingSpec, n: int | None = None) -> GenerationResult:
        """``n`` (default grpo.group_size) samples of each problem's response from the engines: one turn,
        or with a multi-turn environment (env.kind, rollout.max_turns > 1) the turn loop of
        cotrain.rl.multiturn."""
        n = self.cfg.grpo.group_size if n is None else n
        if self.cfg.rollout.max_turns > 1:
            if getattr(self, "turn_loop", None) is None:
                from cotrain.rl.multiturn import TurnLoop

                self.turn_loop = TurnLoop.from_config(self.cfg, self.model_path)
            return self.turn_loop.generate(self.rollout, problems, sampling, n=n)
        return self.rollout.generate([p.prompt for p in problems], sampling, n=n)

    def draw_groups(self, step: int, version: int | None = None) -> StepGroups:
        """The step's groups: one round of prompts_per_step prompts, then (grpo.resample_rounds,
        DAPO's dynamic sampling) further rounds while fewer than prompts_per_step groups carry a
        learning signal; the update's groups are :func:`~cotrain.rl.grpo.select_groups`'.
        ``version``: the policy version the engines hold for this draw (default: the served one)."""
        cfg, g = self.cfg, self.cfg.grpo
        P = g.prompts_per_step
        problems = self.stream.take(P)
        first = self.generate_groups(problems, self.sampling(step))
        first_rewards = score(cfg, first.samples, problems)
        samples, rewards = list(first.samples), [first_rewards]
        signal = groups_with_signal(first_rewards).tolist()
        for r in range(1, g.resample_rounds + 1):
            if sum(signal) >= P:
                break
            more = self.stream.take(P)
            gen = self.generate_groups(more, self.sampling(step, r))
            problems, samples = problems + more, samples + gen.samples
            rewards.append(score(cfg, gen.samples, more))
            signal += groups_with_signal(rewards[-1]).tolist()
        keep = select_groups(signal, P) if g.resample_rounds else list(range(P))
        rewards = torch.cat(rewards)[keep]
        return StepGroups(first=first, first_problems=problems[:P], first_rewards=first_rewards,
                          samples=[samples[i] for i in keep], rewards=rewards,
                          with_signal=int(groups_with_signal(rewards).sum()), resampled_prompts=len(problems) - P,
                          version=self.served_policy if version is None else version)

    def step(self, step: int) -> dict[str, float]:
        cfg, g = self.cfg, self.cfg.grpo
        m: dict[str, float] = {}
        t_step = time.perf_counter()
        with timed(m, "time/rollout"):
            groups = self.ahead.take(step) or self.draw_groups(step)  # (drawn ahead: grpo.max_staleness)
        drawn_now = m["time/rollout"]
        lag = self.ahead.check(step, groups, self.served_policy)
        if g.max_staleness:  # the next steps' rollouts, drawn on the engines while this step updates
            version = self.served_policy
            self.ahead.launch(step, g.num_steps, lambda s: self.draw_groups(s, version))
        m.update(reward_metrics(groups.first.samples, groups.first_problems))
        adv = group_advantages(groups.rewards, g.baseline, g.normalize_std)
        flat = [s for row in groups.samples for s in row]
        cp = cfg.policy.parallel.context  # zigzag CP splits every sequence into 2*CP equal chunks
        batch = build_batch(flat, adv.flatten().tolist(), self.pad_id, multiple_of=2 * cp if cp > 1 else 1)
        # fewer groups with a learning signal than grpo.min_groups_with_signal: no optimizer step (the
        # policy, its optimizer state and LR schedule stay exactly as they are); the drafter still trains
        update = groups.with_signal >= g.min_groups_with_signal
        m.update(rollout_metrics(groups.first.metrics))
        draft_updates, signal = self.draft_budget(step, batch, m)
        with timed(m, "time/update"), self.engines_asleep():
            # the log-prob recomputation; the co-trained drafter takes its step(s) on this same forward
            # (an idle drafter, draft.budget.measure_idle: draft_updates 0 = scored on this forward, no step)
            scored = draft_updates > 0 or (self.budget is not None and cfg.draft.budget.measure_idle)
            lp = self.trainer.logprobs(batch, draft_step=step if scored else None, draft_updates=draft_updates)
            batch.old_logprobs, batch.ref_logprobs = lp.logprobs, lp.ref_logprobs
            if self.budget is not None:
                self.budget.spent(step, draft_updates, signal, lp.draft_metrics)
            m.update(train_inference_kl(batch))
            if g.importance_correction != "none":  # the engines sampled: weigh by trainer / engine ratios
                batch.is_weights, batch.mask, is_metrics = importance_weights(
                    batch.old_logprobs, batch.rollout_logprobs, batch.mask, g.importance_correction,
                    g.importance_cap, log_ratio_clamp=g.log_ratio_clamp)
                m.update(is_metrics)
            train_metrics = self.trainer.train_step(batch) if update else None
        if update:
            check_finite(step, train_metrics)  # before the policy is pushed, logged or saved
        if g.max_staleness:  # the draws in flight end before anything is pushed (between engine calls)
            drawn_ahead, waited = self.ahead.wait()
            m.update({"time/rollout": drawn_now + drawn_ahead, "time/rollout_wait": drawn_now + waited,
                      "async/policy_lag": float(lag)})
        with timed(m, "time/weight_push"):
            if update:  # (an unchanged policy is not pushed again)
                self.push("policy", version=step)
            if self.serves_cotrained_drafter and step % cfg.draft.push_every == 0:
                m.update(self.push_draft(step))
        first, first_flat = groups.first_rewards, [s for row in groups.first.samples for s in row]
        m.update({
            "reward/mean": first.mean().item(),
            "reward/std": first.std().item(),
            "reward/accuracy": accuracy(cfg, first_flat, first),
            **response_metrics(first_flat),
            "grpo/groups_with_signal": float(groups.with_signal),
            "grpo/resampled_prompts": float(groups.resampled_prompts),
            "train/skipped": 0.0 if update else 1.0,
        })
        if update:
            m.update({
                "train/loss": train_metrics["loss"],
                "train/grad_norm": train_metrics["grad_norm"],
                "train/clip_frac": train_metrics["clip_frac"],
                **{f"train/{k}": train_metrics[k] for k in ("lr", "optimizer_steps") if k in train_metrics},
            })
            if "kl_ref" in train_metrics:
                m["kl/ref"] = train_metrics["kl_ref"]
        if lp.draft_metrics is not None:
            m.update(draft_step_metrics(lp.draft_metrics, m["time/update"]))
        m["time/step"] = time.perf_counter() - t_step
        return m

    def draft_budget(self, step: int, batch: TrainBatch, m: dict) -> tuple[int, float | None]:
        """The co-trained drafter's optimizer steps this step (draft.budget; 0 without co-training)
        and the acceptance the decision read: the engines' on this step's rollouts when they serve
        the co-trained drafter, else its offline one from the last step it trained on."""
        if self.budget is None:
            return 0, None
        from cotrain.draft.budget import update_flops

        cfg = self.cfg
        signal = m.get("spec/acceptance_length") if self.serves_cotrained_drafter else self.budget.state.offline
        flops = update_flops(self.policy_params, int(batch.lengths.sum()), cfg.grpo.epochs,
                             cfg.policy.reference_model)
        updates, why = self.budget.decide(step, signal, flops)
        m.update(why)
        m["draft/updates"] = float(updates)
        return updates, signal

    @contextmanager
    def engines_asleep(self):
        """Colocated engines (``rollout.colocate``) and the trainers take turns on the GPUs:

            engines.sleep() -> trainers.onload() -> (the block) -> trainers.offload() -> engines.wake_up()

        and the weight push follows, engines awake. vLLM's sleep level 1 (``VllmGeneration.sleep``):
        the served weights go to host memory, the KV cache is freed, and wake-up restores both -
        level 2 would drop the weights, which a drafter push every ``draft.push_every`` steps leaves
        stale in between. The trainers' offload frees their optimizer states (the weights stay on the
        device: the push exports them); the push then needs the engines' weights back on the device.
        Not colocated: nothing happens."""
        if not self.cfg.rollout.colocate:
            yield
            return
        self.rollout.sleep()
        self.trainer.onload()
        try:
            yield
        finally:
            self.trainer.offload()
            self.rollout.wake_up()

    def push(self, kind: str, version: int) -> None:
        handle = self.trainer.export(kind, version)
        try:
            self.rollout.push(kind, handle, version)
        finally:
            self.trainer.release_export(handle)
        if kind == "policy":
            self.served_policy = version

    def push_draft(self, step: int) -> dict[str, float]:
        """Push the co-trained drafter; a rejected push leaves the engines on the previous drafter
        and is reported (a warning and ``draft/push_ok`` = 0), never ignored."""
        from cotrain.weights import WeightPushError

        t0 = time.perf_counter()
        try:
            self.push("draft", version=step)
            ok = 1.0
        except WeightPushError as e:
            ok = 0.0
            self.rejected_draft_pushes += 1
            warnings.warn(f"step {step}: the drafter push was rejected, the engines keep serving the previous "
                          f"drafter ({self.rejected_draft_pushes} rejected so far): {e}", stacklevel=2)
        return {"draft/push_ok": ok, "time/draft_push": time.perf_counter() - t0}

    def evaluate(self) -> dict[str, float]:
        e = self.cfg.data.eval
        spec = SamplingSpec(temperature=e.temperature, max_tokens=self.cfg.rollout.sampling.max_tokens, seed=0)
        # one sample per held-out problem, through the turn loop with a multi-turn environment (the
        # environment's grading of the final answer: ``accuracy``)
        gen = self.generate_groups(self.eval_problems, spec, n=1)
        r = score(self.cfg, gen.samples, self.eval_problems)
        return {"eval/accuracy": accuracy(self.cfg, [s for row in gen.samples for s in row], r.flatten())}

    # ------------------------------------------------------------------ the loop
    def train(self) -> None:
        from tqdm import tqdm

        cfg = self.cfg
        every_eval = cfg.data.eval.every
        if self.state.step == 0 and every_eval:
            self.logger.log(0, self.evaluate())
        bar = tqdm(range(self.state.step + 1, cfg.grpo.num_steps + 1), initial=self.state.step,
                   total=cfg.grpo.num_steps, desc="GRPO", disable=not cfg.logging.progress_bar, dynamic_ncols=True)
        for step in bar:
            m = self.run_step(step)
            self.state.step = step
            self.state.data = self.stream.state()
            if step % cfg.logging.log_every == 0 or step == cfg.grpo.num_steps:
                self.logger.log(step, m)
            bar.set_postfix({"reward": f"{m['reward/mean']:.3f}", "kl_ti": f"{m['kl/train_infer']:.1e}",
                             **({"acc_len": f"{m['spec/acceptance_length']:.2f}"} if "spec/acceptance_length" in m else {})})
            if step % cfg.checkpoint.every == 0 or step == cfg.grpo.num_steps:
                self.save_checkpoint(step)

    def run_step(self, step: int) -> dict[str, float]:
        """One step (and its evaluation, when due). Several nodes: the step counts (it is logged and
        checkpointed) only if every node of the run is still alive at its end - a node that died
        during the step fails it with a NodeDiedError naming the step, the node and what it held,
        even when every call had returned (a dead raylet's workers finish what they were doing)."""
        from cotrain.placement import NodeDiedError

        try:
            m = self.step(step)
            every_eval = self.cfg.data.eval.every
            if every_eval and step % every_eval == 0:
                m.update(self.evaluate())
            self.workers.check_alive(f"step {step}")
            return m
        except NodeDiedError as e:
            raise e.during_step(step) from None

    def save_checkpoint(self, step: int) -> None:
        self.ckpt.begin(step)
        self.trainer.save_checkpoint(str(self.ckpt.step_dir(step)))
        self.ckpt.commit(step, {"step": step, "data": self.stream.state(), "run_id": self.run_id,
                                **({"draft_budget": self.budget.state_dict()} if self.budget is not None else {}),
                                **({"ahead": self.ahead.state_dict()} if self.cfg.grpo.max_staleness else {})},
                         config_yaml=self.cfg.to_yaml())

    def shutdown(self) -> None:
        self.ahead.close()
        if self.logger is not None:
            self.logger.close()
        for workers in (self.rollout, self.trainer):
            if workers is not None:
                workers.shutdown()
        self.workers.close()


def main(cfg, resume=False) -> None:
    run = GrpoRun(cfg)
    try:
        run.setup(resume)
        run.train()
    finally:
        run.shutdown()
    if cfg.checkpoint.export_final:  # the last checkpoint as a Hugging Face policy and a vLLM drafter
        from cotrain.export import export_final

        export_final(cfg.checkpoint.dir, cfg.run.output_dir)
    from cotrain.rl.plot import plot_run

    png = plot_run(cfg.run.output_dir)
    print(f"done: {cfg.grpo.num_steps} steps; metrics in {cfg.run.output_dir}/metrics.jsonl, curves in {png}")
