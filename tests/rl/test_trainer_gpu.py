"""The Megatron trainer on a GPU (``gpu``: skipped without CUDA).

* export -> engine: a trainer rank on the GPU takes a GRPO step, exports the policy through
  ``cuda_ipc`` (vLLM's IPC engines), a colocated vLLM engine loads it: its greedy output is the
  Hugging Face greedy output of the trainer's weights, and its label is the exported version.
* ``policy.context_parallel_impl=megatron_te`` (Megatron's own CP in transformer-engine's
  attention) gives the log-probs of ``cotrain`` (Megatron's local attention at CP = 1; cotrain's
  ring at CP = 2, which needs two GPUs), within bf16 tolerance, and trains.
"""

from __future__ import annotations

import pytest
import torch

from _rollout_helpers import load_hf, start_ray, stop_ray
from _trainer_utils import fake_rollout_batch

from cotrain.config import load_config

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

GPU = ["cluster.device=cuda", "policy.micro_batch_size=4", "grpo.prompts_per_step=4", "grpo.group_size=4",
       "rollout.colocate=true", "rollout.gpu_memory_utilization=0.2"]


def _cfg(*extra: str):
    n = max(1, torch.cuda.device_count())
    return load_config("configs/grpo.yaml", [*GPU, f"cluster.gpus_per_node={n}", *extra])


@pytest.fixture(scope="module")
def ray_gpu():
    started = start_ray()
    yield
    stop_ray(started)


def test_trainer_export_reaches_a_colocated_engine(ray_gpu, tiny_model_path):
    from cotrain.models.build_tiny import greedy_answers
    from cotrain.rl.interfaces import SamplingSpec
    from cotrain.rl.ray_workers import RayWorkers

    prompts = ["457+86=", "12+3=", "999+1=", "5+40="]
    greedy = SamplingSpec(temperature=0.0, max_tokens=8)
    # the run's own placement: the engine shares its GPU with a trainer rank (colocated bundles)
    workers = RayWorkers(_cfg("policy.optimizer.lr=3e-2", "rollout.num_engines=1"))  # a step that shows
    workers.start()
    trainer = workers.trainer(str(tiny_model_path), None)
    engines = None
    try:
        engines = workers.rollout(str(tiny_model_path), None)
        trainer.connect(engines)
        batch = fake_rollout_batch()
        lp = trainer.logprobs(batch)
        batch.old_logprobs = lp.logprobs
        trainer.train_step(batch)
        handle = trainer.export("policy", 1)  # rollout.weight_transport: cuda_ipc (colocated)
        assert handle["transport"] == "cuda_ipc" and "update_info" in handle
        try:
            engines.push("policy", handle, 1)
        finally:
            trainer.release_export(handle)
        assert engines.weight_version() == 1
        model, tok = load_hf(tiny_model_path)
        model.load_state_dict({k: v.float().cpu() for k, v in trainer.named_weights().items()}, strict=False)
        got = [g[0].text for g in engines.generate(prompts, greedy).samples]
        want = greedy_answers(model.eval(), tok, prompts, 8)
        assert sum(a == b for a, b in zip(got, want)) >= len(prompts) - 1, (got, want)
    finally:
        if engines is not None:
            engines.shutdown()
        trainer.shutdown()
        workers.close()


@pytest.mark.parametrize("cp", [1, 2])
def test_megatron_te_attention_matches_cotrain(ray_gpu, tiny_model_path, cp):
    pytest.importorskip("transformer_engine")
    if torch.cuda.device_count() < cp:
        pytest.skip(f"CP={cp} needs {cp} GPUs (one rank per GPU)")
    from cotrain.rl.workers import TrainerGroup

    out = {}
    for impl in ("cotrain", "megatron_te"):
        cfg = _cfg("policy.dtype=bfloat16", f"policy.parallel.context={cp}", f"policy.context_parallel_impl={impl}")
        group = TrainerGroup(cfg, str(tiny_model_path))
        try:
            batch = fake_rollout_batch(multiple_of=2 * cp)
            lp = group.logprobs(batch).logprobs
            batch.old_logprobs = lp
            out[impl] = (lp, batch.mask, group.train_step(batch))
        finally:
            group.shutdown()
    (a, mask, ma), (b, _, mb) = out["cotrain"], out["megatron_te"]
    diff = (a - b).abs()[mask.bool()]
    assert diff.mean() < 0.02 and diff.max() < 0.25, (diff.mean(), diff.max())
    assert torch.isfinite(torch.tensor(mb["loss"])) and mb["grad_norm"] == pytest.approx(ma["grad_norm"], rel=0.1)
