"""Size a run before renting the machines: memory per rank and what every transfer moves, per step.

    python -m cotrain.plan --config configs/demo.yaml
    python -m cotrain.plan --config configs/demo.yaml --model /path/to/Qwen3-8B \\
        policy.parallel.pipeline=2 policy.parallel.context=4 policy.dtype=bfloat16 \\
        --gpus-per-node 8 --gpu-mem-gib 141 --intra-node-gbps 400 --inter-node-gbps 50

The model is the config's ``policy.model_path`` (``--model`` replaces it: a HF directory or just its
``config.json``; nothing is loaded but the config). The layout, batch and drafter come from the config.
Ranks are numbered as Megatron's parallel_state orders them (TP fastest, then CP, DP, PP) and placed on
nodes of ``--gpus-per-node`` GPUs exactly as the run places them (:mod:`cotrain.placement`: whole TP x CP
groups per node, spread evenly over the trainer nodes; ``cluster.engine_nodes`` engine-only nodes last),
on the config's ``cluster.num_nodes`` or, if the ranks do not fit there, the fewest nodes that hold them
(``--num-nodes`` fixes it; docs/multinode.md).

Notation: L layers, H hidden, a heads, g KV heads, d head dim, I MLP width, V vocabulary; layout
t (TP), p (PP), c (CP), n_dp (DP); microbatch b rows of S tokens, so T = b S / c tokens per rank and
microbatch; w bytes per policy element (2 bf16, 4 fp32); M microbatches per rank and step.

- Parameters: per layer 2 H d (a + g) [q, o and k, v] + 3 H I [MLP] + 2 H + 2 d [norms]; embedding
  V H, LM head V H unless tied, final norm H. A rank holds its stage's layers / t (norms whole), the
  embedding / t on the first stage, the head / t on the last.
- Training state per parameter: weights w, gradients 4 (reduced in fp32), Adam moments 8, an fp32
  master copy 4 when w = 2 (Megatron's non-distributed optimizer); a reference model adds w.
- Activations, per layer and microbatch in flight (Korthikanti et al. 2022, no recomputation, no
  sequence parallelism, 16-bit; x2 for fp32): T H (10 + 24 / t) bytes plus the attention scores
  5 a T (S / c) / t (absent with flash attention). Under 1F1B stage s holds min(M, p - s)
  microbatches; the last stage also holds fp32 logits T V / t x 4.
- Taps (TapChannel), per microbatch from a source stage: T x H x w x (taps on that stage).
- CP ring (cotrain.parallel), per rank, layer and microbatch: forward (c - 1) 2 T g d w; backward
  the K/V again plus dK/dV in fp32: (c - 1) 2 T g d (w + 4).
- Weight pushes per step: the policy's P x w, the drafter's own tensors x 4 (fp32).
- DP gradient all-reduce per step (ring): 2 (n_dp - 1) / n_dp x (the rank's parameters) x 4.
- Seconds = bytes / bandwidth of the link the transfer crosses (intra- or inter-node).

Asynchronous GRPO (``--phases METRICS``: the medians of a synchronous run's rollout R, update U,
weight push W and the rest O of the step, ``time/*`` in its metrics.jsonl, first step left out).
Synchronously a step takes R + U + W + O. With grpo.max_staleness = k >= 1 the engines draw the
next step while the trainers update, so in steady state (one draw and one update per step)

    T_k = R + U + W + O - h min(R, U),   h = the hidden fraction of the shorter phase

h = 1 where engines and trainers hold their own devices (rollout.colocate = false: T = max(R, U) +
W + O); less where they share compute (on a CPU machine both compete for the same cores: measure
h with bench/cotrain_e2e.py --staleness 0,1 and pass it with ``--hidden``). k > 1 adds no steady
throughput - the engines still draw one step per step - it only absorbs steps whose rollout runs
longer than the update. Idle fractions: engines 1 - R / T, trainers 1 - (U + W) / T.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Optional

GIB = 2**30


# ------------------------------------------------------------------------------------ the model
@dataclass(frozen=True)
class Arch:
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    tied: bool = False

    @classmethod
    def from_hf(cls, cfg: dict) -> "Arch":
        cfg = cfg.get("text_config", cfg) if "num_hidden_layers" not in cfg else cfg
        heads = cfg["num_attention_heads"]
        return cls(layers=cfg["num_hidden_layers"], hidden=cfg["hidden_size"], heads=heads,
                   kv_heads=cfg.get("num_key_value_heads") or heads,
                   head_dim=cfg.get("head_dim") or cfg["hidden_size"] // heads,
                   intermediate=cfg["intermediate_size"], vocab=cfg["vocab_size"],
                   tied=bool(cfg.get("tie_word_embeddings", False)))

    # parameters
    def layer_matrix_params(self) -> int:
        return 2 * self.hidden * self.head_dim * (self.heads + self.kv_heads) + 3 * self.hidden * self.intermediate

    def layer_norm_params(self) -> int:
        return 2 * self.hidden + 2 * self.head_dim  # input/post-attention norms, q/k norms (Qwen3)

    def params(self) -> int:
        per_layer = self.layer_matrix_params() + self.layer_norm_params()
        return self.layers * per_layer + self.vocab * self.hidden * (1 if self.tied else 2) + self.hidden


def load_arch(model_path: str) -> Arch:
    if model_path.startswith("builtin:"):
        from cotrain.config.validate import _builtin_config

        return Arch.from_hf(_builtin_config(model_path[len("builtin:"):]))
    p = Path(model_path)
    return Arch.from_hf(json.loads((p / "config.json" if p.is_dir() else p).read_text()))


# ------------------------------------------------------------------------------------ formulas
def tap_bytes(tokens: int, hidden: int, elem_bytes: int, taps: int) -> int:
    """Bytes one source stage sends per microbatch (TapChannel payload of its taps)."""
    return tokens * hidden * elem_bytes * taps


def ring_bytes(tokens: int, kv_heads: int, head_dim: int, elem_bytes: int, cp: int, grad_bytes: int = 4
               ) -> tuple[int, int]:
    """(forward, backward) bytes one rank sends per layer and microbatch in cotrain's CP ring."""
    if cp == 1:
        return 0, 0
    kv = 2 * tokens * kv_heads * head_dim
    return (cp - 1) * kv * elem_bytes, (cp - 1) * kv * (elem_bytes + grad_bytes)


