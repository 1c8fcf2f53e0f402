# SPDX-License-Identifier: Apache-2.0
"""The patch tool (``vllm-ext-patches``): apply the vllm-ext patch series to vLLM, an
installed package or a git checkout (:mod:`.cli` has the usage).

The package: :mod:`.series` (the patches and where they live), :mod:`.targets` (an
installed package or a checkout), :mod:`.cli` (the plan and the commands). The offline
bundle carries it as one zip application (``devkit.bundle``), so it imports only the
standard library, and ``vllm_ext`` where that is installed.
"""

from .cli import (  # noqa: F401
    PatchState,
    Plan,
    build_parser,
    cmd_apply,
    cmd_revert,
    cmd_status,
    main,
    make_plan,
    probe_in_order,
    probe_patches,
)
from .series import (  # noqa: F401
    Hunk,
    Patch,
    PatchToolError,
    UsageError,
    available_series,
    is_pinned,
    load_series,
    nearest_older_series,
    parse_patch,
    patches_root,
    series_dir,
    upstream_elsewhere,
    version_key,
)
from .targets import (  # noqa: F401
    CheckoutTarget,
    Conflict,
    Files,
    PackageTarget,
    SeriesState,
    _conflict_from_git,
    detect,
    dry_run_checkout,
    replay,
    site_packages_of,
)
