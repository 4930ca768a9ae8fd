"""Per-rank bodies for the TapChannel tests (spawned processes import this module)."""

from __future__ import annotations

import os
import signal
import time
from functools import partial

import torch
import torch.distributed as dist

# A random tiny Qwen3-style policy: 8 layers so that PP=4 has 2 layers per stage (no checkpoint needed).
ARCH = dict(model_type="qwen3", vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=8,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
            tie_word_embeddings=False, rope_theta=10000.0)
TAP_LAYERS = [0, 2, 3, 5, 6, 7]  # every stage has taps at PP=2 and PP=4; 6 and 7 are local to the last stage
SEQ_LEN = 16
NUM_TOKENS = [16, 9, 13, 5, 11]  # real tokens per microbatch (padded to SEQ_LEN)
ORDERS = [[0, 1, 2, 3, 4], [3, 0, 4, 2]]  # two steps; the second one shorter and permuted


def make_micro(seed: int = 0, batch: int = 1):
    g = torch.Generator().manual_seed(seed)
    out = []
    for n in NUM_TOKENS:
        ids = torch.randint(1, ARCH["vocab_size"], (batch, SEQ_LEN + 1), generator=g)
        ids[:, n:] = 0  # padding after the real tokens
        mask = torch.zeros(batch, SEQ_LEN)
        mask[:, : max(n - 1, 1)] = 1
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous(), mask, n))
    return out


def _arch():
    from cotrain.models.hf_arch import ArchSpec

    return ArchSpec.from_hf(ARCH)


def _loss(mask, per_token):
    loss = (per_token.float() * mask).sum() / mask.sum()
    return loss, {"loss": loss.detach()}


def reference_pp1(rank, world, micro, micro_b2):
    """PP=1: the global weights, every layer's output per microbatch (own hooks, no TapChannel), the
    losses; plus a local-only TapChannel on batch-2 microbatches (batch-major token order)."""
    from cotrain.models.megatron_compat import model_parallel_manual_seed
    from cotrain.models.megatron_model import build_gpt_model, stage_state_global
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from cotrain.tapchannel import PipelineLayout, TapChannel, attach_tap_hooks, tap_specs

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=1)
    model_parallel_manual_seed(0)
    arch = _arch()
    model = build_gpt_model(arch)
    state = stage_state_global(model)
    hidden: dict[int, list[torch.Tensor]] = {i: [] for i in range(arch.num_layers)}
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_hook(lambda m, a, out, i=i: hidden[i].append(out[0].detach().clone()))
    s = SEQ_LEN
    pos = torch.arange(s)[None]

    def forward_step(it, model):
        ids, labels, mask, _n = next(it)
        return model(ids, pos.expand(ids.shape[0], s), None, labels=labels), partial(_loss, mask)

    out = get_forward_backward_func()(forward_step_func=forward_step, data_iterator=iter(micro), model=[model],
                                      num_microbatches=len(micro), seq_length=s, micro_batch_size=1, forward_only=False)
    losses = [o["loss"].item() for o in out]
    ref = [{i: hidden[i][m] for i in hidden} for m in range(len(micro))]

    # local-only channel (PP=1: every tap is on the reader), batch of 2 rows
    layout = PipelineLayout.from_megatron(model)
    ch = TapChannel(tap_specs(TAP_LAYERS, layout, arch.hidden_size), layout, "shm", max_tokens=2 * s, name="pp1")
    hooks = attach_tap_hooks(model, ch)
    for v in hidden.values():
        v.clear()
    b2 = []
    ch.begin_step(len(micro_b2))
    with torch.no_grad():
        for m, (ids, _labels, _mask, n) in enumerate(micro_b2):
            hooks.set_microbatch(m, num_tokens=n)
            model(ids, pos.expand(ids.shape[0], s), None)
            b2.append(({i: t.clone() for i, t in ch.read(m).items()}, {i: hidden[i][m] for i in TAP_LAYERS}))
    ch.end_step()
    return {"state": state, "hidden": ref, "losses": losses, "b2": b2}


