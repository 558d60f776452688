"""A fleet of appliances on Ray (issue 13): ``djinn fleet``, ``fleet://`` and ``ray://``.

Ray carries control only: which appliances exist, where they listen, what they hold and
how loaded they are, and which of them gets a session. Tensor bytes go straight between
the client and its appliance over Djinn's own TCP data plane.

Nothing here imports ray at module level, and nothing outside this package imports this
package's ray-using modules at module level: a single host needs no Ray (the ``[fleet]``
extra), and the appliance never loads it (``tests/unit/test_fleet_imports.py``).
"""

from __future__ import annotations

from .address import is_fleet_address

__all__ = ["is_fleet_address"]
