"""Weight transports, one module each: ``shm``, ``object_store`` (CPU), ``cuda_ipc``, ``nccl`` (GPU)."""
