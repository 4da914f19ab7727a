"""Communication: ranks (World), the symmetric heap, workspaces, fault status, heap collectives, device self-test."""
