"""Benchmark: TapChannel (taps straight to the last stage) vs relaying taps stage to stage, on CPU.

A tiny random megatron-core GPTModel trains through ``forward_backward_pipelining_without_interleaving``
over gloo at PP=2 and PP=4 (one spawned group per PP degree; every arm runs in that same group). Tap
layers are spread over the stages (DFlash-style). Arms:

- none:  no taps (the training step alone).
- shm:   TapChannel, shared-memory transport.
- gloo:  TapChannel, gloo p2p on a dedicated group.
- relay: the naive design on a dedicated gloo group. After its forward of a microbatch, each stage
         receives the taps of all upstream stages from its predecessor (blocking), appends its own and
         sends the lot on; the last stage receives everything from its predecessor. Every feature
         crosses (last stage - source stage) hops. (Megatron's schedule is not modified: widening its
         own activation tensor would be the other way to relay, with the same hops and bytes.)

Like with like: the last stage gets its taps at the same point in every arm, in the loss function
right after its own forward of the microbatch, where a drafter would run (``channel.read(mb)``, or
the relay's receive); a relay stage receives after its forward too, so the relay's transfers get
the same head start as TapChannel's.

What counts as overhead: the time each rank's training thread spends in tap code, per step. For
TapChannel that is the sources' ``write`` (copy + stamp, or posting the gloo sends, back-pressure
included) plus the reader's wait for stamps and copy-out; for the relay, every stage's blocking
receive plus its concatenation and send. Reported per step as a fraction of that step's time (the
slowest rank's wall time): summed over the ranks (``tap_frac_all_ranks``: as if all of it lay on the
critical path, an upper bound) and for the busiest rank (``tap_frac_busiest_rank``), next to the
reader's part and the busiest source's part. The wall-time difference to ``none`` in the same round
(``step_overhead_vs_none``) is reported too, but on a shared 2-core machine it is noise-dominated.

Arms are interleaved round by round (one step of each per round, the order rotating from round to
round) so that load from other processes hits every arm alike; after warm-up rounds, every number is
reported as the median and the range (min, max) over the timed rounds.

Raw transfer rate of shm and gloo: stage 0 streams large taps to the last stage through the channel,
after one untimed pass that fills the ring; "MB_per_s" reads zero-copy views (the transport alone),
"MB_per_s_with_copy_out" uses ``read`` (one more memcpy on the reader); median and range over rounds.
The taps of shm, gloo and relay are checked to be identical.

Not measured here: the overhead inside a real GRPO co-training step (drafter forward/backward on the
taps, optimizer, rollouts); that comes with the co-training loop.

Writes the JSON (``--out``, default bench/results/tapchannel.json) and a PNG beside it, plus the
docs figure (docs/img/tapchannel.png, not in --quick mode), and prints the markdown table of
docs/tapchannel.md.

    python bench/tapchannel.py              # defaults: ~3 min on 2 cores
    python bench/tapchannel.py --quick      # about a minute, for a smoke test
    python bench/tapchannel.py --plot-only  # redraw the PNGs and reprint the table from the JSON

Raw transfer mode (no Megatron, no Ray): ``--device cuda`` streams taps from one process to another
through ``cuda_ipc``, each process seeing one GPU as Ray's actors do (the same GPU on a one-GPU
machine: a same-device copy, not a transfer between GPUs); ``--transfer`` runs the same code on the
CPU through ``shm``. Writes ``<--out-dir>/tapchannel_transfer_<device>.json``: rates with zero-copy
reads and with copy-out, the reader's summed wait for stamps per round, the writer's time per
microbatch, the latency of one microbatch (see transfer_rank)::

    python bench/tapchannel.py --device cuda --out $OUT    # 3 taps of [8192, 1024] bf16 per microbatch
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from bench.paths import recorded_args  # noqa: E402

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

MODES = ("none", "shm", "gloo", "relay")


def arch_dict(args):
    return dict(model_type="qwen3", vocab_size=128, hidden_size=args.hidden, intermediate_size=2 * args.hidden,
                num_hidden_layers=args.layers, num_attention_heads=4, num_key_value_heads=2,
                head_dim=args.hidden // 4, max_position_embeddings=max(256, args.seq), tie_word_embeddings=False)


def tap_layers(num_layers: int, count: int) -> list[int]:
    """``count`` layer outputs spread from layer 1 to layer L-2 (DFlash-style)."""
    lo, hi = 1, num_layers - 2
    return sorted({round(lo + (hi - lo) * i / (count - 1)) for i in range(count)})


# ----- the naive relay ------------------------------------------------------------------------------------

class Relay:
    """Taps relayed hop by hop along the pipeline on a dedicated gloo group (see module doc).

    Counts on this rank, per step: ``recv_s`` (blocked in the receive from the previous stage) and
    ``work_s`` (concatenating, waiting for the previous send, posting the next). A middle stage does
    both right after its forward; the last stage in :meth:`read`, where TapChannel's reader reads."""

    def __init__(self, model, layout, layers, hidden, group):
        from cotrain.tapchannel.hooks import stage_layer_offset, unwrap_model

        self.model = unwrap_model(model)
        self.layout, self.group, self.hidden = layout, group, hidden
        self.rank = dist.get_rank()
        self.stage = layout.stage_of_rank(self.rank)
        self.last = layout.pp_size - 1
        stage_of = {i: layout.stage_of_layer(i) for i in layers}
        self.upstream = [i for i in layers if stage_of[i] < self.stage]  # arrive from the previous stage
        self.own = [i for i in layers if stage_of[i] == self.stage]
        self.n = 0
        self.mine: dict[int, torch.Tensor] = {}
        self.inflight = []
        self.max_inflight = 2 * layout.pp_size  # sends in flight, held by reference (gloo: 2 x slots, slots = pp)
        self.recv_s = self.work_s = 0.0
        self.bytes_sent = 0
        off = stage_layer_offset(self.model)
        self.handles = [self.model.register_forward_pre_hook(self._pre), self.model.register_forward_hook(self._post)]
        for i in self.own:
            self.handles.append(self.model.decoder.layers[i - off].register_forward_hook(
                lambda m, a, out, i=i: self.mine.__setitem__(i, self._tokens(out[0]))))

    def _tokens(self, h):
        s, b, w = h.shape
        return h.detach().transpose(0, 1).reshape(b * s, w)[: self.n]

    def set_microbatch(self, n):
        self.n = n

    def _pre(self, module, args):
        self.mine = {}

    def _parts(self) -> tuple[list[torch.Tensor], float]:
        """Upstream taps (blocking receive) + this stage's own; returns them and when the work began."""
        parts = []
        if self.upstream:
            t0 = time.perf_counter()
            buf = torch.empty(len(self.upstream), self.n, self.hidden)
            dist.irecv(buf, src=self.layout.stage_ranks[self.stage - 1], group=self.group).wait()
            self.recv_s += time.perf_counter() - t0
            parts.append(buf)
        t0 = time.perf_counter()
        return parts + [self.mine[i][None] for i in self.own], t0

    def _post(self, module, args, out):
        if self.stage == self.last:
            return  # the last stage gets its taps in read(), like TapChannel's reader
        parts, t0 = self._parts()
        if parts:
            while len(self.inflight) >= self.max_inflight:  # as much buffering as TapChannel's gloo writer
                self.inflight.pop(0)[0].wait()
            payload = torch.cat(parts).contiguous()
            self.inflight.append((dist.isend(payload, dst=self.layout.stage_ranks[self.stage + 1], group=self.group),
                                  payload))
            self.bytes_sent += payload.numel() * payload.element_size()
        self.work_s += time.perf_counter() - t0

    def read(self) -> dict[int, torch.Tensor]:
        """Last stage, after its forward of the microbatch: every tap of it, upstream and own."""
        parts, t0 = self._parts()
        allt = torch.cat(parts)
        out = {i: allt[k] for k, i in enumerate(self.upstream + self.own)}
        self.work_s += time.perf_counter() - t0
        return out

    def finish(self):
        t0 = time.perf_counter()
        while self.inflight:
            self.inflight.pop(0)[0].wait()
        self.work_s += time.perf_counter() - t0

    def remove(self):
        for h in self.handles:
            h.remove()


