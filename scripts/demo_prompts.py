"""The demo's prompts, in the order configs/demo.yaml trains on them (data.shuffle: false, 16 a step):

    python scripts/demo_prompts.py           # writes configs/data/demo_prompts.jsonl and demo_eval.jsonl
    python scripts/demo_prompts.py --check   # exit 1 if the committed files are not what it writes

A two-phase curriculum of the built-in arithmetic task (cotrain.tasks.data.arithmetic_dataset, one
seed per phase), one JSON object ``{"prompt": "<a><op><b>=", "answer": "<a op b>"}`` a line:

    steps  1-20  prompts   1-320  operands of 1-2 digits, '+' only: the distribution the tiny model
                                  was warm-started on and the demo's drafter was distilled on
                                  (configs/distill_dflash.yaml); nothing for co-training to follow
    steps 21-60  prompts 321-960  operands of 1-2 digits, '+' or '-' (evenly drawn): subtraction,
                                  which the tiny model was never taught; its responses to it
                                  (and so the drafter's targets) move away from what was distilled

Held-out evaluation (demo_eval.jsonl): 256 distinct problems of the second phase's distribution
whose prompts are not training prompts (cotrain.tasks.data.heldout_arithmetic).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TRAIN, EVAL = ROOT / "configs/data/demo_prompts.jsonl", ROOT / "configs/data/demo_eval.jsonl"

#: (prompts, max digits per operand, operators, seed) per phase, in training order
PHASES = [(320, 2, ("+",), 0), (640, 2, ("+", "-"), 1)]
EVAL_PROMPTS, EVAL_SEED = 256, 7919


def problems():
    """(training problems in order, evaluation problems)."""
    sys.path.insert(0, str(ROOT))
    from cotrain.tasks.data import arithmetic_dataset, heldout_arithmetic

    train = [p for n, digits, ops, seed in PHASES for p in arithmetic_dataset(n, seed=seed, max_digits=digits, ops=ops)]
    _, digits, ops, _ = PHASES[-1]
    return train, heldout_arithmetic(train, EVAL_PROMPTS, seed=EVAL_SEED, max_digits=digits, ops=ops)


def jsonl(problems) -> str:
    return "".join(json.dumps({"prompt": p.prompt, "answer": p.answer}) + "\n" for p in problems)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    args = ap.parse_args(argv)
    train, evals = problems()
    stale = []
    for path, text in ((TRAIN, jsonl(train)), (EVAL, jsonl(evals))):
        if args.check:
            if not path.exists() or path.read_text() != text:
                stale.append(str(path.relative_to(ROOT)))
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            print(f"{path.relative_to(ROOT)}: {text.count(chr(10))} problems")
    if stale:
        print(f"not what scripts/demo_prompts.py writes: {', '.join(stale)} (run it without --check)", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
