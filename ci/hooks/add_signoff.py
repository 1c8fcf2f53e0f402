#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""commit-msg hook: append a DCO ``Signed-off-by:`` trailer from git's user config."""

import subprocess
import sys


def main(msg_file: str) -> int:
    def cfg(key: str) -> str:
        return subprocess.run(
            ["git", "config", key], capture_output=True, text=True, check=False
        ).stdout.strip()

    name, email = cfg("user.name"), cfg("user.email")
    if not name or not email:
        print("add_signoff: set git user.name and user.email", file=sys.stderr)
        return 1
    trailer = f"Signed-off-by: {name} <{email}>"
    with open(msg_file, encoding="utf-8") as f:
        msg = f.read()
    if trailer in msg:
        return 0
    body = msg.rstrip("\n")
    sep = (
        "\n" if body.splitlines() and body.splitlines()[-1].startswith("Signed-off-by:") else "\n\n"
    )
    with open(msg_file, "w", encoding="utf-8") as f:
        f.write(f"{body}{sep}{trailer}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
