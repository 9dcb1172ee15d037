"""Fault injection for tests: transfers a sender fails on purpose (a broken link)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class FaultInjection:
    """Transfers the SENDER fails on purpose (a broken link): before sending anything, or,
    with `midway`, at their second part (after the first one went through)."""

    fail_transfer_ids: frozenset[int] = frozenset()
    fail_every_nth: int = 0  # 0: off; n: every n-th send_blocks call of this transport
    midway: bool = False

    @classmethod
    def of(cls, transport) -> FaultInjection:
        """The faults a TransportConfig (cluster/config.py) asks for."""
        return cls(frozenset(transport.fail_transfer_ids), transport.fail_every_nth, transport.fail_midway)

    def selects(self, transfer_id: int, attempt: int, first: int = 0) -> bool:
        """attempt: 1-based count of send_blocks calls on this transport; first: the part's
        first block within its transfer."""
        if self.midway and first == 0:
            return False
        every = self.fail_every_nth
        return transfer_id in self.fail_transfer_ids or (every > 0 and attempt % every == 0)
