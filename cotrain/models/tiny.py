"""The tiny built-in policy: a Qwen3-architecture model small enough to train on two CPU cores.

Only the constants live here; ``cotrain.models.build_tiny`` builds, warm-starts and
caches the checkpoint. Config validation reads these numbers for the ``builtin:tiny`` model path so
that it can check parallel degrees before anything is built.
"""

BUILTIN_MODEL_PATH = "builtin:tiny"
VOCAB_SIZE = 128  # 99 tokens used, padded to a multiple of 64 (tensor-parallel friendly)

TINY_QWEN3_CONFIG = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    max_position_embeddings=256,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    torch_dtype="float32",
)

# The built-in task the tiny model is warm-started on (and that the demo's GRPO run trains on):
# addition of two numbers with 1..2 digits each, e.g. "57+86=" -> "143".
TINY_TASK = dict(max_digits=2, ops=("+",))

# Supervised warm start with noisy labels: each answer digit of the training data is replaced by a
# random digit with probability label_noise. The model learns the task (its greedy answer is mostly
# right) but keeps that much probability on wrong digits, so its *samples* - what GRPO is rewarded
# on - are right only about half the time: GRPO has headroom and visibly sharpens the policy within
# the demo's few minutes. Changing any of this (or the architecture) changes the cache key.
TINY_SFT = dict(steps=600, batch_size=128, lr=3e-3, warmup=50, weight_decay=0.01, seed=1234, eval_size=512,
                label_noise=0.2)

# Bump when the build changes in a way the constants above do not show (it is part of the cache key).
# 2: the build runs on a fixed BUILD_THREADS torch threads (version 1 used the machine's default, so
# its weights depended on the core count).
BUILD_VERSION = 2

# torch CPU threads of the build, whatever the machine has (restored afterwards): the weights are the
# same on any core count, and one thread does not slow down on a busy machine (the tiny shapes gain
# nothing from a second one).
BUILD_THREADS = 1
