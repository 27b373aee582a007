"""The application builder ``serve_app.serving.app:build_app`` that `serve run` calls with ``args``.

    serve run configs/local.yaml

builds two deployments: ``LLMReplica`` (one engine each, N replicas or autoscaled) and
``OpenAIIngress`` (HTTP + handle API). The per-application controller actor is created by
the first replica or ingress that starts (see :mod:`serve_app.control.actor`).
"""

from __future__ import annotations

from typing import Any

from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from serve_app.serving.config import AppArgs
from serve_app.serving.ingress import OpenAIIngress
from serve_app.serving.replica import LLMReplica

REPLICA_DEPLOYMENT = "LLMReplica"
INGRESS_DEPLOYMENT = "OpenAIIngress"
LEAST_LOADED_ROUTER = "serve_app.serving.routing.LeastLoadedRouter"


INGRESS_SHUTDOWN_S = 300.0  # a stopping ingress's time to finish its streams (a config's deployments may set it)


def build_app(args: AppArgs | dict[str, Any]) -> Application:
    """The application builder that ``serve run CONFIG`` calls with the config's ``args``
    (Serve calls a builder of exactly one parameter): :func:`bind_app`."""
    return bind_app(args)


def bind_app(args: AppArgs | dict[str, Any], replica_options: dict[str, Any] | None = None) -> Application:
    """Validate ``args`` (errors name the field) and bind the application.

    ``replica_options``: more of Serve's deployment options for the replicas (for example
    ``graceful_shutdown_timeout_s``) where the app is built in Python; `serve run` sets them
    in the config file's ``deployments`` section instead."""
    if not isinstance(args, AppArgs):
        args = AppArgs.model_validate(args)
    scaling: dict[str, Any] = (
        {"autoscaling_config": args.autoscaling_config}
        if args.autoscaling_config is not None
        else {"num_replicas": args.num_replicas}
    )
    routing: dict[str, Any] = (
        {"request_router_config": RequestRouterConfig(request_router_class=LEAST_LOADED_ROUTER)}
        if args.request_router == "least_loaded"
        else {}
    )
    replica = LLMReplica.options(
        name=REPLICA_DEPLOYMENT,
        **routing,
        max_ongoing_requests=args.max_ongoing_requests,
        max_queued_requests=args.limits.max_queued_requests,
        ray_actor_options=args.replica_ray_actor_options,
        **scaling,
        **(replica_options or {}),
    ).bind(args.engine, args.policy, args.controller, args.limits, args.streaming)
    # Constructor arguments exclude scaling, so that scaling does not restart replicas.
    # A rolling update replaces the ingress too; its streams last as long as a generation, which
    # outlasts Serve's default 20 s to finish, so a stopping ingress gets longer than its replicas.
    return OpenAIIngress.options(name=INGRESS_DEPLOYMENT, ray_actor_options=args.ingress_ray_actor_options,
                                 graceful_shutdown_timeout_s=INGRESS_SHUTDOWN_S).bind(
        replica,
        REPLICA_DEPLOYMENT,
        args.policy,
        args.controller,
        args.admin_token_env,
        args.served_model_name,
        args.limits,
        args.replica_transport,
    )