def pipeline_taps(rank, world, pp, state, micro):
    """PP=pp through forward_backward_pipelining_without_interleaving, with a shm and a gloo TapChannel
    attached to the same layers; the last stage reads both in its loss function (where a drafter runs)."""
    from cotrain.models.megatron_compat import model_parallel_manual_seed
    from cotrain.models.megatron_model import build_gpt_model, load_megatron_state
    from megatron.core import parallel_state as ps
    from megatron.core.pipeline_parallel import get_forward_backward_func

    from cotrain.tapchannel import PipelineLayout, TapChannel, attach_tap_hooks, tap_specs

    ps.initialize_model_parallel(tensor_model_parallel_size=1, pipeline_model_parallel_size=pp)
    model_parallel_manual_seed(0)
    arch = _arch()
    model = build_gpt_model(arch)
    load_megatron_state(model, state, arch)
    fb = get_forward_backward_func()
    layout = PipelineLayout.from_megatron(model)
    specs = tap_specs(TAP_LAYERS, layout, arch.hidden_size)
    chans = {t: TapChannel(specs, layout, t, max_tokens=SEQ_LEN, name=t, timeout_s=60) for t in ("shm", "gloo")}
    # "auto" with the first half of the stages on node A, the rest (the reader's) on node B: per source,
    # gloo across the nodes, shm within node B (PP=4: stages 0, 1 gloo, stage 2 shm)
    stage = layout.stage_of_rank(rank)
    chans["auto"] = TapChannel(specs, layout, "auto", max_tokens=SEQ_LEN, name="auto", timeout_s=60,
                               node="A" if stage < pp // 2 else "B")
    hooks = {t: attach_tap_hooks(model, c) for t, c in chans.items()}
    last = ps.is_pipeline_last_stage()
    offset = model.decoder.layers[0].layer_number - 1
    latest: dict[int, torch.Tensor] = {}  # this stage's layer outputs (for the zero-copy check)
    for i, layer in enumerate(model.decoder.layers):
        layer.register_forward_hook(lambda m, a, out, i=i: latest.__setitem__(offset + i, out[0]))
    s = SEQ_LEN
    pos = torch.arange(s)[None]
    received = {t: [] for t in chans}
    zero_copy = []
    step_stats = {t: [] for t in chans}
    losses = []
    assert pp == layout.pp_size and fb.__name__ == "forward_backward_pipelining_without_interleaving", fb.__name__
    for order in ORDERS:
        batches = [(mb, micro[i]) for mb, i in enumerate(order)]
        for c in chans.values():
            c.begin_step(len(order))

        def forward_step(it, model):
            mb, (ids, labels, mask, n) = next(it)
            for h in hooks.values():
                h.set_microbatch(mb, num_tokens=n)
            out = model(ids, pos, None, labels=labels)

            def loss_func(per_token):
                if last:
                    taps = chans["shm"].read(mb)  # copies out, releases the slots
                    with chans["gloo"].reading(mb) as views:  # zero-copy views until the block exits
                        gloo = {i: v.clone() for i, v in views.items()}
                    received["shm"].append((order[mb], taps))
                    received["gloo"].append((order[mb], gloo))
                    received["auto"].append((order[mb], chans["auto"].read(mb)))
                    for i in taps:
                        if i in latest:  # produced on this stage: must be the layer's own memory
                            zero_copy.append((i, taps[i].data_ptr() == latest[i].data_ptr()))
                return _loss(mask, per_token)

            return out, loss_func

        out = fb(forward_step_func=forward_step, data_iterator=iter(batches), model=[model],
                 num_microbatches=len(batches), seq_length=s, micro_batch_size=1, forward_only=False)
        if last:
            losses.append([(order[k], o["loss"].item()) for k, o in enumerate(out)])
        for t, c in chans.items():
            step_stats[t].append(c.end_step())
    result = {
        "rank": rank, "stage": layout.stage_of_rank(rank), "layers": list(range(offset, offset + len(model.decoder.layers))),
        "received": received if last else None, "zero_copy": zero_copy, "losses": losses,
        "metrics": {t: c.metrics.summary() for t, c in chans.items()}, "step_stats": step_stats,
        "written_bytes": {t: dict(c.metrics.written_bytes) for t, c in chans.items()},
        "remote_layers": [s.layer for s in chans["shm"].remote],
        "routes": {t: dict(c.routes) for t, c in chans.items()},
        "auto_transports": sorted(chans["auto"].transports),
    }
    for c in chans.values():
        c.close()
    return result


# ----- faults (no Megatron: a 2-stage "pipeline" of plain tensors) --------------------------------------

W = 8


def _channel(transport, *, name, slots=2, timeout_s=0.5, width=W, dtype=torch.float32, layers=(0, 1)):
    from cotrain.tapchannel import PipelineLayout, TapChannel, TapSpec

    layout = PipelineLayout.even([0, 1], num_layers=2)
    specs = [TapSpec(i, width, dtype).resolve(layout) for i in layers]
    return TapChannel(specs, layout, transport, max_tokens=8, slots=slots, timeout_s=timeout_s, name=name)


def _fields(e):
    return {"type": type(e).__name__, "layer": e.layer, "rank": e.rank, "slot": e.slot, "expected": e.expected,
            "seen": e.seen, "msg": str(e)}


def faults(rank, world, transports):
    return {t: _faults(rank, t) for t in transports}


def _faults(rank, transport):
    """Rank 0 writes tap layer 0, rank 1 (the reader) owns tap layer 1. Returns what each case raised."""
    from cotrain.tapchannel import TapError, TapLappedError, TapSpecMismatchError, TapTimeoutError

    res = {}
    x = lambda v, n=4: torch.full((n, W), float(v))  # noqa: E731

    # 1. read timeout names layer, rank, slot, expected and seen stamp; data arriving later is still read
    ch = _channel(transport, name=f"{transport}-timeout")
    ch.begin_step(2)
    if rank == 0:
        ch.write(0, 0, x(1))
        dist.barrier()  # the reader has timed out on microbatch 1
        ch.write(0, 1, x(2))
    else:
        ch.write(1, 0, x(-1))
        ch.write(1, 1, x(-2))
        res["first"] = ch.read(0)[0][0, 0].item()
        t0 = time.monotonic()
        try:
            ch.read(1)
        except TapTimeoutError as e:
            res["timeout"] = _fields(e) | {"elapsed": time.monotonic() - t0}
        dist.barrier()
        late = ch.read(1)
        res["late"] = (late[0][0, 0].item(), late[1][0, 0].item())
    ch.end_step()
    ch.close()

    # 2. a source whose step numbering is ahead of the reader's: lapped on both sides, promptly, whatever
    #    the ring size (with 2 slots the writer's seq 2 needs slot 0, which the reader will never release)
    for slots in (2, 4):
        ch = _channel(transport, name=f"{transport}-lapped{slots}", slots=slots, timeout_s=3)
        t0 = time.monotonic()
        got = {"type": "no error"}
        try:
            if rank == 0:
                ch.begin_step(2)  # an extra step the reader never had
                ch.end_step()
                ch.begin_step(3)
                ch.write(0, 0, x(7))  # sequence number 2 -> stamp 3
            else:
                ch.begin_step(3)
                ch.write(1, 0, x(0))
                ch.read(0)
        except TapError as e:
            got = _fields(e) if isinstance(e, TapLappedError) else {"type": type(e).__name__, "msg": str(e)}
        res[f"lapped{slots}"] = got | {"elapsed": time.monotonic() - t0}
        dist.barrier()
        ch.close()

    # 3. shape / dtype mismatches at writer registration
    ch = _channel(transport, name=f"{transport}-register")
    if rank == 0:
        for key, kw in {"width": dict(width=W + 1, dtype=torch.float32), "dtype": dict(width=W, dtype=torch.float16)}.items():
            try:
                ch.register_writer(0, **kw)
            except TapSpecMismatchError as e:
                res[f"register_{key}"] = str(e)
        ch.register_writer(0, W, torch.float32)  # the right one registers
        ch.begin_step(1)
        try:
            ch.write(0, 0, torch.zeros(9, W))  # more tokens than a slot holds
        except TapSpecMismatchError as e:
            res["too_many_tokens"] = str(e)
        try:
            ch.write(1, 0, torch.zeros(2, W))  # a layer this rank does not produce
        except TapSpecMismatchError as e:
            res["not_mine"] = str(e)
    else:
        try:
            ch.register_writer(1, W, torch.bfloat16)  # the reader's own (local) tap
        except TapSpecMismatchError as e:
            res["register_local"] = str(e)
    dist.barrier()
    ch.close()
    # ranks that disagree on the specs fail at construction, on every rank (nobody is left waiting)
    try:
        _channel(transport, name=f"{transport}-handshake", width=W if rank == 0 else 2 * W)
    except TapSpecMismatchError as e:
        res["handshake"] = str(e)

    # 4. a reader that never releases: the writer's back-pressure wait times out instead of overwriting
    ch = _channel(transport, name=f"{transport}-backpressure", slots=2)
    ch.begin_step(8)
    if rank == 0:
        wrote = 0
        try:
            for mb in range(8):
                ch.write(0, mb, x(mb))
                wrote += 1
        except TapError as e:
            res["backpressure"] = {"type": type(e).__name__, "wrote": wrote, "msg": str(e)}
    dist.barrier()
    if rank == 1:  # what is in the mailbox is intact: the first two microbatches
        res["kept"] = [ch.transport.read(0, s, True)[0, 0].item() for s in range(2)]
    ch.close()
    return res


def dead_source(rank, world):
    """Rank 0 (a source on a shm and a gloo channel) writes microbatch 0, then is SIGKILLed; the reader must
    fail fast on both, not hang (the gloo reader is told nothing about process ids: the transport must tell)."""
    from cotrain.tapchannel import TapSourceDeadError

    chans = {t: _channel(t, name=f"{t}-dead", timeout_s=30) for t in ("shm", "gloo")}
    if rank == 1:
        chans["gloo"].transport.ctx.liveness.peers.clear()  # as if on another node
    for c in chans.values():
        c.begin_step(3)
    if rank == 0:
        for c in chans.values():
            c.write(0, 0, torch.ones(4, W))
        chans["gloo"].transport.flush(time.monotonic() + 10)  # microbatch 0 has reached the reader
        dist.barrier()
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    res = {}
    for t, c in chans.items():
        c.write(1, 0, torch.zeros(4, W))
        c.write(1, 1, torch.zeros(4, W))
        res[t] = {"first": c.read(0)[0].sum().item()}
        t0 = time.monotonic()
        try:
            c.read(1)
            res[t]["second"] = "no error"
        except TapSourceDeadError as e:
            res[t]["dead"] = _fields(e) | {"elapsed": time.monotonic() - t0}
    return res


def gpu_roundtrip(rank, world, transport):
    """Rank 0 writes CUDA taps through ``transport`` (nccl: one GPU per rank); rank 1 reads them on its GPU."""
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    from cotrain.tapchannel import PipelineLayout, TapChannel, TapSpec

    layout = PipelineLayout.even([0, 1], num_layers=2)
    specs = [TapSpec(0, W, torch.bfloat16).resolve(layout), TapSpec(1, W, torch.bfloat16).resolve(layout)]
    ch = TapChannel(specs, layout, transport, max_tokens=8, slots=2, timeout_s=30, name=f"gpu-{transport}", device=dev)
    got = []
    for step in range(2):
        ch.begin_step(5)
        for mb in range(5):
            n = 1 + (mb * 3 + step) % 8
            x = (torch.arange(n * W, device=dev).view(n, W) + 100 * mb + 1000 * step).to(torch.bfloat16)
            ch.write(rank, mb, x)
            if rank == 1:
                taps = ch.read(mb)
                got.append((step, mb, n, taps[0].device.type, taps[0].float().cpu(), taps[1].float().cpu()))
        ch.end_step()
    ch.close()
    return got
