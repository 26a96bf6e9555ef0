"""Format and I/O: the bytes of a bundle, read and written without trusting them.

Owns the file format (:mod:`.format`: schema name and version, tensor sha256, canonical JSON,
atomic writes), confined file-system access (:mod:`.fsio`: no links, regular files, sizes
first), the output directory's transaction (:mod:`.transaction`: survey, lock, staged swap,
resumable staging), ``manifest.json`` (:mod:`.manifest`: strict JSON, JSON Schema), case
files (:mod:`.read`: strict safetensors, integrity in pieces) and the :class:`~.problems.Problem`
record the readers fill. The lowest room of :mod:`refattn.bundle`: it imports no other room,
runs no arithmetic and knows nothing of calls.
"""
