"""Clients and supervisors for the backends the chat talks to, all over HTTP."""
