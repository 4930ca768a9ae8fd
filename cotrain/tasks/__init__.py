"""Task data and rewards: the bottom layer (imports nothing else from cotrain).

- data: ``Problem``, the built-in arithmetic task, the JSONL loader, ``PromptStream``
- rewards: verifiable rewards (exact match)

The layers above: ``cotrain.models`` (the tiny model is warm-started on the task),
``cotrain.draft`` (distillation prompts) and ``cotrain.rl`` (the GRPO loop).
"""
