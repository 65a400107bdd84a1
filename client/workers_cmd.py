"""``loraserve workers``: see ``client.admin_cli``."""

from loraserve.client.admin_cli import add_worker_arguments as add_arguments
from loraserve.client.admin_cli import run_workers as run

__all__ = ["add_arguments", "run"]
