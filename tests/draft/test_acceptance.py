"""The offline acceptance estimator on hand-made drafters and sequences."""

import pytest
import torch

from cotrain.draft.acceptance import accept_lengths, estimate_acceptance
from cotrain.draft.common import DraftBatch, DraftOutput, chain_rows

V, EOS = 16, 1


class StubDrafter:
    """Proposes the data's next tokens at every response bonus position, except at (bonus, j) in
    ``wrong`` (in-sequence positions), where it proposes token 15."""

    def __init__(self, width, wrong=()):
        self.draft_width = width
        self.wrong = set(wrong)
        self.training = False

    def eval(self):
        return self

    def train(self, mode=True):
        return self

    def build_layout(self, batch):
        return None

    def __call__(self, batch, layout):
        p = torch.arange(batch.num_tokens)
        bonus = p[batch.positions >= batch.response_start[batch.seq_of]]
        rows, valid = chain_rows(bonus, self.draft_width, batch)
        toks = batch.input_ids[(rows + 1).clamp(0, batch.num_tokens - 1)]
        for n, b in enumerate(bonus.tolist()):
            for j in range(self.draft_width):
                if (int(batch.positions[b]), j) in self.wrong:
                    toks[n, j] = 15
        logits = torch.nn.functional.one_hot(toks, V).float() * 10
        return DraftOutput(logits=logits, bonus_pos=bonus, target_rows=rows, valid=valid)


def make_batch(seqs, prompt_lens):
    ids = torch.tensor([t for s in seqs for t in s])
    lens = torch.tensor([len(s) for s in seqs])
    cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)])
    pos = torch.cat([torch.arange(n) for n in lens.tolist()])
    start = torch.repeat_interleave(torch.tensor(prompt_lens), lens)
    nxt = torch.cat([ids[1:], ids[:1]])  # the target's greedy token at row r is the data's token r+1
    logits = torch.nn.functional.one_hot(nxt, V).float()
    return DraftBatch(ids, cu, torch.zeros(len(ids), 4), pos >= start, logits, torch.tensor(prompt_lens))


# prompt 5 6 7 | response 10 11 12 13 <eos> | target greedy after EOS: <eos> <eos> <eos>
SEQ = [5, 6, 7, 10, 11, 12, 13, EOS, EOS, EOS, EOS]


def test_walk_and_means_by_hand():
    batch = make_batch([SEQ], [3])
    rep = estimate_acceptance(StubDrafter(3, wrong={(3, 1)}), batch, eos_token_id=EOS)
    # round 1 at bonus 3 (token 10): 11 accepted, 12 rejected -> L = 2, bonus moves to 5 (token 12)
    # round 2 at bonus 5: 13, <eos>, <eos> accepted (drafts past EOS count, as in vLLM) -> L = 4, EOS emitted
    assert (rep.rounds, rep.accepted, rep.histogram) == (2, 4, [0, 1, 0, 1])
    assert rep.walk_len == pytest.approx(3.0)
    # every response bonus position 3..9: lengths 2, 4, 4, 4, 4, 3 (data ends), 2 (data ends)
    assert rep.num_chains == 7 and rep.mean_len == pytest.approx(23 / 7)
    assert rep.per_position == pytest.approx([1.0, 5 / 6, 4 / 5])
    # k = 1: each round accepts its draft and adds the bonus: 10 -> (11, 12) -> (13, <eos>)
    rep1 = estimate_acceptance(StubDrafter(3, wrong={(3, 1)}), batch, k=1, eos_token_id=EOS)
    assert (rep1.rounds, rep1.accepted, rep1.walk_len) == (2, 2, pytest.approx(2.0))


