"""``python -m normscope``: the command line (``normscope scan``, ``normscope report``)."""

from normscope.cli.main import main

if __name__ == "__main__":
    raise SystemExit(main())
