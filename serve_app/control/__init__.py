"""The control plane: the pure policy (:mod:`.policy`), the control loop around it
(:mod:`.loop`), and the Ray actor that runs the loop for a whole application (:mod:`.actor`).

What the serving layer may use is re-exported here; it imports nothing else of this package.
"""

from serve_app.control.actor import NAMESPACE, controller_name, delete_controller, get_or_create_controller
from serve_app.control.config import ControllerOptions, PolicyConfig, Tier, find_policy_file, load_policy_file
from serve_app.control.loop import ReplicaReport

__all__ = [
    "NAMESPACE",
    "ControllerOptions",
    "PolicyConfig",
    "ReplicaReport",
    "Tier",
    "controller_name",
    "delete_controller",
    "get_or_create_controller",
    "find_policy_file",
    "load_policy_file",
]
