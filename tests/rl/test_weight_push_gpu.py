"""GPU weight pushes through vLLM's own weight-transfer engines (``gpu``: skipped without CUDA).

* ``cuda_ipc`` (one GPU): this process is the trainer, a vLLM engine (its worker in a separate
  process, as in a colocated run) the receiver. A policy push makes the engine's greedy output
  follow the pushed weights and relabels it; pushing the original back restores it exactly; a
  rejected push (a transposed tensor) leaves weights and label alone; drafter pushes (the tiny
  policy as its own ``draft_model``) move greedy acceptance from 4 (k = 3) down and back while the
  output never changes and the label stays.
* ``nccl`` (two GPUs: NCCL refuses two ranks on one device): the same through a ``RolloutGroup``
  Ray actor joined to this process's ``NcclBroadcastTransport``; a push the driver rejects is
  still drained by the engine (the sender's release returns), and the next push goes through.
"""

from __future__ import annotations

import pytest
import torch

from _rollout_helpers import load_hf, random_policy_state, start_ray, stop_ray
from cotrain.models.build_tiny import greedy_answers
from cotrain.rl.interfaces import SamplingSpec
from cotrain.weights import WeightPushError

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

PROMPTS = ["457+86=", "12+3=", "999+1=", "5+40=", "1+", "55+", "9", "31+69="]
GREEDY = SamplingSpec(temperature=0.0, max_tokens=8)
K = 3


def _cuda(state: dict[str, torch.Tensor], device="cuda") -> dict[str, torch.Tensor]:
    return {k: v.detach().to(device) for k, v in state.items()}


def _texts(result) -> list[str]:
    return [g[0].text for g in result.samples]


def _spec(path, **kw):
    from cotrain.rl.rollout import EngineSpec

    spec = {"method": "draft_model", "model": str(path), "num_speculative_tokens": K}
    return EngineSpec(str(path), multiprocess=True, gpu_memory_utilization=0.2, speculative=spec, **kw)


@pytest.fixture(scope="module")
def hf(tiny_model_path):
    return load_hf(tiny_model_path)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from cotrain.rl.rollout import VllmGeneration
    from cotrain.weights.transports.cuda_ipc import CudaIpcTransport

    gen = VllmGeneration(_spec(tiny_model_path), transport=CudaIpcTransport())
    yield gen
    gen.shutdown()


def _acceptance(gen) -> float:
    return gen.generate(PROMPTS, GREEDY).metrics["mean_acceptance_length"]


def test_cuda_ipc_policy_push_follows_the_weights(engine, hf):
    model, tok = hf
    before, v0 = _texts(engine.generate(PROMPTS, GREEDY)), engine.weight_version()
    other, state = random_policy_state(tok, seed=8)
    engine.push_weights("policy", _cuda(state), v0 + 1)
    assert engine.weight_version() == v0 + 1
    st = engine.status()
    assert st["last_push"]["transport"] == "cuda_ipc" and st["last_push"]["tensors"] == len(state)
    # the engine's worker reports the GPU it runs on: the one the sender exported on (same device)
    assert st["gpus"] == [str(torch.cuda.get_device_properties(0).uuid)] == [engine.transport.uuid]
    got, want = _texts(engine.generate(PROMPTS, GREEDY)), greedy_answers(other, tok, PROMPTS, 8)
    # fp32 on the GPU vs the CPU: an argmax tie may flip one prompt, never most of them
    assert sum(g == w for g, w in zip(got, want)) >= len(PROMPTS) - 1, (got, want)
    assert got != before
    engine.push_weights("policy", _cuda(model.state_dict()), v0 + 2)
    assert _texts(engine.generate(PROMPTS, GREEDY)) == before and engine.weight_version() == v0 + 2


