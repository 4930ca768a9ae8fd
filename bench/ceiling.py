"""The ceiling: on one GRPO trajectory, the co-trained drafter and its frozen copy against a drafter distilled fresh from the policy of that step.

One GRPO run (``--config``, default configs/demo.yaml; trailing ``key=value`` overrides) with a
co-trained drafter and ``draft.compare_frozen`` on, run in this process step by step. Every
``--every`` steps the benchmark takes a *point* s (s = 1, 1 + E, 1 + 2E, ... <= N = grpo.num_steps,
E = ``--every``); at point s:

    policy    theta_{s-1}, the policy after s - 1 updates: the one that sampled step s's rollouts.
              The run checkpoints every E steps and step s - 1's checkpoint is exported as a Hugging
              Face policy and the co-trained drafter (cotrain.export.export_checkpoint, what
              ``python -m cotrain.export`` runs); s = 1: the base model (policy.model_path).
    chains    step s's own rollout rows: the TrainBatch the loop's log-prob recomputation received.
    drafters  co-trained  d_{s-1}, the export's drafter/ (what the engines served at step s);
              frozen      the run's drafter_init/ (draft.init as the trainer built it);
              ceiling     distilled fresh, offline, from theta_{s-1} with draft.init's recipe and
                          budget: the ``distill:<yaml>`` of draft.init with ``target`` = the export's
                          policy/. Kinds (``--ceilings``, the first the goals'): ``recipe`` = that
                          recipe as it is (its own prompts); ``run`` = the same with its prompts
                          replaced by the run's own prompts of steps s - R .. s + R (R =
                          ``--prompt-radius``; each once, none of step s's own: those are the test
                          set; an eighth held out for the distillation's own evaluation): where the run's prompts move away from the recipe's, the
                          recipe ceiling is distilled on a distribution the run no longer samples.
                          ``--ceiling-seeds`` n distils each kind n times (train.seed, + 1, ...): the
                          ceiling is their mean, their range its noise. ``--distill key=value``
                          changes every ceiling's recipe (smoke tests only).
    score     each drafter's offline greedy acceptance on the same chains, as the loop measures it
              (cotrain.draft.online.OnlineDraftTrainer's ``acceptance_offline``: 1 + leading drafts
              equal to the policy's greedy token, over the first k = the served number of draft
              tokens; the anchors seeded by (run.seed, step s, the row), so the same chains for all
              three), its taps and logits from theta_{s-1} in transformers (compute_taps; logits at
              the sampling temperature, filtered like the trainer's). Each drafter sits in an
              OnlineDraftTrainer at lr 1e-30 fed the step's rows in micro batches of
              policy.micro_batch_size; the acceptance is read before its (discarded) update.

Checks recorded in the JSON: the co-trained and frozen scores are the loop's own
``draft/acceptance_offline`` / ``_frozen`` at step s (Megatron's forward there, transformers'
here; ``loop_check``: the largest difference); at s = 1 the ceiling is a second distillation of the
base model by draft.init's recipe (``recipe_check``: its largest weight difference from draft.init
and its acceptance beside the frozen copy's; s = 1 belongs to no third).

Per third of the run (cotrain.rl.thirds.parts over steps 1..N: sizes as equal as possible; the
points s > 1 in each), over the points' mean acceptances A:

    recovery         = (A_cotrained - A_frozen) / (A_ceiling - A_frozen)
    cotrained share  = A_cotrained / A_ceiling        the goal: >= 0.95 in every third
    frozen share     = A_frozen / A_ceiling           the goal: <= 0.90 in the last third

with the per-point ratios as median [min, max], and the drafter's share of the update over the
third's steps (sum of time/draft / sum of time/update over all its steps, a step without a drafter
step counting 0 s; the loop's metrics: a time, one run on a shared machine, indicative only).

Arms (``--arms``): ``fixed`` (draft.budget.mode=fixed: one drafter step per GRPO step) and
``adaptive`` (draft.budget.mode=adaptive, cotrain.draft.budget). Each arm is its own trajectory
(speculative sampling keeps the policy's distribution, not its draws: a different drafter serves
different rollouts) with its own ceilings; the arms' steps are interleaved (step t of every arm
before step t + 1 of any, the order rotated every step) so that the machine's load falls on both
alike; their points are identical at s = 1 (the same policy, drafter and seeds), which is scored
and distilled once.

    python bench/ceiling.py                                    # configs/demo.yaml, every 5 steps, fixed
    python bench/ceiling.py --arms fixed,adaptive --ceilings recipe,run --out bench/results/ceiling.json \
        --png docs/img/ceiling.png
    python bench/ceiling.py --report bench/results/ceiling.json --markdown   # the tables, PNG redrawn
    python bench/ceiling.py --quick --workdir /tmp/c --out /tmp/c/ceiling.json   # smoke test (~1 min)

Outputs: the JSON (``--out``; no absolute paths), a PNG beside it (and at ``--png``): the three
drafters' acceptance at every point on the trajectory (the loop's per-step co-trained and frozen
curves beside), their shares of the ceiling with the goals' lines, the policy's drift (KL to the
initial policy, reward) and the drafter's share of the update per third. ``<out>.partial.json``
keeps the points scored so far. Work files (checkpoints, exports, distillations) in ``--workdir``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

ARMS = {"fixed": ["draft.budget.mode=fixed"], "adaptive": ["draft.budget.mode=adaptive"]}
#: the loop's per-step metrics kept in the JSON
KEEP = ("time/step", "time/rollout", "time/update", "time/draft", "time/weight_push", "reward/mean", "kl/ref",
        "response/length", "spec/acceptance_length", "draft/acceptance_offline", "draft/acceptance_offline_frozen",
        "draft/loss", "draft/kl", "draft/updates", "train/skipped")
DRAFTERS = ("ceiling", "cotrained", "frozen")
GOAL_COTRAINED, GOAL_FROZEN = 0.95, 0.90
QUICK = {"config": "configs/demo.yaml", "steps": 3, "every": 1,
         "overrides": ["grpo.prompts_per_step=4", "grpo.group_size=4", "policy.micro_batch_size=8"],
         "distill": ["train.steps=3", "train.batch_size=8", "train.eval_every=0", "data.num_prompts=16",
                     "data.eval_prompts=4"]}


# ------------------------------------------------------------------------------------------ points
def point_steps(num_steps: int, every: int) -> list[int]:
    """The rollout steps s scored: 1, 1 + every, ... up to num_steps (the policy after s - 1 updates)."""
    if every < 1:
        raise ValueError(f"--every {every}: must be >= 1")
    return list(range(1, num_steps + 1, every))


def distill_recipe(cfg) -> str:
    """The distillation yaml of ``draft.init: distill:<yaml>`` (the recipe every ceiling repeats)."""
    init = cfg.draft.init
    if not (isinstance(init, str) and init.startswith("distill:")):
        raise ValueError(f"draft.init: {init!r}; the ceiling repeats draft.init's distillation, so it needs "
                         "draft.init: distill:<yaml> (a distillation recipe), not a drafter directory or null")
    return init[len("distill:"):]


# ------------------------------------------------------------------------------------------ phase 1: the run(s)
def _record(run, box: dict, wanted: set[int]) -> None:
    """Keep the TrainBatch rows (inputs, mask, lengths) the log-prob recomputation gets at the steps
    in ``wanted``, and every step's prompts as the engines got them (``box["step"]`` is the step
    running); the calls themselves are unchanged."""
    logprobs, generate = run.trainer.logprobs, run.rollout.generate

    def recording_logprobs(batch, *a, **kw):
        if box["step"] in wanted:
            box["chains"][box["step"]] = {"inputs": batch.inputs.clone(), "mask": batch.mask.clone(),
                                          "lengths": batch.lengths.clone()}
        return logprobs(batch, *a, **kw)

    def recording_generate(prompts, *a, **kw):
        box["prompts"].setdefault(box["step"], []).extend(prompts)
        return generate(prompts, *a, **kw)

    run.trainer.logprobs, run.rollout.generate = recording_logprobs, recording_generate


def run_arms(args, arms: list[str], workdir: Path) -> dict:
    """Phase 1: every arm's GRPO run, steps interleaved; the chains of every point, and the export of
    every checkpoint a point needs. Returns {arm: {cfg, steps, chains, exports, drafter_init, ...}}."""
    import ray
    from tqdm import tqdm

    from cotrain.config import load_config
    from cotrain.export import export_checkpoint
    from cotrain.rl.driver import GrpoRun

    state: dict[str, dict] = {}
    runs: dict[str, GrpoRun] = {}
    try:
        for arm in arms:
            d = workdir / arm
            ov = [f"run.output_dir={d / 'run'}", "run.overwrite=true", f"run.name=ceiling_{arm}",
                  "draft.compare_frozen=true", "logging.progress_bar=false", "logging.tensorboard=false",
                  f"checkpoint.every={args.every}", "data.eval.every=0", "cluster.cpus_per_node=64",
                  *([f"grpo.num_steps={args.steps}"] if args.steps else []), *ARMS[arm], *args.overrides]
            cfg = load_config(args.config, ov)
            distill_recipe(cfg)  # refuse before any worker starts
            if not (cfg.draft.kind and cfg.draft.cotrain):
                raise ValueError(f"{args.config}: draft.kind={cfg.draft.kind} draft.cotrain={cfg.draft.cotrain}: "
                                 "the ceiling needs a co-trained drafter")
            points = point_steps(cfg.grpo.num_steps, args.every)
            print(f"[setup] {arm}: {cfg.grpo.num_steps} steps, points at steps {points}", flush=True)
            runs[arm] = GrpoRun(cfg)
            runs[arm].setup(resume=False)
            box = {"step": None, "chains": {}, "prompts": {}}
            _record(runs[arm], box, set(points))
            state[arm] = {"cfg": cfg, "dir": d, "points": points, "box": box, "steps": [], "exports": {},
                          "export_s": {}, "drafter_init": d / "run" / "drafter_init"}
        n = max(s["cfg"].grpo.num_steps for s in state.values())
        names = list(state)
        origin = time.perf_counter()
        bar = tqdm(range(1, n + 1), desc="GRPO (" + ", ".join(names) + ")", dynamic_ncols=True,
                   disable=args.no_progress)
        for step in bar:
            order = names[step % len(names):] + names[: step % len(names)]
            for arm in order:
                st, run = state[arm], runs[arm]
                if step > st["cfg"].grpo.num_steps:
                    continue
                st["box"]["step"] = step
                t0 = time.perf_counter()
                m = run.step(step)
                m["time/step"] = time.perf_counter() - t0
                run.logger.log(step, m)
                st["steps"].append({"step": step, **{k: float(m[k]) for k in KEEP if k in m}})
                if step + 1 in st["points"]:  # the policy that samples step + 1: checkpoint and export it
                    run.save_checkpoint(step)
                    t1 = time.perf_counter()
                    out = st["dir"] / "points" / f"step_{step + 1:06d}" / "export"
                    export_checkpoint(run.ckpt.step_dir(step), out)
                    st["exports"][step + 1], st["export_s"][step + 1] = out, time.perf_counter() - t1
            bar.set_postfix({a: f"{state[a]['steps'][-1].get('draft/acceptance_offline', float('nan')):.2f}"
                             for a in names if state[a]["steps"]})
        for st in state.values():
            st["run_s"] = time.perf_counter() - origin
    finally:
        for r in runs.values():
            r.shutdown()
        ray.shutdown()
    for arm, st in state.items():
        missing = sorted(set(st["points"]) - set(st["box"]["chains"]))
        if missing:
            raise RuntimeError(f"arm {arm}: no log-prob batch was recorded at steps {missing}")
    return state


# ------------------------------------------------------------------------------------------ phase 2: ceilings, scores
def distill_ceiling(recipe: str, policy_dir: Path, out_dir: Path, overrides: list[str]) -> dict:
    """A drafter distilled from ``policy_dir`` by ``recipe`` (its target replaced) into ``out_dir``;
    the distillation's summary (cotrain.draft.distill)."""
    from cotrain.config.distill import load_distill_config
    from cotrain.draft.distill import distill

    cfg = load_distill_config(ROOT / recipe if not Path(recipe).is_absolute() else recipe,
                              [*overrides, f"target={policy_dir}", f"output_dir={out_dir}", "progress_bar=false"])
    return distill(cfg)


