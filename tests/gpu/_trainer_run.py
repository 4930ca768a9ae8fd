"""One process of the trainer device checks: the Megatron trainer in process (world size 1, PP = 1) on
one device, for tests/gpu/test_trainer_cuda.py (CUDA against CPU) and tests/rl/test_trainer_device.py
(the same code on CPU, with Ray and vLLM made unimportable).

    python tests/gpu/_trainer_run.py --device cuda --cases plain:float32,dflash:float32 --model-dir D --out R.pt

Each case builds a :class:`~cotrain.rl.trainer.MegatronPolicyWorker` on a random-weight tiny Qwen3
(``--model-dir``, written on first use from the built-in tiny architecture and tokenizer: no cache, no
download), takes the log-probs of a fixed rollout batch (with a co-training step of the drafter when
the case names one), one GRPO train step and the log-probs again, and records them with the metrics
and the drafter's weights after its step (all on the CPU). ``--checks`` adds, on the first case's
worker: ``offload`` (offload + onload between two steps; the result must equal a run without:
``offload_ref``), ``rng`` (checkpoint save, draws, load, the same draws again), ``resume`` (a
checkpoint after step 1, step 2, load, step 2 again) and ``pickled`` (a checkpoint holding a pickled
object: the load's error). ``--block ray,vllm`` puts those modules out
of reach before anything is imported. Results: ``torch.save`` of a dict to ``--out``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: the co-trained drafters of the cases (as tests/rl/test_cotrain_trainer.py: eps = 1 and no clipping,
#: so the drafter's first update is ~lr * g and its weights after the step compare gradients linearly)
DRAFT = {"dflash": ["draft.kind=dflash", "draft.dflash.block_size=4", "draft.dflash.anchors_per_seq=2"],
         "eagle3": ["draft.kind=eagle3", "draft.eagle3.ttt_steps=3"]}
# the same drafters on their own branches (SpecOPD: the policy's tree forward scores them)
DRAFT.update({f"{k}_op": v + ["draft.branches=on_policy"] for k, v in list(DRAFT.items())})
DRAFT_OPT = ["draft.cotrain=true", "draft.optimizer.lr=0.5", "draft.optimizer.eps=1.0", "draft.optimizer.clip_grad=0.0"]


def write_model(path: Path) -> Path:
    """A random-weight checkpoint of the built-in tiny architecture with its tokenizer (seeded: the same
    weights on every machine that runs the same torch)."""
    from cotrain.models.build_tiny import _spec, make_model
    from cotrain.models.builtin import tokenizer_for

    if (path / "config.json").exists():
        return path
    spec = _spec("tiny")
    tok = tokenizer_for(spec.tokenizer)
    model = make_model(tok, 0, spec)
    path.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(str(path), safe_serialization=True)
    tok.save_pretrained(str(path))
    return path


def config(device: str, dtype: str, draft: str | None, model_dir: Path, out_dir: Path):
    from cotrain.config import load_config

    ov = [f"policy.model_path={model_dir}", f"run.output_dir={out_dir}", f"policy.dtype={dtype}",
          "policy.micro_batch_size=4", "grpo.prompts_per_step=4", "policy.reference_model=false",
          "rollout.speculative.method=null", "policy.optimizer.lr=1e-3"]
    if device == "cuda":  # one GPU: the engines (never started here) share it
        ov += ["cluster.device=cuda", "cluster.gpus_per_node=1", "rollout.colocate=true"]
    else:
        ov += ["cluster.device=cpu"]
    if draft is not None:
        ov += DRAFT[draft] + DRAFT_OPT
    return load_config(ROOT / "configs" / "grpo.yaml", ov)


def rollout_batch():
    sys.path.insert(0, str(ROOT / "tests" / "rl"))
    from _trainer_utils import fake_rollout_batch

    return fake_rollout_batch()


def _step(worker, batch, draft: bool, between=None) -> dict:
    """log-probs (+ the drafter's step) -> train step -> log-probs again; ``between`` runs before the
    train step."""
    import torch

    lp = worker.logprobs(batch, draft_step=1 if draft else None)
    batch.old_logprobs = lp["logprobs"] + 0.3 * torch.randn(
        lp["logprobs"].shape, generator=torch.Generator().manual_seed(0)) * batch.mask
    if between is not None:
        between()
    metrics = worker.train_step(batch)
    after = worker.logprobs(batch)["logprobs"]
    out = {"logprobs": lp["logprobs"], "metrics": metrics, "logprobs_after": after, "mask": batch.mask}
    if draft:
        out["draft_metrics"] = lp["draft_metrics"]
        out["drafter"] = {n: p.detach().float().cpu().clone() for n, p in worker.draft.trainer.drafter.named_parameters()}
    return out


def _rng_draws(device) -> list:
    import random

    import torch
    from megatron.core.tensor_parallel import random as mrandom

    draws = [torch.rand(4), random.random()]
    if device.type == "cuda":
        draws.append(torch.rand(4, device=device).cpu())
    with mrandom.get_cuda_rng_tracker().fork():  # the model-parallel stream (dropout, init)
        draws.append(torch.rand(4, device=device).cpu())
    return draws


def run_case(spec: str, device: str, model_dir: Path, work: Path, checks: list[str]) -> dict:
    import torch
    from megatron.core import parallel_state as ps

    from cotrain.distributed import find_free_port
    from cotrain.rl.trainer import MegatronPolicyWorker

    kind, dtype = spec.split(":")
    draft = None if kind == "plain" else kind
    cfg = config(device, dtype, draft, model_dir, work / spec.replace(":", "_"))

    def make():
        return MegatronPolicyWorker(cfg, str(model_dir), 0, 1, "127.0.0.1", find_free_port())

    res = {}
    worker = make()
    try:
        res["device"] = str(worker.device)
        res["param_devices"] = sorted({str(p.device) for p in worker.model.parameters()})
        if draft:
            res["drafter_devices"] = sorted({str(p.device) for p in worker.draft.trainer.drafter.parameters()})
        res["step"] = _step(worker, rollout_batch(), draft is not None)
        if "offload" in checks:  # a second step with the optimizer state sent away and back in between
            if worker.device.type == "cuda":
                move = lambda: (worker.offload(), worker.onload())  # noqa: E731
            else:  # on CPU offload() does nothing: the same round trip through CPU copies
                move = lambda: (worker._move_optimizer(torch.device("cpu")), worker._move_optimizer(None))  # noqa: E731
            ck = work / "offload_ck"
            worker.save_checkpoint(str(ck))
            res["offload"] = _step(worker, rollout_batch(), draft is not None, between=move)
            worker.load_checkpoint(str(ck))
            res["offload_ref"] = _step(worker, rollout_batch(), draft is not None)
        if "rng" in checks:
            ck = work / "rng_ck"
            worker.save_checkpoint(str(ck))
            first = _rng_draws(worker.device)
            worker.load_checkpoint(str(ck))
            res["rng"] = (first, _rng_draws(worker.device))
        if "resume" in checks:
            ck = work / "resume_ck"
            worker.save_checkpoint(str(ck))
            second = _step(worker, rollout_batch(), draft is not None)
            worker.load_checkpoint(str(ck))
            res["resume"] = (second, _step(worker, rollout_batch(), draft is not None))
        if "pickled" in checks:  # a trainer file that holds a pickled object besides tensors
            from fractions import Fraction  # an object no one allowlists (megatron adds argparse.Namespace and more)

            ck = work / "pickled_ck"
            worker.save_checkpoint(str(ck))
            f = ck / "trainer_rank0000.pt"
            state = torch.load(f, weights_only=True)
            state["extra"] = Fraction(1, 3)
            torch.save(state, f)
            try:
                worker.load_checkpoint(str(ck))
                res["pickled"] = None
            except Exception as e:  # noqa: BLE001 - the test reads the error
                res["pickled"] = f"{type(e).__name__}: {e}"
    finally:
        worker.shutdown()
        ps.destroy_model_parallel()
    return res


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=["cpu", "cuda"], required=True)
    ap.add_argument("--cases", required=True,
                    help="comma-separated kind:dtype, kind in plain, dflash, eagle3, dflash_op, eagle3_op (on-policy)")
    ap.add_argument("--checks", default="", help="comma-separated: offload, rng, resume, pickled (on the first case)")
    ap.add_argument("--model-dir", type=Path, required=True)
    ap.add_argument("--work", type=Path, required=True, help="a folder for run outputs and checkpoints")
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--block", default="", help="comma-separated modules made unimportable first (ray, vllm)")
    ap.add_argument("--deterministic", action="store_true",
                    help="torch.use_deterministic_algorithms (set CUBLAS_WORKSPACE_CONFIG=:4096:8 on CUDA)")
    a = ap.parse_args(argv)
    for name in filter(None, a.block.split(",")):
        sys.modules[name] = None  # `import name` now raises ImportError
    sys.path.insert(0, str(ROOT))
    import torch

    torch.set_num_threads(2)
    if a.deterministic:
        torch.use_deterministic_algorithms(True, warn_only=True)
        torch.backends.cuda.matmul.allow_tf32 = False  # torch's default, stated: fp32 matmuls stay fp32
    model_dir = write_model(a.model_dir)
    checks = list(filter(None, a.checks.split(",")))
    results = {}
    for i, spec in enumerate(a.cases.split(",")):
        results[spec] = run_case(spec, a.device, model_dir, a.work, checks if i == 0 else [])
    results["modules"] = sorted(m for m in sys.modules if m.split(".")[0] in ("ray", "vllm") and sys.modules[m])
    # the installed packages this process imported (what the GPU machine must have or the check carry)
    results["packages"] = sorted({m.split(".")[0] for m, mod in list(sys.modules.items())
                                  if mod is not None and "site-packages" in (getattr(mod, "__file__", None) or "")})
    torch.save(results, a.out)


if __name__ == "__main__":
    main()
