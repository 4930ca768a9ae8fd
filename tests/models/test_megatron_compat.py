"""The CPU compatibility layer redirects Megatron's CUDA assumptions and nothing else."""

import pytest
import torch

from cotrain.models import megatron_compat as mc

cpu_only = pytest.mark.skipif(torch.cuda.is_available(), reason="the layer is inactive with CUDA")


@pytest.fixture(scope="module")
def compat():
    assert mc.apply_cpu_compat() is True
    assert mc.apply_cpu_compat() is True  # idempotent


@pytest.mark.gpu
def test_inactive_when_cuda_is_present():
    assert mc.apply_cpu_compat() is False
    from megatron.core.transformer import utils

    assert utils.torch is torch


@cpu_only
@pytest.mark.usefixtures("compat")
def test_torch_outside_megatron_is_untouched():
    with pytest.raises((AssertionError, RuntimeError)):
        torch.cuda.current_device()
    assert torch.zeros(1).device.type == "cpu"


@cpu_only
@pytest.mark.usefixtures("compat")
def test_megatron_sees_cpu_as_its_cuda_device():
    from megatron.core.transformer import utils

    assert utils.torch.cuda.current_device() == torch.device("cpu")
    mask = utils.get_default_causal_mask(5)  # hard-codes device="cuda" in megatron
    assert mask.device.type == "cpu"
    assert torch.equal(mask, torch.triu(torch.ones(5, 5), diagonal=1).bool())
    t = utils.torch.tensor([1, 2], device="cuda", pin_memory=True)
    assert t.device.type == "cpu"


class _Group:
    def __init__(self, rank, size):
        self._rank, self._size = rank, size

    def rank(self):
        return self._rank

    def size(self):
        return self._size


@cpu_only
@pytest.mark.usefixtures("compat")
@pytest.mark.parametrize("cp", [1, 2, 4])
def test_rope_cp_split_is_zigzag(cp):
    from megatron.core.models.common.embeddings import rope_utils

    emb = torch.arange(8 * cp * 3, dtype=torch.float32).view(8 * cp, 1, 1, 3)
    chunk = emb.shape[0] // (2 * cp)
    for r in range(cp):
        got = rope_utils.get_pos_emb_on_this_cp_rank(emb, 0, _Group(r, cp))
        want = torch.cat([emb[r * chunk:(r + 1) * chunk], emb[(2 * cp - 1 - r) * chunk:(2 * cp - r) * chunk]])
        assert torch.equal(got, want)


@cpu_only
@pytest.mark.usefixtures("compat")
def test_rng_tracker_forks_do_not_disturb_default_stream():
    from megatron.core.tensor_parallel import random as mrandom

    tracker = mrandom.get_cuda_rng_tracker()
    assert isinstance(tracker, mc.CpuRNGStatesTracker)
    mc.model_parallel_manual_seed(123)
    torch.manual_seed(7)
    expected = torch.rand(4)
    torch.manual_seed(7)
    with tracker.fork():
        a = torch.rand(4)
    assert torch.equal(torch.rand(4), expected)  # the default stream continued as if no fork happened
    mc.model_parallel_manual_seed(123)
    with tracker.fork():
        b = torch.rand(4)
    assert torch.equal(a, b)  # the forked stream is reproducible from the seed
    with pytest.raises(KeyError, match="not added"):
        with tracker.fork("no-such-stream"):
            pass


@cpu_only
@pytest.mark.usefixtures("compat")
def test_seeding_on_cuda_calls_megatrons_own(monkeypatch):
    """Given cuda, seed_model_parallel calls Megatron's model_parallel_cuda_manual_seed (observed by
    patching it: on this machine the real one would need a GPU) and leaves the CPU stand-in's tracker
    alone; given cpu it fills the stand-in's streams, Megatron's function untouched."""
    from megatron.core import tensor_parallel
    from megatron.core.tensor_parallel import random as mrandom

    calls = []
    monkeypatch.setattr(tensor_parallel, "model_parallel_cuda_manual_seed", lambda seed, **kw: calls.append(seed))
    mc._TRACKER.reset()
    mc.seed_model_parallel(11, torch.device("cuda", 0))
    assert calls == [11] and not mrandom.get_cuda_rng_tracker().is_initialized()
    mc.seed_model_parallel(11, "cpu")
    assert calls == [11]
    tracker = mrandom.get_cuda_rng_tracker()
    assert set(tracker.get_states()) == {"model-parallel-rng", "data-parallel-rng"}
    with tracker.fork():  # the tensor-parallel stream: seed + 2718 + tp_rank (Megatron's rule)
        got = torch.rand(3)
    assert torch.equal(got, torch.rand(3, generator=torch.Generator().manual_seed(11 + 2718)))
    with pytest.raises(ValueError, match="neither cpu nor cuda"):
        mc.seed_model_parallel(11, "meta")

