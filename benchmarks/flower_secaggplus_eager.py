"""The same Flower SecAgg+ baseline, written the usual way: torch imported when the module loads.

Flower's examples import the training module (and so torch) at the top of the app; every message
then pays for it in the fresh ClientApp process, including the three SecAgg+ stages that do not
train. ``secagg.py`` reports this variant next to the lazy one in ``flower_secaggplus_app.py``.
"""

import torch  # noqa: F401  (imported for its cost, as a typical app does)
from flower_secaggplus_app import client, server

__all__ = ["client", "server"]
