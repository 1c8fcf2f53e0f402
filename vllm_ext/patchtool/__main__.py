# SPDX-License-Identifier: Apache-2.0
"""``python -m vllm_ext.patchtool``: the ``vllm-ext-patches`` command."""

import sys

from .cli import main

sys.exit(main())