# ----- per-rank body ------------------------------------------------------------------------------------

def bench_rank(rank, world, args, state):
    from tqdm import tqdm

    from cotrain.models.hf_arch import ArchSpec
    from cotrain.models.megatron_compat import model_parallel_manual_seed
    from cotrain.models.megatron_model import build_gpt_model, load_megatron_state
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from cotrain.tapchannel import PipelineLayout, TapChannel, TapSpec, attach_tap_hooks, tap_specs

    pp = world
    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
    model_parallel_manual_seed(0)
    arch = ArchSpec.from_hf(arch_dict(args))
    model = build_gpt_model(arch)
    if state is not None:
        load_megatron_state(model, state, arch)
    fb = get_forward_backward_func()
    layout = PipelineLayout.from_megatron(model)
    layers = tap_layers(arch.num_layers, args.taps)
    specs = tap_specs(layers, layout, arch.hidden_size)
    last = ps.is_pipeline_last_stage()
    S, B, M, H = args.seq, args.micro_batch, args.microbatches, arch.hidden_size
    g = torch.Generator().manual_seed(1)
    tokens = [int(t) for t in torch.randint(S * B // 2, S * B + 1, (M,), generator=g)]  # uneven real lengths
    data = []
    for n in tokens:
        ids = torch.randint(1, arch.vocab_size, (B, S + 1), generator=g)
        data.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), n))
    pos = torch.arange(S)[None].expand(B, S)

    chans = {t: TapChannel(specs, layout, t, max_tokens=S * B, name=f"bench-{t}", timeout_s=120) for t in ("shm", "gloo")}
    relay_group = dist.new_group(list(layout.stage_ranks), backend="gloo")
    out = {"rank": rank, "stage": layout.stage_of_rank(rank), "layers": layers, "tokens": tokens}
    checks = {}
    rounds = args.warmup + args.steps
    bar = tqdm(total=len(MODES) * rounds, desc=f"PP={pp} steps", leave=False, disable=rank != 0 or not args.progress)
    # per arm, per timed round, on this rank: wall and CPU time of the step; time in tap code (tap_s),
    # split into writing / relaying (write_s) and getting the taps on the last stage (read_s, of which
    # reader_wait_s is waiting); bytes that crossed
    keys = ("step_s", "cpu_s", "tap_s", "write_s", "backpressure_s", "read_s", "reader_wait_s", "moved_bytes")
    per_mode = {m: {k: [] for k in keys} for m in MODES}
    for rnd in range(rounds):
        # interleaved (one step of each arm per round) in an order that rotates from round to round, so
        # that load from other processes on the machine and the position in the round hit every arm alike
        order = MODES[rnd % len(MODES):] + MODES[:rnd % len(MODES)]
        for mode in order:
            chan = chans.get(mode)
            hooks = attach_tap_hooks(model, chan) if chan is not None else None
            relay = Relay(model, layout, layers, H, relay_group) if mode == "relay" else None
            got = {}
            if chan is not None:
                chan.begin_step(M)

            def forward_step(it, model, hooks=hooks, relay=relay, chan=chan, got=got):
                mb, (ids, labels, n) = next(it)
                if hooks is not None:
                    hooks.set_microbatch(mb, num_tokens=n)
                if relay is not None:
                    relay.set_microbatch(n)
                o = model(ids, pos, None, labels=labels)

                def loss_func(per_token):
                    # every arm gets the taps here: after this stage's forward, where the drafter runs
                    if last and chan is not None:
                        got[mb] = chan.read(mb)
                    elif last and relay is not None:
                        got[mb] = relay.read()
                    loss = per_token.float().mean()
                    return loss, {"loss": loss.detach()}

                return o, loss_func

            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fb(forward_step_func=forward_step, data_iterator=iter(list(enumerate(data))), model=[model],
               num_microbatches=M, seq_length=S, micro_batch_size=B, forward_only=False)
            if relay is not None:
                relay.finish()  # a relay's last sends are part of its step
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            model.zero_grad(set_to_none=True)
            stats = chan.end_step() if chan is not None else None
            if rnd >= args.warmup:
                rec = per_mode[mode]
                rec["step_s"].append(dt)
                rec["cpu_s"].append(dc)
                if stats is not None:
                    write, read = stats["write_s"], stats["reader_wait_s"] + stats["reader_copy_s"]
                    vals = dict(tap_s=write + read, write_s=write, backpressure_s=stats["backpressure_s"], read_s=read,
                                reader_wait_s=stats["reader_wait_s"], moved_bytes=stats["moved_bytes"])
                elif relay is not None:
                    t = relay.recv_s + relay.work_s
                    vals = dict(tap_s=t, write_s=0.0 if last else t, backpressure_s=0.0, read_s=t if last else 0.0,
                                reader_wait_s=relay.recv_s if last else 0.0, moved_bytes=relay.bytes_sent)
                else:
                    vals = dict(tap_s=0.0, write_s=0.0, backpressure_s=0.0, read_s=0.0, reader_wait_s=0.0, moved_bytes=0)
                for k, v in vals.items():
                    rec[k].append(v)
            if last and rnd == rounds - 1 and mode != "none":
                checks[mode] = got
            if hooks is not None:
                hooks.remove()
            if relay is not None:
                relay.remove()
            bar.update(1)
    out["modes"] = per_mode
    bar.close()

    if last:  # the three ways must deliver the same taps
        ref = checks["shm"]
        out["identical"] = all(
            sorted(checks[m][mb]) == layers and all(torch.equal(checks[m][mb][i], ref[mb][i]) for i in layers)
            for m in ("gloo", "relay") for mb in range(M))

    # raw transfer rate: stage 0 -> last stage, large taps, through each channel (write + read)
    out["raw"] = {}
    src, dst = layout.stage_ranks[0], layout.reader_rank
    big_layer = layers[0]
    rspec = [TapSpec(big_layer, args.raw_width).resolve(layout)]
    for t in ("shm", "gloo"):
        ch = TapChannel(rspec, layout, t, max_tokens=args.raw_tokens, name=f"raw-{t}", timeout_s=120)
        x = torch.randn(args.raw_tokens, args.raw_width, generator=torch.Generator().manual_seed(7))  # same on all ranks
        nb = x.numel() * x.element_size()
        rates = {"view": [], "copy": []}
        # round 0 fills the ring once (first-touch page faults) and is not timed; then copy/view alternate
        for rnd in range(1 + 2 * args.raw_rounds):
            how = "copy" if rnd % 2 else "view"
            ch.begin_step(args.raw_iters)
            dist.barrier()
            t0 = time.perf_counter()
            for i in range(args.raw_iters):
                if rank == src:
                    ch.write(big_layer, i, x)
                if rank == dst:
                    if how == "copy":
                        y = ch.read(i)[big_layer]
                    else:
                        with ch.reading(i) as views:
                            y = views[big_layer]
                    if i == 0:
                        assert torch.equal(y, x), f"{t}: the raw transfer delivered other data"
            dt = time.perf_counter() - t0
            ch.end_step()
            if rnd > 0:
                rates[how].append(nb * args.raw_iters / dt / 1e6)
        if rank == dst:
            out["raw"][t] = {"payload_bytes": nb, "iters": args.raw_iters, "MB_per_s": rng(rates["view"]),
                             "MB_per_s_with_copy_out": rng(rates["copy"])}
        ch.close()
    for c in chans.values():
        c.close()
    return out


