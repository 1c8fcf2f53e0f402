# SPDX-License-Identifier: Apache-2.0
"""Real faults on a running 1P1D: kills, link cuts, lost/late/duplicate PUSH_REGs,
aborts, a full D, a foreign NIXL agent; the audit after each; a soak.

See docs/faults.md. ``python -m devkit.testing.faults --help`` runs the table.
"""
