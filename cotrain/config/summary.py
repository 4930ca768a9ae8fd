"""A short human summary of a validated config (used by ``launch/grpo.py --validate-only``)."""

from __future__ import annotations

from .schema import CotrainConfig

__all__ = ["summary_rows", "print_summary"]


def summary_rows(cfg: CotrainConfig) -> list[tuple[str, str]]:
    """(label, value) rows: run, model, degrees and world size, resources, batches, rollout,
    drafter."""
    c, pol, r, g, d = cfg.cluster, cfg.policy, cfg.rollout, cfg.grpo, cfg.draft
    p = pol.parallel
    arch = cfg.model_arch
    rows: list[tuple[str, str]] = [
        ("run", f"{cfg.run.name} -> {cfg.run.output_dir} (seed {cfg.run.seed})"),
        ("sources", " + ".join(_short(s) for s in cfg.sources) or "-"),
        ("cluster", f"{c.ray_address or 'local Ray / job cluster'}; {c.num_nodes} node(s) x "
                    f"{c.cpus_per_node} CPUs, {c.gpus_per_node} GPUs"
                    f"{f' (the last {c.engine_nodes} engines only)' if c.engine_nodes else ''}; device {c.device}"),
    ]
    model = pol.model_path
    if arch is not None:
        model += (f" ({arch.model_type or 'model'}: {arch.num_hidden_layers} layers, hidden "
                  f"{arch.hidden_size}, heads {arch.num_attention_heads}/{arch.num_key_value_heads} kv)")
    rows += [
        ("policy", f"{model}, {pol.dtype}, lr {pol.optimizer.lr:g}"),
        ("parallel", f"TP={p.tensor} PP={p.pipeline} CP={p.context} DP={p.data} -> world size "
                     f"{cfg.world_size}"),
        ("rollout", f"{r.num_engines} x {r.engine} (TP {r.tensor_parallel}, "
                    f"{'colocated' if r.colocate else 'own devices'}), weights via {r.weight_transport}; "
                    f"T={r.sampling.temperature:g}, max_tokens {r.sampling.max_tokens}"),
    ]
    spec = r.speculative
    rows.append(("speculative", "off" if spec.method is None else
                 f"{spec.method}, {spec.num_speculative_tokens} tokens, {spec.draft_sample_method}"
                 + (f", from {spec.draft_model}" if spec.draft_model else "")))
    if d.kind is None:
        rows.append(("drafter", "none"))
    else:
        s = d.settings
        extra = ", ".join(f"{k}={v}" for k, v in s.model_dump().items()) if s is not None else ""
        how = (f"co-trained from {d.init or 'scratch'}, loss {d.loss}, lr {d.optimizer.lr:g}, pushed every "
               f"{d.push_every} step(s), taps via {d.tap_transport}") if d.cotrain else "fixed"
        rows.append(("drafter", f"{d.kind} ({how}); {extra}"))
    mb = cfg.micro_batches_per_update
    if pol.packing:
        from cotrain.config.derived import packing_budget

        packed = f"packed micro batches of up to {packing_budget(cfg)} tokens per DP rank"
    else:
        packed = f"{mb} padded micro batches of {pol.micro_batch_size} per DP rank"
    rows += [
        ("grpo", f"{g.num_steps} steps x {g.prompts_per_step} prompts x {g.group_size} samples = "
                 f"{cfg.rollout_batch_size} sequences/step; global batch {g.global_batch_size} "
                 f"({packed}); baseline {g.baseline}, "
                 f"kl_coef {g.kl_coef:g}"),
        ("data", cfg.data.task if cfg.data.task != "jsonl" else f"jsonl {cfg.data.jsonl.path}"),
        ("checkpoint", f"every {cfg.checkpoint.every} steps -> {cfg.checkpoint.dir}"
                       + (f", resume {cfg.checkpoint.resume}" if cfg.checkpoint.resume else "")),
    ]
    loggers = [n for n, on in (("tensorboard", cfg.logging.tensorboard), ("wandb", cfg.logging.wandb.enabled),
                               ("mlflow", cfg.logging.mlflow.enabled)) if on]
    rows.append(("logging", ", ".join(loggers) or "none"))
    return rows


def _short(source: str) -> str:
    import os

    if source.startswith("override "):
        return source.removeprefix("override ")
    try:
        return os.path.relpath(source)
    except ValueError:
        return source


def print_summary(cfg: CotrainConfig, title: str = "config OK") -> None:
    """Print the summary with rich when available, else as plain lines."""
    rows = summary_rows(cfg)
    try:
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:  # pragma: no cover
        print(title)
        for k, v in rows:
            print(f"  {k:12s} {v}")
        return
    table = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column(overflow="fold")
    for k, v in rows:
        table.add_row(Text(k), Text(v))
    Console().print(table)
