"""The real GRPO driver (cotrain.rl.driver.GrpoRun) on in-process fakes of its worker interfaces
(cotrain.rl.interfaces): the algorithm's order of calls, the weight-push contract (versions, the
drafter's push period, a rejected drafter push reported and not raised, exports always released),
the batch the trainer gets (old log-probs, group advantages) and an exact resume of the prompt
stream from a checkpoint. No Ray, no Megatron, no vLLM: a few seconds."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import pytest
import torch

from cotrain.config import load_config
from cotrain.rl.driver import GrpoRun
from cotrain.rl.interfaces import (
    GenerationBackend,
    GenerationResult,
    PolicyLogprobs,
    Sample,
    TrainingBackend,
    WorkerFactory,
)
from cotrain.weights import WeightPushError

ROOT = Path(__file__).resolve().parents[2]
P, G, STEPS, PUSH_EVERY = 4, 4, 4, 2
SEED = 0


def _correct(seed: int, i: int, j: int) -> bool:
    """Whether the fake policy answers sample j of prompt i correctly under sampling seed ``seed``."""
    return (seed + 7 * i + 3 * j) % 5 < 2


class FakeRollout(GenerationBackend):
    def __init__(self, log: list, reject_draft: set[int] = frozenset(), fail_policy: set[int] = frozenset(),
                 correct=None, acceptance=None):
        self.log, self.reject_draft, self.fail_policy = log, reject_draft, fail_policy
        self.acceptance = acceptance  # the engines' measured acceptance length by sampling seed (None: none)
        # whether sample j of a prompt is answered correctly: (seed, i, j, prompt) -> bool
        self.correct = correct or (lambda seed, i, j, prompt: _correct(seed, i, j))
        self.version = 0
        self.generated = []  # (sampling seed, the policy version the engines held) per generate call
        self.busy = False  # inside a generate call
        self.overlap = None  # grpo.max_staleness tests: an Event the trainer sets when an update starts

    def generate(self, prompts, sampling, n):
        self.busy = True
        try:
            return self._generate(prompts, sampling, n)
        finally:
            self.busy = False

    def _generate(self, prompts, sampling, n):
        if self.overlap is not None and self.generated:  # (the first draw has no update to overlap)
            # a draw ahead proceeds only once an update is running beside it: a driver that waited
            # for the draw before updating would hang here
            assert self.overlap.wait(timeout=30), "the draw never overlapped an update"
            self.overlap.clear()
        self.generated.append((sampling.seed, self.version))
        self.log.append(("generate", tuple(prompts), sampling.seed, n))
        samples = []
        for i, prompt in enumerate(prompts):
            answer = str(eval(prompt.rstrip("=")))  # the arithmetic task: "12+34="
            row = []
            for j in range(n):
                text = answer if self.correct(sampling.seed, i, j, prompt) else answer + "1"
                ids = [3 + (ord(c) % 40) for c in text]
                row.append(Sample(prompt_index=i, prompt_token_ids=[5] * len(prompt), token_ids=ids,
                                  logprobs=[-0.25] * len(ids), text=text, finish_reason="stop",
                                  weight_version=self.version))
            samples.append(row)
        metrics = {"tokens_per_s": 1.0}
        if self.acceptance is not None:
            metrics.update(mean_acceptance_length=self.acceptance(sampling.seed), draft_acceptance_rate=0.5)
        return GenerationResult(samples, metrics)

    def push(self, kind, handle, version):
        assert not self.busy, f"a {kind} push landed inside a generate call"
        self.log.append(("push", kind, handle["id"], version))
        if kind == "policy" and version in self.fail_policy:
            raise RuntimeError(f"engine lost during the policy push of version {version}")
        if kind == "draft" and version in self.reject_draft:
            raise WeightPushError(f"1 of 1 engines rejected the draft push of version {version}: shape mismatch")
        if kind == "policy":
            self.version = version
        return {"push_s": 0.0}

    def sleep(self):
        self.log.append(("sleep",))

    def wake_up(self):
        self.log.append(("wake_up",))


class FakeTrainer(TrainingBackend):
    def __init__(self, log: list):
        self.log = log
        self.updates = 0
        self.overlap = None
        self.shift = None  # a further shift of the recomputed log-probs: mask -> [N, S]
        self.exports = 0
        self.batches = []
        self.draft_updates = []

    def logprobs(self, batch, draft_step=None, draft_updates=1):
        self.log.append(("logprobs", draft_step))
        self.draft_updates.append(draft_updates if draft_step else 0)
        lp = batch.rollout_logprobs - 0.01 * batch.mask  # what the trainer recomputed
        if self.shift is not None:
            lp = lp + self.shift(batch.mask)
        return PolicyLogprobs(lp, None, {"draft/loss": 2.0, "draft/time_s": 0.0, "draft/flops": 1.0} if draft_step else None)

    def train_step(self, batch):
        if self.overlap is not None:
            self.overlap.set()
        self.log.append(("train_step",))
        self.batches.append(batch)
        self.updates += 1
        return {"loss": 0.5 * self.updates, "grad_norm": 1.0, "clip_frac": 0.0}

    def export(self, kind, version):
        self.exports += 1
        handle = {"id": self.exports, "kind": kind, "version": version}
        self.log.append(("export", kind, handle["id"], version))
        return handle

    def release_export(self, handle):
        self.log.append(("release", handle["id"]))

    def offload(self):
        self.log.append(("offload",))

    def onload(self):
        self.log.append(("onload",))

    def export_draft_dir(self, path):
        self.log.append(("export_draft_dir",))
        return path

    def save_checkpoint(self, directory):
        self.log.append(("save", Path(directory).name))
        (Path(directory) / "fake_trainer.json").write_text(json.dumps({"updates": self.updates}))

    def load_checkpoint(self, directory):
        self.log.append(("load", Path(directory).name))
        self.updates = json.loads((Path(directory) / "fake_trainer.json").read_text())["updates"]

    def connect(self, rollout):
        self.log.append(("connect",))


class FakeWorkers(WorkerFactory):
    def __init__(self, overlap: bool = False, **rollout_faults):
        import threading

        self.log: list = []
        self.rollout_faults = rollout_faults
        self.overlap = threading.Event() if overlap else None
        self.trainer_shift = None

    def trainer(self, model_path, draft_init):
        self.trainer_ = FakeTrainer(self.log)
        self.trainer_.overlap, self.trainer_.shift = self.overlap, self.trainer_shift
        return self.trainer_

    def rollout(self, model_path, draft_model):
        self.log.append(("rollout", draft_model is not None))
        self.rollout_ = FakeRollout(self.log, **self.rollout_faults)
        self.rollout_.overlap = self.overlap
        return self.rollout_


def _cfg(out: Path, *extra: str):
    return load_config(str(ROOT / "configs/grpo.yaml"), [
        f"run.output_dir={out}", f"run.seed={SEED}", f"grpo.num_steps={STEPS}", f"grpo.prompts_per_step={P}",
        f"grpo.group_size={G}", "policy.micro_batch_size=4", "data.eval.every=0", "logging.tensorboard=false",
        "logging.progress_bar=false", "checkpoint.every=2", "checkpoint.keep_last=null",
        "draft.kind=dflash", "draft.cotrain=true", "rollout.speculative.method=dflash",
        f"draft.push_every={PUSH_EVERY}", *extra])


def _run(cfg, workers: FakeWorkers, resume=False) -> GrpoRun:
    run = GrpoRun(cfg, workers=workers)
    try:
        run.setup(resume)
        run.train()
    finally:
        run.shutdown()
    return run


def _push(kind: str, export_id: int, version: int) -> list:
    return [("export", kind, export_id, version), ("push", kind, export_id, version), ("release", export_id)]


def _metrics(out: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (out / "metrics.jsonl").read_text().splitlines())}


COLOCATED = ["cluster.device=cuda", "cluster.gpus_per_node=2", "rollout.colocate=true"]


def _expected_log(log: list, steps: int, colocated: bool) -> list:
    """The calls of a run of ``steps`` steps, in order (the generate entries, which carry the prompts,
    taken from ``log``). Colocated: the trainers offload before the engines start; each step the
    engines sleep and the trainers onload around the update, then offload before the engines wake
    and take the push."""
    expected = [("export_draft_dir",), *([("offload",)] if colocated else []), ("rollout", True), ("connect",)]
    exports = 0
    for step in range(1, steps + 1):
        generate = [e for e in log if e[0] == "generate"][step - 1]
        expected += [generate, *([("sleep",), ("onload",)] if colocated else []), ("logprobs", step), ("train_step",),
                     *([("offload",), ("wake_up",)] if colocated else [])]
        exports += 1
        expected += _push("policy", exports, step)  # after the update, labelled with the step
        if step % PUSH_EVERY == 0:
            exports += 1
            expected += _push("draft", exports, step)
        if step % 2 == 0:
            expected.append(("save", f"step_{step:06d}"))
    return expected


def test_the_driver_runs_the_algorithm_in_order(tmp_path):
    workers = FakeWorkers()
    _run(_cfg(tmp_path), workers)
    assert workers.log == _expected_log(workers.log, STEPS, colocated=False)
    # every step's rollouts are sampled with the per-step seed, group_size samples of prompts_per_step prompts
    gens = [e for e in workers.log if e[0] == "generate"]
    assert [(len(g[1]), g[2], g[3]) for g in gens] == [(P, SEED * 1_000_003 + s, G) for s in range(1, STEPS + 1)]
    m = _metrics(tmp_path)
    assert sorted(m) == list(range(1, STEPS + 1))
    assert [("draft/push_ok" in m[s]) for s in m] == [s % PUSH_EVERY == 0 for s in m]
    assert all(m[s]["draft/push_ok"] == 1.0 for s in m if s % PUSH_EVERY == 0)
    assert [m[s]["train/loss"] for s in m] == [0.5 * s for s in m]  # the trainer's metrics, step by step


def test_colocated_engines_and_trainers_take_turns_on_the_gpus(tmp_path):
    """rollout (engines awake, trainers offloaded) -> sleep -> onload -> log-probs, update -> offload
    -> wake_up -> push, every step; engines on their own devices never sleep, trainers never offload."""
    workers = FakeWorkers()
    _run(_cfg(tmp_path, *COLOCATED), workers)
    assert workers.log == _expected_log(workers.log, STEPS, colocated=True)
    workers = FakeWorkers()
    _run(_cfg(tmp_path / "own", "grpo.num_steps=2"), workers)
    assert not {"sleep", "wake_up", "offload", "onload"} & {e[0] for e in workers.log}


def test_a_colocated_resume_loads_the_trainers_while_the_engines_sleep(tmp_path):
    _run(_cfg(tmp_path / "a", *COLOCATED, "grpo.num_steps=2"), FakeWorkers())
    step2 = tmp_path / "a" / "checkpoints" / "step_000002"
    resumed = FakeWorkers()
    _run(_cfg(tmp_path / "b", *COLOCATED, f"checkpoint.dir={tmp_path / 'a' / 'checkpoints'}",
              f"checkpoint.resume={step2}"), resumed, resume=str(step2))
    assert resumed.log[:10 + 6] == [("export_draft_dir",), ("offload",), ("rollout", True), ("connect",),
                                    ("sleep",), ("onload",), ("load", "step_000002"), ("offload",), ("wake_up",),
                                    *_push("policy", 1, 2), *_push("draft", 2, 2), ("generate",) + resumed.log[15][1:]]


def test_the_trainer_gets_the_recomputed_logprobs_and_group_advantages(tmp_path):
    workers = FakeWorkers()
    _run(_cfg(tmp_path, "grpo.num_steps=2"), workers)
    for step, batch in enumerate(workers.trainer_.batches, start=1):
        seed = SEED * 1_000_003 + step
        rewards = torch.tensor([[1.0 if _correct(seed, i, j) else 0.0 for j in range(G)] for i in range(P)],
                               dtype=torch.float64)
        adv = (rewards - rewards.mean(1, keepdim=True)) / (rewards.std(1, keepdim=True) + 1e-6)  # by hand
        assert torch.allclose(batch.advantages, adv.flatten().float())
        # the old log-probs are the trainer's own recomputation, not the engines' sampling log-probs
        assert torch.equal(batch.old_logprobs, batch.rollout_logprobs - 0.01 * batch.mask)
        assert batch.mask.sum() > 0
    m = _metrics(tmp_path)
    assert m[1]["kl/train_infer_max_abs_diff"] == pytest.approx(0.01)
    assert m[1]["draft/loss"] == 2.0


def test_a_rejected_drafter_push_is_reported_and_the_run_goes_on(tmp_path):
    workers = FakeWorkers(reject_draft={2})
    with pytest.warns(UserWarning, match=r"step 2: the drafter push was rejected, the engines keep serving the "
                                         r"previous drafter \(1 rejected so far\).*shape mismatch"):
        run = _run(_cfg(tmp_path), workers)
    assert run.rejected_draft_pushes == 1
    m = _metrics(tmp_path)
    assert (m[2]["draft/push_ok"], m[4]["draft/push_ok"]) == (0.0, 1.0)
    # every export is released, the rejected one too, right after its push
    log = workers.log
    for i, e in enumerate(log):
        if e[0] == "export":
            assert log[i + 1][:3] == ("push", e[1], e[2]) and log[i + 2] == ("release", e[2])


def test_a_failed_policy_push_stops_the_run_and_still_releases_the_export(tmp_path):
    workers = FakeWorkers(fail_policy={3})
    with pytest.raises(RuntimeError, match="engine lost during the policy push of version 3"):
        _run(_cfg(tmp_path), workers)
    assert workers.log[-3:] == [("export", "policy", 4, 3), ("push", "policy", 4, 3), ("release", 4)]
    assert sorted(_metrics(tmp_path)) == [1, 2]  # step 3 never counted
    assert not (tmp_path / "checkpoints" / "step_000004").exists()


def test_resume_continues_the_same_prompt_stream(tmp_path):
    whole = FakeWorkers()
    _run(_cfg(tmp_path / "a"), whole)
    step2 = tmp_path / "a" / "checkpoints" / "step_000002"
    assert step2.is_dir()
    resumed = FakeWorkers()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no damaged-checkpoint fallback
        _run(_cfg(tmp_path / "b", f"checkpoint.dir={tmp_path / 'a' / 'checkpoints'}", f"checkpoint.resume={step2}"),
             resumed, resume=str(step2))
    # the trainer's state comes back, then the engines get exactly the checkpointed policy and drafter
    assert resumed.log[:3 + 1 + 6] == [("export_draft_dir",), ("rollout", True), ("connect",), ("load", "step_000002"),
                                       *_push("policy", 1, 2), *_push("draft", 2, 2)]
    gens = [e for e in whole.log if e[0] == "generate"]
    assert [e for e in resumed.log if e[0] == "generate"] == gens[2:]  # steps 3 and 4: same prompts, same seeds
    assert len({g[1] for g in gens}) == STEPS  # (the stream moves on: no step repeats another's prompts)
    assert resumed.trainer_.updates == STEPS
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    def timeless(r):
        return {k: v for k, v in r.items() if not k.startswith("time/") and k != "rollout/tokens_per_s"}

    assert [timeless(b[s]) for s in (3, 4)] == [timeless(a[s]) for s in (3, 4)]


# ------------------------------------------------------------------ no optimizer step without a signal
def test_a_step_without_signal_takes_no_optimizer_step_but_the_drafter_trains(tmp_path):
    """Every answer wrong: no group carries a learning signal, so no step updates the policy (nor
    pushes it again: it is unchanged), while the drafter still trains on, and is pushed from, the
    rollouts; the skipped steps are reported."""
    workers = FakeWorkers(correct=lambda seed, i, j, prompt: False)
    _run(_cfg(tmp_path), workers)
    kinds = [e[0] for e in workers.log]
    assert "train_step" not in kinds
    assert [e for e in workers.log if e[0] == "logprobs"] == [("logprobs", s) for s in range(1, STEPS + 1)]
    assert [e[1] for e in workers.log if e[0] == "push"] == ["draft"] * (STEPS // PUSH_EVERY)
    m = _metrics(tmp_path)
    assert all(m[s]["train/skipped"] == 1.0 and m[s]["grpo/groups_with_signal"] == 0.0 for s in m)
    assert not any("train/loss" in r for r in m.values())
    assert all(m[s]["reward/mean"] == 0.0 and "draft/loss" in m[s] for s in m)


def test_min_groups_with_signal_zero_keeps_stepping_on_zero_advantages(tmp_path):
    workers = FakeWorkers(correct=lambda seed, i, j, prompt: False)
    _run(_cfg(tmp_path, "grpo.min_groups_with_signal=0"), workers)
    assert [e[0] for e in workers.log].count("train_step") == STEPS
    assert all(torch.equal(b.advantages, torch.zeros_like(b.advantages)) for b in workers.trainer_.batches)


def _signal_if_even(seed, i, j, prompt):
    """A prompt whose answer is even is answered right by samples 0 and 1 only (a signal); an odd one
    never (no signal)."""
    return eval(prompt.rstrip("=")) % 2 == 0 and j < 2


def test_dynamic_sampling_draws_more_prompts_until_the_step_has_groups_with_signal(tmp_path):
    workers = FakeWorkers(correct=_signal_if_even)
    _run(_cfg(tmp_path, "grpo.resample_rounds=3", "grpo.num_steps=2", "draft.push_every=1"), workers)
    gens = [e for e in workers.log if e[0] == "generate"]
    m = _metrics(tmp_path)
    seen = 0
    for step, batch in zip((1, 2), workers.trainer_.batches):
        rounds = gens[seen:seen + 1 + int(m[step]["grpo/resampled_prompts"]) // P]
        seen += len(rounds)
        # each round its own seed; the first round's is the step's usual one
        assert [g[2] for g in rounds] == [SEED * 1_000_003 + step + r * 2**32 for r in range(len(rounds))]
        drawn = [p for g in rounds for p in g[1]]
        with_signal = [p for p in drawn if eval(p.rstrip("=")) % 2 == 0]
        # stopped at the first round that completed prompts_per_step groups with signal (or the last one)
        assert len(rounds) == 4 or (len(with_signal) >= P and len([p for g in rounds[:-1] for p in g[1]
                                                                   if eval(p.rstrip("=")) % 2 == 0]) < P)
        kept = with_signal[:P] + [p for p in drawn if p not in with_signal][:P - len(with_signal[:P])]
        # the trainer got the first P groups with signal, in draw order (their group advantages)
        # (rewards 1, 1, 0, 0: mean 1/2, unbiased std (1/3)^(1/2))
        expected = torch.tensor([[0.5, 0.5, -0.5, -0.5] if eval(p.rstrip("=")) % 2 == 0 else [0.0] * G
                                 for p in drawn if p in kept]) / (1 / 3) ** 0.5
        assert torch.allclose(batch.advantages, expected.flatten(), atol=1e-5)
        assert m[step]["grpo/groups_with_signal"] == min(P, len(with_signal))
        # reward/* report the first round, an unbiased sample of the policy
        first = [eval(p.rstrip("=")) % 2 == 0 for p in rounds[0][1]]
        assert m[step]["reward/mean"] == pytest.approx(sum(first) * 2 / (P * G))
    assert sum(m[s]["grpo/resampled_prompts"] for s in m) > 0  # (the case is exercised)
    # the prompt stream moved past every prompt drawn, and a resume continues it exactly
    resumed = FakeWorkers(correct=_signal_if_even)
    _run(_cfg(tmp_path / "b", "grpo.resample_rounds=3", "grpo.num_steps=3", "draft.push_every=1",
              f"checkpoint.dir={tmp_path / 'checkpoints'}", f"checkpoint.resume={tmp_path / 'checkpoints' / 'step_000002'}"),
         resumed, resume=str(tmp_path / "checkpoints" / "step_000002"))
    whole = FakeWorkers(correct=_signal_if_even)
    _run(_cfg(tmp_path / "c", "grpo.resample_rounds=3", "grpo.num_steps=3", "draft.push_every=1"), whole)
    assert [e for e in resumed.log if e[0] == "generate"] == [e for e in whole.log if e[0] == "generate"][len(gens):]


# ------------------------------------------------------------------ draft.budget in the loop
def _acceptance(seed):
    """The engines' acceptance: 2.5 for steps 1-6, then the policy moves and it drops to 2.0."""
    return 2.5 if (seed - SEED * 1_000_003) <= 6 else 2.0


