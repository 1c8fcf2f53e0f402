# SPDX-License-Identifier: Apache-2.0
"""Push-mode NIXL KV transfer: P NIXL-WRITEs KV straight into D's pre-allocated blocks."""
