"""build_batch by hand: which positions are trained on, and with which sampler log-probs."""

import torch

from cotrain.rl.batch import build_batch
from cotrain.rl.interfaces import Sample


def _sample(prompt, response, logprobs):
    return Sample(prompt_index=0, prompt_token_ids=prompt, token_ids=response, logprobs=logprobs, text="",
                  finish_reason="stop", weight_version=0)


def test_build_batch_layout_by_hand():
    # prompt 5 6 7, response 8 9 2: the targets that are response tokens are 8, 9, 2 (positions 2..4)
    a = _sample([5, 6, 7], [8, 9, 2], [-0.1, -0.2, -0.3])
    b = _sample([5, 6], [4], [-0.5])
    batch = build_batch([a, b], [1.0, -1.0], pad_id=0, multiple_of=4)
    assert batch.inputs.tolist() == [[5, 6, 7, 8, 9, 2, 0, 0], [5, 6, 4, 0, 0, 0, 0, 0]]
    assert batch.targets.tolist() == [[6, 7, 8, 9, 2, 0, 0, 0], [6, 4, 0, 0, 0, 0, 0, 0]]
    assert batch.mask.tolist() == [[0, 0, 1, 1, 1, 0, 0, 0], [0, 1, 0, 0, 0, 0, 0, 0]]
    torch.testing.assert_close(batch.rollout_logprobs[0, :5], torch.tensor([0, 0, -0.1, -0.2, -0.3]))
    torch.testing.assert_close(batch.rollout_logprobs[1, :2], torch.tensor([0, -0.5]))
    assert batch.lengths.tolist() == [6, 3] and batch.advantages.tolist() == [1.0, -1.0]
    # the masked targets are exactly the response tokens
    assert batch.targets[batch.mask.bool()].tolist() == [8, 9, 2, 4]


def test_context_parallel_shards_by_hand():
    """The one zigzag implementation (cotrain.parallel.zigzag) as the trainer uses it: TrainBatch.zigzag,
    the CP gather's zigzag_merge and the rotary embeddings' split, against chunks cut by hand."""
    import pytest

    from cotrain.models.megatron_compat import pos_emb_on_this_cp_rank
    from cotrain.parallel.zigzag import zigzag_merge

    a = _sample([1, 2, 3], [4, 5, 6, 7, 8], [-0.1] * 5)
    batch = build_batch([a, a], [1.0, -1.0], pad_id=0, multiple_of=8)  # S = 8: 2C = 4 chunks of 2 at C = 2
    row = batch.inputs[0].tolist()
    assert row == [1, 2, 3, 4, 5, 6, 7, 8]
    shards = [batch.zigzag(r, 2) for r in range(2)]
    assert shards[0].inputs[0].tolist() == [1, 2, 7, 8]  # chunks 0 and 3
    assert shards[1].inputs[0].tolist() == [3, 4, 5, 6]  # chunks 1 and 2
    assert shards[1].mask[0].tolist() == batch.mask[0, 2:6].tolist() and shards[0].advantages is batch.advantages
    for cp in (1, 2, 4):
        parts = [batch.zigzag(r, cp).targets for r in range(cp)]
        assert torch.equal(zigzag_merge(parts, dim=1), batch.targets)
    with pytest.raises(ValueError, match="not divisible by 2 x context parallel size 3"):
        batch.zigzag(0, 3)

    class Group:  # a CP process group's size and rank
        def __init__(self, rank):
            self._rank = rank

        def size(self):
            return 2

        def rank(self):
            return self._rank

    emb = torch.arange(8.0).view(8, 1, 1, 1) * torch.ones(8, 1, 1, 3)  # [s, b, 1, dim]
    assert pos_emb_on_this_cp_rank(emb, 0, Group(0))[:, 0, 0, 0].tolist() == [0, 1, 6, 7]
    assert pos_emb_on_this_cp_rank(emb, 0, Group(1))[:, 0, 0, 0].tolist() == [2, 3, 4, 5]


def test_to_moves_every_field():
    """TrainBatch.to puts every field (optional ones included) on the device and keeps the values and
    dtypes: on the meta device (no data) every field must report it, and back on CPU nothing changed."""
    from dataclasses import fields

    a = _sample([5, 6, 7], [8, 9, 2], [-0.1, -0.2, -0.3])
    b = _sample([5, 6], [4], [-0.5])
    batch = build_batch([a, b], [1.0, -1.0], pad_id=0, multiple_of=4)
    batch.old_logprobs = batch.rollout_logprobs - 0.5
    batch.ref_logprobs = batch.rollout_logprobs * 2
    batch.is_weights = batch.mask * 0.5
    names = [f.name for f in fields(batch)]
    assert all(getattr(batch, n) is not None for n in names)  # every field is exercised
    meta = batch.to("meta")
    for n in names:
        assert getattr(meta, n).device.type == "meta", n
        assert getattr(meta, n).dtype == getattr(batch, n).dtype and getattr(meta, n).shape == getattr(batch, n).shape, n
    back = batch.to(torch.device("cpu"))
    for n in names:
        assert torch.equal(getattr(back, n), getattr(batch, n)), n
    # optional fields left unset stay None
    bare = build_batch([a, b], [1.0, -1.0], pad_id=0).to("meta")
    assert bare.old_logprobs is None and bare.ref_logprobs is None and bare.lengths.device.type == "meta"
