"""Benchmark: CP branch attention (packed zigzag ring + branch-local LSE merge) vs a padded all-gather.

Workload: S packed sequences of mixed lengths, DFlash-style branches (blocks of B tokens at random
anchors, exclusive context, full intra-block attention), GQA, fp32 on CPU over gloo.

- ours:     cotrain.parallel.cp_branch_attention on zigzag shards (bytes counted by RingComm).
- baseline: the padded USP-style approach: every sequence padded to the longest (rounded to 2C),
            zigzag-sharded, K/V all-gathered (torch.distributed.nn, differentiable), then torch's
            fused scaled_dot_product_attention with a boolean mask (native GQA) for the local main
            queries and for the local branch queries (their sequence's gathered K/V plus their block). Its bytes are the collective's nominal per-rank volume:
            (C-1) x local K/V bytes for the all-gather, the same for its backward (all-to-all on gloo,
            reduce-scatter on NCCL).

Per CP degree and method: forward+backward wall time (median over iterations, max over ranks),
peak resident memory per rank during one forward+backward (VmHWM after resetting it, minus VmRSS
before; large allocations are forced onto mmap so freed memory really leaves), bytes sent per rank.
Both methods run in the same process group, one after the other, and the outputs of the two are
checked against each other. Writes bench/results/cp_attention.json and docs/img/cp_attention.png.

    python bench/cp_attention.py            # defaults: a couple of minutes on 2 cores
    python bench/cp_attention.py --quick    # seconds, for a smoke test
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import socket
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# Large tensors on mmap: freed memory is returned at once, so the peak-RSS measurement is honest.
os.environ.setdefault("MALLOC_MMAP_THRESHOLD_", "65536")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402


# ----- memory measurement (Linux) ---------------------------------------------------------------------

def _status_kb(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> int:
    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except OSError:
        pass
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # resets VmHWM to the current RSS
    return _status_kb("VmRSS")


def _peak_since(rss_before_kb: int) -> int:
    return max(0, _status_kb("VmHWM") - rss_before_kb) * 1024


# ----- workload -------------------------------------------------------------------------------------------

def make_workload(args, cp_size: int):
    from cotrain.parallel import cu_seqlens_from_lengths, dflash_layout, sample_anchors

    g = torch.Generator().manual_seed(args.seed)
    seqlens = torch.randint(args.min_len, args.max_len + 1, (args.num_seqs,), generator=g)
    seqlens[0] = args.max_len  # one sequence at the maximum, as in real mixed batches
    cu = cu_seqlens_from_lengths(seqlens)
    anchors = sample_anchors(cu, args.blocks_per_seq, g)
    layout = dflash_layout(cu, anchors, args.block_size, cp_size=cp_size)
    T, NBt = layout.total_len, layout.total_branch_tokens
    H, Hk, D = args.heads, args.kv_heads, args.head_dim
    tensors = [torch.randn(n, h, D, generator=g) for n, h in [(T, H), (T, Hk), (T, Hk), (NBt, H), (NBt, Hk), (NBt, Hk)]]
    weights = [torch.randn(T, H, D, generator=g), torch.randn(NBt, H, D, generator=g)]
    return layout, tensors, weights


# ----- ours -----------------------------------------------------------------------------------------------

def ours_inputs(layout, tensors, weights, rank):
    from cotrain.parallel import shard_branches, zigzag_shard

    local = [zigzag_shard(t, layout, rank) for t in tensors[:3]]
    local += [shard_branches(t, layout, rank) for t in tensors[3:]]
    w = [zigzag_shard(weights[0], layout, rank), shard_branches(weights[1], layout, rank)]
    return [t.requires_grad_() for t in local], w


def ours_step(layout, local, w, stats=None):
    from cotrain.parallel import cp_branch_attention

    for t in local:
        t.grad = None
    out, _, bout, _ = cp_branch_attention(*local, layout, None, stats=stats)
    ((out * w[0]).sum() + (bout * w[1]).sum()).backward()
    return out.detach(), bout.detach()


# ----- padded all-gather baseline ---------------------------------------------------------------------

class Padded:
    """Per-rank state of the padded baseline (built outside the timed region)."""

    def __init__(self, layout, tensors, weights, rank, cp_size):
        self.C, self.rank = cp_size, rank
        S = layout.num_seqs
        lens = layout.seqlens
        lmax = int(lens.max())
        unit = 2 * cp_size if cp_size > 1 else 1
        self.Lp = (lmax + unit - 1) // unit * unit
        self.cu, self.lens, self.S = layout.cu_seqlens, lens, S
        self.idx = self.zigzag_positions(rank)  # positions of the padded sequence this rank holds
        q, k, v, bq, bk, bv = tensors

        def pad(x):
            out = x.new_zeros(S, self.Lp, *x.shape[1:])
            for s in range(S):
                out[s, : int(lens[s])] = x[int(self.cu[s]) : int(self.cu[s + 1])]
            return out

        self.q, self.k, self.v = (pad(t)[:, self.idx].clone().requires_grad_() for t in (q, k, v))
        self.w = pad(weights[0])[:, self.idx]
        self.w[self.idx[None, :] >= lens[:, None]] = 0  # padding rows carry no loss
        ids = layout.local_branches(rank)
        B = int(layout.branch_lens[0]) if layout.num_branches else 1
        tok = layout.local_branch_token_index(rank)
        self.nb, self.B = ids.numel(), B
        self.bq, self.bk, self.bv = (t[tok].reshape(self.nb, B, *t.shape[1:]).clone().requires_grad_() for t in (bq, bk, bv))
        self.bw = weights[1][tok].reshape(self.nb, B, *weights[1].shape[1:])
        self.b_seq = layout.branch_seqs[ids]
        self.b_ctx = layout.context_last[ids]  # last visible position (exclusive context)
        # Order of the gathered shards in the padded sequence, and its inverse.
        order = torch.cat([self.zigzag_positions(r) for r in range(cp_size)])
        self.inverse = torch.argsort(order)
        pos_k = torch.arange(self.Lp)
        self.main_mask = (pos_k[None, None, :] <= self.idx[None, :, None]) & (pos_k[None, None, :] < lens[:, None, None])
        ctx = (pos_k[None, :] <= self.b_ctx[:, None]) & (pos_k[None, :] < lens[self.b_seq][:, None])
        self.branch_mask = torch.cat([ctx, torch.ones(self.nb, B, dtype=torch.bool)], 1)  # (nb, Lp + B)

    def zigzag_positions(self, r):
        if self.C == 1:
            return torch.arange(self.Lp)
        c = self.Lp // (2 * self.C)
        return torch.cat([torch.arange(r * c, (r + 1) * c), torch.arange((2 * self.C - 1 - r) * c, (2 * self.C - r) * c)])

    def bytes_per_rank(self) -> tuple[int, int]:
        shard = 2 * self.k.numel() * self.k.element_size()
        return (self.C - 1) * shard, (self.C - 1) * shard

    def step(self):
        from torch.distributed.nn.functional import all_gather

        for t in (self.q, self.k, self.v, self.bq, self.bk, self.bv):
            t.grad = None
        kv = torch.stack([self.k, self.v])  # (2, S, Lq, Hk, D)
        if self.C > 1:
            kv = torch.cat(all_gather(kv), dim=2)[:, :, self.inverse]  # (2, S, Lp, Hk, D) in position order
        # torch's fused CPU attention (SDPA with a boolean mask, native GQA): no S x S autograd tensors.
        sdpa = torch.nn.functional.scaled_dot_product_attention
        out = sdpa(self.q.transpose(1, 2), kv[0].transpose(1, 2), kv[1].transpose(1, 2),
                   attn_mask=self.main_mask[:, None], enable_gqa=True).transpose(1, 2)
        # Branches: their sequence's gathered K/V plus their own block.
        bK = torch.cat([kv[0][self.b_seq], self.bk], 1)
        bV = torch.cat([kv[1][self.b_seq], self.bv], 1)
        bout = sdpa(self.bq.transpose(1, 2), bK.transpose(1, 2), bV.transpose(1, 2),
                    attn_mask=self.branch_mask[:, None, None, :], enable_gqa=True).transpose(1, 2)
        ((out * self.w).sum() + (bout * self.bw).sum()).backward()
        return out.detach(), bout.detach()


# ----- per rank -------------------------------------------------------------------------------------------

def _timed(fn, iters, warmup, show):
    """(median wall seconds, median CPU seconds of this process) per call, after warmup."""
    times, cpu = [], []
    rng = range(warmup + iters)
    if show:
        from tqdm import tqdm

        rng = tqdm(rng, desc="  iterations", leave=False)
    for i in rng:
        dist.barrier()
        t0, c0 = time.perf_counter(), time.process_time()
        fn()
        c1 = time.process_time()
        dist.barrier()
        if i >= warmup:
            times.append(time.perf_counter() - t0)
            cpu.append(c1 - c0)
    return statistics.median(times), statistics.median(cpu)


def rank_main(rank, cp_size, port, args, outdir):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=cp_size)
    from cotrain.parallel import CPStats

    layout, tensors, weights = make_workload(args, cp_size)
    result = {"rank": rank, "local_len": layout.local_len, "local_branch_tokens": layout.local_branch_tokens(rank)}

    # ours
    local, w = ours_inputs(layout, tensors, weights, rank)
    stats = CPStats()
    ours_step(layout, local, w, stats)  # warm the plan cache, count bytes and pairs once
    result["ours_bytes"] = (stats.bytes_sent_forward, stats.bytes_sent_backward)
    result["ours_pairs"] = stats.pairs_computed
    before = _reset_peak()
    out, bout = ours_step(layout, local, w)
    result["ours_peak"] = _peak_since(before)
    result["ours_time"], result["ours_cpu"] = _timed(lambda: ours_step(layout, local, w), args.iters, args.warmup, rank == 0 and args.progress)

    # padded baseline
    pad = Padded(layout, tensors, weights, rank, cp_size)
    pad.step()
    before = _reset_peak()
    pout, pbout = pad.step()
    result["pad_peak"] = _peak_since(before)
    result["pad_time"], result["pad_cpu"] = _timed(pad.step, args.iters, args.warmup, rank == 0 and args.progress)
    result["pad_bytes"] = pad.bytes_per_rank()
    S, Lq = pad.q.shape[:2]
    result["pad_pairs"] = S * Lq * pad.Lp + pad.nb * pad.B * (pad.Lp + pad.B)

    # Rows of both methods with their packed token index, for the cross-check in the parent
    # (the two paddings put a token on different ranks, so the comparison is global).
    gidx = layout.zigzag_index(rank)
    pad_pos = pad.idx[None, :].expand(S, -1)
    pad_gidx = (pad.cu[:-1, None] + pad_pos).masked_fill(pad_pos >= pad.lens[:, None], -1)
    torch.save({
        "ours": (gidx[gidx >= 0], out[gidx >= 0]), "pad": (pad_gidx[pad_gidx >= 0], pout[pad_gidx >= 0]),
        "branch_diff": float((bout.reshape(pad.nb, pad.B, *bout.shape[1:]) - pbout).abs().max()) if pad.nb else 0.0,
    }, os.path.join(outdir, f"{rank}.pt"))
    with open(os.path.join(outdir, f"{rank}.json"), "w") as f:
        json.dump(result, f)
    dist.destroy_process_group()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_cp(cp_size: int, args) -> list[dict]:
    with tempfile.TemporaryDirectory() as outdir:
        mp.start_processes(rank_main, args=(cp_size, free_port(), args, outdir), nprocs=cp_size, join=True, start_method="spawn")
        ranks = [json.load(open(os.path.join(outdir, f"{r}.json"))) for r in range(cp_size)]
        rows = [torch.load(os.path.join(outdir, f"{r}.pt")) for r in range(cp_size)]
    # Cross-check: both methods give the same output for every real token and branch token.
    gather = {}
    for m in ("ours", "pad"):
        idx = torch.cat([r[m][0] for r in rows])
        val = torch.cat([r[m][1] for r in rows])
        gather[m] = val[torch.argsort(idx)]
    diff = max(float((gather["ours"] - gather["pad"]).abs().max()), max(r["branch_diff"] for r in rows))
    for r in ranks:
        r["max_diff_vs_baseline"] = diff
    return ranks


def summarize(cp_size: int, ranks: list[dict]) -> dict:
    row = {"cp": cp_size}
    for m in ("ours", "pad"):
        row[f"{m}_time_s"] = max(r[f"{m}_time"] for r in ranks)
        row[f"{m}_cpu_s"] = max(r[f"{m}_cpu"] for r in ranks)
        row[f"{m}_peak_mem_bytes"] = max(r[f"{m}_peak"] for r in ranks)
        row[f"{m}_bytes_fwd"] = max(r[f"{m}_bytes"][0] for r in ranks)
        row[f"{m}_bytes_bwd"] = max(r[f"{m}_bytes"][1] for r in ranks)
        row[f"{m}_pairs_max"] = max(r[f"{m}_pairs"] for r in ranks)
    row["ratio_time"] = row["ours_time_s"] / row["pad_time_s"]
    row["ratio_cpu"] = row["ours_cpu_s"] / row["pad_cpu_s"]
    row["ratio_peak_mem"] = row["ours_peak_mem_bytes"] / max(1, row["pad_peak_mem_bytes"])
    tot_o = row["ours_bytes_fwd"] + row["ours_bytes_bwd"]
    tot_p = row["pad_bytes_fwd"] + row["pad_bytes_bwd"]
    row["ratio_bytes_fwd"] = row["ours_bytes_fwd"] / row["pad_bytes_fwd"] if row["pad_bytes_fwd"] else None
    row["ratio_bytes_total"] = tot_o / tot_p if tot_p else None
    row["ratio_pairs"] = row["ours_pairs_max"] / row["pad_pairs_max"]
    row["max_diff_vs_baseline"] = max(r["max_diff_vs_baseline"] for r in ranks)
    row["per_rank"] = ranks
    return row


def plot(rows, path: Path):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cps = [r["cp"] for r in rows]
    fig, axes = plt.subplots(1, 3, figsize=(13, 3.8))
    panels = [
        ("fwd+bwd wall time per step (s)", "time_s", 1.0),
        ("peak memory per rank (MiB)", "peak_mem_bytes", 1 / 2**20),
        ("bytes sent per rank, fwd+bwd (MiB)", None, 1 / 2**20),
    ]
    for ax, (title, key, scale) in zip(axes, panels):
        for m, label, style in (("ours", "packed zigzag ring + branch-local", "o-"), ("pad", "padded all-gather", "s--")):
            if key is None:
                ys = [(r[f"{m}_bytes_fwd"] + r[f"{m}_bytes_bwd"]) * scale for r in rows]
            else:
                ys = [r[f"{m}_{key}"] * scale for r in rows]
            ax.plot(cps, ys, style, label=label)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("CP size")
        ax.set_xticks(cps)
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8)
    fig.suptitle("CP branch attention vs padded all-gather (CPU, gloo, fp32, DFlash blocks)", fontsize=11)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--cp", type=int, nargs="+", default=[1, 2, 4])
    p.add_argument("--num-seqs", type=int, default=8)
    p.add_argument("--min-len", type=int, default=32)
    p.add_argument("--max-len", type=int, default=512)
    p.add_argument("--blocks-per-seq", type=int, default=4)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--iters", type=int, default=7)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--quick", action="store_true", help="tiny sizes, for a smoke test")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "cp_attention.json")
    p.add_argument("--png", type=Path, default=ROOT / "docs" / "img" / "cp_attention.png")
    args = p.parse_args()
    if args.quick:
        args.num_seqs, args.min_len, args.max_len, args.iters, args.warmup = 4, 8, 64, 2, 1

    from rich.console import Console
    from rich.table import Table
    from tqdm import tqdm

    rows = []
    for cp in tqdm(args.cp, desc="CP degrees", disable=not args.progress):
        rows.append(summarize(cp, run_cp(cp, args)))

    table = Table(title="ours / padded all-gather, measured in the same run")
    for col in ("CP", "time ours (ms)", "time pad (ms)", "time ratio", "cpu ratio", "peak ours (MiB)", "peak pad (MiB)",
                "mem ratio", "bytes ours (KiB)", "bytes pad (KiB)", "bytes ratio", "max |diff|"):
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(
            str(r["cp"]), f"{r['ours_time_s'] * 1e3:.1f}", f"{r['pad_time_s'] * 1e3:.1f}", f"{r['ratio_time']:.2f}", f"{r['ratio_cpu']:.2f}",
            f"{r['ours_peak_mem_bytes'] / 2**20:.1f}", f"{r['pad_peak_mem_bytes'] / 2**20:.1f}", f"{r['ratio_peak_mem']:.2f}",
            f"{(r['ours_bytes_fwd'] + r['ours_bytes_bwd']) / 1024:.0f}", f"{(r['pad_bytes_fwd'] + r['pad_bytes_bwd']) / 1024:.0f}",
            "-" if r["ratio_bytes_total"] is None else f"{r['ratio_bytes_total']:.2f}", f"{r['max_diff_vs_baseline']:.1e}",
        )
    Console(width=200).print(table)

    config = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    layout, _, _ = make_workload(args, 1)
    config["seqlens"] = layout.seqlens.tolist()
    config["num_branches"] = layout.num_branches
    config["torch"] = torch.__version__
    config["threads_per_rank"] = 1
    config["cpu_count"] = os.cpu_count()
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"config": config, "results": rows}, indent=1))
    plot(rows, args.png)
    print(f"wrote {args.out} and {args.png}")


if __name__ == "__main__":
    main()