def activation_bytes(tokens: int, seq_per_rank: int, arch: Arch, tp: int, elem_bytes: int,
                     flash: bool = False) -> float:
    """Activation memory of one layer for one microbatch (see the module docstring)."""
    scale = elem_bytes / 2
    base = tokens * arch.hidden * (10 + 24 / tp)
    scores = 0.0 if flash else 5 * arch.heads * tokens * seq_per_rank / tp
    return (base + scores) * scale


def drafter_push_params(kind: str, arch: Arch, taps: int, num_layers: int = 1, markov_rank: int = 16,
                        draft_vocab: Optional[int] = None) -> int:
    """Parameters of a drafter's own tensors (what a draft push carries)."""
    H = arch.hidden
    attn = 2 * H * arch.head_dim * (arch.heads + arch.kv_heads)
    mlp = 3 * H * arch.intermediate
    if kind == "eagle3":
        # layer 0's q/k/v read 2H (embedding ++ hidden); 3 norms per layer (input, post, hidden_norm)
        first = attn + H * arch.head_dim * (arch.heads + 2 * arch.kv_heads) + mlp + 3 * H
        rest = (num_layers - 1) * (attn + mlp + 3 * H)
        return taps * H * H + first + rest + H + (draft_vocab or arch.vocab) * H
    layer = attn + mlp + 2 * H + 2 * arch.head_dim
    n = taps * H * H + H + num_layers * layer + H  # fc, hidden_norm, layers, norm
    if kind == "dspark":
        n += markov_rank * (arch.vocab + (draft_vocab or arch.vocab))
    return n


# ------------------------------------------------------------------------------------ the plan
@dataclass
class Hardware:
    gpus_per_node: int = 8
    gpu_mem_gib: float = 80.0
    intra_node_gbps: float = 400.0  # GB/s (NVLink-class)
    inter_node_gbps: float = 50.0  # GB/s (400 Gb/s InfiniBand)