def _tempered(logits, sampling):
    """The policy's logits as the trainer hands them to the drafter: at the sampling temperature,
    top-k / top-p filtered (the rest at -inf) when the engines filter."""
    from cotrain.rl.sampling_filter import filter_active, keep_mask

    logits = logits.float() / (sampling.temperature or 1.0)
    if filter_active(sampling.temperature, sampling.top_k, sampling.top_p):
        logits = logits.masked_fill(~keep_mask(logits, sampling.top_k, sampling.top_p), float("-inf"))
    return logits


def score(cfg, step: int, policy_dir: Path, drafter_dirs: dict[str, Path], chains: dict) -> dict[str, float]:
    """{drafter: offline greedy acceptance} on step ``step``'s rows ``chains``, the policy at
    ``policy_dir`` (see the module doc)."""
    import torch

    from cotrain.config.schema import DraftConfig
    from cotrain.draft.export import load_drafter
    from cotrain.draft.online import OnlineDraftTrainer, RolloutRows
    from cotrain.draft.taps import TargetSpec, compute_taps, load_hf_target

    target = TargetSpec.from_checkpoint(policy_dir)
    model = load_hf_target(policy_dir)
    drafters = {name: load_drafter(d, target) for name, d in drafter_dirs.items()}
    shapes = {n: (d.kind, tuple(d.tap_layers), getattr(d.cfg, "block_size", None), getattr(d.cfg, "anchors_per_seq", None))
              for n, d in drafters.items()}
    if len(set(shapes.values())) != 1:
        raise ValueError(f"step {step}: the drafters differ in (kind, tap layers, block size, anchors per sequence) "
                         f"{shapes}; they must score the same chains")
    inputs, mask, lengths = chains["inputs"], chains["mask"], chains["lengths"].to(torch.int64)
    spec = cfg.rollout.speculative
    first = next(iter(drafters.values()))
    k = spec.num_speculative_tokens if spec.method == first.vllm_method else None
    # the drafter inside an optimizer that cannot move it; its acceptance is read before the update anyway
    d = cfg.draft.model_dump(mode="json")
    d.update(compare_frozen=False, budget={"mode": "fixed"},
             optimizer={**d["optimizer"], "lr": 1e-30, "min_lr": 0.0, "warmup_steps": 0, "schedule": "constant"})
    draft_cfg = DraftConfig.model_validate(d)
    trainers = {n: OnlineDraftTrainer(dr, draft_cfg, total_steps=cfg.grpo.num_steps, seed=cfg.run.seed, k=k,
                                      eos_token_id=target.eos_token_id) for n, dr in drafters.items()}
    for t in trainers.values():
        t.begin_step(step, embed=target.embed, lm_head=target.lm_head)
    mbs = cfg.policy.micro_batch_size
    for a in range(0, len(lengths), mbs):
        rows = slice(a, a + mbs)
        lens = lengths[rows]
        ids = torch.cat([inputs[r, : int(n)] for r, n in zip(range(a, a + len(lens)), lens)])
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lens, 0)])
        taps, logits = compute_taps(model, ids, cu, first.tap_layers)
        rr = RolloutRows(inputs[rows], mask[rows], lens, torch.arange(a, a + len(lens)), widths=lens)
        logits = _tempered(logits, cfg.rollout.sampling)
        for t in trainers.values():
            t.microbatch(rr, taps, logits)
    return {n: float(t.end_step()["acceptance_offline"]) for n, t in trainers.items()}


