# SPDX-License-Identifier: Apache-2.0
"""Offline install bundles for air-gapped (GPU) hosts: ``tools/bundle.py``.

* :mod:`~devkit.bundle.build`: ``bundle build``, the wheels a target lacks for a
  pin's vLLM build, nixl and this project, resolved by uv as of the pin's release,
  checksummed and split into parts of a given size.
* :mod:`~devkit.bundle.installer`: the offline installer (standard library only),
  shipped beside the parts as ``install.py``: checks, reassembles, installs with
  pip from the bundle alone and applies the pin's patches.
* :mod:`~devkit.bundle.target`, :mod:`~devkit.bundle.resolve`,
  :mod:`~devkit.bundle.collect`: the target, the resolution, the wheels.

``docs/offline-install.md`` has the commands.
"""
