"""The co-trained drafter's compact logits handoff inside the Megatron trainer, for
tests/rl/test_trainer_handoff.py: one :class:`~cotrain.rl.trainer.MegatronPolicyWorker` in this process
(world size 1), a DFlash or EAGLE-3 drafter (``--kind``) under the fixed budget (so the compact handoff
is on), the built tiny model, a fixed rollout batch.

For each layout (packed rows whole, packed rows in log-prob chunks of 8 positions, padded rows in
chunks) the drafter's step is taken twice from the same state: with the compact handoff (only the rows
its chains read cross, OnlineDraftTrainer.logit_rows) and with it turned off (the whole logits of every
micro batch), the drafter's state restored in between; then a measure-only step the same way. Records
the draft metrics, the drafter's weights, the policy's log-probs and the rows handed over per micro
batch (``torch.save`` of a dict to ``--out``).

    python tests/rl/_handoff_run.py --model-dir D --out R.pt [--kind eagle3]
"""

from __future__ import annotations

import argparse
import copy
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests" / "rl"))

LAYOUTS = {"packed": {"packing": True, "logprob_chunk_tokens": 0},
           "packed_chunks": {"packing": True, "logprob_chunk_tokens": 8},
           "padded_chunks": {"packing": False, "logprob_chunk_tokens": 8}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model-dir", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--kind", default="dflash", choices=("dflash", "eagle3"))
    args = ap.parse_args(argv)
    import torch

    from _trainer_utils import fake_rollout_batch
    from cotrain.config import load_config
    from cotrain.distributed import find_free_port
    from cotrain.rl.trainer import MegatronPolicyWorker

    torch.set_num_threads(1)
    cfg = load_config(ROOT / "configs/grpo.yaml", [
        "policy.micro_batch_size=4", "grpo.prompts_per_step=4", "policy.reference_model=false",
        "rollout.speculative.method=null", f"draft.kind={args.kind}", "draft.cotrain=true",
        *(["draft.dflash.block_size=4", "draft.dflash.anchors_per_seq=2"] if args.kind == "dflash"
          else ["draft.eagle3.ttt_steps=3"]), "draft.optimizer.lr=0.05", "draft.budget.mode=fixed",
        "policy.max_seq_len=32", "policy.max_tokens_per_microbatch=64", "run.output_dir=" + str(Path(args.out).parent / "run")])
    worker = MegatronPolicyWorker(cfg, args.model_dir, 0, 1, "127.0.0.1", find_free_port())
    stage, trainer = worker.draft, worker.draft.trainer
    handed: list = []
    after_logits = stage.after_logits

    def spy(i, rows, logits, logit_rows=None):
        handed.append((int(logits.reshape(-1, logits.shape[-1]).shape[0]), int(rows.lengths.sum()),
                       logit_rows is not None))
        return after_logits(i, rows, logits, logit_rows=logit_rows)

    stage.after_logits = spy
    batch = fake_rollout_batch()
    out: dict = {}
    step = 0
    for name, policy in LAYOUTS.items():
        for key, value in policy.items():
            setattr(worker.cfg.policy, key, value)
        for updates in (1, 0):  # a training step, then a measure-only one
            step += 1
            state = copy.deepcopy(trainer.state_dict())
            runs = {"before": {n: p.detach().clone() for n, p in trainer.drafter.named_parameters()}}
            for arm in ("compact", "whole"):
                trainer.load_state_dict(copy.deepcopy(state))
                if arm == "whole":
                    trainer.logit_rows = lambda rows: None
                handed.clear()
                lp = worker.logprobs(batch, draft_step=step, draft_updates=updates)
                trainer.__dict__.pop("logit_rows", None)
                runs[arm] = {"metrics": lp["draft_metrics"], "logprobs": lp["logprobs"], "handed": list(handed),
                             "weights": {n: p.detach().clone() for n, p in trainer.drafter.named_parameters()}}
            out[f"{name}/{'train' if updates else 'measure'}"] = runs
    torch.save(out, args.out)


if __name__ == "__main__":
    main()