@dataclass
class StagePlan:
    stage: int
    node: int
    layers: int
    params: int
    state_gib: float
    activation_gib: float
    drafter_gib: float
    total_gib: float
    fits: bool
    tap_bytes_per_microbatch: int
    tap_link: str
    tap_seconds_per_step: float


@dataclass
class Plan:
    model_params: int
    layout: dict
    tokens_per_microbatch: int
    microbatches_per_step: int
    placement: dict = field(default_factory=dict)  # num_nodes, engine_nodes, node of every rank and engine
    stages: list[StagePlan] = field(default_factory=list)
    cp_ring_bytes_per_step: int = 0
    cp_link: str = "none"
    cp_seconds_per_step: float = 0.0
    push_bytes_per_step: int = 0
    push_link: str = "inter"
    push_seconds_per_step: float = 0.0
    dp_allreduce_bytes_per_step: int = 0
    notes: list[str] = field(default_factory=list)


def placement_for(cfg, hw: Hardware, num_nodes: Optional[int] = None):
    """(the run's node layout on nodes of ``hw.gpus_per_node`` GPUs, issues). ``num_nodes``: None = the
    config's, raised to the fewest nodes that hold the ranks and engines."""
    from cotrain.placement import COLOCATED_ENGINE_GPU_SHARE, layout_issues

    r = cfg.rollout
    share = COLOCATED_ENGINE_GPU_SHARE if r.colocate else 1.0  # colocated: a share of each trainer GPU
    gpe = r.gpus_per_engine if cfg.cluster.device == "cuda" and r.gpus_per_engine else share * r.tensor_parallel
    kw = dict(device="cuda", gpus_per_node=hw.gpus_per_node, cpus_per_node=float(1 << 30), gpus_per_engine=gpe)
    if num_nodes is not None:
        return layout_issues(cfg, num_nodes=num_nodes, **kw)
    first = layout_issues(cfg, **kw)
    n = cfg.cluster.num_nodes
    while first[0] is None and n < cfg.cluster.num_nodes + 4096:
        n += 1
        layout, issues = layout_issues(cfg, num_nodes=n, **kw)
        if layout is not None:
            return layout, issues
        if any("straddle" in msg for _, msg in issues):
            break  # no node count helps
    return first


