"""The untrusted node as a process (``splitleak serve``): the server session over TLS, its limits and its own
capture. It sits above ``training`` (its sessions answer with the training roles) and ``wire`` (the
transport); nothing below imports it."""

from splitleak.deploy.server import ServerNode, Session, SessionRecord

__all__ = ["ServerNode", "Session", "SessionRecord"]
