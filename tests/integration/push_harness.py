# SPDX-License-Identifier: Apache-2.0
"""Real push connector workers over the fake NIXL fabric, in one process.

What is real: vLLM 0.23.0's ``VllmConfig`` on the tiny local model, the
``NixlPushConnector`` facade in both roles, ``NixlPushConnectorScheduler`` and
``NixlPushConnectorWorker`` (and their vLLM base classes), the
``nixl-push-writer`` threads, the ZMQ side channel (each engine's scheduler
half runs vLLM's handshake listener on a free 127.0.0.1 port, and workers run
vLLM's ``_nixl_handshake`` against it), the CPU KV cache tensors (4-D
``(num_blocks, num_kv_heads, block_size, 2 * head_size)`` bf16 per layer,
registered with ``register_kv_caches``), ``Request`` objects, the KV cache
manager and vLLM's ``Scheduler`` (with the connector it builds itself).

What is fake: NIXL (``devkit.testing.fake_nixl``: bytes really move
between the tensors), the tensor-parallel group (each worker is told its
rank/size while it is built) and the forward pass (the fake model runner
samples :data:`SAMPLED_TOKEN`; KV tensors start as seeded random data).

Two ways to drive an :class:`Engine`:

* engine level: :meth:`Engine.add_request` + :meth:`Engine.engine_step`, i.e.
  ``Scheduler.schedule`` -> every rank's model-runner KV step (bind metadata,
  ``start_load_kv``, ``get_finished``, load errors, stats) -> the executor's
  ``KVOutputAggregator`` -> ``Scheduler.update_from_output``;
* connector level: call the scheduler half (:attr:`Engine.sched`) yourself
  with real ``Request`` objects and ``KVCacheBlocks`` of chosen ids, then
  :meth:`Engine.connector_step` (``build_connector_meta`` -> ranks ->
  ``update_connector_output``).

The harness's public face: tests import every name from here. Where each lives:
:mod:`push_rank` (an engine's spec, P's timeouts, vLLM's blocks, one TP rank),
:mod:`push_engine` (:class:`Engine`), :mod:`push_env` (:class:`PushEnv`, the fixture,
and :func:`push_one`), :mod:`push_probes` (notifications and writer probes) and
:mod:`push_checks` (the KV checks, log capture, a junk side channel).
"""

from __future__ import annotations

from push_checks import GarbageSideChannel as GarbageSideChannel
from push_checks import assert_kv_pushed as assert_kv_pushed
from push_checks import assert_untouched as assert_untouched
from push_checks import block_pairs as block_pairs
from push_checks import capture_logs as capture_logs
from push_checks import kv_blocks as kv_blocks
from push_engine import Engine as Engine
from push_engine import join_stopped_listeners as join_stopped_listeners
from push_env import BLOCK_BYTES as BLOCK_BYTES
from push_env import PushEnv as PushEnv
from push_env import live_xfer_handles as live_xfer_handles
from push_env import open_push_env as open_push_env
from push_env import prompt_tokens as prompt_tokens
from push_env import push_one as push_one
from push_env import writer_threads as writer_threads
from push_probes import WRITER_ONLY_CALLS as WRITER_ONLY_CALLS
from push_probes import HandshakeGate as HandshakeGate
from push_probes import HeldWriter as HeldWriter
from push_probes import assert_nixl_calls_on_writer as assert_nixl_calls_on_writer
from push_probes import assert_self_polls as assert_self_polls
from push_probes import assert_writer_sleeps as assert_writer_sleeps
from push_probes import completion as completion
from push_probes import completion_or_none as completion_or_none
from push_probes import completions as completions
from push_probes import held_finished as held_finished
from push_probes import notif_reads as notif_reads
from push_probes import notifs as notifs
from push_probes import pending_regs as pending_regs
from push_probes import push_reg_token as push_reg_token
from push_rank import HARNESS_P_TCP_USER_TIMEOUT_S as HARNESS_P_TCP_USER_TIMEOUT_S
from push_rank import HARNESS_P_WRITE_TIMEOUT_S as HARNESS_P_WRITE_TIMEOUT_S
from push_rank import P_HOLDS_ITS_WRITE as P_HOLDS_ITS_WRITE
from push_rank import EngineSpec as EngineSpec
from push_rank import Rank as Rank
from push_rank import VllmBlocks as VllmBlocks
from push_rank import harness_p_timeouts as harness_p_timeouts
from push_rank import worker_idle as worker_idle

# (the in-process builder's names the tests use)
from devkit.testing.inproc import DTYPE as DTYPE
from devkit.testing.inproc import HEAD_SIZE as HEAD_SIZE
from devkit.testing.inproc import HYBRID_SHARING as HYBRID_SHARING
from devkit.testing.inproc import LAYERS as LAYERS
from devkit.testing.inproc import NUM_KV_HEADS as NUM_KV_HEADS
from devkit.testing.inproc import SAMPLED_TOKEN as SAMPLED_TOKEN
from devkit.testing.inproc import free_port as free_port
from devkit.testing.inproc import wait_until as wait_until
