"""The GRPO driver: the algorithm, one step at a time.

    for each step:
        prompts   <- the next prompts_per_step problems
        rollouts  <- group_size samples per prompt from the engines (current weights)
        rewards   <- verifiable reward of each response
        advantages<- group-normalised rewards
        update    <- recompute log-probs, one GRPO optimizer step on the trainers
        push      <- new policy weights into the engines (versioned)
        metrics   -> JSONL / TensorBoard / W&B / MLflow;  checkpoint every N steps

The workers are reached only through their interfaces (:mod:`cotrain.rl.interfaces`); how they are
placed on Ray lives in :mod:`cotrain.rl.workers` and :mod:`cotrain.rl.rollout`.
"""

from __future__ import annotations

import os
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from cotrain.rl.batch import TrainBatch, build_batch
from cotrain.rl.checkpoint import CheckpointManager
from cotrain.tasks.data import Problem, PromptStream, arithmetic_dataset, load_jsonl
from cotrain.rl.grpo import group_advantages, k3_kl
from cotrain.rl.interfaces import SamplingSpec
from cotrain.rl.metrics import MetricsLogger
from cotrain.tasks.rewards import exact_match_reward


# ---------------------------------------------------------------------------------------- pieces
def load_problems(cfg) -> tuple[list[Problem], list[Problem]]:
    """Training problems and held-out evaluation problems."""
    d = cfg.data
    if d.task == "arithmetic":
        a = d.arithmetic
        train = arithmetic_dataset(a.num_prompts, seed=a.seed, max_digits=a.digits, ops=a.ops)
        evals = arithmetic_dataset(d.eval.num_prompts, seed=a.seed + 7919, max_digits=a.digits, ops=a.ops)
    else:
        train = load_jsonl(d.jsonl.path, d.jsonl.prompt_key, d.jsonl.answer_key)
        evals = (load_jsonl(d.eval.path, d.jsonl.prompt_key, d.jsonl.answer_key) if d.eval.path
                 else train[: d.eval.num_prompts])
    return train, evals[: d.eval.num_prompts]


def score(cfg, samples, problems: list[Problem]) -> torch.Tensor:
    """Rewards [prompts, group]."""
    r = cfg.reward
    return torch.tensor([[exact_match_reward(s.text, p.answer, r.correct, r.incorrect) for s in row]
                         for row, p in zip(samples, problems)])


def train_inference_kl(batch: TrainBatch) -> dict[str, float]:
    """How far the engines' sampling log-probs are from the trainer's on the same weights."""
    m = batch.mask.bool()
    rollout, train = batch.rollout_logprobs[m], batch.old_logprobs[m]
    return {"kl/train_infer": k3_kl(rollout, train).mean().item(),
            "kl/train_infer_max_abs_diff": (rollout - train).abs().max().item()}


def rollout_metrics(gm: dict[str, float]) -> dict[str, float]:
    m = {"rollout/tokens_per_s": gm["tokens_per_s"]}
    if "mean_acceptance_length" in gm:
        m["spec/acceptance_length"] = gm["mean_acceptance_length"]
        m["spec/draft_acceptance_rate"] = gm["draft_acceptance_rate"]
    return m


def init_ray(cfg) -> None:
    import ray

    if ray.is_initialized():
        return
    address = cfg.cluster.ray_address
    if address is None and os.environ.get("RAY_ADDRESS"):
        address = "auto"  # launched by `ray job submit`: join that cluster
    if address in (None, "local"):
        ray.init(address="local", num_cpus=cfg.cluster.cpus_per_node, num_gpus=cfg.cluster.gpus_per_node or None,
                 include_dashboard=False, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)


@contextmanager
def timed(metrics: dict, key: str):
    t = time.perf_counter()
    yield
    metrics[key] = time.perf_counter() - t


@dataclass
class DriverState:
    """What the driver itself needs to resume exactly (the workers checkpoint their own state)."""

    step: int = 0
    data: dict = field(default_factory=dict)