def weight_diff(a: Path, b: Path) -> float:
    """Largest absolute difference between two drafter exports' tensors (the same names required)."""
    from cotrain.draft.export import read_export

    ta, tb = read_export(a)[2], read_export(b)[2]
    if set(ta) != set(tb):
        raise ValueError(f"{a} and {b} hold different tensors: {sorted(set(ta) ^ set(tb))}")
    return max(float((ta[n].double() - tb[n].double()).abs().max()) for n in ta if ta[n].is_floating_point())


def run_prompts(prompts_by_step: dict[int, list[str]], s: int, radius: int) -> list[str]:
    """The run's own prompts around step ``s``: those of steps s - radius .. s + radius but none of
    step s's own (its chains are the test set), in order, each once (the ``run`` ceiling's
    distillation prompts)."""
    seen = set(prompts_by_step.get(s, []))
    out = []
    for step in range(s - radius, s + radius + 1):
        for p in prompts_by_step.get(step, []):
            if p not in seen:
                seen.add(p)
                out.append(p)
    return out


def ceiling_overrides(kind: str, recipe_cfg, prompts: list[str], pdir: Path) -> list[str]:
    """The distillation overrides of a ceiling kind: ``recipe`` none (draft.init's recipe as it is);
    ``run``: its prompts replaced by the run's own around the step (a JSONL beside the point), an
    eighth of them (at most the recipe's eval_prompts) held out for its own evaluation."""
    if kind == "recipe":
        return []
    n = len(prompts)
    if n < 8:
        raise ValueError(f"the run ceiling at {pdir.name}: only {n} distinct prompts around the step "
                         "(allowed: >= 8; raise --prompt-radius)")
    n_eval = max(1, min(recipe_cfg.data.eval_prompts, n // 8))
    path = pdir / "ceiling_prompts.jsonl"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return ["data.task=jsonl", f"data.jsonl_path={path}", "data.prompt_key=prompt", f"data.num_prompts={n - n_eval}",
            f"data.eval_prompts={n_eval}"]


def ceiling_point(args, cfg, recipe: str, s: int, policy: Path, cotrained: Path, frozen: Path, chains: dict,
                  prompts_by_step: dict, pdir: Path) -> dict:
    """One point: each ceiling kind (``--ceilings``) distilled ``--ceiling-seeds`` times (the
    recipe's train.seed, then train.seed + 1, ...; its acceptance is their mean), and every drafter
    scored on the step's chains."""
    from cotrain.config.distill import load_distill_config

    t0 = time.perf_counter()
    recipe_cfg = load_distill_config(ROOT / recipe, list(args.distill))
    seed0 = recipe_cfg.train.seed
    prompts = run_prompts(prompts_by_step, s, args.prompt_radius)
    dirs, info = {}, {}
    for kind in args.ceilings:
        extra = ceiling_overrides(kind, recipe_cfg, prompts, pdir)
        info[kind] = {"train_seed": [], "acceptance_own_eval": [], "final_loss": [], "seconds": []}
        if kind == "run":
            info[kind]["prompts"] = len(prompts)
        for i in range(args.ceiling_seeds):
            out = pdir / (f"ceiling_{kind}" + (f"_seed{seed0 + i}" if i else ""))
            sm = distill_ceiling(recipe, policy, out, [*args.distill, *extra, *([f"train.seed={seed0 + i}"] if i else [])])
            dirs[f"{kind}/{i}"] = out / "drafter"
            for key, v in (("train_seed", seed0 + i), ("acceptance_own_eval", sm["acceptance_walk_len"]),
                           ("final_loss", sm["final_loss"]), ("seconds", sm["total_s"])):
                info[kind][key].append(v)
            info[kind]["k_own_eval"], info[kind]["steps"] = sm["k"], sm["steps"]
    t1 = time.perf_counter()
    acc = score(cfg, s, policy, {**dirs, "cotrained": cotrained, "frozen": frozen}, chains)
    ceilings = {}
    for kind in args.ceilings:
        seeds = [acc.pop(f"{kind}/{i}") for i in range(args.ceiling_seeds)]
        ceilings[kind] = {"acceptance": statistics.fmean(seeds), "seeds": seeds, "distill": info[kind]}
    rec = {"step": s, "policy_updates": s - 1, "ceiling": ceilings[args.ceilings[0]]["acceptance"], **acc,
           "ceilings": ceilings, "distill_s": t1 - t0, "score_s": time.perf_counter() - t1}
    if s == 1:  # the base policy: draft.init's recipe again must give draft.init
        rec["recipe_check"] = {"max_abs_weight_diff_vs_draft_init": weight_diff(
            dirs["recipe/0"] if "recipe" in args.ceilings else dirs[f"{args.ceilings[0]}/0"], frozen)}
    return rec


def score_arms(args, state: dict, result: dict, out: Path) -> None:
    """Phase 2: every point's ceiling distilled and the three drafters scored; ``result["arms"]``
    filled point by point (``<out>.partial.json`` after each)."""
    import torch
    from tqdm import tqdm

    from cotrain.models.build_tiny import resolve_model_path

    total = sum(len(st["points"]) for st in state.values())
    bar = tqdm(total=total, desc="ceilings", dynamic_ncols=True, disable=args.no_progress)
    shared: dict[str, dict] = {}  # s = 1 is the same point in every arm: distilled and scored once
    for arm, st in state.items():
        cfg = st["cfg"]
        recipe = distill_recipe(cfg)
        base = Path(resolve_model_path(cfg.policy.model_path, progress=False))
        res = result["arms"][arm]
        for s in st["points"]:
            t0 = time.perf_counter()
            pdir = st["dir"] / "points" / f"step_{s:06d}"
            if s == 1:
                policy, cotrained = base, st["drafter_init"]
            else:
                policy, cotrained = st["exports"][s] / "policy", st["exports"][s] / "drafter"
            chains = st["box"]["chains"][s]
            pdir.mkdir(parents=True, exist_ok=True)
            torch.save(chains, pdir / "chains.pt")  # the step's rows, for a rerun of the scores by hand
            if s == 1 and shared and all(
                    (shared["chains"][f] == chains[f]).all() for f in ("inputs", "mask", "lengths")):
                rec = dict(shared["record"])
            else:
                rec = ceiling_point(args, cfg, recipe, s, policy, cotrained, st["drafter_init"], chains,
                                    st["box"]["prompts"], pdir)
                rec["export_s"] = st["export_s"].get(s)
                if s == 1:
                    shared.update(chains=chains, record=rec)
            loop = next((m for m in res["steps"] if m["step"] == s), {})
            rec["loop"] = {"cotrained": loop.get("draft/acceptance_offline"),
                           "frozen": loop.get("draft/acceptance_offline_frozen")}
            res["points"].append(rec)
            bar.update(1)
            bar.set_postfix(arm=arm, step=s, ceil=f"{rec['ceiling']:.2f}", co=f"{rec['cotrained']:.2f}",
                            fr=f"{rec['frozen']:.2f}")
            result["summary"] = summarize(result)
            out.with_suffix(".partial.json").write_text(json.dumps(result, indent=1))
    bar.close()


# ------------------------------------------------------------------------------------------ the summary
def _ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def _spread(xs: list[float]) -> dict | None:
    xs = [x for x in xs if not math.isnan(x)]
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)} if xs else None


