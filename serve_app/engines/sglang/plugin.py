"""SGLang plugin: a run-time ``num_steps`` switch inside SGLang's scheduler processes.

Registered under the entry-point group ``sglang.srt.plugins``. SGLang's ``load_plugins()``
(srt/plugins/__init__.py) calls ``register()`` with no arguments in every process it starts
(main, schedulers, detokenizer) before they build anything. ``register`` then

1. wraps ``AdaptiveController.__init__`` so every EAGLE worker's controller gets a
   :class:`CommandedStepsPolicy` in place of SGLang's acceptance-EMA policy, the way the
   running release's controller takes its policy (:mod:`serve_app.engines.sglang.compat`);
   ours keeps SGLang's policy inside it and, with ``$SPECSERVE_SGLANG_STEP_POLICY``
   ``adaptive`` (or the RPC's ``adaptive=1``), caps what that picks at the command (the
   command is then a ceiling);
2. adds ``Scheduler.specserve_set_num_steps(num_steps, max_batch_size)``, which
   ``Engine.collective_rpc`` reaches on every TP rank through ``Scheduler.handle_rpc_request``.

``collective_rpc`` returns nothing to the caller, so each policy also publishes what it runs
(the steps of the last decode batch, and acceptance over its recent verifies) to a small file
in the folder ``$SPECSERVE_SGLANG_STATE_DIR`` names, one file per scheduler process; the
engine reads them in ``load()``.

It does nothing unless ``SPECSERVE_SGLANG_PLUGIN=1`` (set by :class:`SGLangEngine` before it
launches SGLang), so installing specserve never changes another SGLang server in the same
environment. This module imports no sglang at import time.
"""

from __future__ import annotations

import functools
import inspect
import logging
import os

from serve_app.engines.sglang import compat
from serve_app.engines.sglang.policy import CommandedStepsPolicy, StatePublisher

logger = logging.getLogger(__name__)

ENTRY_POINT_GROUP = "sglang.srt.plugins"
ENTRY_POINT_NAME = "specserve"
ENTRY_POINT_VALUE = "serve_app.engines.sglang.plugin:register"
ENABLE_ENV = "SPECSERVE_SGLANG_PLUGIN"
STATE_DIR_ENV = "SPECSERVE_SGLANG_STATE_DIR"
RPC_METHOD = "specserve_set_num_steps"
STEP_POLICY_ENV = "SPECSERVE_SGLANG_STEP_POLICY"

# The policies of the adaptive controllers built in this process (one per scheduler process).
policies: list[CommandedStepsPolicy] = []


def register() -> None:
    """Entry point of ``sglang.srt.plugins``: install the policy hook and the RPC method."""
    if os.environ.get(ENABLE_ENV) != "1":
        return
    release = compat.installed()  # load_plugins() logs what this raises; the engine's start() fails on it
    from sglang.srt.managers.scheduler import Scheduler
    from sglang.srt.speculative.adaptive_runtime_state import AdaptiveController

    install_policy_hook(AdaptiveController, release)
    setattr(Scheduler, RPC_METHOD, specserve_set_num_steps)
    logger.info("specserve plugin registered for sglang %s (pid %d)", release.version, os.getpid())


def install_policy_hook(controller_cls: type, release: compat.Release) -> None:
    """Make every ``controller_cls`` run a CommandedStepsPolicy (idempotent).

    From 0.5.20 the controller takes its policy, ``(worker, policy)``: ours replaces it, with
    the same candidate steps. Before, ``(worker, config_path=None)`` builds SGLang's policy
    into ``self.params``: ours replaces that after the original ``__init__``.
    """
    original = controller_cls.__init__
    if getattr(original, "_specserve", False):
        return
    params = list(inspect.signature(original).parameters)
    expected = "policy" if release.controller_takes_policy else "config_path"
    if params[2:3] != [expected]:
        raise compat.UnsupportedSGLangError(
            f"sglang {release.version}: AdaptiveController.__init__{tuple(params)} does not take "
            f"{expected!r} as this release should; the plugin cannot install its policy"
        )
    publisher = StatePublisher(os.environ.get(STATE_DIR_ENV))

    def commanded_for(worker, own) -> CommandedStepsPolicy:
        """Ours, in place of SGLang's ``own`` policy (kept inside it, to pick under a ceiling)."""
        adaptive = os.environ.get(STEP_POLICY_ENV) == "adaptive"
        policy = CommandedStepsPolicy(own.candidate_steps, worker.speculative_num_steps, publisher, own, adaptive)
        policies.append(policy)
        return policy

    if release.controller_takes_policy:

        @functools.wraps(original)
        def __init__(self, worker, policy):
            original(self, worker, commanded_for(worker, policy))

    else:

        @functools.wraps(original)
        def __init__(self, worker, config_path=None):
            original(self, worker, config_path)
            self.params = commanded_for(worker, self.params)

    __init__._specserve = True
    controller_cls.__init__ = __init__


def specserve_set_num_steps(scheduler, num_steps: int, max_batch_size: int = 0, adaptive: int = -1) -> None:
    """Scheduler method behind ``collective_rpc("specserve_set_num_steps", ...)``.

    Runs inside the scheduler loop between batches, so the next decode batch sees it.
    ``max_batch_size`` 0 means no guard; ``adaptive`` 1 lets SGLang's policy pick under
    ``num_steps``, 0 runs ``num_steps`` as commanded, -1 keeps what was (RPC parameters must
    be flat scalars).
    """
    if not policies:
        raise RuntimeError(
            "specserve: no adaptive controller in this scheduler; SGLang did not enable "
            "--speculative-adaptive or built the EAGLE worker before the plugin loaded"
        )
    for policy in policies:
        policy.command(int(num_steps), int(max_batch_size) or None, None if int(adaptive) < 0 else bool(adaptive))
