"""The way out of sandboxes with network: see ``api.py``."""

from orchard.agent.egress.api import Egress, choose_egress, start_egress

__all__ = ["Egress", "choose_egress", "start_egress"]
