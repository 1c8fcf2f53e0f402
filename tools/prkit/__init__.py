# SPDX-License-Identifier: Apache-2.0
"""The upstream PR kit behind ``tools/upstream_pr.py`` (see docs/upstream.md).

Modules: ``identity`` (whose sign-off), ``common`` (git, progress, errors), ``branch``
(the PR branch in a vLLM tree), ``checks`` (vLLM's checks on the touched files),
``refresh`` (a series against a newer tree), ``describe`` (the PR description).
"""
