"""The co-trained drafter on a two-turn sample (prompt, policy turn, environment reply, policy turn):
the batch the online trainer builds supervises the policy's tokens only, block drafters' anchors are
policy tokens, and every chain (DFlash, DSpark, EAGLE-3) stops at the turn boundary - against
positions listed by hand. A single-turn row beside it keeps the anchors it always had."""

from __future__ import annotations

import torch

from cotrain.draft.online import RolloutRows, to_draft_batch
from cotrain.draft.registry import build_drafter
from cotrain.rl.batch import build_batch
from cotrain.rl.interfaces import Sample

# in-sequence positions: prompt 0-3, turn 1 4-8, reply 9-11, turn 2 12-15
PROMPT, TURN1, REPLY, TURN2 = [5, 6, 7, 8], [20, 21, 22, 23, 2], [30, 31, 32], [24, 25, 26, 2]
POLICY = set(range(4, 9)) | set(range(12, 16))


def draft_batch(drafter):
    two = Sample(0, PROMPT, TURN1 + REPLY + TURN2, [-0.5] * 12, "", "stop", 0,
                 loss_mask=[1] * 5 + [0] * 3 + [1] * 4)
    # (the longest row's last token is no input: the single-turn row is one longer, so that the
    # two-turn row is whole)
    one = Sample(1, [5, 6, 7], list(range(40, 53)) + [2], [-0.5] * 14, "", "stop", 0)
    batch = build_batch([two, one], [1.0, -1.0], pad_id=0)
    rows = RolloutRows(batch.inputs, batch.mask, batch.lengths, torch.arange(2))
    b, S = batch.inputs.shape
    g = torch.Generator().manual_seed(0)
    taps = torch.randn(b * S, drafter.num_taps * drafter.target_arch.hidden_size, generator=g)
    logits = torch.randn(b * S, drafter.target_arch.vocab_size, generator=g)
    db, _ = to_draft_batch(rows, taps, logits)
    return db


def test_supervised_positions_are_the_policy_tokens(target):
    d = build_drafter("dflash", {"block_size": 7, "anchors_per_seq": 64}, target, seed=1)
    db = draft_batch(d)
    assert db.cu_seqlens.tolist() == [0, 16, 32]
    sup = db.loss_mask.nonzero().squeeze(1).tolist()
    assert sup == sorted(POLICY) + [16 + p for p in range(3, 16)]
    assert db.response_start.tolist() == [4, 3]


def test_block_anchors_and_chains_stop_at_the_turn_boundary(target):
    for kind in ("dflash", "dspark"):
        d = build_drafter(kind, {"block_size": 7, "anchors_per_seq": 64}, target, seed=1).eval()
        db = draft_batch(d)
        cand = d.anchor_candidates(db).tolist()
        # the bonus token and the next one are the policy's: not the last turn-1 token (its next is
        # the reply), not the reply's last token (serving samples the first turn-2 token, never drafts it)
        assert cand == [4, 5, 6, 7, 12, 13, 14] + [16 + p for p in range(3, 15)], kind
        # the single-turn row keeps the old rule: p >= response start, p + 1 supervised
        p = torch.arange(16, 32)
        old = [int(x) for x in p[(db.loss_mask[(p + 1).clamp(max=31)]) & (p + 1 < 32) & (p - 16 >= 3)]]
        assert [c for c in cand if c >= 16] == old
        out = d(db, d.build_layout(db, torch.Generator().manual_seed(0)))
        W = out.width
        want = torch.zeros(len(cand), W, dtype=torch.bool)
        for n, a in enumerate(cand):
            for j in range(W):
                seq_end = 16 if a < 16 else 32
                tok = a + 1 + j
                if tok >= seq_end or not bool(db.loss_mask[tok]):
                    break  # the chain ends at the first token that is not the policy's
                want[n, j] = True
        assert out.bonus_pos.tolist() == cand
        assert torch.equal(out.valid.cpu(), want), kind
        assert want[3].tolist() == [True] + [False] * (W - 1)  # anchor 7: token 8 (<eos>), then the reply
        assert bool(db.loss_mask[out.target_rows[out.valid] + 1].all())


