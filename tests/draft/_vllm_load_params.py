"""Load a drafter export into vLLM's own model class (through its ``load_weights``) and save the
class's named parameters, so that a test can compare them, by role, with the drafter's modules.

Usage: python _vllm_load_params.py KIND EXPORT_DIR TARGET_DIR OUTPUT.pt   (KIND: eagle3 | dflash)

Run in a subprocess: it initialises vLLM's distributed state. The weights are read exactly as vLLM
reads them when it serves the drafter (name mapping, stacked q/k/v and gate/up), so a tensor put
under the wrong name by the export lands in the wrong module here."""

import sys
import tempfile

import torch


def main(kind: str, export_dir: str, target_dir: str, outp: str) -> None:
    torch.set_num_threads(1)
    from safetensors.torch import load_file
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel
    from vllm.engine.arg_utils import EngineArgs

    if kind == "eagle3":
        from vllm.model_executor.models.llama_eagle3 import Eagle3LlamaForCausalLM as cls
        spec = {"method": "eagle3", "model": export_dir, "num_speculative_tokens": 3}
    else:
        from vllm.model_executor.models.qwen3_dflash import DFlashQwen3ForCausalLM as cls
        spec = {"method": "dflash", "model": export_dir, "num_speculative_tokens": 4}
    cfg = EngineArgs(model=target_dir, dtype="float32", enforce_eager=True, max_model_len=256,
                     kv_cache_memory_bytes=1 << 26, speculative_config=spec).create_engine_config()
    with set_current_vllm_config(cfg):
        init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                     distributed_init_method=f"file://{tempfile.mktemp()}", backend="gloo")
        initialize_model_parallel(1, 1)
        m = cls(vllm_config=cfg).eval()
        m.load_weights(iter(load_file(f"{export_dir}/model.safetensors").items()))
        params = {n: p.detach().clone() for n, p in m.named_parameters()}
    torch.save(params, outp)


if __name__ == "__main__":
    main(*sys.argv[1:5])