ADAPTIVE = ["draft.budget.mode=adaptive", "draft.budget.max_steps=3", "draft.budget.max_update_share=1.0",
            "draft.budget.probe_every=100", "grpo.num_steps=9", "draft.push_every=1"]


def test_the_adaptive_budget_idles_while_the_drafter_keeps_up_and_works_when_it_falls_behind(tmp_path):
    workers = FakeWorkers(acceptance=_acceptance)
    _run(_cfg(tmp_path / "a", *ADAPTIVE), workers)
    # steps 1-5: too little measured (fewer than 2 x recent_steps signals): 1 each; step 6 at its
    # level: idle (no drafter work at all); no noise here (every signal exact), so step 7's level
    # (2.5 - 2.33) / 1.5 = 11% behind is 1.2 tolerances past the 5% threshold: 2; then 22%, 33%: 3
    assert workers.trainer_.draft_updates == [1, 1, 1, 1, 1, 0, 2, 3, 3]
    assert [e for e in workers.log if e[0] == "logprobs"] == [("logprobs", s if s != 6 else None)
                                                            for s in range(1, 10)]
    m = _metrics(tmp_path / "a")
    assert [m[s]["draft/updates"] for s in m] == [1.0] * 5 + [0.0, 2.0, 3.0, 3.0]
    assert "draft/loss" not in m[6] and "draft/loss" in m[7]
    assert m[8]["draft/budget_behind"] == pytest.approx((2.5 - 13 / 6) / 1.5)
    # a resume from step 4 continues the decisions exactly (the budget's state is in the checkpoint)
    resumed = FakeWorkers(acceptance=_acceptance)
    step4 = tmp_path / "a" / "checkpoints" / "step_000004"
    _run(_cfg(tmp_path / "b", *ADAPTIVE, f"checkpoint.dir={tmp_path / 'a' / 'checkpoints'}",
              f"checkpoint.resume={step4}"), resumed, resume=str(step4))
    assert resumed.trainer_.draft_updates == [1, 0, 2, 3, 3]
    # draft.budget.measure_idle: the idle step still hands the drafter its forward, with no update
    measured = FakeWorkers(acceptance=_acceptance)
    _run(_cfg(tmp_path / "c", *ADAPTIVE, "draft.budget.measure_idle=true"), measured)
    assert measured.trainer_.draft_updates == workers.trainer_.draft_updates
    assert [e for e in measured.log if e[0] == "logprobs"] == [("logprobs", s) for s in range(1, 10)]
    assert _metrics(tmp_path / "c")[6]["draft/updates"] == 0.0