def reference_state(rank, world, args):
    from cotrain.models.hf_arch import ArchSpec
    from cotrain.models.megatron_compat import model_parallel_manual_seed
    from cotrain.models.megatron_model import build_gpt_model, stage_state_global
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_manual_seed(0)
    return stage_state_global(build_gpt_model(ArchSpec.from_hf(arch_dict(args))))


# ----- summary, table and plot ---------------------------------------------------------------------------

def rng(xs) -> dict:
    """Median and range of the rounds."""
    xs = list(xs)
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def summarize(pp, ranks, args):
    """Per arm: every number per timed round first (a step = the slowest rank's wall time; fractions
    are of that round's step), then its median and range over the rounds."""
    last, sources = ranks[-1], ranks[:-1]
    K = args.steps
    step = {m: [max(r["modes"][m]["step_s"][k] for r in ranks) for k in range(K)] for m in MODES}

    def per_round(f):
        return rng(f(k) for k in range(K))

    modes = {}
    for m in MODES:
        st = step[m]
        col = lambda key, rs: [[r["modes"][m][key][k] for r in rs] for k in range(K)]  # noqa: E731
        tap, write = col("tap_s", ranks), col("write_s", sources)
        d = {
            "step_ms": rng(x * 1e3 for x in st),
            "step_overhead_vs_none": per_round(lambda k: st[k] / step["none"][k] - 1),
            "cpu_s_busiest_rank": per_round(lambda k: max(r["modes"][m]["cpu_s"][k] for r in ranks)),
        }
        if m != "none":
            lm = last["modes"][m]
            d.update(
                tap_frac_all_ranks=per_round(lambda k: sum(tap[k]) / st[k]),
                tap_frac_busiest_rank=per_round(lambda k: max(tap[k]) / st[k]),
                reader_frac=per_round(lambda k: lm["read_s"][k] / st[k]),
                reader_wait_frac=per_round(lambda k: lm["reader_wait_s"][k] / st[k]),
                source_write_frac_busiest=per_round(lambda k: max(write[k]) / st[k]),
                sources_write_frac=per_round(lambda k: sum(write[k]) / st[k]),
                reader_ms=rng(x * 1e3 for x in lm["read_s"]),
                source_write_ms_busiest=per_round(lambda k: 1e3 * max(write[k])),
                source_backpressure_ms_busiest=per_round(
                    lambda k: 1e3 * max(r["modes"][m]["backpressure_s"][k] for r in sources)),
                bytes_moved_per_step=(sum(r["modes"][m]["moved_bytes"][0] for r in ranks) if m == "relay"
                                      else lm["moved_bytes"][0]),
            )
        modes[m] = d
    med = lambda m, key: modes[m][key]["median"]  # noqa: E731
    raw = last["raw"]
    ratios = {
        "relay_over_shm_tap_time": med("relay", "tap_frac_all_ranks") / med("shm", "tap_frac_all_ranks"),
        "relay_over_gloo_tap_time": med("relay", "tap_frac_all_ranks") / med("gloo", "tap_frac_all_ranks"),
        "relay_over_shm_reader_time": med("relay", "reader_frac") / med("shm", "reader_frac"),
        "relay_over_tap_bytes": modes["relay"]["bytes_moved_per_step"] / modes["shm"]["bytes_moved_per_step"],
        "shm_over_gloo_raw_rate": raw["shm"]["MB_per_s"]["median"] / raw["gloo"]["MB_per_s"]["median"],
        "shm_over_gloo_raw_rate_with_copy_out": (raw["shm"]["MB_per_s_with_copy_out"]["median"]
                                                 / raw["gloo"]["MB_per_s_with_copy_out"]["median"]),
    }
    return {"pp": pp, "tap_layers": last["layers"], "tokens_per_microbatch": last["tokens"], "modes": modes,
            "raw_transfer": raw, "ratios": ratios, "taps_identical_shm_gloo_relay": last["identical"]}


