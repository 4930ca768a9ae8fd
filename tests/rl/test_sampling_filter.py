"""The trainer's log-probs are those of the distribution the engines sample from, top-k / top-p
included (cotrain.rl.sampling_filter):

- the kept set equals vLLM's own filter functions (``apply_top_k_only``, ``apply_top_k_top_p_pytorch``)
  on random logits, on one rank and split over 2 tensor-parallel ranks (gloo);
- for every accepted sampling setting (temperature, top_k, top_p; greedy; TP=1 and TP=2) the
  trainer's recomputation equals the vLLM engine's sampling log-probs on the same weights
  (train-inference KL ~ 0), where without the filter the two differ;
- the co-trained drafter learns from the filtered distribution: its step equals the offline
  distillation step on a Hugging Face forward's tempered logits filtered by vLLM's function.
"""

from __future__ import annotations

import pytest
import ray
import torch

from cotrain.config import load_config
from cotrain.rl.sampling_filter import keep_mask

# (temperature, top_k, top_p)
FILTERS = [(1.0, 3, 1.0), (1.0, 1, 1.0), (0.7, -1, 0.8), (1.0, 5, 0.9), (1.3, 50, 0.95), (1.0, -1, 0.3)]


def vllm_keep(logits: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """vLLM's kept set for rows of full-vocabulary logits (its CPU path: top-k alone without a sort)."""
    from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_only, apply_top_k_top_p_pytorch

    n, V = logits.shape
    k = torch.full((n,), top_k if 0 < top_k < V else V, dtype=torch.long) if top_k > 0 else None
    p = torch.full((n,), top_p, dtype=torch.float32) if top_p < 1 else None
    if k is None and p is None:
        return torch.ones_like(logits, dtype=torch.bool)
    x = logits.clone()
    out = apply_top_k_only(x, k) if p is None else apply_top_k_top_p_pytorch(x, k, p, allow_cpu_sync=True)
    return out > float("-inf")


def _logits(seed: int, n: int = 64, V: int = 48) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, V, generator=g) * 2.0
    x[: n // 4] = torch.round(x[: n // 4])  # ties at the k-th value: vLLM keeps them all
    return x


@pytest.mark.parametrize("temperature, top_k, top_p", FILTERS)
def test_kept_set_is_vllms(temperature, top_k, top_p):
    for seed in range(3):
        x = _logits(seed) / temperature
        want = vllm_keep(x, top_k, top_p)
        if top_p < 1:  # ties make a sort's order (hence a top-p cut) arbitrary: compare untied rows
            x, want = x[16:], want[16:]
        got = keep_mask(x, top_k, top_p)
        assert torch.equal(got, want)
        assert got.sum(-1).min() >= 1


def _tp_worker(rank, world, cases):
    import torch.distributed as dist

    out = []
    for x, top_k, top_p in cases:
        V = x.shape[-1] // world
        out.append(keep_mask(x[..., rank * V:(rank + 1) * V], top_k, top_p, group=dist.group.WORLD,
                             vocab_start=rank * V))
    return out


def test_kept_set_over_tensor_parallel_ranks():
    """Each of 2 ranks holds half the vocabulary ([b, S, V/2], the trainer's shape); their kept
    slices make up vLLM's kept set (one spawn for every filter: starting processes dominates)."""
    from cotrain.distributed import spawn_local

    cases = [((_logits(7)[16:] / t).reshape(4, 12, -1), k, p) for t, k, p in FILTERS]
    parts = spawn_local(_tp_worker, 2, cases, timeout_s=300)
    for i, (x, top_k, top_p) in enumerate(cases):
        got = torch.cat([parts[0][i], parts[1][i]], dim=-1)
        want = vllm_keep(x.reshape(-1, x.shape[-1]), top_k, top_p).reshape(got.shape)
        assert torch.equal(got, want), (top_k, top_p)


# ------------------------------------------------------------------------ trainer vs engine
PROMPTS = ["457+86=", "12+3=", "999+1=", "5+40=", "31+69=", "7+7=", "68+25=", "1+"]
N = 4  # samples per prompt: 32 sequences = 4 micro-batches of 8
# (temperature, top_k, top_p, tensor parallel)
SETTINGS = [(1.0, -1, 1.0, 1), (1.0, 3, 1.0, 2), (1.0, 1, 1.0, 2), (0.7, -1, 0.8, 1), (1.2, 5, 0.9, 2),
            (0.0, 3, 0.5, 1)]
BASE = ["policy.micro_batch_size=8", f"grpo.prompts_per_step={len(PROMPTS)}", f"grpo.group_size={N}",
        "policy.reference_model=false", "rollout.sampling.max_tokens=12"]


def sampling_overrides(temperature, top_k, top_p):
    return [f"rollout.sampling.temperature={temperature}", f"rollout.sampling.top_k={top_k}",
            f"rollout.sampling.top_p={top_p}"]


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from _rollout_helpers import start_ray, stop_ray

    from cotrain.rl.rollout import EngineSpec, RolloutWorker

    started = start_ray()
    actor = ray.remote(RolloutWorker).options(num_cpus=1).remote(EngineSpec(str(tiny_model_path)))
    ray.get(actor.ready.remote())
    yield actor
    ray.get(actor.shutdown.remote())
    ray.kill(actor)
    stop_ray(started)


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    from _rollout_helpers import load_hf

    return load_hf(tiny_model_path)


def rollout_batch(engine, pad_id, temperature, top_k, top_p):
    from cotrain.rl.batch import build_batch
    from cotrain.rl.interfaces import SamplingSpec

    spec = SamplingSpec(temperature=temperature, top_k=top_k, top_p=top_p, max_tokens=12, seed=3)
    res = ray.get(engine.generate.remote(PROMPTS, spec, N))
    flat = [s for group in res.samples for s in group]
    return build_batch(flat, [0.0] * len(flat), pad_id=pad_id)


@torch.no_grad()
def hf_logprobs(model, batch, temperature, top_k, top_p, filtered=True):
    """The reference: HF logits / T, vLLM's own filter (when sampling), log-softmax, the targets."""
    logits = model(input_ids=batch.inputs).logits.float()
    if temperature > 0:
        logits = logits / temperature
        if filtered:
            flat = logits.reshape(-1, logits.shape[-1])
            logits = flat.masked_fill(~vllm_keep(flat, top_k, top_p), float("-inf")).reshape(logits.shape)
    lp = torch.log_softmax(logits, -1).gather(-1, batch.targets[..., None])[..., 0]
    return torch.where(batch.mask.bool(), lp, torch.zeros_like(lp))


@pytest.mark.slow  # a vLLM engine (as tests/rl/test_rollout_engine.py)
@pytest.mark.parametrize("temperature, top_k, top_p, tp", SETTINGS)
def test_trainer_logprobs_equal_the_engines(engine, hf, tiny_model_path, temperature, top_k, top_p, tp):
    from cotrain.rl.grpo import k3_kl
    from cotrain.rl.workers import TrainerGroup

    batch = rollout_batch(engine, hf[1].pad_token_id, temperature, top_k, top_p)
    m = batch.mask.bool()
    cfg = load_config("configs/grpo.yaml", BASE + sampling_overrides(temperature, top_k, top_p)
                      + [f"policy.parallel.tensor={tp}"])
    group = TrainerGroup(cfg, tiny_model_path)
    try:
        trainer = group.logprobs(batch).logprobs
    finally:
        group.shutdown()
    engine_lp = batch.rollout_logprobs
    assert torch.isfinite(trainer).all()
    kl = k3_kl(engine_lp[m].double(), trainer[m].double()).mean().item()
    assert 0 <= kl < 1e-6, kl
    assert (engine_lp[m] - trainer[m]).abs().max() < 1e-3
    ref = hf_logprobs(hf[0], batch, temperature, top_k, top_p)
    assert (ref[m] - trainer[m]).abs().max() < 1e-4  # vLLM's filter on HF logits: the same numbers
    if temperature > 0 and (top_k != -1 or top_p < 1):  # ... and the filter matters here
        unfiltered = hf_logprobs(hf[0], batch, temperature, top_k, top_p, filtered=False)
        assert (unfiltered[m] - engine_lp[m]).abs().max() > 0.05
    if top_k == 1 and temperature > 0:
        assert trainer[m].abs().max() < 1e-6  # one token kept: probability 1


# ------------------------------------------------------------------------ the drafter's target
DRAFT = ["draft.kind=dflash", "draft.dflash.block_size=4", "draft.dflash.anchors_per_seq=2", "draft.cotrain=true",
         "draft.optimizer.lr=0.5", "draft.optimizer.eps=1.0", "draft.optimizer.clip_grad=0.0",
         "rollout.speculative.method=null", "draft.init=null"]
DRAFT_FILTER = (1.0, 4, 0.9)


def test_cotrained_drafter_learns_the_filtered_distribution(ray_started, tiny_model_path):
    """Reference as in test_cotrain_trainer: the HF policy's taps and logits on the same rows, the
    drafter built as the distillation builds it, one step of the same loss on the same chains - with
    the target logits tempered and filtered by vLLM's function. Unfiltered logits give another step."""
    from _trainer_utils import fake_rollout_batch

    from cotrain.draft.online import OnlineDraftTrainer, RolloutRows
    from cotrain.draft.registry import build_drafter
    from cotrain.draft.taps import TargetSpec, compute_taps, load_hf_target
    from cotrain.rl.workers import TrainerGroup

    temperature, top_k, top_p = DRAFT_FILTER
    cfg = load_config("configs/grpo.yaml", ["policy.micro_batch_size=4", "grpo.prompts_per_step=4",
                                            "grpo.group_size=4", "policy.reference_model=false"]
                      + sampling_overrides(temperature, top_k, top_p) + DRAFT)
    b = fake_rollout_batch()
    group = TrainerGroup(cfg, tiny_model_path)
    try:
        draft = group.logprobs(b, draft_step=1).draft_metrics
    finally:
        group.shutdown()

    target = TargetSpec.from_checkpoint(tiny_model_path)
    hf = load_hf_target(tiny_model_path)
    rows = RolloutRows(b.inputs, b.mask, b.lengths, torch.arange(len(b)))
    S = b.seq_len
    taps, logits = compute_taps(hf, b.inputs.reshape(-1), torch.arange(0, len(b) * S + 1, S),
                                build_drafter("dflash", cfg.draft.settings, target, seed=cfg.run.seed).tap_layers)
    tempered = logits.float() / temperature
    filtered = tempered.masked_fill(~vllm_keep(tempered, top_k, top_p), float("-inf"))
    steps = {}
    for name, target_logits in (("filtered", filtered), ("unfiltered", tempered)):
        drafter = build_drafter("dflash", cfg.draft.settings, target, seed=cfg.run.seed)
        online = OnlineDraftTrainer(drafter, cfg.draft, total_steps=cfg.grpo.num_steps, seed=cfg.run.seed)
        online.begin_step(1)
        online.microbatch(rows, taps, target_logits)
        steps[name] = online.end_step()
    for k in ("loss", "grad_norm", "acceptance_offline"):
        assert draft[f"draft/{k}"] == pytest.approx(steps["filtered"][k], rel=1e-4), k
    # unfiltered logits give a loss the match above tells apart: 5x its tolerance (measured 8.6e-4 relative
    # on one build of the tiny model, > 1e-3 on another)
    assert abs(steps["unfiltered"]["loss"] - steps["filtered"]["loss"]) > 5e-4 * abs(steps["filtered"]["loss"])


@pytest.fixture(scope="module")
def ray_started():
    from _rollout_helpers import start_ray, stop_ray

    started = start_ray()
    yield
    stop_ray(started)
