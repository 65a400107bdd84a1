"""``loraserve adapters``: see ``client.admin_cli``."""

from loraserve.client.admin_cli import add_adapter_arguments as add_arguments
from loraserve.client.admin_cli import run_adapters as run

__all__ = ["add_arguments", "run"]