# ------------------------------------------------------------------ asynchronous GRPO (grpo.max_staleness)
def _batches_equal(a, b) -> bool:
    from dataclasses import fields

    return all((getattr(a, f.name) is None and getattr(b, f.name) is None) or torch.equal(getattr(a, f.name),
               getattr(b, f.name)) for f in fields(a))


def test_staleness_one_draws_the_next_step_while_this_one_updates(tmp_path):
    """k = 1: step t's rollouts are sampled by the policy of step t-2 (the initial one for t <= 2),
    the draw of step t+1 runs beside step t's update (the fake engines block until an update has
    started), no push lands inside a generate call, and - these fake engines' outputs do not depend
    on the policy - the trainer gets exactly the synchronous run's batches."""
    sync = FakeWorkers()
    _run(_cfg(tmp_path / "sync"), sync)
    workers = FakeWorkers(overlap=True)
    _run(_cfg(tmp_path / "async", "grpo.max_staleness=1"), workers)
    seeds = [SEED * 1_000_003 + s for s in range(1, STEPS + 1)]
    assert workers.rollout_.generated == list(zip(seeds, [0, 0, 1, 2]))
    assert sync.rollout_.generated == list(zip(seeds, [0, 1, 2, 3]))
    assert len(workers.trainer_.batches) == STEPS
    assert all(_batches_equal(a, b) for a, b in zip(workers.trainer_.batches, sync.trainer_.batches))
    # each step's policy (and the drafter every PUSH_EVERY) is pushed after its update, as synchronously
    pushes = [e for e in workers.log if e[0] == "push"]
    assert pushes == [e for e in sync.log if e[0] == "push"]
    m = _metrics(tmp_path / "async")
    assert [m[s]["async/policy_lag"] for s in m] == [0.0, 1.0, 1.0, 1.0]
    assert all(m[s]["time/rollout_wait"] >= 0 and m[s]["time/step"] > 0 for s in m)
    assert "async/policy_lag" not in _metrics(tmp_path / "sync")[1]


