# SPDX-License-Identifier: Apache-2.0
"""vllm-ext's development kit (distribution ``vllm-ext-devkit``): what this repository
uses to demonstrate, test and measure the connector, never loaded by vLLM.

* :mod:`devkit.demo`: the README's 1P1D demo (``python3 tools/demo.py``);
* :mod:`devkit.launch`: engines and P/D pairs on CPU cores or GPUs, the one way to start
  a pair (the demo, the e2e tests, the fault tools and the benchmarks use it);
* :mod:`devkit.testing`: the tiny model builders, fake NIXL, the in-process engine
  builder, the fault harness (``testing/faults``);
* :mod:`devkit.bench`: the P/D benchmark, the floor, the scale benches;
* :mod:`devkit.bundle`: offline bundles;
* :mod:`devkit.cpu_isa`, :mod:`devkit.index_config`, :mod:`devkit.pip_retry`: the env
  builder's helpers.

The runtime (``vllm_ext``) never imports this package (tests/unit/test_layering.py).
"""
