# SPDX-License-Identifier: Apache-2.0
"""Test and demo helpers importable by tests and tools (tiny model, fake NIXL, ...)."""