def test_walk_stops_at_eos_and_data_end():
    seqs = [[5, 6, EOS, EOS, EOS], [5, 6, 10, 11, 12]]  # EOS first; a response cut by the data
    batch = make_batch(seqs, [2, 2])
    rep = estimate_acceptance(StubDrafter(2), batch, eos_token_id=EOS)
    # seq 0: the first response token is EOS -> no round. seq 1: bonus 2 drafts 11, 12 -> L = 3, data ends
    assert (rep.rounds, rep.accepted) == (1, 2)
    rep = estimate_acceptance(StubDrafter(2, wrong={(2, 0)}), batch, eos_token_id=EOS)
    # seq 1: bonus 2 rejects its first draft (L = 1), bonus 3 drafts 12 (L = 2, the data ends)
    assert (rep.rounds, rep.accepted, rep.walk_len) == (2, 1, pytest.approx(1.5))


def test_accept_lengths_and_errors():
    m = torch.tensor([[True, True, False, True], [False, True, True, True], [True, True, True, True]])
    assert accept_lengths(m, 4).tolist() == [3, 1, 5]
    assert accept_lengths(m, 2).tolist() == [3, 1, 3]
    batch = make_batch([SEQ], [3])
    with pytest.raises(ValueError, match="exceeds"):
        estimate_acceptance(StubDrafter(2), batch, k=3)
    batch.target_logits = None
    with pytest.raises(ValueError, match="target_logits"):
        estimate_acceptance(StubDrafter(2), batch)


def _simulated_walk(batch, survival_at, k, gen, draws):
    """The serving walk with each round's accepted count drawn from its survival (Monte Carlo)."""
    from cotrain.draft.acceptance import _walk

    rounds = accepted = 0
    at_least = [0] * k
    for _ in range(draws):
        accept_at = {}
        for b, S in survival_at.items():  # one draw per round start: P(>= j) = S_j
            u = float(torch.rand((), generator=gen))
            accept_at[b] = 1 + sum(1 for s in S if u < s)
        r, a, hist = _walk(batch, accept_at, EOS, k)
        rounds, accepted = rounds + r, accepted + a
        for j in range(1, k + 1):
            at_least[j - 1] += sum(hist[j:])
    return 1 + accepted / rounds, [x / rounds for x in at_least]


def test_expected_walk_is_the_walk_in_expectation():
    """expected_walk (T = 1 on sampled responses): 0/1 survivals give _walk's walk exactly; random
    ones give the mean of the simulated walk (EOS inside a round and the data's end stop it)."""
    from cotrain.draft.acceptance import _walk, expected_walk

    seqs = [SEQ, [5, 6, 10, 11, 12, 13, 14, 10, 11, EOS, EOS], [5, 6, 10, 11, 12, 13, 14, 12]]
    batch = make_batch(seqs, [3, 2, 2])
    k = 3
    starts = [b for b in range(batch.num_tokens) if bool(batch.loss_mask[b]) and int(batch.input_ids[b]) != EOS]
    gen = torch.Generator().manual_seed(0)
    for _ in range(5):  # deterministic acceptance: the exact walk
        accept_at = {b: 1 + int(torch.randint(0, k + 1, (), generator=gen)) for b in starts}
        r, a, hist = _walk(batch, accept_at, EOS, k)
        e = expected_walk(batch, {b: [1.0 if L - 1 >= j else 0.0 for j in range(1, k + 1)]
                                  for b, L in accept_at.items()}, EOS, k)
        assert (e["rounds"], e["accepted"]) == (r, a)
        assert e["survival"] == pytest.approx([sum(hist[j:]) / r for j in range(1, k + 1)])
    survival_at = {}
    for b in starts:  # random non-increasing survivals, some rounds certain to stop at 0
        s = torch.sort(torch.rand(k, generator=gen), descending=True).values
        survival_at[b] = (s * (0.0 if b % 5 == 0 else 1.0)).tolist()
    e = expected_walk(batch, survival_at, EOS, k)
    length, surv = _simulated_walk(batch, survival_at, k, gen, draws=4000)
    assert e["acceptance_len"] == pytest.approx(length, abs=0.02)
    assert e["survival"] == pytest.approx(surv, abs=0.02)
    assert e["acceptance_len"] != pytest.approx(1 + sum(sum(s) for s in survival_at.values()) / len(starts), abs=0.02)
