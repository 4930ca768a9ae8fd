"""Task data and rewards: the bottom layer (imports nothing else from cotrain).

- data: ``Problem``, the built-in arithmetic task, the JSONL loader, ``PromptStream``, ``load_task``
- gcd: the built-in gcd task (worked solutions with a long tail of lengths)
- rewards: verifiable rewards (exact match of the final answer)

The layers above: ``cotrain.models`` (the built-in models are warm-started on the tasks),
``cotrain.draft`` (distillation prompts) and ``cotrain.rl`` (the GRPO loop).
"""
