"""State records, one aggregate: The node registry: nodes seen and registered, their departments, enabled or disabled.

Part of ``Repository`` (``repository.py``); every method is one transaction (``access.write``/``read``)."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from quorumfl.errors import NotFoundError
from quorumfl.server.state.access import (
    StateAccess,
    utcnow,
)
from quorumfl.server.state.orm import (
    Node,
)

__all__ = ["NodeRecords"]


class NodeRecords(StateAccess):
    def touch_node(self, node_id: int, *, department: str | None = None) -> Node:
        """Register ``node_id`` or update its last-seen time (and department when reported)."""

        def op(s: Session) -> Node:
            now = utcnow()
            node = s.get(Node, node_id)
            if node is None:
                node = Node(node_id=node_id, department=department, enabled=True, first_seen=now, last_seen=now)
                s.add(node)
            else:
                node.last_seen = now
                if department:
                    node.department = department
            s.flush()
            return node

        return self._write(op)

    def record_registered(self, node_id: int, department: str) -> bool:
        """A node key registered at the SuperLink under ``department``: listed from now on (not yet
        seen) if it was not known; True when it was new."""

        def op(s: Session) -> bool:
            node = s.get(Node, node_id)
            if node is None:
                s.add(Node(node_id=node_id, department=department, enabled=True, first_seen=utcnow(), last_seen=None))
                return True
            if not node.department:
                node.department = department
            return False

        return self._write(op)

    def list_nodes(self) -> list[Node]:
        return self._read(lambda s: list(s.scalars(select(Node).order_by(Node.department, Node.node_id))))

    def find_nodes(self, ref: str) -> list[Node]:
        """Nodes matching a Flower node id or a department name."""

        def op(s: Session) -> list[Node]:
            if ref.isdigit():
                node = s.get(Node, int(ref)) if int(ref) < 2**64 else None
                if node is not None:
                    return [node]
            return list(s.scalars(select(Node).where(Node.department == ref)))

        nodes = self._read(op)
        if not nodes:
            raise NotFoundError(
                f"no node with id or department '{ref}'; 'quorumfl nodes list' shows the known nodes"
            )
        return nodes

    def set_enabled(self, ref: str, enabled: bool) -> list[Node]:
        ids = [n.node_id for n in self.find_nodes(ref)]

        def op(s: Session) -> list[Node]:
            nodes = [s.get(Node, i) for i in ids]
            for node in nodes:
                assert node is not None
                node.enabled = enabled
            return [n for n in nodes if n is not None]

        return self._write(op)

    def disabled_node_ids(self) -> set[int]:
        return self._read(
            lambda s: set(s.scalars(select(Node.node_id).where(Node.enabled.is_(False))))
        )