def _mean(xs: list[float]) -> float:
    return statistics.fmean(xs) if xs else float("nan")


def ceiling_kinds(result: dict) -> list[str]:
    """The ceiling kinds of a result, the primary (the goals') first."""
    return list(result.get("ceilings", ["recipe"]))


def ceiling_of(p: dict, kind: str) -> dict:
    """A point's ceiling of ``kind``: {acceptance (mean over seeds), seeds}."""
    if "ceilings" in p:
        return p["ceilings"][kind]
    return {"acceptance": p["ceiling"], "seeds": [p["ceiling"]]}  # a single-ceiling JSON


def versus(pts: list[dict], kind: str) -> dict:
    """The co-trained drafter and the frozen copy against the ``kind`` ceiling over ``pts``."""
    C = _mean([ceiling_of(p, kind)["acceptance"] for p in pts])
    A = {d: _mean([p[d] for p in pts]) for d in ("cotrained", "frozen")}
    return {"acceptance": C,
            "recovery": _ratio(A["cotrained"] - A["frozen"], C - A["frozen"]),
            "cotrained_share": _ratio(A["cotrained"], C), "frozen_share": _ratio(A["frozen"], C),
            "per_point": {
                "cotrained_share": _spread([_ratio(p["cotrained"], ceiling_of(p, kind)["acceptance"]) for p in pts]),
                "frozen_share": _spread([_ratio(p["frozen"], ceiling_of(p, kind)["acceptance"]) for p in pts]),
                "ceiling_minus_frozen": _spread([ceiling_of(p, kind)["acceptance"] - p["frozen"] for p in pts])},
            "seed_range": _mean([max(v) - min(v) for v in (ceiling_of(p, kind)["seeds"] for p in pts)])}