def test_eagle3_chains_stop_at_the_turn_boundary(target):
    d = build_drafter("eagle3", {"ttt_steps": 5}, target, seed=1).eval()  # chains longer than the reply
    db = draft_batch(d)
    out = d(db, d.build_layout(db))
    bonus = out.bonus_pos.tolist()
    # chain anchor p: token p + 2 is supervised, bonus x_{p+1} (in turn 2 the reply's last token
    # may be the bonus, as the prompt's last token is in turn 1)
    assert bonus == [3, 4, 5, 6, 7, 11, 12, 13, 14] + [16 + q for q in range(2, 15)]
    valid = {b: out.valid[n].tolist() for n, b in enumerate(bonus)}
    assert valid[6] == [True, True, False, False, False]  # tokens 7, 8, then the reply
    assert valid[7] == [True, False, False, False, False]  # token 8; not 12 after the reply
    assert valid[11] == [True, True, True, True, False]  # tokens 12-15 of turn 2, then the end
    assert valid[14] == [True, False, False, False, False]
    assert bool(db.loss_mask[out.target_rows[out.valid] + 1].all())


def test_turn_of_the_supervised_tokens(target):
    from cotrain.draft.common import turn_of

    d = build_drafter("dflash", {"block_size": 7, "anchors_per_seq": 64}, target, seed=1)
    turn = turn_of(draft_batch(d)).tolist()
    assert turn[:16] == [0] * 4 + [1] * 5 + [0] * 3 + [2] * 4  # prompt, turn 1, reply, turn 2
    assert turn[16:] == [0] * 3 + [1] * 13  # the single-turn row: turn 1 throughout


def test_online_acceptance_per_turn(target):
    """The online trainer's acceptance_offline_turn<t> against the chains recomputed by hand on the
    same layout, split by the hand-listed turn of each chain's first draft; a single-turn step
    reports no per-turn key."""
    from cotrain.config.schema import DraftConfig
    from cotrain.draft.acceptance import accept_lengths
    from cotrain.draft.online import OnlineDraftTrainer

    cfg = DraftConfig.model_validate({"kind": "dflash", "loss": "soft_ce",
                                      "dflash": {"block_size": 4, "anchors_per_seq": 64}})
    d = build_drafter("dflash", cfg.settings, target, seed=0)
    trainer = OnlineDraftTrainer(d, cfg, total_steps=10, seed=7)
    two = Sample(0, PROMPT, TURN1 + REPLY + TURN2, [-0.5] * 12, "", "stop", 0, loss_mask=[1] * 5 + [0] * 3 + [1] * 4)
    one = Sample(1, [5, 6, 7], list(range(40, 53)) + [2], [-0.5] * 14, "", "stop", 0)
    batch = build_batch([two, one], [1.0, -1.0], pad_id=0)
    rows = RolloutRows(batch.inputs, batch.mask, batch.lengths, torch.arange(2))
    b, S = batch.inputs.shape
    g = torch.Generator().manual_seed(0)
    taps = torch.randn(b * S, d.num_taps * target.arch.hidden_size, generator=g)
    logits = torch.randn(b * S, target.arch.vocab_size, generator=g)
    db, tl = to_draft_batch(rows, taps, logits)
    layout = trainer._layout_for(db, rows.seq_ids, 1)
    with torch.no_grad():
        out = d.eval()(db, layout)
        drafted = out.logits.argmax(-1)
        for n, a in enumerate(out.bonus_pos.tolist()):  # make the policy agree with turn 2's chains
            if a >= 12 and a < 16:
                for j in range(out.width):
                    if bool(out.valid[n, j]):
                        logits[int(out.target_rows[n, j])] = -10.0
                        logits[int(out.target_rows[n, j]), int(drafted[n, j])] = 10.0
                break
        db, tl = to_draft_batch(rows, taps, logits)
        best = tl.argmax(-1)[out.target_rows.clamp(min=0)]
        lens = accept_lengths((drafted == best) & out.valid, trainer.k)
    first = out.valid[:, 0]
    turn_of_first = [1 if (a + 1) in range(4, 9) or a >= 16 else 2 for a in out.bonus_pos.tolist()]
    want = {t: lens[first & (torch.tensor(turn_of_first) == t)].double().mean().item() for t in (1, 2)}
    trainer.begin_step(1)
    trainer.microbatch(rows, taps, logits)
    m = trainer.end_step()
    assert set(k for k in m if "_turn" in k) == {"acceptance_offline_turn1", "acceptance_offline_turn2"}
    assert abs(m["acceptance_offline_turn1"] - want[1]) < 1e-12 and abs(m["acceptance_offline_turn2"] - want[2]) < 1e-12
    assert want[2] > want[1]
    assert abs(m["acceptance_offline"] - lens[first].double().mean().item()) < 1e-12
    # single-turn rows: no per-turn keys
    trainer.begin_step(2)
    single = build_batch([one, one], [1.0, -1.0], pad_id=0)
    r1 = RolloutRows(single.inputs, single.mask, single.lengths, torch.arange(2))
    n1 = single.inputs.numel()
    trainer.microbatch(r1, taps[:n1], logits[:n1])
    assert not any("_turn" in k for k in trainer.end_step())
