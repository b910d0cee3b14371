"""Runnable examples, run from the repository root as modules: ``python -m examples.demo``,
``python -m examples.collapse_alert``, ``python -m examples.plain_loop``,
``python -m examples.ternary_qat``, ``python -m examples.train_gpt``. ``nanogpt`` (the model),
``data`` and ``lit_gpt`` are what they share."""
