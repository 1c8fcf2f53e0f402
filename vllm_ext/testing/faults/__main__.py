# SPDX-License-Identifier: Apache-2.0
import sys

from vllm_ext.testing.faults.runner import main

sys.exit(main())