def test_cuda_ipc_rejected_push_keeps_the_engine(engine, hf):
    model, tok = hf
    before, v0 = _texts(engine.generate(PROMPTS, GREEDY)), engine.weight_version()
    bad = {k: v + 0.5 if v.is_floating_point() else v for k, v in model.state_dict().items()}
    name = "model.layers.0.self_attn.k_proj.weight"
    bad[name] = bad[name].t().contiguous()
    with pytest.raises(WeightPushError, match=rf"shape mismatch\(es\): '{name}'"):
        engine.push_weights("policy", _cuda(bad), 99)
    assert engine.weight_version() == v0 and _texts(engine.generate(PROMPTS, GREEDY)) == before


def test_cuda_ipc_draft_push_moves_acceptance_not_output(engine, hf):
    model, tok = hf
    before, v0 = _texts(engine.generate(PROMPTS, GREEDY)), engine.weight_version()
    assert _acceptance(engine) == pytest.approx(K + 1)  # the policy drafting for itself
    _, state = random_policy_state(tok, seed=3)
    engine.push_weights("draft", _cuda(state), 1)
    assert _acceptance(engine) < 2.0
    assert _texts(engine.generate(PROMPTS, GREEDY)) == before  # lossless
    engine.push_weights("draft", _cuda(model.state_dict()), 2)
    assert _acceptance(engine) == pytest.approx(K + 1)
    assert engine.weight_version() == v0 and engine.draft_version == 2  # drafts never relabel


def test_nccl_push_through_a_rollout_group(tiny_model_path, hf):
    if torch.cuda.device_count() < 2:
        pytest.skip("nccl needs two GPUs: NCCL refuses two ranks (the sender, the engine) on one device")
    import ray

    from cotrain.distributed import find_free_port
    from cotrain.rl.rollout import RolloutGroup
    from cotrain.weights.transports.nccl import NcclBroadcastTransport

    model, tok = hf
    started = start_ray()
    group = sender = None
    try:
        group = RolloutGroup(_spec(tiny_model_path), 1, gpus_per_engine=1)
        taken = {int(i) for i in (group.ready_info[0]["cuda_visible_devices"] or "0").split(",")}
        mine = next(i for i in range(torch.cuda.device_count()) if i not in taken)
        before = _texts(group.generate(PROMPTS, GREEDY))
        port = find_free_port()
        refs = group.init_broadcast_group("127.0.0.1", port, world_size=2)
        sender = NcclBroadcastTransport("127.0.0.1", port, 0, 2, device=f"cuda:{mine}", timeout_s=300)
        sender.connect()
        ray.get(refs)
        dev = f"cuda:{mine}"

        def push(kind, state, version):
            h = sender.send(_cuda(state, dev), version)
            try:
                return group.push(kind, h, version)
            finally:
                sender.release(h)  # returns once every engine took the bytes (loaded or drained)

        other, state = random_policy_state(tok, seed=8)
        push("policy", state, 1)
        got, want = _texts(group.generate(PROMPTS, GREEDY)), greedy_answers(other, tok, PROMPTS, 8)
        assert group.weight_version() == 1 and sum(g == w for g, w in zip(got, want)) >= len(PROMPTS) - 1
        bad = dict(model.state_dict())
        bad.pop("model.norm.weight")
        with pytest.raises(WeightPushError, match=r"missing name\(s\): 'model.norm.weight'"):
            push("policy", bad, 2)  # rejected on the driver; the engine drains the broadcast
        assert group.weight_version() == 1
        push("policy", model.state_dict(), 3)  # the group is still in step
        assert group.weight_version() == 3 and _texts(group.generate(PROMPTS, GREEDY)) == before
        # one sender carries the drafter too
        _, rnd = random_policy_state(tok, seed=3)
        push("draft", rnd, 4)
        res = group.generate(PROMPTS, GREEDY)
        assert res.metrics["mean_acceptance_length"] < 2.0 and _texts(res) == before
        push("draft", model.state_dict(), 5)
        assert group.generate(PROMPTS, GREEDY).metrics["mean_acceptance_length"] == pytest.approx(K + 1)
    finally:
        if sender is not None:
            sender.close()
        if group is not None:
            group.shutdown()
        stop_ray(started)