def test_staleness_two_resumes_exactly_with_the_samples_in_flight(tmp_path):
    """k = 2, 6 steps, checkpoints every 2: the checkpoint of step 2 holds the rollouts of steps 3 and 4
    (sampled by the initial policy and step 1's), so the resumed run draws only steps 5 and 6, on the
    versions the whole run drew them on, and trains on the same batches with the same metrics."""
    six = ["grpo.num_steps=6", "grpo.max_staleness=2"]
    whole = FakeWorkers()
    _run(_cfg(tmp_path / "a", *six), whole)
    seeds = [SEED * 1_000_003 + s for s in range(1, 7)]
    assert whole.rollout_.generated == list(zip(seeds, [0, 0, 0, 1, 2, 3]))
    step2 = tmp_path / "a" / "checkpoints" / "step_000002"
    resumed = FakeWorkers()
    _run(_cfg(tmp_path / "b", *six, f"checkpoint.dir={tmp_path / 'a' / 'checkpoints'}", f"checkpoint.resume={step2}"),
         resumed, resume=str(step2))
    assert resumed.rollout_.generated == whole.rollout_.generated[4:]
    assert [e for e in resumed.log if e[0] == "generate"] == [e for e in whole.log if e[0] == "generate"][4:]
    assert all(_batches_equal(a, b) for a, b in zip(resumed.trainer_.batches, whole.trainer_.batches[2:]))
    a, b = _metrics(tmp_path / "a"), _metrics(tmp_path / "b")
    def timeless(r):
        return {k: v for k, v in r.items() if not k.startswith("time/") and k != "rollout/tokens_per_s"}

    assert [timeless(b[s]) for s in range(3, 7)] == [timeless(a[s]) for s in range(3, 7)]
    assert [a[s]["async/policy_lag"] for s in a] == [0.0, 1.0, 2.0, 2.0, 2.0, 2.0]
    # another staleness cannot continue this checkpoint's schedule: refused before any worker starts
    from cotrain.config import ConfigError

    refused = FakeWorkers()
    with pytest.raises(ConfigError, match="grpo.max_staleness"):
        _run(_cfg(tmp_path / "c", "grpo.num_steps=6", "grpo.max_staleness=1",
                  f"checkpoint.dir={tmp_path / 'a' / 'checkpoints'}", f"checkpoint.resume={step2}"),
             refused, resume=str(step2))
    assert "generate" not in {e[0] for e in refused.log}


