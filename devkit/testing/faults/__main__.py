# SPDX-License-Identifier: Apache-2.0
import sys

from devkit.testing.faults.runner import main

sys.exit(main())
