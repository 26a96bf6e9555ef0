"""Writing bundles: every case computed and encoded, then committed as one transaction.

Owns :func:`~.write.write_bundle` (``refattn golden``), :func:`~.write.encode_case` (one case's
file bytes and manifest entry) and :func:`~.write.write_sweep` (the resumable form of
``refattn sweep``). Computes through :mod:`refattn.bundle.golden`; the directory is
:mod:`refattn.bundle.storage`'s.
"""