def part_summary(points: list[dict], steps: list[dict], lo: int, hi: int, kinds: list[str]) -> dict:
    """One part of the run (steps lo..hi): the points s > 1 in it against every ceiling kind (the
    primary's numbers also at the top level) and the loop's steps in it."""
    pts = [p for p in points if lo <= p["step"] <= hi and p["step"] > 1]
    by = {k: versus(pts, k) for k in kinds}
    main = by[kinds[0]]
    out = {"steps": [lo, hi], "points": [p["step"] for p in pts],
           "acceptance": {"ceiling": main["acceptance"], **{d: _mean([p[d] for p in pts]) for d in ("cotrained", "frozen")}},
           **{k: main[k] for k in ("recovery", "cotrained_share", "frozen_share", "per_point")}, "by_ceiling": by}
    # every step of the part: one where the drafter took no step (draft.budget adaptive) spent 0 s on it
    st = [m for m in steps if lo <= m["step"] <= hi and "time/update" in m]
    upd = sum(m["time/update"] for m in st)
    out["drafter_share_of_update"] = _ratio(sum(m.get("time/draft", 0.0) for m in st), upd) if st else float("nan")
    out["drafter_steps"] = sum(m.get("draft/updates", 1.0) for m in steps if lo <= m["step"] <= hi)
    kl = [m["kl/ref"] for m in steps if lo <= m["step"] <= hi and "kl/ref" in m]
    out["kl_ref_last"] = kl[-1] if kl else float("nan")
    return out


def goals(thirds: list[dict], kind: str) -> dict[str, bool]:
    """The two acceptance goals against the ``kind`` ceiling (not met where a third has no point)."""
    v = [t["by_ceiling"][kind] for t in thirds]
    full = bool(thirds) and all(t["points"] for t in thirds)
    return {"cotrained_ge_95pct_of_ceiling_every_third": full and all(x["cotrained_share"] >= GOAL_COTRAINED for x in v),
            "frozen_le_90pct_of_ceiling_last_third": bool(thirds) and bool(thirds[-1]["points"])
            and v[-1]["frozen_share"] <= GOAL_FROZEN}


