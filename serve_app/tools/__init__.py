"""Offline tools around the runtime: benchmarks, the simulator, calibration, dashboards,
draft-head training, the SGLang export and the SGLang pin checks. Nothing at runtime imports them."""