def make_plan(cfg, arch: Arch, hw: Hardware, num_nodes: Optional[int] = None) -> Plan:
    par, pol = cfg.policy.parallel, cfg.policy
    t, p, c, dp = par.tensor, par.pipeline, par.context, par.data
    w = 2 if pol.dtype == "bfloat16" else 4
    S, b = pol.max_seq_len, pol.micro_batch_size
    T = b * S // c
    rollout = cfg.grpo.prompts_per_step * cfg.grpo.group_size
    M = max(1, rollout // (dp * b))
    if pol.packing:  # packed micro batches of at most the token budget; the worst case: every sequence max_seq_len
        from cotrain.config.derived import packing_budget

        budget = packing_budget(cfg)
        T = -(-budget // c)
        M = max(1, -(-rollout * S // (dp * budget)))
    epochs = cfg.grpo.epochs
    plan = Plan(model_params=arch.params(), layout={"tp": t, "pp": p, "cp": c, "dp": dp, "world": t * p * c * dp},
                tokens_per_microbatch=T, microbatches_per_step=M)
    # drafter (on the last stage)
    d = cfg.draft
    taps_by_stage = [0] * p
    draft_params = 0
    if d.kind is not None and d.cotrain:
        s = d.settings
        layers = sorted(s.tap_layers or s.default_tap_layers(arch.layers))
        for layer in layers:
            taps_by_stage[min(p - 1, layer // (arch.layers // p))] += 1
        draft_params = drafter_push_params(d.kind, arch, len(layers), getattr(s, "num_layers", 1),
                                           getattr(s, "markov_rank", 16), getattr(s, "draft_vocab_size", None))
    per_param = w + 4 + 8 + (4 if w == 2 else 0) + (w if pol.reference_model else 0)
    span = t * c * dp  # ranks per pipeline stage (Megatron order: tp, cp, dp, then pp)
    layout, issues = placement_for(cfg, hw, num_nodes)
    if layout is not None:
        rank_node = list(layout.rank_node)
        plan.placement = {"num_nodes": layout.num_nodes, "engine_nodes": layout.engine_nodes,
                          "ranks_per_node": layout.ranks_per_node, "rank_node": rank_node,
                          "engine_node": list(layout.engine_node)}
        if layout.shared:  # colocated: the trainer ranks whose GPUs each engine's workers share
            plan.placement.update(engine_gpus_of_ranks=[list(b) for b in layout.engine_bundles],
                                  engine_gpu_share=layout.engine_gpu_share,
                                  engine_memory_fraction=layout.gpu_memory_utilization)
    else:  # cannot be placed as the run would: number the nodes naively and say why
        rank_node = [rk // hw.gpus_per_node for rk in range(t * p * c * dp)]
        plan.notes += [f"cannot be placed: {k}: {m}" for k, m in issues]

    def _node(rank: int, hw: Hardware) -> int:
        return rank_node[rank]

    last_node = _node((p - 1) * span, hw)
    for s in range(p):
        n_layers = arch.layers // p
        params = n_layers * (arch.layer_matrix_params() // t + arch.layer_norm_params())
        if s == 0:
            params += arch.vocab * arch.hidden // t
        if s == p - 1:
            params += arch.hidden + (0 if (arch.tied and p == 1) else arch.vocab * arch.hidden // t)
        inflight = min(M, p - s)
        act = n_layers * inflight * activation_bytes(T, S // c, arch, t, w)
        if s == p - 1:
            act += T * arch.vocab / t * 4
        drafter = draft_params * 16 if s == p - 1 else 0  # fp32 weights, grads, AdamW moments
        state = params * per_param
        total = (state + act + drafter) / GIB
        node = _node(s * span, hw)
        tb = tap_bytes(T, arch.hidden, w, taps_by_stage[s]) if s != p - 1 else 0
        link = "local" if s == p - 1 or tb == 0 else ("intra" if node == last_node else "inter")
        bw = hw.intra_node_gbps if link == "intra" else hw.inter_node_gbps
        plan.stages.append(StagePlan(stage=s, node=node, layers=n_layers, params=params, state_gib=state / GIB,
                                     activation_gib=act / GIB, drafter_gib=drafter / GIB, total_gib=total,
                                     fits=total <= hw.gpu_mem_gib, tap_bytes_per_microbatch=tb, tap_link=link,
                                     tap_seconds_per_step=0.0 if link == "local" else tb * M / (bw * 1e9)))
    # CP ring: forwards of the log-prob pass (+ reference) and the updates, backwards of the updates
    fwd, bwd = ring_bytes(T, arch.kv_heads, arch.head_dim, w, c)
    passes = 1 + (1 if pol.reference_model else 0) + epochs
    plan.cp_ring_bytes_per_step = (arch.layers // p) * M * (passes * fwd + epochs * bwd)
    if c > 1:
        plan.cp_link = "intra" if layout is not None else "inter"  # the placement keeps TP x CP groups in a node
        bw = hw.intra_node_gbps if plan.cp_link == "intra" else hw.inter_node_gbps
        plan.cp_seconds_per_step = plan.cp_ring_bytes_per_step / (bw * 1e9)
    plan.push_bytes_per_step = arch.params() * w + draft_params * 4
    # trainer rank 0 sends; engines on another node make the push cross nodes (object_store / nccl)
    remote = layout is None or any(n != rank_node[0] for n in layout.engine_node)
    plan.push_link = "inter" if remote else "intra"
    plan.push_seconds_per_step = plan.push_bytes_per_step / ((hw.inter_node_gbps if remote else hw.intra_node_gbps) * 1e9)
    stage0 = plan.stages[0].params
    plan.dp_allreduce_bytes_per_step = int(2 * (dp - 1) / dp * stage0 * 4 * epochs) if dp > 1 else 0

    for st in plan.stages:
        if not st.fits:
            plan.notes.append(f"stage {st.stage} needs {st.total_gib:.1f} GiB > {hw.gpu_mem_gib:g} GiB per GPU")
    return plan


PHASE_KEYS = {"rollout": "time/rollout", "update": "time/update", "push": "time/weight_push", "step": "time/step"}


def read_phases(metrics_jsonl: str | Path, skip: int = 1) -> dict[str, float]:
    """Median seconds of a synchronous run's phases (the first ``skip`` steps left out: one-time
    costs) from its metrics.jsonl; ``other`` = step - rollout - update - push (>= 0)."""
    import statistics

    rows = [json.loads(line) for line in Path(metrics_jsonl).read_text().splitlines() if line.strip()]
    rows = [r for r in rows if "time/rollout" in r]
    if any("async/policy_lag" in r for r in rows):
        raise ValueError(f"{metrics_jsonl}: an asynchronous run (grpo.max_staleness > 0): its phases overlap; "
                         "give a synchronous run's metrics")
    rows = rows[skip:] if len(rows) > skip else rows
    if not rows:
        raise ValueError(f"{metrics_jsonl}: no step with time/rollout")
    med = {name: statistics.median(r.get(key, 0.0) for r in rows) for name, key in PHASE_KEYS.items()}
    if not any("time/step" in r for r in rows):  # (older runs): the phases alone
        med["step"] = med["rollout"] + med["update"] + med["push"]
    med["other"] = max(0.0, med.pop("step") - med["rollout"] - med["update"] - med["push"])
    return med


def async_steps(phases: dict[str, float], max_staleness: int = 2, hidden: float = 1.0) -> list[dict]:
    """The module doc's model: per k = 0..max_staleness the predicted step seconds, the speed-up over
    k = 0 and the idle fractions of engines and trainers."""
    if not 0.0 <= hidden <= 1.0:
        raise ValueError(f"--hidden: {hidden} (allowed: 0..1, the hidden fraction of the shorter phase)")
    R, U, W, O = (phases[k] for k in ("rollout", "update", "push", "other"))
    sync = R + U + W + O
    out = []
    for k in range(max_staleness + 1):
        T = sync if k == 0 else sync - hidden * min(R, U)
        out.append({"staleness": k, "step_s": T, "speedup": sync / T if T else float("nan"),
                    "engine_idle": 1 - R / T if T else 0.0, "trainer_idle": 1 - (U + W) / T if T else 0.0})
    return out


def format_async(phases: dict[str, float], rows: list[dict], hidden: float) -> str:
    lines = [f"asynchronous GRPO from measured phases (medians): rollout {phases['rollout']:.2f}s, update "
             f"{phases['update']:.2f}s, push {phases['push']:.2f}s, other {phases['other']:.2f}s; hidden fraction "
             f"of the shorter phase h = {hidden:g}",
             "max_staleness  step s  speed-up  engines idle  trainers idle"]
    for r in rows:
        lines.append(f"{r['staleness']:>13} {r['step_s']:>7.2f} {r['speedup']:>8.2f}x {r['engine_idle']:>13.2f} "
                     f"{r['trainer_idle']:>14.2f}")
    lines.append("(k > 1: the same steady step; it only absorbs rollouts longer than the update)")
    return "\n".join(lines)


def format_plan(plan: Plan) -> str:
    L = plan.layout
    lines = [f"model: {plan.model_params / 1e6:,.1f} M parameters; layout TP={L['tp']} PP={L['pp']} CP={L['cp']} "
             f"DP={L['dp']} ({L['world']} ranks); {plan.tokens_per_microbatch} tokens per rank and microbatch, "
             f"{plan.microbatches_per_step} microbatches per step",
             "stage node layers  params/rank  state GiB  activ. GiB  drafter GiB  total GiB  fits  "
             "tap bytes/mb  tap link  tap s/step"]
    for s in plan.stages:
        lines.append(f"{s.stage:>5} {s.node:>4} {s.layers:>6} {s.params / 1e6:>10.1f}M {s.state_gib:>10.2f} "
                     f"{s.activation_gib:>11.2f} {s.drafter_gib:>12.2f} {s.total_gib:>10.2f}  {'yes' if s.fits else 'NO':>4}"
                     f"  {s.tap_bytes_per_microbatch:>12,} {s.tap_link:>9} {s.tap_seconds_per_step:>11.4f}")
    pl = plan.placement
    if pl:
        nodes = []
        for n in range(pl["num_nodes"]):
            ranks = [r for r, x in enumerate(pl["rank_node"]) if x == n]
            engines = [e for e, x in enumerate(pl["engine_node"]) if x == n]
            nodes.append(f"node {n}: ranks {ranks or '-'}, engines {engines or '-'}")
        lines.insert(1, f"placement ({pl['num_nodes']} node(s), {pl['ranks_per_node']} ranks per trainer node): "
                        + "; ".join(nodes))
        if "engine_gpus_of_ranks" in pl:
            share, mem = pl["engine_gpu_share"], pl["engine_memory_fraction"]
            lines.insert(2, "colocated: " + "; ".join(f"engine {e} on the GPUs of ranks {rs}" for e, rs in
                                                      enumerate(pl["engine_gpus_of_ranks"]))
                         + f" (Ray: engine worker {share:g} + rank {1 - share:g} of each GPU; memory: engine "
                         + (f"{mem:g} of the device, trainer the rest)" if mem is not None else "by kv_cache_memory_bytes)"))
    lines += [f"CP ring per rank and step: {plan.cp_ring_bytes_per_step:,} bytes ({plan.cp_link}), "
              f"{plan.cp_seconds_per_step:.3f} s",
              f"weight pushes per step: {plan.push_bytes_per_step:,} bytes, {plan.push_seconds_per_step:.3f} s "
              f"({plan.push_link}-node)",
              f"DP gradient all-reduce per rank and step: {plan.dp_allreduce_bytes_per_step:,} bytes"]
    lines += [f"note: {n}" for n in plan.notes]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cotrain.plan", description=__doc__.split("\n")[0])
    ap.add_argument("--config", required=True)
    ap.add_argument("--model", help="HF checkpoint directory or config.json (default: policy.model_path)")
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu-mem-gib", type=float, default=80.0)
    ap.add_argument("--intra-node-gbps", type=float, default=400.0, help="GB/s within a node")
    ap.add_argument("--inter-node-gbps", type=float, default=50.0, help="GB/s between nodes")
    ap.add_argument("--num-nodes", type=int, help="nodes of the run (default: cluster.num_nodes, raised to the "
                    "fewest that hold the ranks and engines)")
    ap.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ap.add_argument("--phases", metavar="METRICS_JSONL", help="a synchronous run's metrics.jsonl: also predict the "
                    "step of asynchronous GRPO (grpo.max_staleness) from its measured phase times")
    ap.add_argument("--hidden", type=float, default=1.0, help="with --phases: the fraction of the shorter phase "
                    "hidden behind the longer (1 = engines and trainers on their own devices; measure it on shared "
                    "hardware with bench/cotrain_e2e.py --staleness 0,1)")
    ap.add_argument("overrides", nargs="*", metavar="key.path=value")
    args = ap.parse_args(argv)
    from cotrain.config import ConfigError, load_config

    overrides = list(args.overrides)
    if args.model:
        overrides.append(f"policy.model_path={args.model}")
    try:
        cfg = load_config(args.config, overrides)
    except ConfigError as e:
        print(f"config error ({args.config}):\n{e}", file=sys.stderr)
        return 2
    hw = Hardware(args.gpus_per_node, args.gpu_mem_gib, args.intra_node_gbps, args.inter_node_gbps)
    plan = make_plan(cfg, load_arch(cfg.policy.model_path), hw, args.num_nodes)
    if args.phases:
        try:
            phases = read_phases(args.phases)
            rows = async_steps(phases, max(2, cfg.grpo.max_staleness), args.hidden)
        except (OSError, ValueError) as e:
            print(f"--phases: {e}", file=sys.stderr)
            return 2
    if args.json:
        out = asdict(plan)
        if args.phases:
            out["async"] = {"phases": phases, "hidden": args.hidden, "steps": rows}
        print(json.dumps(out, indent=1))
    else:
        print(format_plan(plan) + (("\n" + format_async(phases, rows, args.hidden)) if args.phases else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