# ---------------------------------------------------------------------------------------- the run
class GrpoRun:
    def __init__(self, cfg):
        self.cfg = cfg
        self.ckpt = CheckpointManager(cfg.checkpoint.dir, cfg.checkpoint.keep_last)
        self.trainer = self.rollout = self.logger = None

    def setup(self, resume) -> None:
        from transformers import AutoTokenizer

        from cotrain.models.build_tiny import resolve_model_path
        from cotrain.rl.rollout import RolloutGroup
        from cotrain.rl.workers import TrainerGroup

        cfg = self.cfg
        self.model_path = str(resolve_model_path(cfg.policy.model_path))
        self.pad_id = AutoTokenizer.from_pretrained(self.model_path).pad_token_id
        train, self.eval_problems = load_problems(cfg)
        self.stream = PromptStream(train, seed=cfg.run.seed, shuffle=cfg.data.shuffle)
        self.state = DriverState()
        init_ray(cfg)
        self.trainer = TrainerGroup(cfg, self.model_path)
        self.rollout = RolloutGroup.from_config(cfg, model_path=self.model_path)
        if cfg.rollout.weight_transport == "nccl":  # GPU engines on other devices: a broadcast group
            self.trainer.connect_weight_broadcast(self.rollout)
        resume_dir = self.ckpt.resolve(resume) if resume else None
        if resume_dir is not None:
            self.trainer.load_checkpoint(str(resume_dir))
            saved = self.ckpt.load_driver_state(resume_dir)
            self.state = DriverState(step=saved["step"], data=saved["data"])
            self.stream.load_state(self.state.data)
            self.push_policy(version=self.state.step)  # engines serve exactly the checkpointed policy
            print(f"resumed from {resume_dir} at step {self.state.step}")
        self.logger = MetricsLogger(cfg, resume_step=self.state.step)

    # ------------------------------------------------------------------ one step
    def sampling(self, step: int) -> SamplingSpec:
        s = self.cfg.rollout.sampling
        # a per-step seed makes every step's rollouts reproducible, which is what resume relies on
        return SamplingSpec(temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_tokens,
                            seed=self.cfg.run.seed * 1_000_003 + step)

    def step(self, step: int) -> dict[str, float]:
        cfg, g = self.cfg, self.cfg.grpo
        m: dict[str, float] = {}
        problems = self.stream.take(g.prompts_per_step)
        with timed(m, "time/rollout"):
            gen = self.rollout.generate([p.prompt for p in problems], self.sampling(step), n=g.group_size)
        rewards = score(cfg, gen.samples, problems)
        adv = group_advantages(rewards, g.baseline, g.normalize_std)
        flat = [s for row in gen.samples for s in row]
        cp = cfg.policy.parallel.context  # zigzag CP splits every sequence into 2*CP equal chunks
        batch = build_batch(flat, adv.flatten().tolist(), self.pad_id, multiple_of=2 * cp if cp > 1 else 1)
        with timed(m, "time/update"):
            batch.old_logprobs, batch.ref_logprobs = self.trainer.logprobs(batch)
            m.update(train_inference_kl(batch))
            train_metrics = self.trainer.train_step(batch)
        with timed(m, "time/weight_push"):
            self.push_policy(version=step)
        m.update({
            "reward/mean": rewards.mean().item(),
            "reward/std": rewards.std().item(),
            "reward/accuracy": (rewards == cfg.reward.correct).float().mean().item(),
            "response/length": sum(len(s.token_ids) for s in flat) / len(flat),
            "response/truncated": sum(s.finish_reason == "length" for s in flat) / len(flat),
            "train/loss": train_metrics["loss"],
            "train/grad_norm": train_metrics["grad_norm"],
            "train/clip_frac": train_metrics["clip_frac"],
        })
        if "kl_ref" in train_metrics:
            m["kl/ref"] = train_metrics["kl_ref"]
        m.update(rollout_metrics(gen.metrics))
        return m

    def push_policy(self, version: int) -> None:
        handle = self.trainer.export_policy(version, self.cfg.rollout.weight_transport)
        try:
            self.rollout.push_handle("policy", handle, version)
        finally:
            self.trainer.release_export(handle)

    def evaluate(self) -> dict[str, float]:
        e = self.cfg.data.eval
        spec = SamplingSpec(temperature=e.temperature, max_tokens=self.cfg.rollout.sampling.max_tokens, seed=0)
        gen = self.rollout.generate([p.prompt for p in self.eval_problems], spec, n=1)
        r = score(self.cfg, gen.samples, self.eval_problems)
        return {"eval/accuracy": (r == self.cfg.reward.correct).float().mean().item()}

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
            m = self.step(step)
            if every_eval and step % every_eval == 0:
                m.update(self.evaluate())
            self.state.step = step
            self.state.data = self.stream.state()
            if step % cfg.logging.log_every == 0 or step == cfg.grpo.num_steps:
                self.logger.log(step, m)
            bar.set_postfix({"reward": f"{m['reward/mean']:.3f}", "kl_ti": f"{m['kl/train_infer']:.1e}",
                             **({"acc_len": f"{m['spec/acceptance_length']:.2f}"} if "spec/acceptance_length" in m else {})})
            if step % cfg.checkpoint.every == 0 or step == cfg.grpo.num_steps:
                self.save_checkpoint(step)

    def save_checkpoint(self, step: int) -> None:
        self.ckpt.begin(step)
        self.trainer.save_checkpoint(str(self.ckpt.step_dir(step)))
        self.ckpt.commit(step, {"step": step, "data": self.stream.state()})

    def shutdown(self) -> None:
        if self.logger is not None:
            self.logger.close()
        for workers in (self.rollout, self.trainer):
            if workers is not None:
                workers.shutdown()


def check_supported(cfg) -> None:
    """Refuse, before anything starts, what the loop does not do yet (rather than ignore it)."""
    if cfg.draft.kind is not None and cfg.draft.cotrain:
        raise NotImplementedError(
            f"draft.cotrain: true (draft.kind={cfg.draft.kind}) - co-training the drafter inside the GRPO step "
            "is not wired into the loop yet. Train the drafter offline (python -m cotrain.draft.distill --config "
            f"configs/distill_{cfg.draft.kind}.yaml) and serve it frozen with rollout.speculative.draft_model=<its "
            "drafter/ directory> draft.cotrain=false.")


def main(cfg, resume=False) -> int:
    check_supported(cfg)
    run = GrpoRun(cfg)
    try:
        run.setup(resume)
        run.train()
    finally:
        run.shutdown()
    from cotrain.rl.plot import plot_run

    png = plot_run(cfg.run.output_dir)
    print(f"done: {cfg.grpo.num_steps} steps; metrics in {cfg.run.output_dir}/metrics.jsonl, curves in {png}")
    return 0
