"""The ``k8s`` backend: one pod per sandbox, the exec agent injected from the agent bundle."""