def summarize(result: dict) -> dict:
    """Per arm: the thirds (module doc), the whole run (points s > 1), the goals per ceiling kind
    (``goals``: the primary's), the checks."""
    from cotrain.rl.thirds import parts

    kinds = ceiling_kinds(result)
    out = {}
    for arm, res in result["arms"].items():
        points, steps = res["points"], res["steps"]
        n = res["num_steps"]
        thirds = [part_summary(points, steps, lo, hi, kinds) for lo, hi in parts(list(range(1, n + 1)))] if n >= 3 else []
        diffs = [abs(p[d] - p["loop"][d]) for p in points for d in ("cotrained", "frozen")
                 if p.get("loop", {}).get(d) is not None]
        s1 = next((p for p in points if p["step"] == 1), None)
        by_kind = {k: goals(thirds, k) for k in kinds}
        out[arm] = {
            "thirds": thirds, "whole": part_summary(points, steps, 1, n, kinds),
            "goals": by_kind[kinds[0]], "goals_by_ceiling": by_kind,
            "loop_check": {"max_abs_diff": max(diffs) if diffs else None, "compared": len(diffs)},
            "recipe_check": (None if s1 is None else {
                **s1.get("recipe_check", {}), "frozen": s1["frozen"], "cotrained": s1["cotrained"],
                **{f"ceiling_{k}": ceiling_of(s1, k)["acceptance"] for k in kinds}}),
        }
    return out


# ------------------------------------------------------------------------------------------ output
CEILING_STYLE = {"recipe": ("o-", "ceiling (draft.init's recipe)"), "run": ("D-.", "ceiling (the run's prompts)")}