def _pct(r: dict) -> str:
    return f"{100 * r['median']:.2f}% ({100 * r['min']:.2f}–{100 * r['max']:.2f})"


def _num(r: dict, fmt: str = "{:.0f}") -> str:
    return f"{fmt.format(r['median'])} ({fmt.format(r['min'])}–{fmt.format(r['max'])})"


def markdown(result: dict) -> str:
    """The tables of docs/tapchannel.md, from the JSON (median (min–max) over the timed rounds)."""
    rows = result["results"]
    lines = ["| arm | PP | tap time, all ranks | busiest rank | last stage gets its taps | of which waiting "
             "| busiest source writes | step vs `none` (paired) | step (ms) |",
             "|---|---|---|---|---|---|---|---|---|"]
    for mode in ("shm", "gloo", "relay"):
        for r in rows:
            m = r["modes"][mode]
            lines.append(f"| {mode} | {r['pp']} | **{_pct(m['tap_frac_all_ranks'])}** | {_pct(m['tap_frac_busiest_rank'])} "
                         f"| {_pct(m['reader_frac'])} | {_pct(m['reader_wait_frac'])} "
                         f"| {_pct(m['source_write_frac_busiest'])} | {_pct(m['step_overhead_vs_none'])} "
                         f"| {_num(m['step_ms'])} |")
    for r in rows:
        lines.append(f"| none | {r['pp']} | | | | | | | {_num(r['modes']['none']['step_ms'])} |")
    lines += ["", "| | " + " | ".join(f"PP={r['pp']}" for r in rows) + " |", "|---|" + "---|" * len(rows)]

    def row(name, f):
        lines.append(f"| {name} | " + " | ".join(f(r) for r in rows) + " |")

    row("relay / TapChannel (shm) tap time, all ranks",
        lambda r: f"{r['ratios']['relay_over_shm_tap_time']:.1f}x")
    row("relay / TapChannel (gloo) tap time, all ranks",
        lambda r: f"{r['ratios']['relay_over_gloo_tap_time']:.1f}x")
    row("bytes moved per step, TapChannel / relay",
        lambda r: f"{r['modes']['shm']['bytes_moved_per_step'] / 1e6:.2f} MB / "
                  f"{r['modes']['relay']['bytes_moved_per_step'] / 1e6:.2f} MB")
    for t in ("shm", "gloo"):
        row(f"raw rate {t}, zero-copy read (MB/s)", lambda r, t=t: _num(r["raw_transfer"][t]["MB_per_s"]))
        row(f"raw rate {t}, with copy-out (MB/s)", lambda r, t=t: _num(r["raw_transfer"][t]["MB_per_s_with_copy_out"]))
    row("taps identical (shm, gloo, relay)", lambda r: str(r["taps_identical_shm_gloo_relay"]))
    return "\n".join(lines)


