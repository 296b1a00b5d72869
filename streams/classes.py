"""Fault classes the TEE tells apart, and how each maps onto the contract's :class:`FaultKind`.

A :class:`FaultClass` is finer than ``contracts.FaultKind`` (which the controller's policy reads):
every fault event carries its class in ``evidence["class"]``, and its kind is the closest contract
kind (:data:`KIND_OF`). Hard classes come from rules (a counter, a state, a code: no doubt about
them); soft classes from the pyod detectors (a drift that needs a baseline or the node's peers).
"""

from __future__ import annotations

import enum

from transom.contracts import FaultKind

__all__ = ["FaultClass", "HARD", "SOFT", "KIND_OF"]


class FaultClass(str, enum.Enum):
    XID = "xid"                              # an XID whose code maps to no finer class
    ECC_DBE = "ecc_dbe"                      # double-bit ECC (counter or XID 48/94/95)
    ROW_REMAP_FAILURE = "row_remap_failure"  # row remapping failed (field or XID 64)
    GPU_LOST = "gpu_lost"                    # GPU_IS_LOST or XID 79
    LINK_DOWN = "link_down"                  # NIC/IB port down for longer than link_down_hold
    LINK_FLAP = "link_flap"                  # link_flap_count downs shorter than the hold within link_flap_window
    NAN_LOSS = "nan_loss"
    NODE_LOST = "node_lost"                  # heartbeat missing
    HANG = "hang"                            # ranks alive, no step progress
    THERMAL = "thermal"                      # soft: a GPU running hot (and slowing down)
    POWER_CAP = "power_cap"                  # soft: power held under its usual level, clocks down
    STRAGGLER = "straggler"                  # soft: clocks/power/step time below the peers'
    LINK_DEGRADED = "link_degraded"          # soft: link error counters rising, bandwidth down


HARD = frozenset({FaultClass.XID, FaultClass.ECC_DBE, FaultClass.ROW_REMAP_FAILURE, FaultClass.GPU_LOST,
                  FaultClass.LINK_DOWN, FaultClass.LINK_FLAP, FaultClass.NAN_LOSS, FaultClass.NODE_LOST,
                  FaultClass.HANG})
SOFT = frozenset(set(FaultClass) - HARD)

#: The contract kind of each class. The contract has no ECC or link kinds yet: GPU memory faults
#: are XIDs (NVIDIA reports them as XID 48/64 as well), a node whose fabric link is down is lost
#: to its job, a straggler is its own kind (the controller may replace it), other soft classes are
#: anomalies.
KIND_OF = {
    FaultClass.XID: FaultKind.XID, FaultClass.ECC_DBE: FaultKind.XID, FaultClass.ROW_REMAP_FAILURE: FaultKind.XID,
    FaultClass.GPU_LOST: FaultKind.GPU_LOST, FaultClass.LINK_DOWN: FaultKind.NODE_LOST,
    FaultClass.LINK_FLAP: FaultKind.NODE_LOST, FaultClass.NAN_LOSS: FaultKind.NAN_LOSS,
    FaultClass.NODE_LOST: FaultKind.NODE_LOST, FaultClass.HANG: FaultKind.HANG,
    FaultClass.THERMAL: FaultKind.ANOMALY, FaultClass.POWER_CAP: FaultKind.ANOMALY,
    FaultClass.STRAGGLER: FaultKind.STRAGGLER, FaultClass.LINK_DEGRADED: FaultKind.ANOMALY,
}
