"""``rollout.colocate`` on a GPU (``gpu``: skipped without CUDA): an engine built as a colocated run
builds it (vLLM's sleep mode) gives the device back while it sleeps - the GPU's free memory grows by
most of what the engine held - and, woken, answers exactly as before and takes a policy push that
its greedy output then follows; a whole colocated run on one GPU places the rank and the engine on
it and takes two steps. (On CPU vLLM has no sleep mode and validation refuses the key:
tests/config/test_config_errors.py; the driver's sleep / wake / offload / onload order:
tests/rl/test_driver_contract.py; the placement on fake GPUs: tests/test_placement.py.)"""

from __future__ import annotations

import pytest
import torch

from _rollout_helpers import load_hf, random_policy_state
from cotrain.models.build_tiny import greedy_answers
from cotrain.rl.interfaces import SamplingSpec

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

PROMPTS = ["457+86=", "12+3=", "999+1=", "5+40="]
GREEDY = SamplingSpec(temperature=0.0, max_tokens=8)


def _texts(result) -> list[str]:
    return [g[0].text for g in result.samples]


def test_a_colocated_engine_sleeps_off_the_device_and_wakes_up_the_same(tiny_model_path):
    from cotrain.rl.rollout import EngineSpec, VllmGeneration
    from cotrain.weights.transports.cuda_ipc import CudaIpcTransport

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    _, tok = load_hf(tiny_model_path)
    gen = VllmGeneration(EngineSpec(str(tiny_model_path), multiprocess=True, gpu_memory_utilization=0.3,
                                    sleep_mode=True), transport=CudaIpcTransport())
    try:
        before = _texts(gen.generate(PROMPTS, GREEDY))
        free_awake, total = torch.cuda.mem_get_info()
        gen.sleep()
        free_asleep, _ = torch.cuda.mem_get_info()
        # the engine held about 0.3 of the device (weights + KV cache): most of it comes back
        assert free_asleep - free_awake > 0.2 * total
        gen.wake_up()
        assert torch.cuda.mem_get_info()[0] < free_asleep - 0.2 * total  # ... and is taken again
        assert _texts(gen.generate(PROMPTS, GREEDY)) == before
        other, state = random_policy_state(tok, seed=8)
        gen.push_weights("policy", {k: v.cuda() for k, v in state.items()}, 1)
        got, want = _texts(gen.generate(PROMPTS, GREEDY)), greedy_answers(other, tok, PROMPTS, 8)
        # fp32 on the GPU vs the CPU: an argmax tie may flip one prompt, never most of them
        assert sum(g == w for g, w in zip(got, want)) >= len(PROMPTS) - 1 and got != before, (got, want)
    finally:
        gen.shutdown()


def test_a_colocated_run_shares_the_gpu_and_takes_turns(tiny_model_path, tmp_path):
    """The whole colocated path on one GPU (needs Ray and vLLM beside CUDA): the run's placement group
    holds one bundle for the rank, the engine's actor and the rank are both given that GPU (Ray's
    fractional requests), and two GRPO steps run through offload / sleep / onload / wake / push."""
    pytest.importorskip("ray")
    pytest.importorskip("vllm")
    import json

    import ray

    from cotrain.config import load_config
    from cotrain.rl.driver import GrpoRun

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    cfg = load_config("configs/grpo.yaml", [
        "cluster.device=cuda", f"cluster.gpus_per_node={torch.cuda.device_count()}", "rollout.colocate=true",
        f"run.output_dir={tmp_path}", "grpo.num_steps=2", "grpo.prompts_per_step=4", "grpo.group_size=4",
        "policy.micro_batch_size=4", "data.eval.every=0", "logging.tensorboard=false", "logging.progress_bar=false",
        "checkpoint.every=2", "rollout.gpu_memory_utilization=0.3"])
    run = GrpoRun(cfg)
    try:
        run.setup(False)
        layout = run.workers.placement.layout
        assert layout.engine_bundles == ((0,),) and layout.trainer_resources(0)["num_gpus"] == 0.5
        rank = ray.get(run.trainer.actors[0].visible_gpus.remote(), timeout=60)
        engine = run.rollout.ready_info[0]
        assert len(rank["gpu_ids"]) == 1 and engine["cuda_visible_devices"] == rank["cuda_visible_devices"] \
            == rank["gpu_ids"][0]
        run.train()
    finally:
        run.shutdown()
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and all(r["train/loss"] == r["train/loss"] for r in rows)