def plot(rows, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    fig, ax = plt.subplots(1, 4, figsize=(19, 4.4))
    pps = [r["pp"] for r in rows]
    xt = (range(len(pps)), [f"PP={p}" for p in pps])
    width = 0.2
    colors = {"none": "#999999", "shm": "#1f77b4", "gloo": "#2ca02c", "relay": "#d62728"}

    def bars(a, xs, stats, scale, **kw):
        med = [s["median"] * scale for s in stats]
        err = [[m - s["min"] * scale for m, s in zip(med, stats)], [s["max"] * scale - m for m, s in zip(med, stats)]]
        a.bar(xs, med, width, yerr=err, capsize=2, **kw)
        return med

    def label(a, xs, vals, fmt):
        for x, v in zip(xs, vals):
            a.annotate(fmt.format(v), (x, v), ha="center", va="bottom", fontsize=7, xytext=(0, 2),
                       textcoords="offset points")

    for k, mode in enumerate(MODES):
        xs = [i + (k - 1.5) * width for i in range(len(pps))]
        bars(ax[0], xs, [r["modes"][mode]["step_ms"] for r in rows], 1, label=mode, color=colors[mode])
    ax[0].set_xticks(*xt)
    ax[0].set_ylabel("ms (median, bars = min..max over rounds)")
    ax[0].set_title("training step (wall, slowest rank)")
    ax[0].legend(fontsize=8)

    top = 2.0
    for k, mode in enumerate(("shm", "gloo", "relay")):
        xs = [i + (k - 1) * width for i in range(len(pps))]
        tot = bars(ax[1], xs, [r["modes"][mode]["tap_frac_all_ranks"] for r in rows], 100, color=colors[mode],
                   label=f"{mode}: all ranks' tap time")
        rd = [100 * r["modes"][mode]["reader_frac"]["median"] for r in rows]
        ax[1].bar(xs, rd, width * 0.5, color="white", alpha=0.55, hatch="///", edgecolor=colors[mode])
        label(ax[1], xs, tot, "{:.2f}%")
        top = max(top, *(100 * r["modes"][mode]["tap_frac_all_ranks"]["max"] for r in rows))
    ax[1].axhline(2.0, ls="--", c="k", lw=1, label="goal 2%")
    handles, _ = ax[1].get_legend_handles_labels()
    handles.append(Patch(facecolor="white", hatch="///", edgecolor="k", label="of which the last stage getting its taps"))
    ax[1].set_ylim(0, 1.35 * top)
    ax[1].set_xticks(*xt)
    ax[1].set_ylabel("% of the training step (median, min..max)")
    ax[1].set_title("time in tap code: sources' writes + reader")
    ax[1].legend(handles=handles, fontsize=7)

    for k, mode in enumerate(("shm", "relay")):
        xs = [i + (k - 0.5) * width for i in range(len(pps))]
        vals = [r["modes"][mode]["bytes_moved_per_step"] / 1e6 for r in rows]
        ax[2].bar(xs, vals, width, label="TapChannel (each feature once)" if mode == "shm" else "relay (per hop)",
                  color=colors[mode])
        label(ax[2], xs, vals, "{:.2f}")
    ax[2].set_ylim(0, 1.3 * max(r["modes"]["relay"]["bytes_moved_per_step"] / 1e6 for r in rows))
    ax[2].set_xticks(*xt)
    ax[2].set_ylabel("MB per step")
    ax[2].set_title("bytes moved")
    ax[2].legend(fontsize=8)

    for k, (t, key, hatch) in enumerate([("shm", "MB_per_s", None), ("shm", "MB_per_s_with_copy_out", "//"),
                                         ("gloo", "MB_per_s", None), ("gloo", "MB_per_s_with_copy_out", "//")]):
        xs = [i + (k - 1.5) * width for i in range(len(pps))]
        vals = bars(ax[3], xs, [r["raw_transfer"][t][key] for r in rows], 1, color=colors[t], hatch=hatch,
                    edgecolor="white", label=f"{t}, {'zero-copy read' if hatch is None else 'read + copy-out'}")
        label(ax[3], xs, vals, "{:.0f}")
    ax[3].set_ylim(0, 1.45 * max(r["raw_transfer"][t]["MB_per_s"]["max"] for r in rows for t in ("shm", "gloo")))
    ax[3].set_xticks(*xt)
    ax[3].set_ylabel("MB/s (stage 0 -> last stage)")
    ax[3].set_title("raw transfer rate")
    ax[3].legend(fontsize=7)
    fig.suptitle("TapChannel vs stage-to-stage relay on CPU (tiny GPTModel, gloo pipeline, 1 thread per rank, "
                 "shared 2-core machine; arms interleaved per round)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def write_outputs(result: dict, args) -> list[Path]:
    """A PNG beside the JSON, plus the docs figure (``--png``; by default only for full runs)."""
    pngs = [args.out.with_suffix(".png")]
    if args.png is not None and args.png != pngs[0]:
        pngs.append(args.png)
    for p in pngs:
        plot(result["results"], p)
    return pngs


# ----- raw tap transfer between two processes: --device cuda (cuda_ipc, one GPU) / cpu (shm) -------------

def transfer_rank(rank, world, args):
    """Rank 0 streams ``--ipc-taps`` taps of [tokens, width] per microbatch to rank 1 (the reader)
    through a TapChannel: cuda_ipc on CUDA (each process sees one GPU, as under Ray: the same GPU here),
    shm on CPU. Per round of ``--ipc-iters`` microbatches: the reader's rate (payload / time from a
    barrier to its last read), its summed wait for stamps, the writer's time per microbatch; then the
    latency of one microbatch (the reader's wait from a barrier until the stamp, the writer's copy and
    stream sync included)."""
    import os

    cuda = args.device == "cuda"
    if cuda:
        os.environ["CUDA_VISIBLE_DEVICES"] = os.environ.get("TAPBENCH_GPU", "0")  # one GPU per process, as Ray does
        torch.cuda.set_device(0)
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    from cotrain.tapchannel import PipelineLayout, TapChannel, TapSpec

    n_taps, tokens, width = args.ipc_taps, args.ipc_tokens, args.ipc_width
    dtype = getattr(torch, args.ipc_dtype)
    layout = PipelineLayout.even([0, 1], num_layers=2 * n_taps)  # layers 0 .. n_taps-1 on stage 0 (rank 0)
    specs = [TapSpec(i, width, dtype).resolve(layout) for i in range(n_taps)]
    transport = "cuda_ipc" if cuda else "shm"
    ch = TapChannel(specs, layout, transport, max_tokens=tokens, slots=args.ipc_slots, timeout_s=120,
                    name="ipc-bench", device=device if cuda else None)
    g = torch.Generator().manual_seed(11)
    xs = [torch.randn(tokens, width, generator=g).to(device=device, dtype=dtype) for _ in range(n_taps)]
    payload = sum(x.numel() * x.element_size() for x in xs)
    sync = (lambda: torch.cuda.synchronize(device)) if cuda else (lambda: None)  # noqa: E731
    iters = args.ipc_iters
    out = {"rank": rank, "transport": transport, "payload_bytes": payload, "iters": iters,
           "rate": {"view": [], "copy": []}, "reader_wait_s": {"view": [], "copy": []}, "write_s": [],
           "latency_s": [], "writer_latency_s": []}
    # round 0: every microbatch checked (and the ring filled once, first-touch costs); not timed
    for rnd in range(1 + 2 * args.ipc_rounds):
        how = "copy" if rnd % 2 else "view"
        ch.begin_step(iters)
        dist.barrier()
        sync()
        t0 = time.perf_counter()
        for mb in range(iters):
            if rank == 0:
                w0 = time.perf_counter()
                for t, x in enumerate(xs):
                    ch.write(t, mb, x + mb if rnd == 0 else x)
                if rnd > 0:
                    out["write_s"].append(time.perf_counter() - w0)
            elif how == "copy":
                ch.read(mb)
            else:
                with ch.reading(mb) as got:  # zero-copy views, released at the end of the block
                    if rnd == 0:
                        for t, x in enumerate(xs):
                            assert torch.equal(got[t], x + mb), f"{transport}: microbatch {mb}, tap {t}: other data"
        sync()
        dt = time.perf_counter() - t0
        stats = ch.end_step()
        if rank == 1 and rnd > 0:
            out["rate"][how].append(payload * iters / dt)
            out["reader_wait_s"][how].append(stats["reader_wait_s"])
    for _ in range(args.ipc_rounds):  # latency of one microbatch
        ch.begin_step(1)
        dist.barrier()
        t0 = time.perf_counter()
        if rank == 0:
            for t, x in enumerate(xs):
                ch.write(t, 0, x)
            out["writer_latency_s"].append(time.perf_counter() - t0)
        else:
            ch.read(0)
            sync()
            out["latency_s"].append(time.perf_counter() - t0)
        ch.end_step()
    dist.barrier()
    if cuda:
        from cotrain.tapchannel.transports.cuda_ipc import visible_gpus

        out["gpus_seen"] = visible_gpus()
        out["device_name"] = torch.cuda.get_device_name(device)
    ch.close()
    return out


def transfer_main(args) -> dict:
    """--device cuda / --transfer: transfer_rank on two processes, summarised into args.out_dir."""
    from cotrain.distributed import spawn_local

    t0 = time.time()
    writer, reader = spawn_local(transfer_rank, 2, args, timeout_s=600)
    cuda = args.device == "cuda"
    result = {
        "what": ("cuda_ipc tap transfer between two processes that each see one GPU: the same GPU, so a "
                 "same-device copy (not the between-GPU transfer the paper's 27-39 GB/s measures)") if cuda else
                "shm tap transfer between two processes on the CPU (smoke run of the same code path)",
        "transport": reader["transport"], "device": reader.get("device_name", "cpu"), "torch": torch.__version__,
        "gpus_seen": [writer.get("gpus_seen"), reader.get("gpus_seen")],
        "taps": args.ipc_taps, "tokens": args.ipc_tokens, "width": args.ipc_width, "dtype": args.ipc_dtype,
        "slots": args.ipc_slots, "payload_bytes_per_microbatch": reader["payload_bytes"], "iters_per_round": reader["iters"],
        "GB_per_s_zero_copy_read": rng([r / 1e9 for r in reader["rate"]["view"]]),
        "GB_per_s_with_copy_out": rng([r / 1e9 for r in reader["rate"]["copy"]]),
        "reader_wait_s_per_round_zero_copy": rng(reader["reader_wait_s"]["view"]),
        "reader_wait_s_per_round_with_copy_out": rng(reader["reader_wait_s"]["copy"]),
        "writer_s_per_microbatch": rng(writer["write_s"]),
        "latency_s_one_microbatch": rng(reader["latency_s"]),
        "writer_s_one_microbatch": rng(writer["writer_latency_s"]),
        "command": " ".join(["python", "bench/tapchannel.py", *sys.argv[1:]]),
    }
    result["wall_s"] = time.time() - t0
    args.out_dir.mkdir(parents=True, exist_ok=True)
    path = args.out_dir / f"tapchannel_transfer_{args.device}.json"
    path.write_text(json.dumps(result, indent=1))
    mb = result["payload_bytes_per_microbatch"] / 2**20
    print(f"{result['transport']} ({result['device']}), {mb:.0f} MiB per microbatch: "
          f"{result['GB_per_s_zero_copy_read']['median']:.1f} GB/s zero-copy read, "
          f"{result['GB_per_s_with_copy_out']['median']:.1f} GB/s with copy-out; one microbatch in "
          f"{result['latency_s_one_microbatch']['median'] * 1e3:.2f} ms")
    print(f"wrote {path}")
    return result


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--taps", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1, help="untimed rounds")
    p.add_argument("--steps", type=int, default=10, help="timed rounds (one step of every arm each)")
    p.add_argument("--raw-tokens", type=int, default=2048)
    p.add_argument("--raw-width", type=int, default=1024)
    p.add_argument("--raw-iters", type=int, default=16)
    p.add_argument("--raw-rounds", type=int, default=5)
    p.add_argument("--quick", action="store_true", help="fewer and smaller steps (smoke test)")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNGs and reprint the tables from the JSON")
    p.add_argument("--out", type=Path, default=None,
                   help="JSON (a PNG is written beside it); default bench/results/tapchannel.json "
                        "(tapchannel-quick.json with --quick)")
    p.add_argument("--png", type=Path, default=None,
                   help="another copy of the figure; default docs/img/tapchannel.png, none with --quick")
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu",
                   help="cuda: only the raw cuda_ipc transfer between two processes on one GPU (no Megatron)")
    p.add_argument("--transfer", action="store_true", help="only the raw transfer, on --device (cpu: shm, a smoke run)")
    p.add_argument("--ipc-taps", type=int, default=3, help="transfer mode: taps per microbatch")
    p.add_argument("--ipc-tokens", type=int, default=8192, help="transfer mode: tokens per microbatch")
    p.add_argument("--ipc-width", type=int, default=1024, help="transfer mode: tap width (Qwen3-0.6B's hidden size)")
    p.add_argument("--ipc-dtype", choices=["bfloat16", "float32"], default="bfloat16")
    p.add_argument("--ipc-slots", type=int, default=2)
    p.add_argument("--ipc-iters", type=int, default=16, help="transfer mode: microbatches per round")
    p.add_argument("--ipc-rounds", type=int, default=5, help="transfer mode: timed rounds per read kind")
    p.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results",
                   help="transfer mode: folder of tapchannel_transfer_<device>.json (--out DIR: the same)")
    args = p.parse_args()
    if args.device == "cuda" or args.transfer:
        args.out_dir = args.out or args.out_dir  # the GPU check's interface: --device cuda --out DIR
        transfer_main(args)
        return
    if args.out is None:
        args.out = ROOT / "bench" / "results" / f"tapchannel{'-quick' if args.quick else ''}.json"
    if args.png is None and not args.quick:
        args.png = ROOT / "docs" / "img" / "tapchannel.png"
    if args.quick:
        args.steps, args.seq, args.microbatches, args.raw_iters, args.raw_rounds = 2, 64, 4, 6, 1

    if args.plot_only:
        result = json.loads(args.out.read_text())
        print(markdown(result))
        print("wrote " + ", ".join(map(str, write_outputs(result, args))))
        return

    from tqdm import tqdm

    from cotrain.distributed import spawn_local

    t_start = time.time()
    state = spawn_local(reference_state, 1, args, timeout_s=300)[0]
    rows = []
    for pp in tqdm(args.pp, desc="PP degrees", disable=not args.progress):
        ranks = spawn_local(bench_rank, pp, args, state, timeout_s=1800)
        rows.append(summarize(pp, ranks, args))
    config = recorded_args(args)
    config["command"] = " ".join(["python", "bench/tapchannel.py", *sys.argv[1:]])
    config["threads_per_rank"] = 1
    config["wall_s"] = time.time() - t_start
    config["date"] = time.strftime("%Y-%m-%d")
    result = {"config": config, "results": rows}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=1))
    pngs = write_outputs(result, args)
    print(markdown(result))
    print(f"wrote {args.out}, " + ", ".join(map(str, pngs)) + f" in {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