class MislabellingRollout(FakeRollout):
    """Engines whose samples of the third generate call carry a version no push made."""

    def _generate(self, prompts, sampling, n):
        res = super()._generate(prompts, sampling, n)
        if len(self.generated) == 3:
            for row in res.samples:
                row[0].weight_version = self.version + 7
        return res


def test_samples_of_another_version_than_the_schedule_are_refused(tmp_path):
    from cotrain.rl.inflight import DrawAhead, StaleSampleError, StepGroups

    workers = FakeWorkers()
    workers.rollout = lambda model_path, draft_model: setattr(workers, "rollout_", MislabellingRollout(workers.log)) \
        or workers.rollout_
    with pytest.raises(StaleSampleError, match=r"step 3: samples of policy version\(s\) \[8\] in a draw started on "
                                               r"version 1: a weight push landed during the draw"):
        _run(_cfg(tmp_path, "grpo.max_staleness=1"), workers)
    assert [e[0] for e in workers.log].count("train_step") == 2  # steps 1 and 2 trained, step 3 refused
    # a sample more than k versions older than the trainer's policy is never trained on
    sample = Sample(prompt_index=0, prompt_token_ids=[5], token_ids=[6], logprobs=[-0.1], text="2",
                    finish_reason="stop", weight_version=0)
    drawn = StepGroups(first=None, first_problems=[], first_rewards=None, samples=[[sample]], rewards=None,
                       with_signal=0, resampled_prompts=0, version=0)
    assert DrawAhead(1).check(5, drawn, 1) == 1
    with pytest.raises(StaleSampleError, match=r"step 5: samples of policy version 0 would be trained by version 2, "
                                               r"2 versions newer \(grpo.max_staleness=1\)"):
        DrawAhead(1).check(5, drawn, 2)


