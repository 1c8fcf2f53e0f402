# SPDX-License-Identifier: Apache-2.0
"""``python -m vllm_ext.proxy``: same as the ``vllm-ext-proxy`` console script."""

from vllm_ext.proxy.cli import main

if __name__ == "__main__":
    raise SystemExit(main())
