# SPDX-License-Identifier: Apache-2.0
"""Command line of the bundle tool: ``build`` here, ``check``/``install`` as install.py does.

    python3 tools/bundle.py build --pin 0.23.0 --flavor cuda -o DIR [...]
    python3 tools/bundle.py check --parts DIR
    python3 tools/bundle.py install --parts DIR --venv VENV

Exit status: 0 done, 1 a failure (the message says which), 2 bad usage.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from devkit.bundle import build, installer
from devkit.bundle.installer import BundleError


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] in (["check"], ["install"]):
        return installer.main(argv)
    ap = argparse.ArgumentParser(
        prog="bundle.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser(
        "build",
        help="collect, check and split the wheels for a target",
        description=build.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    build.add_build_arguments(b)
    sub.add_parser("check", help="check a bundle's parts and wheels (as install.py check)")
    sub.add_parser("install", help="install a bundle (as install.py install)")
    args = ap.parse_args(argv)
    try:
        build.build(build.options_from_args(args))
    except BundleError as e:
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