def plot(result: dict, png: Path) -> None:
    """Per arm (a column each): the drafters' acceptance at the points (the loop's every-step curves
    beside) above their shares of each ceiling; last column: the policy's drift above the drafter's
    share of the update per third."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    arms, kinds = result["arms"], ceiling_kinds(result)
    n = len(arms)
    fig, ax = plt.subplots(2, n + 1, figsize=(7.2 * (n + 1), 9.5), squeeze=False)
    first = next(iter(result["summary"].values()))
    bounds = [t["steps"][0] - 0.5 for t in first["thirds"][1:]]
    reward = ax[0, n].twinx()
    for i, (arm, res) in enumerate(arms.items()):
        top, bottom, c = ax[0, i], ax[1, i], f"C{i}"
        pts = res["points"]
        xs = [p["step"] for p in pts]
        steps = [m["step"] for m in res["steps"]]
        for key, col, label in (("draft/acceptance_offline", "C2", "co-trained, every step it trained (loop)"),
                                ("draft/acceptance_offline_frozen", "C3", "frozen, every step it was scored (loop)")):
            top.plot(steps, [m.get(key, float("nan")) for m in res["steps"]], "-", color=col, lw=0.7, alpha=0.35,
                     label=label)
        for j, kind in enumerate(kinds):
            style, label = CEILING_STYLE.get(kind, ("o-", f"ceiling ({kind})"))
            top.plot(xs, [ceiling_of(p, kind)["acceptance"] for p in pts], style, color="k" if j == 0 else "0.45",
                     lw=2 if j == 0 else 1.4, label=label)
            for who, mk, col in (("cotrained", "s-", "C2"), ("frozen", "x:", "C3")):
                bottom.plot(xs, [_ratio(p[who], ceiling_of(p, kind)["acceptance"]) for p in pts],
                            mk if j == 0 else mk[0] + "-.", color=col, ms=7, alpha=1 if j == 0 else 0.55,
                            lw=1.6 if j == 0 else 1.0, label=f"{'co-trained' if who == 'cotrained' else 'frozen'} / "
                            f"{kind} ceiling")
        top.plot(xs, [p["cotrained"] for p in pts], "s--", color="C2", lw=1.6, label="co-trained")
        top.plot(xs, [p["frozen"] for p in pts], "x:", color="C3", ms=8, lw=1.6, label="frozen copy")
        top.set_title(f"{arm}: offline greedy acceptance on step s's own chains (k={result.get('k')})")
        bottom.axhline(GOAL_COTRAINED, color="g", lw=0.8, ls="--", label="goal: co-trained >= 0.95")
        bottom.axhline(GOAL_FROZEN, color="r", lw=0.8, ls="--", label="goal: frozen <= 0.90 (last third)")
        bottom.set_title(f"{arm}: share of the ceiling")
        ax[0, n].plot(steps, [m.get("kl/ref", float("nan")) for m in res["steps"]], "-", color=c,
                      label=f"{arm}: KL to the initial policy")
        reward.plot(steps, [m.get("reward/mean", float("nan")) for m in res["steps"]], ":", color=c, alpha=0.6,
                    label=f"{arm}: reward (right axis)")
        thirds = result["summary"][arm]["thirds"]
        w = 0.8 / n
        ax[1, n].bar([j + i * w for j in range(len(thirds))], [t["drafter_share_of_update"] for t in thirds], w,
                     color=c, label=arm)
        for a in (top, bottom):
            a.set_xlabel("step s (the policy after s - 1 updates)")
    for a in [*ax[:, :n].reshape(-1), ax[0, n]]:
        for b in bounds:
            a.axvline(b, color="0.7", lw=0.8)
    ax[0, n].set_title("the policy's drift")
    ax[0, n].set_xlabel("step")
    reward.set_ylabel("reward (dotted)")
    reward.legend(fontsize=7, loc="lower right")
    ax[1, n].set_title("drafter time / update time, per third (one run, shared machine)")
    ax[1, n].set_xticks([j + 0.4 - 0.4 / n for j in range(len(first["thirds"]))],
                        [f"steps {t['steps'][0]}-{t['steps'][1]}" for t in first["thirds"]])
    for a in ax.reshape(-1):
        a.legend(fontsize=7, loc="upper left" if a is ax[0, n] else "best")
    seeds = result.get("ceiling_seeds", 1)
    fig.suptitle(f"the ceiling on one trajectory: {result['config']} "
                 f"({result['arms'][next(iter(arms))]['num_steps']} steps, points every {result['every']}"
                 + (f", each ceiling the mean of {seeds} distillation seeds" if seeds > 1 else "") + ")")
    fig.tight_layout()
    fig.savefig(png, dpi=100)
    plt.close(fig)


def _f(x, nd=3) -> str:
    return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.{nd}f}"


def _r(d: dict | None) -> str:
    return "-" if not d else f"{d['median']:.3f} [{d['min']:.3f}, {d['max']:.3f}]"


def _met(b: bool) -> str:
    return "met" if b else "not met"


def markdown(result: dict) -> str:
    kinds = ceiling_kinds(result)
    seeds = result.get("ceiling_seeds", 1)
    lines = []
    for arm, S in result["summary"].items():
        res = result["arms"][arm]
        lines += [f"**{arm}** (draft.budget.mode={arm}): per third of the run (points s > 1; acceptance = mean over "
                  "the third's points; per-point ratios median [min, max])", "",
                  "| | " + " | ".join(f"steps {t['steps'][0]}-{t['steps'][1]}" for t in S["thirds"]) + " | whole run |",
                  "|---" * (len(S["thirds"]) + 2) + "|"]
        cols = S["thirds"] + [S["whole"]]

        def row(name, get):
            lines.append(f"| {name} | " + " | ".join(get(t) for t in cols) + " |")

        row("points (steps)", lambda t: ", ".join(map(str, t["points"])) or "-")
        row("acceptance co-trained", lambda t: _f(t["acceptance"]["cotrained"]))
        row("acceptance frozen copy", lambda t: _f(t["acceptance"]["frozen"]))
        for kind in kinds:
            g = lambda t, kind=kind: t["by_ceiling"][kind]  # noqa: E731
            row(f"acceptance ceiling ({kind})", lambda t: _f(g(t)["acceptance"]))
            if seeds > 1:
                row(f"  range over {seeds} distillation seeds (mean)", lambda t: _f(g(t)["seed_range"]))
            row("  recovery (co - frozen) / (ceiling - frozen)", lambda t: _f(g(t)["recovery"]))
            row("  co-trained / ceiling (goal >= 0.95)", lambda t: _f(g(t)["cotrained_share"]))
            row("    per point", lambda t: _r(g(t)["per_point"]["cotrained_share"]))
            row("  frozen / ceiling (goal <= 0.90 last third)", lambda t: _f(g(t)["frozen_share"]))
            row("    per point", lambda t: _r(g(t)["per_point"]["frozen_share"]))
        row("drafter optimizer steps", lambda t: f"{t['drafter_steps']:.0f}")
        row("drafter share of the update", lambda t: _f(t["drafter_share_of_update"]))
        row("KL to the initial policy (last step)", lambda t: _f(t["kl_ref_last"]))
        lines.append("")
        for kind in kinds:
            g = S["goals_by_ceiling"][kind]
            lines.append(f"Goals against the {kind} ceiling: co-trained >= 95% of it in every third: "
                         f"**{_met(g['cotrained_ge_95pct_of_ceiling_every_third'])}**; frozen <= 90% of it in the "
                         f"last third: **{_met(g['frozen_le_90pct_of_ceiling_last_third'])}**.")
        lc, rc = S["loop_check"], S["recipe_check"]
        lines.append(f"Loop check: the co-trained and frozen scores differ from the loop's own (Megatron) by at most "
                     f"{_f(lc['max_abs_diff'], 4)} over {lc['compared']} values.")
        if rc:
            lines.append("Recipe check (step 1, the base policy): " + ", ".join(
                f"the {k} ceiling scores {_f(rc[f'ceiling_{k}'])}" for k in kinds) +
                f" against draft.init's {_f(rc['frozen'])}; the recipe's drafter differs from draft.init's by at "
                f"most {_f(rc.get('max_abs_weight_diff_vs_draft_init'), 6)} in any weight.")
        head = " | ".join(f"ceiling ({k})" + (" per seed" if seeds > 1 else "") for k in kinds)
        lines += ["", f"| step | {head} | co-trained | frozen | co / ceiling | frozen / ceiling | loop co-trained | "
                  "loop frozen | distill s |", "|---" * (9 + len(kinds) - 1) + "|"]
        for p in res["points"]:
            cells = " | ".join(" / ".join(f"{v:.3f}" for v in ceiling_of(p, k)["seeds"]) for k in kinds)
            secs = sum(sum(c["distill"]["seconds"]) for c in p.get("ceilings", {}).values()) if "ceilings" in p else float("nan")
            lines.append(f"| {p['step']} | {cells} | {_f(p['cotrained'])} | {_f(p['frozen'])} | "
                         f"{_f(_ratio(p['cotrained'], p['ceiling']))} | {_f(_ratio(p['frozen'], p['ceiling']))} | "
                         f"{_f(p['loop']['cotrained'])} | {_f(p['loop']['frozen'])} | {_f(secs, 1)} |")
        lines.append("")
    return "\n".join(lines)


def workload(cfg) -> dict:
    """The settings that make the trajectory (the JSON's record of the config as it was)."""
    g, d = cfg.grpo, cfg.draft
    return {"model": cfg.policy.model_path, "task": cfg.data.task, "policy_lr": cfg.policy.optimizer.lr,
            "num_steps": g.num_steps, "prompts_per_step": g.prompts_per_step, "group_size": g.group_size,
            "temperature": cfg.rollout.sampling.temperature, "max_tokens": cfg.rollout.sampling.max_tokens,
            "draft_kind": d.kind, "draft_init": d.init, "draft_lr": d.optimizer.lr, "draft_loss": d.loss,
            "num_speculative_tokens": cfg.rollout.speculative.num_speculative_tokens, "seed": cfg.run.seed}


def machine_info() -> dict:
    import platform

    import torch

    return {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "platform": platform.platform(),
            "load_avg_at_end": os.getloadavg()}


def git_commit() -> str:
    try:
        sha = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "bench/ceiling.py", "cotrain"], cwd=ROOT,
                               capture_output=True, text=True).stdout.strip()
        return sha + ("+dirty" if dirty else "")
    except OSError:
        return "unknown"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--config", default="configs/demo.yaml")
    ap.add_argument("--steps", type=int, default=None, help="grpo.num_steps (default: the config's)")
    ap.add_argument("--every", type=int, default=5, help="a point every this many steps (1, 1 + every, ...)")
    ap.add_argument("--arms", default="fixed", help=f"comma list of {', '.join(ARMS)} (draft.budget.mode per arm)")
    ap.add_argument("--distill", nargs="*", default=[], metavar="key=value",
                    help="overrides of every ceiling's distillation recipe (smoke tests; the benchmark repeats "
                    "draft.init's recipe as it is)")
    ap.add_argument("--ceilings", default="recipe", help="comma list of ceiling kinds, the first the goals': "
                    "recipe (draft.init's distillation as it is, its target the step's policy), run (the same with "
                    "the run's own prompts around the step)")
    ap.add_argument("--prompt-radius", type=int, default=10, help="the run ceiling's prompts: those of steps "
                    "s - radius .. s + radius")
    ap.add_argument("--ceiling-seeds", type=int, default=1, help="distillations per point (train.seed, +1, ...): "
                    "the ceiling is their mean, their range its noise")
    ap.add_argument("--workdir", default="runs/bench_ceiling", help="checkpoints, exports and distillations")
    ap.add_argument("--out", default="bench/results/ceiling.json")
    ap.add_argument("--png", default=None, help="another copy of the figure (e.g. docs/img/ceiling.png)")
    ap.add_argument("--quick", action="store_true", help="smoke test: 3 steps of 16 samples, a point every step, "
                    "3-step distillations")
    ap.add_argument("--no-progress", action="store_true", help="no tqdm bars")
    ap.add_argument("--report", metavar="JSON", help="print the summary of an earlier run and redraw its PNG")
    ap.add_argument("--markdown", action="store_true", help="with --report: Markdown tables (the default too)")
    ap.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = ap.parse_args(argv)
    if args.report:
        result = json.loads(Path(args.report).read_text())
        result["summary"] = summarize(result)
        Path(args.report).write_text(json.dumps(result, indent=1))
        for p in [Path(args.report).with_suffix(".png")] + ([Path(args.png)] if args.png else []):
            plot(result, p)
        print(markdown(result))
        return 0
    arms = [a for a in args.arms.split(",") if a]
    bad = [a for a in arms if a not in ARMS]
    if bad or not arms:
        ap.error(f"--arms {args.arms}: allowed {', '.join(ARMS)} (comma separated)")
    args.ceilings = [k for k in args.ceilings.split(",") if k]
    if not args.ceilings or any(k not in CEILING_STYLE for k in args.ceilings) or len(set(args.ceilings)) < len(args.ceilings):
        ap.error(f"--ceilings {','.join(args.ceilings)}: allowed recipe, run (comma separated, each once)")
    if args.ceiling_seeds < 1:
        ap.error(f"--ceiling-seeds {args.ceiling_seeds}: must be >= 1")
    if args.quick:
        args.config, args.steps, args.every = QUICK["config"], QUICK["steps"], QUICK["every"]
        args.overrides = [*QUICK["overrides"], *args.overrides]
        args.distill = [*QUICK["distill"], *args.distill]
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    workdir = Path(args.workdir)
    t0 = time.perf_counter()
    state = run_arms(args, arms, workdir)
    first = next(iter(state.values()))["cfg"]
    result = {"config": args.config, "overrides": args.overrides, "every": args.every, "quick": args.quick,
              "ceilings": args.ceilings, "ceiling_seeds": args.ceiling_seeds, "prompt_radius": args.prompt_radius,
              "distill_recipe": distill_recipe(first), "distill_overrides": args.distill,
              "k": first.rollout.speculative.num_speculative_tokens, "draft_kind": first.draft.kind,
              "commit": git_commit(),
              "arms": {arm: {"overrides": ARMS[arm], "num_steps": st["cfg"].grpo.num_steps, "points_at": st["points"],
                             "workload": workload(st["cfg"]), "run_s": st["run_s"], "steps": st["steps"], "points": []}
                       for arm, st in state.items()}}
    score_arms(args, state, result, out)
    result["seconds"] = time.perf_counter() - t0
    result["machine"] = machine_info()
    result["summary"] = summarize(result)
    out.write_text(json.dumps(result, indent=1))
    out.with_suffix(".partial.json").unlink(missing_ok=True)
    pngs = [out.with_suffix(".png")] + ([Path(args.png)] if args.png else [])
    for p in pngs:
        p.parent.mkdir(parents=True, exist_ok=True)
        plot(result, p)
    print(markdown(result))
    print(f"wrote {out}, " + ", ".join(map(str, pngs)) + f" in {result['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
