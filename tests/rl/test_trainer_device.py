"""The trainer's device handling on CPU: the rank's device rule, the layer-spec choice and its names,
and the in-process trainer of the GPU check (tests/gpu/_trainer_run.py) run here on CPU with Ray and
vLLM unimportable: log-probs against a Hugging Face forward of the same checkpoint, offload / onload
leaving the next step bit-identical, exact resume (every RNG stream included) and a checkpoint holding
a pickled object refused with its file named. tests/gpu/test_trainer_cuda.py runs the same script on
CUDA against these CPU results."""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from cotrain.rl.trainer import rank_device

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "gpu" / "_trainer_run.py"


def test_rank_device_rule(monkeypatch):
    assert rank_device("cpu") == torch.device("cpu")
    assert rank_device("cuda", visible=1, local_rank=3) == torch.device("cuda", 0)  # Ray: one GPU per actor
    assert rank_device("cuda", visible=4, local_rank=2) == torch.device("cuda", 2)
    monkeypatch.setenv("LOCAL_RANK", "3")
    assert rank_device("cuda", visible=4) == torch.device("cuda", 3)
    with pytest.raises(RuntimeError, match="LOCAL_RANK=3, but this process sees 2 GPUs"):
        rank_device("cuda", visible=2)
    with pytest.raises(RuntimeError, match="sees no GPU"):
        rank_device("cuda", visible=0)
    with pytest.raises(ValueError, match="auto is resolved"):
        rank_device("auto")


def test_layer_spec_choice_and_refusal():
    from cotrain.config import ConfigError, load_config
    from cotrain.models.megatron_model import resolve_layer_spec

    assert resolve_layer_spec("auto", "cpu") == "local"
    assert resolve_layer_spec("local", "cuda") == "local"
    with pytest.raises(ConfigError, match="policy.layer_spec: transformer_engine .* needs CUDA"):
        load_config("configs/grpo.yaml", ["policy.layer_spec=transformer_engine"])


def test_te_names_round_trip():
    """A transformer-engine spec keeps each input norm inside the linear after it; tensor_state speaks
    the local spec's names whatever the spec, and load_tensor_state takes them back."""
    from cotrain.models.megatron_model import load_tensor_state, tensor_state

    def te_layer():
        layer = torch.nn.Module()
        layer.self_attention = torch.nn.Module()
        layer.self_attention.linear_qkv = torch.nn.Linear(4, 12, bias=False)
        layer.self_attention.linear_qkv.layer_norm_weight = torch.nn.Parameter(torch.randn(4))
        layer.mlp = torch.nn.Module()
        layer.mlp.linear_fc1 = torch.nn.Linear(4, 8, bias=False)
        layer.mlp.linear_fc1.layer_norm_weight = torch.nn.Parameter(torch.randn(4))
        return layer

    model = torch.nn.Module()
    model.decoder = torch.nn.Module()
    model.decoder.layers = torch.nn.ModuleList([te_layer(), te_layer()])
    state = tensor_state(model)
    assert "decoder.layers.1.input_layernorm.weight" in state and "decoder.layers.0.pre_mlp_layernorm.weight" in state
    assert not any("layer_norm_weight" in k for k in state)
    torch.testing.assert_close(state["decoder.layers.1.input_layernorm.weight"],
                               model.decoder.layers[1].self_attention.linear_qkv.layer_norm_weight)
    other = torch.nn.Module()
    other.decoder = torch.nn.Module()
    other.decoder.layers = torch.nn.ModuleList([te_layer(), te_layer()])
    missing, unexpected = load_tensor_state(other, state)
    assert not missing and not unexpected
    for (a, x), (b, y) in zip(model.state_dict().items(), other.state_dict().items()):
        assert a == b and torch.equal(x, y), a


@pytest.fixture(scope="module")
def cpu_run(tmp_path_factory):
    """The GPU check's trainer process, here on CPU with ray and vllm unimportable."""
    d = tmp_path_factory.mktemp("trainer_cpu")
    out = d / "res.pt"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--device", "cpu", "--cases", "plain:float32,dflash:float32",
                           "--checks", "offload,rng,resume,pickled", "--model-dir", str(d / "model"),
                           "--work", str(d / "work"), "--out", str(out), "--block", "ray,vllm"],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return torch.load(out, weights_only=False), d / "model"


def test_runs_without_ray_or_vllm(cpu_run):
    res, _ = cpu_run
    assert res["modules"] == []
    for case in ("plain:float32", "dflash:float32"):
        assert res[case]["device"] == "cpu" and res[case]["param_devices"] == ["cpu"]
    assert res["dflash:float32"]["drafter_devices"] == ["cpu"]
    m = res["dflash:float32"]["step"]["draft_metrics"]
    assert m["draft/positions"] > 0 and m["draft/grad_norm"] > 0


def test_logprobs_match_hugging_face(cpu_run):
    """The trainer's log-probs of the batch (moved onto the rank's device, positions made there) are
    Hugging Face's log-softmax of the same checkpoint at the targets (temperature 1 in configs/grpo.yaml)."""
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "tests" / "rl"))
    from _trainer_utils import fake_rollout_batch

    res, model_dir = cpu_run
    batch = fake_rollout_batch()
    hf = AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(hf(input_ids=batch.inputs).logits.float(), -1).gather(-1, batch.targets[..., None])[..., 0]
    got = res["plain:float32"]["step"]["logprobs"]
    assert got.device.type == "cpu"
    m = batch.mask.bool()
    torch.testing.assert_close(got[m], ref[m], atol=2e-5, rtol=1e-5)
    assert torch.all(got[~m] == 0)


def test_offload_onload_leaves_the_next_step_bit_identical(cpu_run):
    res, _ = cpu_run
    a, b = res["plain:float32"]["offload"], res["plain:float32"]["offload_ref"]
    assert torch.equal(a["logprobs_after"], b["logprobs_after"]) and a["metrics"] == b["metrics"]
    assert not torch.equal(a["logprobs_after"], a["logprobs"])  # the step moved the policy


def test_resume_is_exact_with_every_rng_stream(cpu_run):
    res, _ = cpu_run
    first, again = res["plain:float32"]["rng"]
    assert len(first) == 3  # torch CPU, Python, the model-parallel tracker's stream
    for x, y in zip(first, again):
        assert (torch.equal(x, y) if torch.is_tensor(x) else x == y)
    a, b = res["plain:float32"]["resume"]
    assert torch.equal(a["logprobs_after"], b["logprobs_after"]) and a["metrics"] == b["metrics"]


def test_checkpoint_with_a_pickled_object_is_refused_naming_the_file(cpu_run):
    res, _ = cpu_run
    err = res["plain:float32"]["pickled"]
    assert err is not None and err.startswith("CheckpointError")
    assert "pickled_ck/trainer_rank0000.pt" in err and "pickled Python object" in err
