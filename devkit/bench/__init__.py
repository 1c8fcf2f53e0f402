# SPDX-License-Identifier: Apache-2.0
"""The P/D benchmark (SPEC S-BEN-1): push vs pull vs vLLM's own push, with the floor.

``python -m devkit.bench --help`` (or ``python3 tools/bench.py``, which builds the
envs first). One module per concern: ``modes`` (what is compared), ``workload``
(the sweep and its order), ``runner`` (deployments and points), ``client`` (the
load generator: vLLM's ``vllm bench serve``), ``probes`` (Prometheus and idle CPU),
``floor`` (memcpy and raw NIXL WRITE), ``report`` (JSON, tables, plots).
"""
