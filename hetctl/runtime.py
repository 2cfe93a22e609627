"""The public rank-side API: ``from hetctl.runtime import RankContext, heartbeat``.

A training script imports this module; it is the stable name of
:mod:`hetctl.node.runtime` (stdlib only), which ships in the agent zipapp too, so
the import works on a node without hetctl installed.
"""

from hetctl.node.runtime import (
    TRAIN_ENV,
    Heartbeat,
    RankContext,
    heartbeat,
    load_plan,
    read_heartbeat,
    write_atomic,
    write_heartbeat,
)

__all__ = ["TRAIN_ENV", "Heartbeat", "RankContext", "heartbeat", "load_plan", "read_heartbeat", "write_atomic",
           "write_heartbeat"]
