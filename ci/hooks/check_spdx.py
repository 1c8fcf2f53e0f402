#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""Fail if a file lacks an SPDX-License-Identifier line in its first 5 lines."""

import sys

TAG = "SPDX-License-Identifier:"


def main(paths: list[str]) -> int:
    missing = []
    for path in paths:
        try:
            with open(path, encoding="utf-8", errors="replace") as f:
                head = [next(f, "") for _ in range(5)]
        except OSError as e:
            missing.append(f"{path} ({e})")
            continue
        if not any(TAG in line for line in head):
            missing.append(path)
    for m in missing:
        print(f"missing '{TAG} Apache-2.0' header: {m}")
    return 1 if missing else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
