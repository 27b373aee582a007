"""The serving layer: the Ray Serve application (ingress, replicas), its OpenAI protocol,
streaming, metrics and configuration. It meets the engines through
:mod:`serve_app.engines.base` and the control plane through the public API of :mod:`serve_app.control`."""
