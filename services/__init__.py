"""Tandem services: kvstore, gpuworker and router, and the plumbing they share in ``common``.

Services never import each other; they meet on the wire (``tandem.*`` generated stubs) and in
``services.common``.
"""
