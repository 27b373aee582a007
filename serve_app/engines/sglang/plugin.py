"""SGLang plugin: a run-time ``num_steps`` switch inside SGLang's scheduler processes.

Registered under the entry-point group ``sglang.srt.plugins``. SGLang's ``load_plugins()``
(srt/plugins/__init__.py) calls ``register()`` with no arguments in every process it starts
(main, schedulers, detokenizer) before they build anything. ``register`` then

1. wraps ``AdaptiveController.__init__`` so every EAGLE worker's controller gets a
   :class:`CommandedStepsPolicy` in place of SGLang's acceptance-EMA policy;
2. adds ``Scheduler.specserve_set_num_steps(num_steps, max_batch_size)``, which
   ``Engine.collective_rpc`` reaches on every TP rank through ``Scheduler.handle_rpc_request``.

It does nothing unless ``SPECSERVE_SGLANG_PLUGIN=1`` (set by :class:`SGLangEngine` before it
launches SGLang), so installing specserve never changes another SGLang server in the same
environment. This module imports no sglang at import time.
"""

from __future__ import annotations

import functools
import logging
import os

from serve_app.engines.sglang.policy import CommandedStepsPolicy

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "specserve"
ENTRY_POINT_VALUE = "serve_app.engines.sglang.plugin:register"
ENABLE_ENV = "SPECSERVE_SGLANG_PLUGIN"
RPC_METHOD = "specserve_set_num_steps"

# The policies of the adaptive controllers built in this process (one per scheduler process).
policies: list[CommandedStepsPolicy] = []


def register() -> None:
    """Entry point of ``sglang.srt.plugins``: install the policy hook and the RPC method."""
    if os.environ.get(ENABLE_ENV) != "1":
        return
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController

    install_policy_hook(AdaptiveController)
    setattr(Scheduler, RPC_METHOD, specserve_set_num_steps)
    logger.info("specserve plugin registered (pid %d)", os.getpid())


def install_policy_hook(controller_cls: type) -> None:
    """Make ``controller_cls(worker, policy)`` use a CommandedStepsPolicy (idempotent)."""
    original = controller_cls.__init__
    if getattr(original, "_specserve", False):
        return

    @functools.wraps(original)
    def __init__(self, worker, policy):
        commanded = CommandedStepsPolicy(policy.candidate_steps, worker.speculative_num_steps)
        policies.append(commanded)
        original(self, worker, commanded)

    __init__._specserve = True
    controller_cls.__init__ = __init__


def specserve_set_num_steps(scheduler, num_steps: int, max_batch_size: int = 0) -> None:
    """Scheduler method behind ``collective_rpc("specserve_set_num_steps", ...)``.

    Runs inside the scheduler loop between batches, so the next decode batch sees it.
    ``max_batch_size`` 0 means no guard (RPC parameters must be flat scalars).
    """
    if not policies:
        raise RuntimeError(
            "specserve: no adaptive controller in this scheduler; SGLang did not enable "
            "--speculative-adaptive or built the EAGLE worker before the plugin loaded"
        )
    for policy in policies:
        policy.command(int(num_steps), int(max_batch_size) or None)