def test_importance_correction_weighs_the_trainers_batch(tmp_path):
    """w = pi_old / pi_engine per response token (the fake trainer's recomputation is the engines'
    log-probs - 0.01, plus 0.5 on every other position of the mis run): tis hands the trainer
    min(w, C) and keeps every token; mis rejects the tokens with w > C from the loss mask and weighs
    the others by w; none adds nothing. The metrics report the ratios."""
    import math

    workers = FakeWorkers()
    _run(_cfg(tmp_path / "tis", "grpo.num_steps=2", "grpo.importance_correction=tis"), workers)
    for batch in workers.trainer_.batches:
        torch.testing.assert_close(batch.is_weights, math.exp(-0.01) * batch.mask)
        assert batch.mask.sum() > 0
    m = _metrics(tmp_path / "tis")
    assert m[1]["train/is_ratio_mean"] == pytest.approx(math.exp(-0.01))
    assert m[1]["train/is_truncated_frac"] == 0.0
    workers = FakeWorkers()
    workers.trainer_shift = lambda mask: 0.5 * mask * (torch.arange(mask.shape[1]) % 2)
    _run(_cfg(tmp_path / "mis", "grpo.num_steps=1", "grpo.importance_correction=mis", "grpo.importance_cap=1.5"),
         workers)
    (batch,) = workers.trainer_.batches
    response = batch.rollout_logprobs != 0  # (the fake engines' log-probs are -0.25 on every response token)
    odd = (torch.arange(batch.seq_len) % 2 == 1).expand_as(response)
    assert torch.equal(batch.mask.bool(), response & ~odd)  # w = e^0.49 > 1.5 rejected, e^-0.01 kept
    torch.testing.assert_close(batch.is_weights, math.exp(-0.01) * batch.mask)
    frac = _metrics(tmp_path / "mis")[1]["train/is_truncated_frac"]
    assert frac == pytest.approx((response & odd).sum().item() / response.sum().item())
    workers = FakeWorkers()
    _run(_cfg(tmp_path / "none", "grpo.num_steps=1"), workers)
    assert workers.trainer_.batches[0].is_weights is None
    assert "train/is_ratio_mean" not in _metrics(tmp_path / "none")[1]


