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
