"""The router: Tandem's front door (DESIGN §4).

Pure, network-free decisions:

* ``policy``    — which worker: prefix reuse weighed against load (α·missing + β·active + γ·queued);
* ``tenants``   — bearer tokens → tenants → cache salts (constant-time token checks);
* ``jobs``      — request validation and tokenization into a :class:`~services.router.jobs.GenerateJob`;
* ``retry``     — wait queue, backoff, and what a worker failure means for a request;
* ``directory`` — registry snapshot, in-flight counts, failure cooldowns.

Network glue: ``dispatcher`` (Match → Reserve → Worker.Generate, retries, settling reservations),
``servicer`` (proto adapter), ``server`` (assembly), ``settings`` and ``main`` (``tandem router``).
"""