def test_staleness_and_its_correction_are_validated(tmp_path):
    from cotrain.config import ConfigError

    with pytest.raises(ConfigError, match=r"grpo.max_staleness(.|\n)*rollout.colocate=true"):
        _cfg(tmp_path, *COLOCATED, "grpo.max_staleness=1")
    with pytest.raises(ConfigError, match=r"grpo.importance_cap(.|\n)*acts only with grpo.importance_correction"):
        _cfg(tmp_path, "grpo.importance_cap=3")


class DyingRollout(FakeRollout):
    """Engines that die in their third generate call (the draw of step 3, made beside step 2's update)."""

    def _generate(self, prompts, sampling, n):
        if len(self.generated) == 2:
            raise RuntimeError("engine 0 (node 127.0.0.1) died during generate")
        return super()._generate(prompts, sampling, n)


def test_an_engine_dying_in_a_draw_ahead_fails_the_step_with_its_name(tmp_path):
    """The draw's error surfaces in the step it ran beside (step 2), before that step's push: the step
    is neither logged nor checkpointed, and the background thread is gone."""
    import threading

    workers = FakeWorkers()
    workers.rollout = lambda model_path, draft_model: setattr(workers, "rollout_", DyingRollout(workers.log)) \
        or workers.rollout_
    with pytest.raises(RuntimeError, match=r"engine 0 \(node 127.0.0.1\) died during generate"):
        _run(_cfg(tmp_path, "grpo.max_staleness=1", "checkpoint.every=1"), workers)
    assert [e[0] for e in workers.log].count("train_step") == 2  # step 2 updated; its push never came
    assert [e[3] for e in workers.log if e[:2] == ("push", "policy")] == [1]
    assert sorted(_metrics(tmp_path)) == [1]
    assert (tmp_path / "checkpoints" / "step_000001").is_dir() and not (tmp_path / "checkpoints" / "step_000002").exists()
    for t in [t for t in threading.enumerate() if t.name.startswith("cotrain-draw-ahead")]:
        t.join(timeout=10)  # (shutdown asked it to stop; it is idle: the draw had failed)
        assert not t.is_alive()
