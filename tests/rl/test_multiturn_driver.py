"""The real GRPO driver with a multi-turn environment (env.kind=calculator) on in-process fakes: the
groups come from the turn loop, the rewards are the environment's, the trainer's batch trains on the
policy's tokens only and the train-inference KL is measured on them only. No Ray, vLLM or Megatron."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from cotrain.config import load_config
from cotrain.models.tokenizer import build_tokenizer
from cotrain.rl.driver import GrpoRun
from cotrain.rl.grpo import k3_kl
from cotrain.rl.interfaces import (
    GenerationBackend,
    GenerationResult,
    PolicyLogprobs,
    Sample,
    TrainingBackend,
    WorkerFactory,
)

ROOT = Path(__file__).resolve().parents[2]
TOK = build_tokenizer()


class CalcRollout(GenerationBackend):
    """Calls the calculator on the prompt, then copies its reply (wrong when the seed is odd)."""

    def __init__(self):
        self.calls = []
        self.version = 0  # the policy version pushed last (what real engines label their samples with)

    def generate(self, prompts, sampling, n):
        self.calls.append((len(prompts), n))
        out = []
        for i, p in enumerate(prompts):
            ids = TOK.encode(p) if isinstance(p, str) else list(p)
            hist = TOK.decode(ids, skip_special_tokens=True)
            row = []
            for j in range(n):
                seed = sampling.seed + i * n + j
                if "[" not in hist:
                    text = f"<calc>{hist.rstrip('=')}</calc>"
                else:
                    got = hist.rsplit("[", 1)[1].rstrip("]")
                    text = got if seed % 2 == 0 else got + "7"
                toks = TOK.encode(text) + [TOK.eos_token_id]
                row.append(Sample(i, list(ids), toks, [-0.5] * len(toks), text, "stop", self.version))
            out.append(row)
        return GenerationResult(out, {"time_s": 0.01, "tokens_per_s": 1.0})

    def push(self, kind, handle, version):
        if kind == "policy":
            self.version = version
        return {}

    def sleep(self):
        pass

    def wake_up(self):
        pass


class Trainer(TrainingBackend):
    def __init__(self):
        self.batches = []

    def logprobs(self, batch, draft_step=None, draft_updates=1):
        return PolicyLogprobs(batch.rollout_logprobs - 0.01 * batch.mask)

    def train_step(self, batch):
        self.batches.append(batch)
        return {"loss": 0.1, "grad_norm": 1.0, "clip_frac": 0.0}

    def export(self, kind, version):
        return {"id": version}

    def release_export(self, handle):
        pass

    def export_draft_dir(self, path):
        return path

    def offload(self):
        pass

    def onload(self):
        pass

    def save_checkpoint(self, directory):
        pass

    def load_checkpoint(self, directory):
        pass


class Workers(WorkerFactory):
    def trainer(self, model_path, draft_init):
        self.trainer_ = Trainer()
        return self.trainer_

    def rollout(self, model_path, draft_model):
        self.rollout_ = CalcRollout()
        return self.rollout_


def test_driver_trains_on_policy_tokens_with_the_environment_reward(tmp_path):
    cfg = load_config(str(ROOT / "configs/grpo.yaml"), [
        f"run.output_dir={tmp_path}", "grpo.num_steps=2", "grpo.prompts_per_step=2", "grpo.group_size=4",
        "policy.micro_batch_size=4", "data.eval.every=0", "logging.tensorboard=false", "logging.progress_bar=false",
        "checkpoint.every=100", "checkpoint.export_final=false", "env.kind=calculator", "rollout.max_turns=3",
        "data.arithmetic.ops=[\"*\"]", "reward.correct=2.0"])
    workers = Workers()
    run = GrpoRun(cfg, workers=workers)
    try:
        run.setup(False)
        run.train()
    finally:
        run.shutdown()
    assert workers.rollout_.calls == [(2, 4), (8, 1)] * 2  # turn 1 per problem, turn 2 per conversation
    batch = workers.trainer_.batches[0]
    m = batch.mask.bool()
    brackets = torch.isin(batch.targets, torch.tensor(TOK.convert_tokens_to_ids(["[", "]"])))
    assert bool(brackets.any()) and not bool((brackets & m).any())  # the replies are never trained
    # per row: policy tokens = the two turns (call + <eos>, answer + <eos>)
    assert (batch.targets == TOK.eos_token_id).logical_and(m).sum(dim=1).tolist() == [2] * 8
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    first = rows[0]
    # seeds alternate right (2.0) and wrong (0.0) answers: half the samples are right
    assert first["reward/mean"] == 1.0 and first["reward/accuracy"] == 0.5
    want = k3_kl(torch.tensor([-0.5], dtype=torch.float64), torch.tensor([-0.51], dtype=torch.float64)).item()
    assert abs(first["kl/train_infer"] / want - 1) < 1e-4  # every measured token is a policy token (float32 inputs)
