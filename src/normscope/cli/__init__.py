"""The ``normscope`` command line: ``normscope scan MODEL`` reads a checkpoint you already
have, ``normscope report RUN_DIR`` turns a finished run's logged metrics into plots.

    normscope scan path/to/hf-model-dir --out scan/          # table + report.md/.html + PNGs
    normscope scan mypkg.models:build_model --tokens 16384
    normscope report lightning_logs/version_0                # CSV logger or W&B offline run
    python -m normscope scan ...                             # the same

Needs the ``cli`` extra (``pip install normscope[cli]``: matplotlib, transformers,
safetensors, tqdm). The entry point is :func:`normscope.cli.main.main`. The package imports
none of its modules: each is imported by its path (``normscope.cli.main``), so that no module
of the command line imports another through the package.
"""
