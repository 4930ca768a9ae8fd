"""Benchmark: TapChannel (taps straight to the last stage) vs relaying taps stage to stage, on CPU.

A tiny random megatron-core GPTModel trains through ``forward_backward_pipelining_without_interleaving``
over gloo at PP=2 and PP=4 (one spawned group per PP degree; every mode runs in that same group, one
after the other). Tap layers are spread over the stages (DFlash-style); the last stage "reads" the taps
for each microbatch in its loss function, where a drafter would run. Modes:

- none:  no taps (the training step alone).
- shm:   TapChannel, shared-memory transport.
- gloo:  TapChannel, gloo p2p on a dedicated group.
- relay: the naive design. Each stage receives the taps of all upstream stages for the microbatch at
         the start of its forward (blocking recv on a dedicated gloo group), appends its own, and sends
         the lot to the next stage after its forward; the last stage receives everything from its
         predecessor. Every feature crosses (last stage - source stage) hops and every hop is on the
         pipeline's critical path. (Megatron's schedule is not modified: widening its own activation
         tensor would be the other way to relay, with the same hops and bytes.)

Per PP degree and mode: step time (median over timed steps of the slowest rank; the modes run
interleaved, one step of each per round, so that outside load hits them alike), CPU time of the
busiest rank, the last stage's wait
for taps as a fraction of the step (goal <= 2%), the sources' write time, bytes moved per step. Raw
transfer rate of shm and gloo: stage 0 streams large taps to the last stage through the channel,
after one untimed pass that fills the ring; "MB_per_s" reads zero-copy views (the transport alone),
"MB_per_s_with_copy_out" uses ``read`` (one more memcpy on the reader); medians over rounds. The taps of shm, gloo and relay are checked to be identical. Writes
bench/results/tapchannel.json and docs/img/tapchannel.png.

    python bench/tapchannel.py            # defaults: a few minutes on 2 cores
    python bench/tapchannel.py --quick    # about a minute, for a smoke test
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
    """Taps relayed hop by hop along the pipeline on a dedicated gloo group (see module doc)."""

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
        self.mb, self.n = 0, 0
        self.carried: torch.Tensor | None = None
        self.mine: dict[int, torch.Tensor] = {}
        self.inflight = []
        self.delivered: dict[int, dict[int, torch.Tensor]] = {}
        self.wait_s = self.send_s = 0.0
        self.bytes_sent = 0
        off = stage_layer_offset(self.model)
        self.handles = [self.model.register_forward_pre_hook(self._pre), self.model.register_forward_hook(self._post)]
        for i in self.own:
            self.handles.append(self.model.decoder.layers[i - off].register_forward_hook(
                lambda m, a, out, i=i: self.mine.__setitem__(i, self._tokens(out[0]))))

    def _tokens(self, h):
        s, b, w = h.shape
        return h.detach().transpose(0, 1).reshape(b * s, w)[: self.n]

    def set_microbatch(self, mb, n):
        self.mb, self.n = mb, n

    def _pre(self, module, args):
        self.mine = {}
        self.carried = None
        if self.upstream:
            t0 = time.perf_counter()
            buf = torch.empty(len(self.upstream), self.n, self.hidden)
            dist.irecv(buf, src=self.layout.stage_ranks[self.stage - 1], group=self.group).wait()
            self.carried = buf
            self.wait_s += time.perf_counter() - t0

    def _post(self, module, args, out):
        t0 = time.perf_counter()
        parts = ([self.carried] if self.carried is not None else []) + [self.mine[i][None] for i in self.own]
        if self.stage == self.last:
            allt = torch.cat(parts) if parts else None
            self.delivered[self.mb] = {i: allt[k] for k, i in enumerate(self.upstream + self.own)}
        elif parts:
            while self.inflight:  # the previous microbatch's send must be done before the next goes out
                self.inflight.pop(0)[0].wait()
            payload = torch.cat(parts).contiguous()
            self.inflight.append((dist.isend(payload, dst=self.layout.stage_ranks[self.stage + 1], group=self.group),
                                  payload))
            self.bytes_sent += payload.numel() * payload.element_size()
        self.send_s += time.perf_counter() - t0

    def read(self, mb):
        return self.delivered.pop(mb)

    def finish(self):
        while self.inflight:
            self.inflight.pop(0)[0].wait()

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

    from cotrain.tapchannel import PipelineLayout, TapChannel, attach_tap_hooks, tap_specs

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
    out = {"rank": rank, "stage": layout.stage_of_rank(rank), "layers": layers, "tokens": tokens, "modes": {}}
    checks = {}
    units = len(MODES) * (args.warmup + args.steps)
    bar = tqdm(total=units, desc=f"PP={pp} steps", leave=False, disable=rank != 0 or not args.progress)

    per_mode = {m: {"step_s": [], "cpu_s": [], "reader_wait_s": [], "reader_copy_s": [], "write_s": [], "backpressure_s": [], "moved_bytes": [], "relay_wait_s": [],
                    "relay_send_s": [], "relay_bytes": []} for m in MODES}
    # modes interleaved round-robin (one step of each per round), so that load from other processes on
    # the machine hits every mode alike
    for rnd in range(args.warmup + args.steps):
        for mode in MODES:
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
                    relay.set_microbatch(mb, n)
                o = model(ids, pos, None, labels=labels)

                def loss_func(per_token):
                    if last and chan is not None:
                        got[mb] = chan.read(mb)
                    elif last and relay is not None:
                        got[mb] = relay.read(mb)
                    loss = per_token.float().mean()
                    return loss, {"loss": loss.detach()}

                return o, loss_func

            dist.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            fb(forward_step_func=forward_step, data_iterator=iter(list(enumerate(data))), model=[model],
               num_microbatches=M, seq_length=S, micro_batch_size=B, forward_only=False)
            if relay is not None:
                relay.finish()
            dt, dc = time.perf_counter() - t0, time.process_time() - c0
            model.zero_grad(set_to_none=True)
            stats = chan.end_step() if chan is not None else None
            rec = per_mode[mode]
            if rnd >= args.warmup:
                rec["step_s"].append(dt)
                rec["cpu_s"].append(dc)
                if stats is not None:
                    rec["reader_wait_s"].append(stats["reader_wait_s"])
                    rec["reader_copy_s"].append(stats["reader_copy_s"])
                    rec["write_s"].append(stats["write_s"])
                    rec["backpressure_s"].append(stats["backpressure_s"])
                    rec["moved_bytes"].append(stats["moved_bytes"])
                if relay is not None:
                    rec["relay_wait_s"].append(relay.wait_s)
                    rec["relay_send_s"].append(relay.send_s)
                    rec["relay_bytes"].append(relay.bytes_sent)
            if last and rnd == args.warmup + args.steps - 1 and mode != "none":
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

    # raw transfer rate: stage 0 -> last stage, large taps, through each channel (write + read with copy)
    out["raw"] = {}
    src, dst = layout.stage_ranks[0], layout.reader_rank
    big_layer = layers[0]
    from cotrain.tapchannel import TapSpec

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
            out["raw"][t] = {"payload_bytes": nb, "iters": args.raw_iters,
                             "MB_per_s": statistics.median(rates["view"]),
                             "MB_per_s_with_copy_out": statistics.median(rates["copy"]),
                             "MB_per_s_rounds": rates}
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


# ----- summary and plot ---------------------------------------------------------------------------------

def summarize(pp, ranks, args):
    last = ranks[-1]
    modes = {}
    for mode in MODES:
        step = [max(r["modes"][mode]["step_s"][k] for r in ranks) for k in range(args.steps)]  # slowest rank
        med = statistics.median(step)
        cpu = statistics.median(max(r["modes"][mode]["cpu_s"][k] for r in ranks) for k in range(args.steps))
        m = {"step_s": med, "step_s_all": step, "cpu_s": cpu}
        lm = last["modes"][mode]
        if mode in ("shm", "gloo"):
            wait = statistics.median(lm["reader_wait_s"])
            src_write = max(statistics.median(r["modes"][mode]["write_s"]) for r in ranks[:-1])
            src_bp = max(statistics.median(r["modes"][mode]["backpressure_s"]) for r in ranks[:-1])
            read = statistics.median(a + b for a, b in zip(lm["reader_wait_s"], lm["reader_copy_s"]))
            m.update(reader_wait_s=wait, reader_wait_frac=wait / med, reader_read_s=read, reader_read_frac=read / med,
                     source_write_s=src_write, source_backpressure_s=src_bp,
                     source_write_frac=src_write / med, bytes_moved_per_step=lm["moved_bytes"][0])
        elif mode == "relay":
            wait = statistics.median(lm["relay_wait_s"])
            per_stage = [statistics.median(r["modes"][mode]["relay_wait_s"]) + statistics.median(r["modes"][mode]["relay_send_s"])
                         for r in ranks]
            m.update(reader_wait_s=wait, reader_wait_frac=wait / med, relay_s_max_stage=max(per_stage),
                     relay_frac_max_stage=max(per_stage) / med,
                     bytes_moved_per_step=sum(r["modes"][mode]["relay_bytes"][0] for r in ranks))
        modes[mode] = m
    base = modes["none"]["step_s"]
    for mode in MODES:
        modes[mode]["overhead_vs_none"] = modes[mode]["step_s"] / base - 1
        modes[mode]["cpu_overhead_vs_none"] = modes[mode]["cpu_s"] / modes["none"]["cpu_s"] - 1
    tap = modes["shm"]
    ratios = {
        "relay_over_shm_step": modes["relay"]["step_s"] / tap["step_s"],
        "relay_over_gloo_step": modes["relay"]["step_s"] / modes["gloo"]["step_s"],
        "relay_over_tap_bytes": modes["relay"]["bytes_moved_per_step"] / tap["bytes_moved_per_step"],
        # the relay's last stage blocks in its receive; TapChannel's reader waits for stamps and copies out
        "relay_over_shm_reader_time": modes["relay"]["reader_wait_s"] / tap["reader_read_s"],
        "relay_over_gloo_reader_time": modes["relay"]["reader_wait_s"] / modes["gloo"]["reader_read_s"],
        "shm_over_gloo_raw_rate": last["raw"]["shm"]["MB_per_s"] / last["raw"]["gloo"]["MB_per_s"],
        "shm_over_gloo_raw_rate_with_copy_out": (last["raw"]["shm"]["MB_per_s_with_copy_out"]
                                                 / last["raw"]["gloo"]["MB_per_s_with_copy_out"]),
    }
    return {"pp": pp, "tap_layers": last["layers"], "tokens_per_microbatch": last["tokens"], "modes": modes,
            "raw_transfer": last["raw"], "ratios": ratios, "taps_identical_shm_gloo_relay": last["identical"]}


def plot(rows, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(1, 4, figsize=(18, 4.2))
    pps = [r["pp"] for r in rows]
    xt = (range(len(pps)), [f"PP={p}" for p in pps])
    width = 0.2
    colors = {"none": "#999999", "shm": "#1f77b4", "gloo": "#2ca02c", "relay": "#d62728"}

    def label(a, xs, vals, fmt):
        for x, v in zip(xs, vals):
            a.annotate(fmt.format(v), (x, v), ha="center", va="bottom", fontsize=7)

    for k, mode in enumerate(MODES):
        xs = [i + (k - 1.5) * width for i in range(len(pps))]
        med = [r["modes"][mode]["step_s"] * 1e3 for r in rows]
        lo = [med[i] - min(r["modes"][mode]["step_s_all"]) * 1e3 for i, r in enumerate(rows)]
        hi = [max(r["modes"][mode]["step_s_all"]) * 1e3 - med[i] for i, r in enumerate(rows)]
        ax[0].bar(xs, med, width, yerr=[lo, hi], capsize=2, label=mode, color=colors[mode])
    ax[0].set_xticks(*xt)
    ax[0].set_ylabel("ms (median, bars = min..max)")
    ax[0].set_title("training step (wall, slowest rank)")
    ax[0].legend(fontsize=8)

    for k, mode in enumerate(("shm", "gloo", "relay")):
        xs = [i + (k - 1) * width for i in range(len(pps))]
        key = "reader_wait_frac" if mode == "relay" else "reader_read_frac"
        vals = [100 * r["modes"][mode][key] for r in rows]
        ax[1].bar(xs, vals, width, label=f"{mode} ({'recv wait' if mode == 'relay' else 'wait + copy-out'})",
                  color=colors[mode])
        label(ax[1], xs, vals, "{:.2f}%")
    ax[1].axhline(2.0, ls="--", c="k", lw=1, label="goal 2%")
    ax[1].set_ylim(0, 1.45 * max(2.0, *(100 * r["modes"]["relay"]["reader_wait_frac"] for r in rows)))
    ax[1].set_xticks(*xt)
    ax[1].set_ylabel("% of the training step")
    ax[1].set_title("last stage: time to get its taps")
    ax[1].legend(fontsize=7)

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
        vals = [r["raw_transfer"][t][key] for r in rows]
        ax[3].bar(xs, vals, width, color=colors[t], hatch=hatch, edgecolor="white",
                  label=f"{t}, {'zero-copy read' if hatch is None else 'read + copy-out'}")
        label(ax[3], xs, vals, "{:.0f}")
    ax[3].set_ylim(0, 1.45 * max(r["raw_transfer"][t]["MB_per_s"] for r in rows for t in ("shm", "gloo")))
    ax[3].set_xticks(*xt)
    ax[3].set_ylabel("MB/s (stage 0 -> last stage)")
    ax[3].set_title("raw transfer rate")
    ax[3].legend(fontsize=7)
    fig.suptitle("TapChannel vs stage-to-stage relay on CPU (tiny GPTModel, gloo pipeline, 1 thread per rank, "
                 "shared 2-core machine)")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pp", type=int, nargs="+", default=[2, 4])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--taps", type=int, default=4)
    p.add_argument("--seq", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=2)
    p.add_argument("--microbatches", type=int, default=8)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--steps", type=int, default=5)
    p.add_argument("--raw-tokens", type=int, default=2048)
    p.add_argument("--raw-width", type=int, default=1024)
    p.add_argument("--raw-iters", type=int, default=16)
    p.add_argument("--raw-rounds", type=int, default=3)
    p.add_argument("--quick", action="store_true", help="fewer and smaller steps")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--plot-only", action="store_true", help="redraw the PNG from the existing JSON")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "tapchannel.json")
    p.add_argument("--png", type=Path, default=ROOT / "docs" / "img" / "tapchannel.png")
    args = p.parse_args()
    if args.quick:
        args.steps, args.seq, args.microbatches, args.raw_iters, args.raw_rounds = 2, 64, 4, 6, 1

    if args.plot_only:
        plot(json.loads(args.out.read_text())["results"], args.png)
        print(f"wrote {args.png}")
        return

    from tqdm import tqdm

    from cotrain.distributed import spawn_local

    t_start = time.time()
    state = spawn_local(reference_state, 1, args, timeout_s=300)[0]
    rows = []
    for pp in tqdm(args.pp, desc="PP degrees", disable=not args.progress):
        ranks = spawn_local(bench_rank, pp, args, state, timeout_s=900)
        rows.append(summarize(pp, ranks, args))
    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    config["threads_per_rank"] = 1
    config["wall_s"] = time.time() - t_start
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": config, "results": rows}, indent=1))
    plot(rows, args.png)
    for r in rows:
        m = r["modes"]
        print(f"PP={r['pp']}: step none {m['none']['step_s']*1e3:.1f} ms | "
              + " | ".join(f"{k} {m[k]['step_s']*1e3:.1f} ms (+{100*m[k]['overhead_vs_none']:.1f}%), "
                           f"wait {100*m[k]['reader_wait_frac']:.2f}%"
                           + (f" (read {100*m[k]['reader_read_frac']:.2f}%)" if k != "relay" else "")
                           for k in ("shm", "gloo", "relay")))
        print(f"      bytes/step tap {m['shm']['bytes_moved_per_step']/1e6:.2f} MB, relay {m['relay']['bytes_moved_per_step']/1e6:.2f} MB;"
              f" raw shm {r['raw_transfer']['shm']['MB_per_s']:.0f} MB/s, gloo {r['raw_transfer']['gloo']['MB_per_s']:.0f} MB/s;"
              f" ratios {json.dumps({k: round(v, 3) for k, v in r['ratios'].items()})}; identical {r['taps_identical_shm_gloo_relay']}")
    print(f"wrote {args.out} and {args.png} in {time.time() - t_start:.0f}s")


if __name__ == "__main__":
    main()
